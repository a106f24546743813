"""The task runner's live sandboxes, each task run's attempts, and the outputs its last node left.

Standard library only: the runner (:mod:`prefect_resoluto.task_runner.runner`) registers a node's
sandbox here from its launch until it is destroyed -- by the node's driver, or later by the
runner's reaper -- so that ``cancel_all`` reaches every sandbox still alive.
"""

from __future__ import annotations

import threading
from pathlib import Path

from prefect_resoluto.runtimes.base import SandboxHandle


class LiveSandboxes:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, SandboxHandle] = {}
        self._attempts: dict[str, int] = {}
        #: task run id -> the declared output files of its last successful node.
        self._outputs: dict[str, dict[str, Path]] = {}

    def next_attempt(self, task_run_id: str) -> int:
        """This task run's next node: 1 for its first, counting infrastructure re-launches and
        the task's own retries alike (a node id is the task run id, then ``.2``, ``.3`` ...)."""
        with self._lock:
            attempt = self._attempts[task_run_id] = self._attempts.get(task_run_id, 0) + 1
            return attempt

    def add(self, handle: SandboxHandle) -> None:
        with self._lock:
            self._live[handle.id] = handle

    def drop(self, handle_id: str) -> None:
        with self._lock:
            self._live.pop(handle_id, None)

    def handles(self) -> list[SandboxHandle]:
        with self._lock:
            return list(self._live.values())

    def set_outputs(self, task_run_id: str, files: dict[str, Path]) -> None:
        with self._lock:
            self._outputs[task_run_id] = dict(files)

    def outputs(self, task_run_id: str) -> dict[str, Path]:
        with self._lock:
            return dict(self._outputs.get(task_run_id, {}))
