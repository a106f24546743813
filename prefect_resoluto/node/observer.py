"""The one seam between the node driver and the host that drives a node.

Three hosts drive nodes -- the task runner (one node per task run), the worker (one node per
flow run) and the CLI's ``run`` -- and each sees the same three things happen (the sandbox
launched, an event arrived, the node finished) and answers the same few questions (is the
node cancelled? will you reap its sandbox? how is the workspace packed?). A host subclasses
:class:`NodeObserver` and overrides what it cares about; every method has the answer of a
host that does not care. The driver (:func:`prefect_resoluto.node.drive.drive`) knows no host.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from guest_runner import archive

if TYPE_CHECKING:
    from guest_runner.wire import SpanEvent
    from prefect_resoluto.node.outcome import NodeOutcome
    from prefect_resoluto.runtimes.base import SandboxHandle


class NodeObserver:
    """What a host sees of one node, and the few things it decides for it."""

    def launched(self, handle: SandboxHandle) -> None:
        """The sandbox exists (launched, or a warm one assigned): from now on it can be reaped."""

    def event(self, ev: SpanEvent) -> None:
        """One event of the node's, in order, its secrets already redacted (untrusted data)."""

    def finished(self, outcome: NodeOutcome) -> None:
        """The node's outcome, before the driver returns it (not called when it raised)."""

    def cancelled(self) -> bool:
        """Polled while the node runs: True stops it (``lost``, "cancelled by the host")."""
        return False

    def wake_fds(self) -> tuple[int, ...]:
        """Descriptors that turn readable when :meth:`cancelled` may have turned True (a
        :class:`~prefect_resoluto.node.wake.WakeEvent`'s): the driver sleeps on them."""
        return ()

    def cancel_polled(self) -> bool:
        """Whether :meth:`cancelled` (or an exception raised in the driving thread: Prefect's
        timeout of a sync task) can come with no descriptor of :meth:`wake_fds` saying so: the
        driver then wakes every few seconds to look, else only when told of something."""
        return True

    def reap(self, handle: SandboxHandle) -> bool:
        """A node that succeeded and left everything in the conduit: True takes over destroying
        its sandbox (the interpreter's exit and the teardown are not waited for); False lets the
        driver destroy it before returning."""
        return False

    def pack_workspace(self, root: Path, skip: list[str]) -> bytes:
        """The workspace archive (the task runner reuses one while the tree is unchanged)."""
        return archive.pack(root, skip=skip)


class Callbacks(NodeObserver):
    """An observer made of plain callbacks: :func:`prefect_resoluto.node.drive.drive_node`'s keywords."""

    def __init__(
        self,
        *,
        on_event: Callable[[SpanEvent], None] | None = None,
        on_launch: Callable[[SandboxHandle], None] | None = None,
        should_cancel: Callable[[], bool] | None = None,
        reap: Callable[[SandboxHandle], None] | None = None,
        pack_workspace: Callable[[Path, list[str]], bytes] | None = None,
    ) -> None:
        self._on_event = on_event
        self._on_launch = on_launch
        self._should_cancel = should_cancel
        self._reap = reap
        self._pack = pack_workspace

    def launched(self, handle: SandboxHandle) -> None:
        if self._on_launch is not None:
            self._on_launch(handle)

    def event(self, ev: SpanEvent) -> None:
        if self._on_event is not None:
            self._on_event(ev)

    def cancelled(self) -> bool:
        return self._should_cancel is not None and self._should_cancel()

    def reap(self, handle: SandboxHandle) -> bool:
        if self._reap is None:
            return False
        self._reap(handle)
        return True

    def pack_workspace(self, root: Path, skip: list[str]) -> bytes:
        return self._pack(root, skip) if self._pack is not None else super().pack_workspace(root, skip)


#: A guest runs one workload span; a guest opening more is not believed past this many
#: (what the host remembers of a sandbox's words is bounded, not chosen by the sandbox).
MAX_WORKLOAD_SPANS = 4


class WorkloadOutput:
    """Which events are the workload's own output: the plain log lines of a ``workload`` span
    (what ``run`` prints on stdout, what a command task's line sink receives) -- not the setup's
    or cleanup's output, nor the guest runner's own words."""

    def __init__(self, phases: frozenset[str] = frozenset({"workload"})) -> None:
        self._phases = phases  # the span kinds whose lines count (a worker's: setup and cleanup too)
        self._spans: set[str] = set()

    def line(self, ev: SpanEvent) -> str | None:
        """The line ``ev`` carries when it is workload output, else None (feed every event)."""
        kind, event = ev.get("kind", ""), ev.get("event", "")
        if event == "open":
            if kind in self._phases and len(self._spans) < MAX_WORKLOAD_SPANS:
                self._spans.add(str(ev.get("span_id", "")))
            return None
        if event == "log" and kind == "log" and str(ev.get("parent_span_id", "")) in self._spans:
            return str((ev.get("data") or {}).get("line", ""))
        return None
