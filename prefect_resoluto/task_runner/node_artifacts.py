"""When the runner's artifacts (:mod:`.artifacts`, opt-in: ``summary_artifact``) reach the API:
off the task's critical path, and only once a task run's end is known.

A node's row joins its flow run's table at once; a failed node's own table is held until
its task run's future is done and kept only if the task run did not complete (a task that
failed once and then completed carries no runner artifact), queued on the runner's
background thread, drained by the runner's exit; each flow run's table is published last,
once, at the exit. With the setting off nothing is held, queued or published.
"""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable

from guest_runner.redact import Redactor
from prefect_resoluto.node.outcome import NodeOutcome
from prefect_resoluto.task_runner.artifacts import (
    NodeTable,
    error_summary,
    flow_key,
    publish_node_table,
    publish_tables,
)
from prefect_resoluto.task_runner.background import Background


class NodeArtifacts:
    """The entered runner's artifacts: a table per flow run, a failed node's table held per task run."""

    def __init__(self, queue: Background, summary: bool) -> None:
        self._queue = queue
        self._summary = summary
        self._lock = threading.Lock()
        # The last failed node's table of task runs whose future is not done yet.
        self._held: dict[str, Callable[[], None]] = {}
        self._tables: dict[str, NodeTable] = {}  # per flow run: its row in the flow's collection

    def publish(self, outcome: NodeOutcome, attempt: int, redactor: Redactor, sandbox: str = "") -> None:
        """The node's row in its flow run's table and, if it failed, its table held for the
        current task run until :meth:`task_done`. Nothing when the summary is off."""
        if not self._summary:
            return
        from prefect.context import FlowRunContext, TaskRunContext

        ctx = TaskRunContext.get()
        fr_ctx = FlowRunContext.get()
        task_run_name = ctx.task_run.name if ctx is not None and ctx.task_run is not None else outcome.node_id
        error = error_summary(outcome, redactor)
        if fr_ctx is not None and fr_ctx.flow_run is not None:
            fr_id = str(fr_ctx.flow_run.id)
            with self._lock:
                table = self._tables.get(fr_id)
                if table is None:
                    flow_name = fr_ctx.flow.name if fr_ctx.flow is not None else fr_ctx.flow_run.name
                    table = self._tables[fr_id] = NodeTable(
                        fr_id, flow_key(flow_name), fr_ctx.flow_run.name or fr_id
                    )
            table.add(outcome, task_run_name, attempt, error)
        if outcome.ok or ctx is None or ctx.task_run is None:
            return
        publish = functools.partial(publish_node_table, outcome, task_run_name, attempt, error, sandbox)
        job = functools.partial(contextvars.copy_context().run, publish)  # the task run's context
        with self._lock:
            self._held[str(ctx.task_run.id)] = job  # a later attempt's failure replaces it

    def task_done(self, task_run_id: str, completed: bool) -> None:
        """The task run's future is done: a failed node's table is kept only if it did not complete."""
        with self._lock:
            held = self._held.pop(task_run_id, None)
        if held is not None and not completed:
            self._queue.submit(held, "node artifact")

    def flush_held(self) -> None:
        """Queue the tables of task runs whose future never completed (cancelled, interrupted)."""
        with self._lock:
            held = list(self._held.values())
            self._held.clear()
        for job in held:
            self._queue.submit(job, "node artifact")

    def publish_tables(self) -> None:
        with self._lock:
            tables = list(self._tables.values())
        publish_tables(tables)
