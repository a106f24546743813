"""The pure verdict and the runner's live registry, apart from the polling that feeds them."""

from __future__ import annotations

from prefect_resoluto.node import verdict
from prefect_resoluto.node.outcome import EGRESS_NOT_ENFORCED, FailureKind
from prefect_resoluto.runtimes.base import Resources, SandboxHandle, SandboxStatus
from prefect_resoluto.task_runner.live import LiveSandboxes


def test_the_guests_word_on_its_workload() -> None:
    assert verdict.of_result({"status": "success", "exit_code": 0}, networked=False) == (None, "")
    assert verdict.of_result({"status": "failure", "exit_code": 3}, networked=False) == (
        FailureKind.WORKLOAD,
        "workload exited with code 3",
    )
    canary = {"status": "failure", "exit_code": 1, "reason": f"{EGRESS_NOT_ENFORCED}: 1.1.1.1:443 reached"}
    assert verdict.of_result(canary, networked=True)[0] is FailureKind.EGRESS
    # Without a network the guest's words cannot make it an egress stop.
    assert verdict.of_result(canary, networked=False)[0] is FailureKind.WORKLOAD


def test_after_exit_and_memory() -> None:
    killed = SandboxStatus("failed", reason="OOMKilled", infrastructure=True)
    assert verdict.after_exit(killed, manifest=True) == (FailureKind.KILLED, "OOMKilled")
    assert verdict.after_exit(SandboxStatus("succeeded", exit_code=0), manifest=True) == (None, "")
    assert verdict.after_exit(SandboxStatus("failed", exit_code=2), manifest=False) == (
        FailureKind.NO_RESULT,
        "the sandbox exited (exit code 2) without writing _manifest.json",
    )
    res = Resources.from_quantities(memory="64Mi")
    failure, reason = verdict.with_memory(
        FailureKind.WORKLOAD, "exit 137", SandboxStatus("failed", memory_exhausted=True), res
    )
    assert failure is FailureKind.KILLED and reason.startswith("OOM-killed") and "64Mi" in reason
    assert verdict.with_memory(None, "", SandboxStatus("succeeded"), res) == (None, "")
    assert "output_limit" in verdict.limit_hint(1 << 20, "the output_limit setting")


def test_live_sandboxes_count_attempts_and_keep_outputs() -> None:
    live = LiveSandboxes()
    assert [live.next_attempt("t1"), live.next_attempt("t1"), live.next_attempt("t2")] == [1, 2, 1]
    h = SandboxHandle(id="rsl-1", runtime="process")
    live.add(h)
    assert live.handles() == [h]
    live.drop("rsl-1")
    live.drop("rsl-1")  # idempotent
    assert live.handles() == []
    assert live.outputs("t1") == {}
