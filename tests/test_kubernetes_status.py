"""Pod status -> SandboxStatus, on its own: pods as the API server returns them, no cluster, no runtime.

Each pod here is JSON in the shape a kubelet reports (decoded by the client library into the
same ``V1Pod`` models the runtime reads), so the mapping is tested against real field names.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("kubernetes", reason="the kubernetes client library is not installed")

from kubernetes.client import ApiClient  # noqa: E402

from prefect_resoluto.runtimes.kubernetes.status import (  # noqa: E402
    gone_status,
    pod_status,
    remember_terminal,
)

NOW = "2026-01-01T00:00:00Z"


def pod(
    phase: str = "Pending",
    *,
    container: dict[str, Any] | None = None,
    conditions: list[dict[str, Any]] | None = None,
    reason: str | None = None,
    message: str | None = None,
    deleting: bool = False,
    other_containers: list[dict[str, Any]] | None = None,
) -> Any:
    status: dict[str, Any] = {"phase": phase}
    if reason:
        status["reason"] = reason
    if message:
        status["message"] = message
    if conditions is not None:
        status["conditions"] = conditions
    statuses = [dict(c) for c in other_containers or []]
    if container is not None:
        statuses.append(
            {
                "name": "guest",
                "image": "registry.example/guest:1",
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "state": container,
            }
        )
    if statuses:
        status["containerStatuses"] = statuses
    meta: dict[str, Any] = {"name": "rsl-abc-12345678", "namespace": "sandboxes"}
    if deleting:
        meta["deletionTimestamp"] = NOW
    raw = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [{"name": "guest", "image": "registry.example/guest:1"}]},
        "status": status,
    }
    return ApiClient().deserialize(json.dumps(raw), "V1Pod", "application/json")


def terminated(exit_code: int, reason: str, message: str | None = None) -> dict[str, Any]:
    term: dict[str, Any] = {"exitCode": exit_code, "reason": reason, "startedAt": NOW, "finishedAt": NOW}
    if message:
        term["message"] = message
    return {"terminated": term}


def status_of(
    p: Any,
    notes: dict[str, Any] | None = None,
    *,
    now: float = 0.0,
    patience: float = 300.0,
    secret: str | None = None,
) -> Any:
    return pod_status(
        p,
        notes if notes is not None else {},
        clock=lambda: now,
        unschedulable_patience_s=patience,
        runtime_class="kata-qemu",
        store_credentials_secret=secret,
    )


def test_oom_killed_names_the_limit_and_asks_for_more_memory() -> None:
    st = status_of(pod("Failed", container=terminated(137, "OOMKilled")), {"memory_limit": "268435456"})
    assert (st.phase, st.exit_code, st.infrastructure, st.unstartable) == ("failed", 137, True, False)
    assert "exceeded its memory limit of 268435456 bytes" in st.reason
    assert st.reason.endswith("give the task more memory")
    # Without a recorded limit the sentence still stands, with no made-up number.
    assert "limit and was killed" in status_of(pod("Failed", container=terminated(137, "OOMKilled"))).reason


@pytest.mark.parametrize(
    "reason", ["ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull"]
)
def test_an_image_that_cannot_be_pulled_is_unstartable_with_the_image_named(reason: str) -> None:
    waiting = {"waiting": {"reason": reason, "message": 'Back-off pulling image "registry.example/guest:1"'}}
    st = status_of(pod("Pending", container=waiting))
    assert st.unstartable and not st.terminal and st.phase == "pending"
    assert st.reason.startswith(f'{reason}: Back-off pulling image "registry.example/guest:1"')
    assert "cannot pull the image" in st.reason and "imagePullSecrets" in st.reason


def test_a_missing_secret_names_the_store_credentials_secret() -> None:
    waiting = {"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "store" not found'}}
    st = status_of(pod("Pending", container=waiting), secret="store")
    assert st.unstartable
    assert st.reason == (
        'CreateContainerConfigError: secret "store" not found -- check that the referenced '
        "Secrets exist in the namespace (store credentials Secret 'store')"
    )


def test_a_crash_looping_container_in_a_running_pod_is_unstartable_but_running() -> None:
    st = status_of(pod("Running", container={"waiting": {"reason": "CrashLoopBackOff"}}))
    assert (st.phase, st.unstartable, st.reason) == ("running", True, "CrashLoopBackOff")


def test_unschedulable_is_patient_then_unstartable_and_the_clock_resets_once_scheduled() -> None:
    unsched = [
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity.",
        }
    ]
    notes: dict[str, Any] = {}
    first = status_of(pod(conditions=unsched), notes, now=100.0, patience=60)
    assert (first.phase, first.unstartable) == ("pending", False)
    assert first.reason.startswith("Unschedulable: 0/3 nodes are available")
    assert notes["unschedulable_since"] == 100.0
    late = status_of(pod(conditions=unsched), notes, now=170.0, patience=60)
    assert late.unstartable and "for 70s, patience 60s" in late.reason and "'kata-qemu'" in late.reason
    scheduled = [{"type": "PodScheduled", "status": "True"}]
    assert status_of(pod(conditions=scheduled), notes, now=500.0).reason == "Pending"
    assert "unschedulable_since" not in notes


def test_the_guests_own_exit_is_not_infrastructure() -> None:
    st = status_of(pod("Failed", container=terminated(3, "Error")))
    assert (st.phase, st.exit_code, st.infrastructure, st.reason) == (
        "failed",
        3,
        False,
        "the guest exited with code 3",
    )
    ok = status_of(pod("Succeeded", container=terminated(0, "Completed")))
    assert (ok.phase, ok.exit_code, ok.terminal) == ("succeeded", 0, True)


def test_eviction_and_node_loss_are_infrastructure() -> None:
    evicted = status_of(
        pod(
            "Failed",
            reason="Evicted",
            message="The node was low on resource: memory.",
            container=terminated(137, "Error"),
        )
    )
    assert (evicted.infrastructure, evicted.reason) == (
        True,
        "Evicted: The node was low on resource: memory.",
    )
    gc = status_of(
        pod(
            "Failed",
            container=terminated(137, "ContainerStatusUnknown"),
            conditions=[
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "DeletionByPodGC",
                    "message": "PodGC: node no longer exists",
                }
            ],
        )
    )
    assert gc.infrastructure and gc.reason == "DeletionByPodGC: PodGC: node no longer exists"
    legacy = status_of(
        pod("Unknown", reason="NodeLost", message="Node n1 which was running pod is unresponsive")
    )
    assert (legacy.phase, legacy.infrastructure) == ("failed", True) and legacy.reason.startswith(
        "NodeLost: Node n1"
    )


def test_deletion_from_outside_is_told_apart_from_our_own() -> None:
    running = pod("Running", container={"running": {"startedAt": NOW}}, deleting=True)
    assert status_of(running).reason == "the pod is being deleted from outside prefect-resoluto"
    assert status_of(running, {"destroyed": True}).reason == "Running"
    killed = pod("Failed", container=terminated(143, "Error"), deleting=True)
    st = status_of(killed)
    assert (
        st.infrastructure
        and "deleted from outside prefect-resoluto while running (exit code 143)" in st.reason
    )


def test_only_the_guest_container_counts() -> None:
    sidecar = {
        "name": "istio-proxy",
        "image": "proxy",
        "imageID": "",
        "ready": False,
        "restartCount": 0,
        "state": {"waiting": {"reason": "ImagePullBackOff", "message": "proxy"}},
    }
    st = status_of(
        pod("Pending", other_containers=[sidecar], container={"waiting": {"reason": "ContainerCreating"}})
    )
    assert (st.unstartable, st.reason) == (False, "ContainerCreating")


def test_a_vanished_pod_keeps_its_last_verdict_or_says_who_removed_it() -> None:
    notes: dict[str, Any] = {}
    remember_terminal(notes, status_of(pod("Failed", container=terminated(137, "OOMKilled")), notes))
    kept = gone_status("sandboxes", "rsl-x", notes)
    assert (kept.phase, kept.gone, kept.infrastructure, kept.exit_code) == ("failed", True, True, 137)
    assert kept.reason.startswith("OOMKilled")
    ours = gone_status("sandboxes", "rsl-x", {"destroyed": True})
    assert (ours.gone, ours.infrastructure, ours.reason) == (True, False, "pod sandboxes/rsl-x was destroyed")
    theirs = gone_status("sandboxes", "rsl-x", {})
    assert theirs.gone and theirs.infrastructure and "deleted from outside prefect-resoluto" in theirs.reason
    # A running pod leaves no verdict to keep.
    fresh: dict[str, Any] = {}
    remember_terminal(fresh, status_of(pod("Running", container={"running": {"startedAt": NOW}})))
    assert "last_terminal" not in fresh
