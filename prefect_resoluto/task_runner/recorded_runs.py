"""Each task run is recorded by the Prefect server before its engine starts it (issue 41).

Prefect 3's engine makes a task run in memory and tells the server only by events: the
server's task-run recorder inserts the row, stamping ``created`` with its own clock, when
the run's first event reaches it -- after the engine stamped the Running state (the run's
``start_time``) on this side, milliseconds after Pending. So the UI shows a task run
starting before it was created, by the events' latency: 0.05-0.7 s under
ThreadPoolTaskRunner on this machine, more while sandboxes boot and the host is busy.

Here, in the task's worker thread, the runner makes the run as the engine would, emits its
Pending event, waits until the API has the run (reads only: ``GET /task_runs/{id}``) and
hands it to the engine, which stamps Running after that: ``created`` comes before
``start_time``, both true. Creating the run by ``POST /task_runs/`` instead was tried: on a
SQLite server each is a write next to the recorder's, and 30-50 % of them were answered 503
after the database's lock timeout (2 s each) on a loaded host. A server that records nothing
(its recorder off) is waited for once per entered runner, :data:`RECORDED_WITHIN` seconds.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from uuid import UUID

from prefect_resoluto.task_runner.interruptible import interruptible, join_all

if TYPE_CHECKING:
    from prefect.client.schemas.objects import TaskRun
    from prefect.tasks import Task

logger = logging.getLogger("prefect_resoluto.task_runner")

#: Seconds a task run waits for the server to record it before its engine starts it anyway.
RECORDED_WITHIN = 5.0
#: Pauses between reads: the first about the events' latency on an idle host, then growing.
FIRST_READ_AFTER = 0.02
MAX_PAUSE = 0.2


@dataclass
class Recorder:
    """The server's task-run recorder as one entered runner found it: recording (until a run
    was not recorded within :data:`RECORDED_WITHIN`: later runs are not held for it)."""

    silent: bool = False


def recorded_first(
    recorder: Recorder,
    task: Task[Any, Any],
    task_run_id: UUID,
    parameters: dict[str, Any] | None = None,
    wait_for: Any = None,
    dependencies: dict[str, Any] | None = None,
    flow_run_context: Any = None,
    parent_task_run_context: Any = None,
) -> TaskRun:
    """The task run the engine would make (its name, keys, inputs, parents, tags), its Pending
    emitted, once the API has it (or :data:`RECORDED_WITHIN` seconds passed)."""
    from prefect.task_engine import _create_task_run_locally
    from prefect.utilities.engine import emit_task_run_state_change_event

    run = _create_task_run_locally(
        task=task,
        id=task_run_id,
        parameters=parameters,
        flow_run_context=flow_run_context,
        parent_task_run_context=parent_task_run_context,
        wait_for=wait_for,
        extra_task_inputs=dependencies,
    )
    assert run.state is not None
    emit_task_run_state_change_event(task_run=run, initial_state=None, validated_state=run.state)
    if not recorder.silent and _wait_until_recorded(run.id) is False:
        recorder.silent = True
        logger.debug("task run %s not recorded within %.0f s: runs start unrecorded", run.id, RECORDED_WITHIN)
    return run


def _wait_until_recorded(task_run_id: UUID) -> bool | None:
    """True once the API has the run; False when it has not within :data:`RECORDED_WITHIN`;
    None when reading failed (an API error: this run is not waited for, later ones are)."""
    from prefect.context import SyncClientContext
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + RECORDED_WITHIN
    pause = FIRST_READ_AFTER
    with SyncClientContext.get_or_create() as ctx:
        while True:
            time.sleep(pause)  # the recorder inserts the row some milliseconds after the event left
            try:
                ctx.client.read_task_run(task_run_id)
                return True
            except ObjectNotFound:
                pass
            except Exception as e:  # noqa: BLE001 - the task runs regardless
                logger.debug("task run %s: its record not read (%r)", task_run_id, e)
                return None
            if time.monotonic() > deadline:
                return False
            pause = min(pause * 1.5, MAX_PAUSE)


def _run_recorded(recorder: Recorder, run: Callable[..., Any], /, **kwargs: Any) -> Any:
    """``run_task_sync(**kwargs)`` with its task run recorded first (in the worker thread, in
    the submission's context: the flow run's, the parent task run's)."""
    if kwargs.get("task_run") is None and kwargs.get("task_run_id") is not None:
        kwargs["task_run"] = recorded_first(
            recorder,
            kwargs["task"],
            kwargs["task_run_id"],
            kwargs.get("parameters"),
            kwargs.get("wait_for"),
            kwargs.get("dependencies"),
        )
    return run(**kwargs)


class RecordingExecutor(ThreadPoolExecutor):
    """ThreadPoolTaskRunner's executor, the sync engine's runs recorded first, its waits
    interruptible by Ctrl-C (:mod:`.interruptible`). The runner sets it
    as the class of the executor Prefect built (whose arguments vary by Prefect version): the
    one place the task run's id and the engine's call are both in hand before the engine runs.
    An async task's run is recorded by its task's ``create_local_run`` (:func:`record_async_first`)."""

    recorder: Recorder  # set by the runner with the class

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        from prefect.task_engine import run_task_sync

        # ThreadPoolTaskRunner.submit: ``submit(context.run, run_task_sync, **engine_kwargs)``
        if args and args[0] is run_task_sync:
            args = (functools.partial(_run_recorded, self.recorder, run_task_sync), *args[1:])
        return interruptible(super().submit(fn, *args, **kwargs))

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=False, cancel_futures=cancel_futures)
        if wait:
            join_all(self._threads)


def record_async_first(task: Task[Any, Any], recorder: Recorder) -> None:
    """Make ``task`` (the runner's own copy) hand its async engine a run already recorded: the
    engine asks the task for its run (``create_local_run``), then emits its Pending again (the
    same state, id and time: nothing changes on the server)."""
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
        if id is None or deferred:  # not the engine's call
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
        # Blocking reads on this task's own event loop, which runs nothing else yet.
        return recorded_first(
            recorder,
            task,
            id,
            parameters,
            wait_for,
            extra_task_inputs,
            flow_run_context,
            parent_task_run_context,
        )

    setattr(task, "create_local_run", create_local_run)  # noqa: B010 - an instance's method, this copy only
