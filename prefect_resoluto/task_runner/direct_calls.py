"""A task called directly in a flow (``total = add(1, 2)``) runs in a sandbox too.

Prefect 3 runs a direct call in the flow's own thread, through its task engine, without
asking the flow's task runner: with no more than the runner, such a task would run on the
host, unisolated, while its ``.submit()`` ran in a sandbox. So, once a
:class:`~.runner.ResolutoTaskRunner` has been entered in this process, ``Task.__call__``
looks at the calling flow run's task runner: when it is a started ResolutoTaskRunner, the
call is Prefect's own on the runner's sandboxed copy of the task (only ``fn`` replaced, as
for a submission), so states, retries, ``return_state``, ``wait_for``, caching and the
await of an async task are Prefect's; otherwise the call is untouched (a flow on another
task runner).

A call with no flow run context at all -- from a thread the flow started without copying
its context, or a flow's hook -- goes to the process's one entered runner, if there is
exactly one (with none or several, whose it is cannot be told: Prefect's own). A call
whose flow run context holds a ResolutoTaskRunner not yet entered (a ``flow_run_name``
callable) is refused: it has no sandbox to run in yet, and must not run on the host.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Awaitable, Callable
from typing import Any

_LOCK = threading.Lock()
_INSTALLED = False
#: The runners entered in this process and not yet exited, by id (a runner is unhashable).
_ENTERED: dict[int, Any] = {}


def entered(runner: Any) -> None:
    with _LOCK:
        _ENTERED[id(runner)] = runner


def exited(runner: Any) -> None:
    with _LOCK:
        _ENTERED.pop(id(runner), None)


def install(runner_class: type) -> None:
    """Route direct calls of tasks in flows on ``runner_class`` (idempotent)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        from prefect.tasks import Task

        original: Any = Task.__call__

        @functools.wraps(original)
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            runner = _flows_runner(runner_class)
            if runner is None:
                return original(self, *args, **kwargs)
            sandboxed, started = runner.sandboxed_copy(self)
            try:
                result = original(sandboxed, *args, **kwargs)
            except BaseException:
                started()
                raise
            if inspect.isawaitable(result):
                return _then(result, started)
            started()
            return result

        Task.__call__ = __call__  # type: ignore[method-assign]
        _INSTALLED = True


def _flows_runner(runner_class: type) -> Any:
    """The runner whose sandbox a task called now runs in (None: Prefect's own call)."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None:
        with _LOCK:
            only = list(_ENTERED.values()) if len(_ENTERED) == 1 else []
        return only[0] if only else None
    runner = getattr(ctx, "task_runner", None)
    if not isinstance(runner, runner_class):
        return None
    if getattr(runner, "_config", None) is None:
        raise RuntimeError(
            "a task called before its flow's ResolutoTaskRunner started (from a flow_run_name "
            "callable?) has no sandbox to run in; call it from the flow's body"
        )
    return runner


async def _then(awaitable: Awaitable[Any], started: Callable[[], None]) -> Any:
    try:
        return await awaitable
    finally:
        started()
