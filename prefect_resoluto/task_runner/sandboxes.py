"""The runner's sandboxes as one task run's node may reach them: its observer's narrow handle.

A node's observer (:class:`~prefect_resoluto.task_runner.task_node.TaskRunObserver`)
registers its sandbox as live from launch until destroyed (so ``cancel_all`` reaches it),
hands a finished one to the runner's reaper, packs its workspace with the runner's packer
and asks whether the runner is cancelling -- and nothing else of the runner's.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterable
from pathlib import Path

from prefect_resoluto.node.wake import WakeEvent
from prefect_resoluto.runtimes.base import SandboxHandle, SandboxRuntime
from prefect_resoluto.runtimes.labels import LABEL_FLOW_RUN, label_value
from prefect_resoluto.task_runner.background import Background
from prefect_resoluto.task_runner.live import LiveSandboxes
from prefect_resoluto.task_runner.workspace import WorkspacePacker

log = logging.getLogger("prefect_resoluto")


class RunnerSandboxes:
    """The entered runner's runtime, live sandboxes, reaper and workspace packer."""

    def __init__(
        self,
        runtime: SandboxRuntime,
        live: LiveSandboxes,
        cancelled: threading.Event,
        reaper: Background,
        packer: WorkspacePacker,
    ) -> None:
        self._runtime = runtime
        self._live = live
        self._cancelled = cancelled
        self._reaper = reaper
        #: None once the runner has exited: its archives go with it.
        self.packer: WorkspacePacker | None = packer

    def launched(self, handle: SandboxHandle) -> None:
        self._live.add(handle)

    def released(self, handle_id: str) -> None:
        self._live.drop(handle_id)

    def cancelling(self) -> bool:
        return self._cancelled.is_set()

    def cancel_fd(self) -> int | None:
        """A descriptor readable once the runner cancels (a WakeEvent's), else None."""
        return self._cancelled.fileno() if isinstance(self._cancelled, WakeEvent) else None

    def reap(self, handle: SandboxHandle) -> None:
        """Destroy ``handle`` on the reaper's thread; it stays live until destroyed."""
        self._reaper.submit(functools.partial(self._reap, handle), f"reaping sandbox {handle.id}")

    def pack(self, root: Path, skip: list[str]) -> bytes | None:
        """The workspace archive from the runner's packer (None: the runner has exited)."""
        packer = self.packer
        return packer(root, skip) if packer is not None else None

    def destroy_all(self) -> None:
        for handle in self._live.handles():
            self.destroy(handle)

    def destroy(self, handle: SandboxHandle) -> None:
        try:
            self._runtime.destroy(handle)
        except Exception as e:
            log.warning("could not destroy sandbox %s: %s", handle.id, e)

    def _reap(self, handle: SandboxHandle) -> None:
        self.destroy(handle)
        self._live.drop(handle.id)


def sweep(runtime: SandboxRuntime, flow_run_ids: Iterable[str]) -> None:
    """Destroy what is left of the flow runs' sandboxes (a node's own teardown, or the
    reaper's, that did not happen), found by their flow-run label."""
    for fr in flow_run_ids:
        try:
            n = runtime.sweep({LABEL_FLOW_RUN: label_value(fr)})
            if n:
                log.warning("reaped %d leftover sandbox(es) of flow run %s", n, fr)
        except Exception as e:
            log.warning("sweeping sandboxes of flow run %s failed: %s", fr, e)
