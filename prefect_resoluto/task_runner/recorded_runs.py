"""Each task run is recorded by the Prefect server before its engine starts it (issue 41).

Prefect 3's engine makes a task run in memory and tells the server only by events: the
server's task-run recorder inserts the row, stamping ``created`` with its own clock, when
the run's first event reaches it -- after the engine stamped the Running state (the run's
``start_time``) on this side, milliseconds after Pending. So the UI shows a task run
starting before it was created, by the events' latency: 0.05-0.7 s under
ThreadPoolTaskRunner on this machine, more while sandboxes boot and the host is busy.

Here, in the task's worker thread, the runner makes the run as the engine would, emits its
Pending event, waits until the API has the run (reads only, below) and
hands it to the engine, which stamps Running after that: ``created`` comes before
``start_time``, both true. Creating the run by ``POST /task_runs/`` instead was tried: on a
SQLite server each is a write next to the recorder's, and 30-50 % of them were answered 503
after the database's lock timeout (2 s each) on a loaded host. A server that records nothing
(its recorder off) is waited for once per entered runner, :data:`RECORDED_WITHIN` seconds.

The reads are shared (issue 42): one thread per entered runner asks for every run waiting
at once, so N task runs starting together cost a few requests, not one or more each (each
request's client work was a fifth of a sandboxed node's CPU in the flow process at 50 in
flight). A read counts (``POST /task_runs/count`` by ids) and lists the runs (``POST
/task_runs/filter``) only when some of them, not all, are there: a listing is whole task
runs to serialise on the server and parse here (3-4 ms of the server's CPU a request, measured
in a loop, where a count was 1.6 ms).
"""

from __future__ import annotations

import contextvars
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from uuid import UUID

from prefect_resoluto.task_runner.interruptible import interruptible, join_all

if TYPE_CHECKING:
    from prefect.client.schemas.objects import TaskRun
    from prefect.tasks import Task

logger = logging.getLogger("prefect_resoluto.task_runner")

#: Seconds a task run waits for the server to record it before its engine starts it anyway.
RECORDED_WITHIN = 5.0
#: Pauses between reads for one run: the first about the events' latency on an idle host,
#: then growing. A read asks for every run waiting, so one run's read serves the others too.
FIRST_READ_AFTER = 0.02
MAX_PAUSE = 0.2
#: Ids in one read at most (the server's default page: 200).
READ_BATCH = 200
#: Seconds the reading thread outlives the last run it waited for (the next map's runs reuse it).
IDLE_LINGER = 2.0


@dataclass(eq=False)
class _Waiting:
    """One task run waiting to be recorded: when it is next due a read, and what was found."""

    due: float
    pause: float = FIRST_READ_AFTER
    found: bool | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class Recorder:
    """The server's task-run recorder as one entered runner found it: recording (until a run
    was not recorded within :data:`RECORDED_WITHIN`: later runs are not held for it); and
    the one thread that reads, for every run waiting, whether the API has it yet."""

    silent: bool = False
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _waiting: dict[UUID, _Waiting] = field(default_factory=dict)
    _thread: threading.Thread | None = None

    def wait(self, task_run_id: UUID) -> bool | None:
        """True once the API has the run; False when it has not within :data:`RECORDED_WITHIN`;
        None when reading failed (an API error: this run is not waited for, later ones are)."""
        waiting = _Waiting(due=time.monotonic() + FIRST_READ_AFTER)
        with self._cond:
            self._waiting[task_run_id] = waiting
            if self._thread is None:
                # In the first waiter's context: the flow run's settings (its API) and client.
                ctx = contextvars.copy_context()
                self._thread = threading.Thread(
                    target=ctx.run, args=(self._read_loop,), name="resoluto-recorded-runs", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        try:
            if not waiting.done.wait(RECORDED_WITHIN):
                return False
            return waiting.found
        finally:
            with self._cond:
                self._waiting.pop(task_run_id, None)

    def _read_loop(self) -> None:
        from prefect.context import SyncClientContext

        try:
            with SyncClientContext.get_or_create() as ctx:
                while (ids := self._next_round()) is not None:
                    try:
                        found = _recorded(ctx.client, ids)
                    except Exception as e:  # noqa: BLE001 - the tasks run regardless
                        logger.debug("task runs %s: their records not read (%r)", ids, e)
                        self._settle(ids, set(), failed=True)
                    else:
                        self._settle(ids, found, failed=False)
        finally:
            with self._cond:
                if self._thread is threading.current_thread():  # it failed (its client did not open)
                    self._thread = None
                    for waiting in self._waiting.values():  # not waited for: found stays None
                        waiting.done.set()

    def _next_round(self) -> list[UUID] | None:
        """The runs waiting once the first of them is due a read; None after IDLE_LINGER with none."""
        with self._cond:
            idle_until = time.monotonic() + IDLE_LINGER
            while True:
                now = time.monotonic()
                if not self._waiting:
                    if now >= idle_until:
                        self._thread = None  # under the lock: a new waiter starts a new thread
                        return None
                    self._cond.wait(idle_until - now)
                    continue
                due = min(w.due for w in self._waiting.values())
                if due <= now:
                    return list(self._waiting)
                self._cond.wait(due - now)

    def _settle(self, ids: list[UUID], found: set[UUID], *, failed: bool) -> None:
        with self._cond:
            now = time.monotonic()
            for run_id in ids:
                waiting = self._waiting.get(run_id)
                if waiting is None:
                    continue  # gone: waited its RECORDED_WITHIN out
                if failed or run_id in found:
                    waiting.found = None if failed else True
                    del self._waiting[run_id]
                    waiting.done.set()
                else:
                    waiting.pause = min(waiting.pause * 1.5, MAX_PAUSE)
                    waiting.due = now + waiting.pause


def _recorded(client: Any, ids: list[UUID]) -> set[UUID]:
    """Those of ``ids`` the API has, per READ_BATCH of them: counted first (a number, where a
    read answers whole runs for this side and the server to serialise and parse), read only
    when some but not all are there."""
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterId

    found: set[UUID] = set()
    for at in range(0, len(ids), READ_BATCH):
        batch = ids[at : at + READ_BATCH]
        only = TaskRunFilter(id=TaskRunFilterId(any_=batch)).model_dump(mode="json")
        have = _count(client, only)
        if have == len(batch):
            found.update(batch)
        elif have != 0:  # some, or not counted (an API without the route): which ones
            found.update(_listed(client, only, batch))
    return found


def _listed(client: Any, only: dict[str, Any], batch: list[UUID]) -> set[UUID]:
    """Those of ``batch`` a listing of the runs ``only`` selects holds: their ids read from
    the answer's JSON, not each run built as a model (the client's CPU of a listing of a map's
    runs, several a second while they start, was most of what a wait for them cost)."""
    runs = client._client.post("/task_runs/filter", json={"task_runs": only, "limit": len(batch)}).json()
    if not isinstance(runs, list):
        return set()
    wanted = {str(i): i for i in batch}
    return {wanted[r["id"]] for r in runs if isinstance(r, dict) and r.get("id") in wanted}


def _count(client: Any, only: dict[str, Any]) -> int | None:
    """``POST /task_runs/count`` of the runs ``only`` (a filter, as JSON) selects; None when
    the API refuses it."""
    import httpx

    try:
        reply = client._client.post("/task_runs/count", json={"task_runs": only})
        have = reply.json()
    except (httpx.HTTPStatusError, ValueError):
        return None
    return have if isinstance(have, int) and not isinstance(have, bool) else None


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
    if not recorder.silent and recorder.wait(run.id) is False:
        recorder.silent = True
        logger.debug("task run %s not recorded within %.0f s: runs start unrecorded", run.id, RECORDED_WITHIN)
    return run


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
