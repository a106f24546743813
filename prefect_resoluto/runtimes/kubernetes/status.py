"""What a pod's status means for its node: phases, container reasons, forensics -> SandboxStatus.

Pure: it reads a pod as the client library returns it (``V1Pod``) and the handle's own
notes (``handle.data``: the memory limit, whether we destroyed it, since when it is
unschedulable); the only thing it writes is that last note.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
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


def pod_status(
    pod: Any,
    notes: MutableMapping[str, Any],
    *,
    clock: Callable[[], float],
    unschedulable_patience_s: float,
    runtime_class: str,
    store_credentials_secret: str | None = None,
) -> SandboxStatus:
    """The node's view of ``pod``; ``notes`` is the handle's data (read, and the unschedulable clock)."""
    ps = pod.status
    phase = (ps.phase if ps else None) or "Pending"
    pod_reason = (ps.reason if ps else None) or ""
    pod_message = (ps.message if ps else None) or ""
    cs = None
    for c in (ps.container_statuses or []) if ps else []:
        if c.name == CONTAINER_NAME:
            cs = c
    state = cs.state if cs is not None else None
    waiting = state.waiting if state is not None else None
    terminated = state.terminated if state is not None else None
    exit_code = terminated.exit_code if terminated is not None else None
    deleted_outside = bool(pod.metadata and pod.metadata.deletion_timestamp) and not notes.get("destroyed")
    disruption = None
    for cond in (ps.conditions or []) if ps else []:
        if cond.type == "DisruptionTarget" and cond.status == "True":
            disruption = cond

    # Never going to start. The pod is still Pending: the phase says so, the flag says
    # it will stay that way (callers confirm over a few observations, then give up).
    if waiting is not None and (waiting.reason or "") in FATAL_WAITING_REASONS:
        msg = waiting.message or ""
        return SandboxStatus(
            "running" if phase == "Running" else "pending",
            unstartable=True,
            reason=f"{waiting.reason}: {msg}".rstrip(": ")
            + waiting_hint(waiting.reason or "", store_credentials_secret),
        )

    if phase == "Pending":
        if _scheduled(ps):
            notes.pop("unschedulable_since", None)
        unsched = _unschedulable(ps)
        if unsched is not None:
            since = notes.setdefault("unschedulable_since", clock())
            waited = clock() - since
            reason = f"Unschedulable: {unsched}"
            if waited >= unschedulable_patience_s:
                return SandboxStatus(
                    "pending",
                    unstartable=True,
                    reason=f"{reason} (no node accepted the pod for {waited:.0f}s, patience "
                    f"{unschedulable_patience_s:.0f}s: check the RuntimeClass "
                    f"{runtime_class!r} exists on some node, node selectors/taints and "
                    "free capacity)",
                )
            return SandboxStatus("pending", reason=reason)
        why = (waiting.reason if waiting is not None else "") or pod_reason or "Pending"
        return SandboxStatus("pending", reason=why)

    if phase == "Running":
        reason = "Running"
        if deleted_outside:
            reason = "the pod is being deleted from outside prefect-resoluto"
        return SandboxStatus("running", reason=reason)

    if phase == "Succeeded":
        return SandboxStatus(
            "succeeded", reason="Completed", exit_code=exit_code if exit_code is not None else 0
        )

    if phase == "Failed":
        t_reason = (terminated.reason if terminated is not None else "") or ""
        t_message = (terminated.message if terminated is not None else "") or ""
        if pod_reason in INFRA_POD_REASONS or disruption is not None:
            why = pod_reason or (disruption.reason if disruption is not None else "")
            msg = pod_message or (disruption.message if disruption is not None else "") or ""
            return SandboxStatus(
                "failed", reason=f"{why}: {msg}".rstrip(": "), exit_code=exit_code, infrastructure=True
            )
        if t_reason == "OOMKilled":
            limit = notes.get("memory_limit")
            lim = f" of {limit} bytes" if limit else ""
            return SandboxStatus(
                "failed",
                exit_code=exit_code,
                infrastructure=True,
                reason=f"OOMKilled: the container exceeded its memory limit{lim} and was killed "
                f"(exit code {exit_code}); give the task more memory",
            )
        if t_reason in ("ContainerStatusUnknown", "NodeLost"):
            return SandboxStatus(
                "failed",
                exit_code=exit_code,
                infrastructure=True,
                reason=f"{t_reason}: {t_message or 'the node running the pod was lost'}",
            )
        if deleted_outside:
            return SandboxStatus(
                "failed",
                exit_code=exit_code,
                infrastructure=True,
                reason="the pod was deleted from outside prefect-resoluto while running "
                f"(exit code {exit_code})",
            )
        if exit_code is None:
            return SandboxStatus(
                "failed",
                infrastructure=True,
                reason=f"{pod_reason or 'Failed'}: {pod_message or 'the pod failed without a container exit code'}",
            )
        return SandboxStatus(
            "failed",
            exit_code=exit_code,
            reason=f"the guest exited with code {exit_code}"
            + (f" ({t_reason})" if t_reason and t_reason != "Error" else ""),
        )

    # Unknown: the node stopped reporting.
    if pod_reason == "NodeLost":
        return SandboxStatus("failed", infrastructure=True, reason=f"NodeLost: {pod_message}".rstrip(": "))
    return SandboxStatus("unknown", reason=pod_reason or "the pod's node is not reporting its state")


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
