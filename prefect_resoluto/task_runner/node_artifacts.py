"""When the runner's artifacts (:mod:`.artifacts`) reach the API: off the task's critical path.

A node's artifacts are held until its task run's future is done, so their API round trips
never compete with the task's own Completed-state call; then queued on the runner's
background thread, drained by the runner's exit; each flow run's keyed table of every node
is published last, once, at the exit.
"""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable

from guest_runner.redact import Redactor
from prefect_resoluto.node.outcome import NodeOutcome
from prefect_resoluto.task_runner.artifacts import NodeTable, flow_run_key, publish_tables
from prefect_resoluto.task_runner.artifacts import publish_node_artifact as _publish_artifact
from prefect_resoluto.task_runner.background import Background


class NodeArtifacts:
    """The entered runner's artifacts: held per task run, queued, and a table per flow run."""

    def __init__(self, queue: Background) -> None:
        self._queue = queue
        self._lock = threading.Lock()
        # Artifacts of task runs whose future is not done yet.
        self._held: dict[str, list[Callable[[], None]]] = {}
        self._tables: dict[str, NodeTable] = {}  # per flow run: its keyed artifact

    def publish(self, outcome: NodeOutcome, attempt: int, redactor: Redactor, sandbox: str = "") -> None:
        """The node's artifacts, held for the current task run until :meth:`task_done`
        (published now outside a task run)."""
        from prefect.context import FlowRunContext, TaskRunContext

        ctx = TaskRunContext.get()
        fr_ctx = FlowRunContext.get()
        task_run_name = ctx.task_run.name if ctx is not None and ctx.task_run is not None else outcome.node_id
        table = None
        if fr_ctx is not None and fr_ctx.flow_run is not None:
            fr_id = str(fr_ctx.flow_run.id)
            with self._lock:
                table = self._tables.get(fr_id)
                if table is None:
                    name = fr_ctx.flow_run.name or fr_id
                    table = self._tables[fr_id] = NodeTable(fr_id, flow_run_key(name, fr_id), name)
        publish = functools.partial(
            _publish_artifact, outcome, task_run_name, attempt, redactor, table, sandbox
        )
        job = functools.partial(contextvars.copy_context().run, publish)  # the task run's context
        if ctx is None or ctx.task_run is None:
            job()
            return
        with self._lock:
            self._held.setdefault(str(ctx.task_run.id), []).append(job)

    def task_done(self, task_run_id: str) -> None:
        """The task run's future is done: its held artifacts go to the queue."""
        with self._lock:
            held = self._held.pop(task_run_id, [])
        for job in held:
            self._queue.submit(job, "node artifact")

    def flush_held(self) -> None:
        """Queue the artifacts of task runs whose future never completed (cancelled, interrupted)."""
        with self._lock:
            held = [job for jobs in self._held.values() for job in jobs]
            self._held.clear()
        for job in held:
            self._queue.submit(job, "node artifact")

    def publish_tables(self) -> None:
        with self._lock:
            tables = list(self._tables.values())
        publish_tables(tables)
