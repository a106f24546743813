"""What a pod's status means for its node: phases, container reasons, forensics -> SandboxStatus.

Pure: it reads a pod as the client library returns it (``V1Pod``) and the handle's own
notes (``handle.data``: the memory limit, whether we destroyed it, since when it is
unschedulable); the only thing it writes is that last note.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from prefect_resoluto.runtimes.base import SandboxStatus
from prefect_resoluto.runtimes.kubernetes.manifests import CONTAINER_NAME

#: Waiting reasons after which a container will never start without outside help.
FATAL_WAITING_REASONS = frozenset(
    {
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "CrashLoopBackOff",
        "PreCreateHookError",
        "PreStartHookError",
        "PostStartHookError",
    }
)
#: Pod-level reasons of a Failed pod that come from the node, not from the workload.
INFRA_POD_REASONS = frozenset(
    {
        "Evicted",
        "NodeLost",
        "Shutdown",
        "NodeShutdown",
        "Terminated",
        "UnexpectedAdmissionError",
        "OutOfcpu",
        "OutOfmemory",
        "OutOfpods",
        "OutOfephemeral-storage",
        "NodeAffinity",
        "DeadlineExceeded",
        "Preempting",
        "NodeAffinityFailed",
    }
)
_IMAGE_PULL_REASONS = ("ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull")


@dataclass(frozen=True)
class _Pod:
    """What :func:`pod_status` decides from: the pod's facts and the runtime's context."""

    phase: str
    pod_reason: str
    pod_message: str
    waiting_reason: str
    waiting_message: str
    terminated_reason: str
    terminated_message: str
    exit_code: int | None
    deleted_outside: bool
    disruption: Any
    status: Any  # the pod's own V1PodStatus (its conditions)
    notes: MutableMapping[str, Any]
    clock: Callable[[], float]
    unschedulable_patience_s: float
    runtime_class: str
    store_credentials_secret: str | None

    @property
    def failed(self) -> bool:
        return self.phase == "Failed"


def pod_status(
    pod: Any,
    notes: MutableMapping[str, Any],
    *,
    clock: Callable[[], float],
    unschedulable_patience_s: float,
    runtime_class: str,
    store_credentials_secret: str | None = None,
) -> SandboxStatus:
    """The node's view of ``pod``; ``notes`` is the handle's data (read, and the unschedulable clock).

    The first row of :data:`_TABLE` whose condition holds gives the verdict."""
    p = _read(pod, notes, clock, unschedulable_patience_s, runtime_class, store_credentials_secret)
    return next(verdict(p) for _, when, verdict in _TABLE if when(p))


def _read(
    pod: Any,
    notes: MutableMapping[str, Any],
    clock: Callable[[], float],
    unschedulable_patience_s: float,
    runtime_class: str,
    store_credentials_secret: str | None,
) -> _Pod:
    ps = pod.status
    cs = None
    for c in (ps.container_statuses or []) if ps else []:
        if c.name == CONTAINER_NAME:
            cs = c
    state = cs.state if cs is not None else None
    waiting = state.waiting if state is not None else None
    terminated = state.terminated if state is not None else None
    disruption = None
    for cond in (ps.conditions or []) if ps else []:
        if cond.type == "DisruptionTarget" and cond.status == "True":
            disruption = cond
    return _Pod(
        phase=(ps.phase if ps else None) or "Pending",
        pod_reason=(ps.reason if ps else None) or "",
        pod_message=(ps.message if ps else None) or "",
        waiting_reason=(waiting.reason if waiting is not None else "") or "",
        waiting_message=(waiting.message if waiting is not None else "") or "",
        terminated_reason=(terminated.reason if terminated is not None else "") or "",
        terminated_message=(terminated.message if terminated is not None else "") or "",
        exit_code=terminated.exit_code if terminated is not None else None,
        deleted_outside=bool(pod.metadata and pod.metadata.deletion_timestamp) and not notes.get("destroyed"),
        disruption=disruption,
        status=ps,
        notes=notes,
        clock=clock,
        unschedulable_patience_s=unschedulable_patience_s,
        runtime_class=runtime_class,
        store_credentials_secret=store_credentials_secret,
    )


# -- the verdicts, one per row of the table ----------------------------------------------------


def _never_starts(p: _Pod) -> SandboxStatus:
    # The pod is still Pending: the phase says so, the flag says it will stay that way
    # (callers confirm over a few observations, then give up).
    return SandboxStatus(
        "running" if p.phase == "Running" else "pending",
        unstartable=True,
        reason=f"{p.waiting_reason}: {p.waiting_message}".rstrip(": ")
        + waiting_hint(p.waiting_reason, p.store_credentials_secret),
    )


def _pending(p: _Pod) -> SandboxStatus:
    if _scheduled(p.status):
        p.notes.pop("unschedulable_since", None)
    unsched = _unschedulable(p.status)
    if unsched is None:
        return SandboxStatus("pending", reason=p.waiting_reason or p.pod_reason or "Pending")
    since = p.notes.setdefault("unschedulable_since", p.clock())
    waited = p.clock() - since
    reason = f"Unschedulable: {unsched}"
    if waited < p.unschedulable_patience_s:
        return SandboxStatus("pending", reason=reason)
    return SandboxStatus(
        "pending",
        unstartable=True,
        reason=f"{reason} (no node accepted the pod for {waited:.0f}s, patience "
        f"{p.unschedulable_patience_s:.0f}s: check the RuntimeClass "
        f"{p.runtime_class!r} exists on some node, node selectors/taints and "
        "free capacity)",
    )


def _running(p: _Pod) -> SandboxStatus:
    reason = "the pod is being deleted from outside prefect-resoluto" if p.deleted_outside else "Running"
    return SandboxStatus("running", reason=reason)


def _succeeded(p: _Pod) -> SandboxStatus:
    return SandboxStatus(
        "succeeded", reason="Completed", exit_code=p.exit_code if p.exit_code is not None else 0
    )


def _node_failed_it(p: _Pod) -> SandboxStatus:
    d = p.disruption
    why = p.pod_reason or (d.reason if d is not None else "")
    msg = p.pod_message or (d.message if d is not None else "") or ""
    return SandboxStatus(
        "failed", reason=f"{why}: {msg}".rstrip(": "), exit_code=p.exit_code, infrastructure=True
    )


def _out_of_memory(p: _Pod) -> SandboxStatus:
    limit = p.notes.get("memory_limit")
    lim = f" of {limit} bytes" if limit else ""
    return SandboxStatus(
        "failed",
        exit_code=p.exit_code,
        infrastructure=True,
        reason=f"OOMKilled: the container exceeded its memory limit{lim} and was killed "
        f"(exit code {p.exit_code}); give the task more memory",
    )


def _container_lost(p: _Pod) -> SandboxStatus:
    return SandboxStatus(
        "failed",
        exit_code=p.exit_code,
        infrastructure=True,
        reason=f"{p.terminated_reason}: {p.terminated_message or 'the node running the pod was lost'}",
    )


def _deleted_while_running(p: _Pod) -> SandboxStatus:
    return SandboxStatus(
        "failed",
        exit_code=p.exit_code,
        infrastructure=True,
        reason=f"the pod was deleted from outside prefect-resoluto while running (exit code {p.exit_code})",
    )


def _no_exit_code(p: _Pod) -> SandboxStatus:
    return SandboxStatus(
        "failed",
        infrastructure=True,
        reason=f"{p.pod_reason or 'Failed'}: {p.pod_message or 'the pod failed without a container exit code'}",
    )


def _guest_exited(p: _Pod) -> SandboxStatus:
    t_reason = p.terminated_reason
    return SandboxStatus(
        "failed",
        exit_code=p.exit_code,
        reason=f"the guest exited with code {p.exit_code}"
        + (f" ({t_reason})" if t_reason and t_reason != "Error" else ""),
    )


def _node_lost(p: _Pod) -> SandboxStatus:
    return SandboxStatus("failed", infrastructure=True, reason=f"NodeLost: {p.pod_message}".rstrip(": "))


def _not_reporting(p: _Pod) -> SandboxStatus:
    return SandboxStatus("unknown", reason=p.pod_reason or "the pod's node is not reporting its state")


#: (what the row means, when it applies, the verdict): the first row that applies decides.
_TABLE: tuple[tuple[str, Callable[[_Pod], bool], Callable[[_Pod], SandboxStatus]], ...] = (
    ("a container will never start", lambda p: p.waiting_reason in FATAL_WAITING_REASONS, _never_starts),
    ("pending (scheduling, pulling)", lambda p: p.phase == "Pending", _pending),
    ("running", lambda p: p.phase == "Running", _running),
    ("succeeded", lambda p: p.phase == "Succeeded", _succeeded),
    (
        "failed: the node's doing (eviction, shutdown, disruption)",
        lambda p: p.failed and (p.pod_reason in INFRA_POD_REASONS or p.disruption is not None),
        _node_failed_it,
    ),
    ("failed: out of memory", lambda p: p.failed and p.terminated_reason == "OOMKilled", _out_of_memory),
    (
        "failed: the container's node was lost",
        lambda p: p.failed and p.terminated_reason in ("ContainerStatusUnknown", "NodeLost"),
        _container_lost,
    ),
    ("failed: deleted from outside", lambda p: p.failed and p.deleted_outside, _deleted_while_running),
    ("failed without an exit code", lambda p: p.failed and p.exit_code is None, _no_exit_code),
    ("failed: the guest's own exit", lambda p: p.failed, _guest_exited),
    ("unknown: the node was lost", lambda p: p.pod_reason == "NodeLost", _node_lost),
    ("unknown: the node is not reporting", lambda p: True, _not_reporting),
)


def remember_terminal(notes: MutableMapping[str, Any], st: SandboxStatus) -> None:
    """Keep a terminal verdict, so a pod collected afterwards still reports how it ended."""
    if st.terminal:
        notes["last_terminal"] = {
            "phase": st.phase,
            "reason": st.reason,
            "exit_code": st.exit_code,
            "infrastructure": st.infrastructure,
            "unstartable": st.unstartable,
        }


def gone_status(namespace: str, name: str, notes: MutableMapping[str, Any]) -> SandboxStatus:
    """The status of a pod the API server no longer has (404)."""
    last = notes.get("last_terminal")
    if last:  # it had finished before it went: keep that verdict
        return SandboxStatus(
            last["phase"],
            reason=last["reason"],
            exit_code=last["exit_code"],
            gone=True,
            infrastructure=last["infrastructure"],
            unstartable=last["unstartable"],
        )
    if notes.get("destroyed"):
        return SandboxStatus("unknown", reason=f"pod {namespace}/{name} was destroyed", gone=True)
    return SandboxStatus(
        "unknown",
        gone=True,
        infrastructure=True,
        reason=f"pod {namespace}/{name} no longer exists: it was deleted from outside prefect-resoluto "
        "(kubectl delete, a namespace cleanup, or the node's garbage collection) before it "
        "finished",
    )


def waiting_hint(reason: str, store_credentials_secret: str | None = None) -> str:
    """What to check for a container stuck waiting with ``reason`` ('' when nothing useful)."""
    if reason in _IMAGE_PULL_REASONS:
        return (
            " -- the node cannot pull the image; check the name, the registry's reachability "
            "from the nodes and imagePullSecrets"
        )
    if reason == "CreateContainerConfigError":
        return " -- check that the referenced Secrets exist in the namespace" + (
            f" (store credentials Secret {store_credentials_secret!r})" if store_credentials_secret else ""
        )
    return ""


def _scheduled(ps: Any) -> bool:
    return any(c.type == "PodScheduled" and c.status == "True" for c in (ps.conditions or []))


def _unschedulable(ps: Any) -> str | None:
    for c in (ps.conditions or []) if ps else []:
        if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
            return c.message or "no node can run the pod"
    return None
