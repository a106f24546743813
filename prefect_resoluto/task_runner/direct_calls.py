"""A task called directly in a flow (``total = add(1, 2)``) runs in a sandbox too.

Prefect 3 runs a direct call in the flow's own thread, through its task engine, without
asking the flow's task runner: with no more than the runner, such a task would run on the
host, unisolated, while its ``.submit()`` ran in a sandbox. So, once a
:class:`~.runner.ResolutoTaskRunner` has been entered in this process, ``Task.__call__``
looks at the calling flow run's task runner: when it is a started ResolutoTaskRunner, the
call is Prefect's own on the runner's sandboxed copy of the task (only ``fn`` replaced, as
for a submission), so states, retries, ``return_state``, ``wait_for``, caching and the
await of an async task are Prefect's; otherwise the call is untouched (a flow on another
task runner, a task called outside any flow).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Awaitable, Callable
from typing import Any

_LOCK = threading.Lock()
_INSTALLED = False


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
    """The calling flow run's task runner, if it is a started ``runner_class``."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    runner = getattr(ctx, "task_runner", None) if ctx is not None else None
    if isinstance(runner, runner_class) and getattr(runner, "_config", None) is not None:
        return runner
    return None


async def _then(awaitable: Awaitable[Any], started: Callable[[], None]) -> Any:
    try:
        return await awaitable
    finally:
        started()
