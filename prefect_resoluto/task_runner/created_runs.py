"""Each task run is created by the Prefect API before its engine starts it (issue 41).

Prefect 3's engine makes a task run in memory and tells the server only by events: the
server's task-run recorder inserts the row, stamping ``created`` with its own clock, when
the run's first event reaches it -- after the engine stamped the Running state (the run's
``start_time``) on this side. So the UI shows a task run starting before it was created,
by the events' latency: 0.05-0.4 s under ThreadPoolTaskRunner on this machine, more while
sandboxes boot and the host is busy.

Here the runner creates the task run with one ``POST /task_runs/`` in the task's worker
thread and hands it to the engine, which emits no Pending of its own for it: ``created``
is the server's clock when the run was made, before the engine stamps Running, after the
request returned. Times are the engine's as they were; only the row exists earlier. When
the API cannot create the run, the engine makes it as Prefect does (the task still runs).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from uuid import UUID

if TYPE_CHECKING:
    from prefect.client.schemas.objects import TaskRun
    from prefect.tasks import Task

logger = logging.getLogger("prefect_resoluto.task_runner")


def create_first(
    task: Task[Any, Any],
    task_run_id: UUID,
    parameters: dict[str, Any] | None = None,
    wait_for: Any = None,
    dependencies: dict[str, Any] | None = None,
    flow_run_context: Any = None,
    parent_task_run_context: Any = None,
) -> TaskRun | None:
    """The task run the engine would make in memory (its name, keys, inputs, parents, tags),
    created by the API with the same id; None (said at DEBUG) when the API did not."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.context import SyncClientContext
    from prefect.task_engine import _create_task_run_locally

    local = _create_task_run_locally(
        task=task,
        id=task_run_id,
        parameters=parameters,
        flow_run_context=flow_run_context,
        parent_task_run_context=parent_task_run_context,
        wait_for=wait_for,
        extra_task_inputs=dependencies,
    )
    try:
        with SyncClientContext.get_or_create() as ctx:
            client: SyncPrefectClient = ctx.client
            created = client.create_task_run(
                task=task,
                flow_run_id=local.flow_run_id,
                dynamic_key=local.dynamic_key,
                id=local.id,
                name=local.name,
                extra_tags=local.tags,
                task_inputs=local.task_inputs,
            )
    except Exception as e:  # noqa: BLE001 - the task runs regardless; Prefect's path makes its run
        logger.debug("task run %s not created by the API first (%r): the engine makes it", task_run_id, e)
        return None
    if created.id != local.id:  # another row holds its keys: never run the task as that one
        logger.debug("task run %s was answered by task run %s: the engine makes it", local.id, created.id)
        return None
    return created


def _run_created(run: Callable[..., Any], /, **kwargs: Any) -> Any:
    """``run_task_sync(**kwargs)``, its task run created by the API first (in the worker thread,
    in the submission's context: the flow run's, the parent task run's)."""
    if kwargs.get("task_run") is None and kwargs.get("task_run_id") is not None:
        created = create_first(
            kwargs["task"],
            kwargs["task_run_id"],
            kwargs.get("parameters"),
            kwargs.get("wait_for"),
            kwargs.get("dependencies"),
        )
        if created is not None:
            kwargs["task_run"] = created
    return run(**kwargs)


class CreatingExecutor(ThreadPoolExecutor):
    """ThreadPoolTaskRunner's executor, the sync engine's runs created first. The runner sets it
    as the class of the executor Prefect built (whose arguments vary by Prefect version): the
    one place the task run's id and the engine's call are both in hand before the engine runs.
    An async task's run is created by its task's ``create_local_run`` (:func:`create_async_first`)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        from prefect.task_engine import run_task_sync

        # ThreadPoolTaskRunner.submit: ``submit(context.run, run_task_sync, **engine_kwargs)``
        if args and args[0] is run_task_sync:
            args = (functools.partial(_run_created, run_task_sync), *args[1:])
        return super().submit(fn, *args, **kwargs)


def create_async_first(task: Task[Any, Any]) -> None:
    """Make ``task`` (the runner's own copy) create its async engine's run by the API first: the
    async engine asks the task for its run (``create_local_run``) and emits the run's state as
    it was created, the server's Pending, which the recorder already holds."""
    made_locally = task.create_local_run

    async def create_local_run(
        client: Any = None,
        id: UUID | None = None,
        parameters: dict[str, Any] | None = None,
        flow_run_context: Any = None,
        parent_task_run_context: Any = None,
        wait_for: Any = None,
        extra_task_inputs: dict[str, Any] | None = None,
        deferred: bool = False,
    ) -> TaskRun:
        if id is not None and not deferred:  # the engine's call: its id, never deferred
            # A short blocking request on this task's own event loop, which runs nothing else yet.
            created = create_first(
                task, id, parameters, wait_for, extra_task_inputs, flow_run_context, parent_task_run_context
            )
            if created is not None:
                return created
        return await made_locally(
            client=client,
            id=id,
            parameters=parameters,
            flow_run_context=flow_run_context,
            parent_task_run_context=parent_task_run_context,
            wait_for=wait_for,
            extra_task_inputs=extra_task_inputs,
            deferred=deferred,
        )

    setattr(task, "create_local_run", create_local_run)  # noqa: B010 - an instance's method, this copy only
