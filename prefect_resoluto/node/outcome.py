"""What became of a node: the outcome, and the one list of ways a node fails.

Pure (no I/O): the driver (:mod:`prefect_resoluto.node.drive`) fills a :class:`NodeOutcome` in;
the task runner, the worker, the CLI and the artifacts read it. A failure's kind is a
:class:`FailureKind`, whose values are what outcomes, the CLI's JSON and artifacts carry.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


class NodeFailure(RuntimeError):
    """Base of every way a node can fail to produce a successful result."""

    def __init__(self, message: str, outcome: NodeOutcome | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome


class WorkloadFailed(NodeFailure):
    """The user's work ran and failed (non-zero exit, exception): a user failure."""


class InfrastructureError(NodeFailure):
    """The sandbox, not the work, failed; safe to re-launch."""


class SandboxUnstartable(InfrastructureError):
    """Never started: launch refused, image missing, sustained fatal waiting reason."""


class SandboxLost(InfrastructureError):
    """Started, then vanished: deleted from outside, or silent past the watchdog."""


class SandboxKilled(InfrastructureError):
    """Killed by the substrate: OOM, eviction, a signal from outside."""


class NoResult(InfrastructureError):
    """The sandbox ended without leaving a (valid) result.json / manifest."""


class ProtocolError(InfrastructureError):
    """The guest's objects break the wire contract (malformed chunk, gap, bad result)."""


class EgressNotEnforced(InfrastructureError):
    """The guest's canary reached a destination outside the allowlist: the workload never ran."""


#: How the guest's fail-closed canary words its verdict (guest_runner.egress).
EGRESS_NOT_ENFORCED = "egress is not enforced"


class FailureKind(enum.StrEnum):
    """Every way a node can fail, as the host judged it. The values are what outcomes, the
    CLI's JSON and artifacts carry (a ``str``: ``outcome.failure == "workload"`` holds)."""

    WORKLOAD = "workload"
    UNSTARTABLE = "unstartable"
    LOST = "lost"
    KILLED = "killed"
    NO_RESULT = "no_result"
    PROTOCOL = "protocol"
    EGRESS = "egress"

    @property
    def infrastructure(self) -> bool:
        """The sandbox, not the work, failed (a task run may be re-launched)."""
        return self is not FailureKind.WORKLOAD

    @property
    def error(self) -> type[NodeFailure]:
        return _ERRORS[self]

    @property
    def what(self) -> str:
        """How a node's description words it: ``node n1 <what> on gvisor: ...``."""
        return _WHAT[self]

    @property
    def crash_how(self) -> str:
        """How a flow run's Crashed message words it: ``Sandbox rsl-.. on gvisor <how>: ...``."""
        return _CRASH_HOW.get(self, "failed")


_ERRORS: dict[FailureKind, type[NodeFailure]] = {
    FailureKind.WORKLOAD: WorkloadFailed,
    FailureKind.UNSTARTABLE: SandboxUnstartable,
    FailureKind.LOST: SandboxLost,
    FailureKind.KILLED: SandboxKilled,
    FailureKind.NO_RESULT: NoResult,
    FailureKind.PROTOCOL: ProtocolError,
    FailureKind.EGRESS: EgressNotEnforced,
}
_WHAT = {
    FailureKind.WORKLOAD: "failed",
    FailureKind.UNSTARTABLE: "could not start",
    FailureKind.LOST: "was lost",
    FailureKind.KILLED: "was killed by the sandbox substrate",
    FailureKind.NO_RESULT: "ended without a result",
    FailureKind.PROTOCOL: "broke the wire protocol",
    FailureKind.EGRESS: "was stopped before its workload",
}
# A flow run's sandbox (the worker) is worded shorter; a failed workload or a stopped canary
# there is the flow run's own failure, reported by the engine, so it has no entry.
_CRASH_HOW = {
    FailureKind.UNSTARTABLE: "could not start",
    FailureKind.LOST: "was lost",
    FailureKind.KILLED: "was killed",
    FailureKind.NO_RESULT: "ended without reporting",
    FailureKind.PROTOCOL: "broke the wire protocol",
}


@dataclass
class NodeOutcome:
    run_id: str
    node_id: str
    status: str  # "success" | "failure"
    exit_code: int | None
    reason: str
    observed_phase: str
    failure: FailureKind | None  # None on success
    substrate_logs: str
    output_dir: Path | None
    output_files: dict[str, Path]
    output_archives: list[str]
    conduit_prefix: str
    conduit_url: str
    runtime: str
    isolation: str
    sandbox_id: str
    events: int
    timings: dict[str, float]
    #: Whether the node ran in a sandbox started ahead of demand (prefect_resoluto.warm.pool).
    warm: bool = False
    #: The spec's ``read_in_memory`` files the outbox held, by name (never on disk).
    output_data: dict[str, bytes] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "success"

    @property
    def infrastructure_failure(self) -> bool:
        return self.failure is not None and self.failure.infrastructure

    def raise_for_failure(self) -> None:
        if self.failure is None:
            return
        raise self.failure.error(self.describe(), self)

    def describe(self) -> str:
        if self.ok:
            return f"node {self.node_id} succeeded on {self.runtime} ({self.isolation})"
        what = self.failure.what if self.failure is not None else "failed"
        code = f", exit code {self.exit_code}" if self.exit_code is not None else ""
        msg = f"node {self.node_id} {what} on {self.runtime}{code}: {self.reason or 'no reason given'}"
        if self.substrate_logs and self.failure is not FailureKind.WORKLOAD:
            msg += "\n--- substrate logs (tail) ---\n" + self.substrate_logs[-2000:]
        return msg

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("output_data")  # the caller's to read: bytes, and maybe the task's data
        d["output_dir"] = str(self.output_dir) if self.output_dir else None
        d["output_files"] = {k: str(v) for k, v in self.output_files.items()}
        return d
