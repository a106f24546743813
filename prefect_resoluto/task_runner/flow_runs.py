"""The flow runs one entered task runner serves.

It keeps the engine's own FlowRun objects (their states kept current by the engine: a
failed flow's final state tells the runner's exit to cancel), says once in each flow run's
logs where its tasks run, and knows the flow runs its nodes ran under (swept at exit).
"""

from __future__ import annotations

import threading
from typing import Any

from guest_runner.conduit import Conduit
from prefect_resoluto.runtimes.base import Resources, SandboxRuntime


class FlowRuns:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: dict[str, Any] = {}
        self._announced: set[str] = set()
        #: Ids the runner's nodes ran under (a task run outside a flow run: its own id).
        self.with_nodes: set[str] = set()

    def submitted(self, flow_run: Any) -> bool:
        """A task of ``flow_run`` was submitted; True the first time for this flow run."""
        key = str(flow_run.id)
        self._objects[key] = flow_run
        with self._lock:
            if key in self._announced:
                return False
            self._announced.add(key)
            return True

    def any_failed(self) -> bool:
        # The flow engine handles the flow's exception before leaving the runner's context,
        # so a failed flow exits the runner "cleanly": its final state tells.
        for fr in self._objects.values():
            state = getattr(fr, "state", None)
            if state is not None and state.is_final() and not state.is_completed():
                return True
        return False


def announce(
    fr_ctx: Any, runtime: SandboxRuntime, conduit: Conduit, max_workers: int, resources: Resources
) -> None:
    """One line in the flow run's logs saying where its tasks will run. The flow engine
    enters the runner before its run context exists, so this waits for the first
    submission of each flow run."""
    from prefect.logging.loggers import flow_run_logger

    flow_run_logger(fr_ctx.flow_run, fr_ctx.flow).info(
        "ResolutoTaskRunner: each task runs in its own sandbox; runtime %s, isolation %s, conduit %s, "
        "max_workers %d, per sandbox %s",
        runtime.name,
        runtime.isolation.label,
        conduit.url,
        max_workers,
        resources.describe(),
    )
