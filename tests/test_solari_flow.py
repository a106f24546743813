"""ResolutoTaskRunner(runtime="solari") end to end: a real Prefect API, the SDK, the stand-in.

Relay mode runs the demo's tasks with each VM's commands in gVisor, into a local conduit;
direct mode lets the guest reach the moto S3 endpoint itself, so its VM is a host process
(a gVisor sandbox here has no network to reach the store).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from flows import sample_flows as sf
from prefect import flow
from support.prefect_readback import task_runs
from support.solari_gateway import SolariGateway
from test_task_runner import logs_of

from guest_runner.conduit import LocalConduit
from prefect_resoluto import ResolutoTaskRunner, output_files, run_command, sandbox_options

pytestmark = [
    pytest.mark.prefect,
    pytest.mark.usefixtures("prefect"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FLOWS = Path(sf.__file__).parent


def options(gw: SolariGateway, **kw) -> dict:
    return {"base_url": gw.base_url, "api_key": gw.api_key, "template": "python", **kw}


@pytest.mark.sandbox
def test_the_demos_tasks_run_in_solari_vms_relayed_into_a_local_conduit(tmp_path: Path, gvisor):
    sys.path.insert(0, str(EXAMPLES))
    try:
        import demo_flow as demo
    finally:
        sys.path.remove(str(EXAMPLES))
    gw = SolariGateway(tmp_path / "gateway", executor="gvisor").start()
    conduit = LocalConduit(tmp_path / "conduit")
    try:

        @flow(
            task_runner=ResolutoTaskRunner(
                runtime="solari",
                runtime_options=options(gw),
                conduit=conduit,
                workspace=EXAMPLES,
                outputs_dir=tmp_path / "outputs",
                min_isolation="vm",
            )
        )
        def demo_on_solari() -> dict:
            stats = demo.word_stats.map(list(demo.TEXTS), list(demo.TEXTS.values()))
            with sandbox_options(output_paths=["reports/**"]):
                report = demo.write_report.submit(stats)
            kernel = run_command.submit(["sh", "-c", "echo hello from the VM"])
            fetched = demo.flaky_fetch.submit()
            written = report.result()  # the task's own value: the file's workspace path
            return {
                "stats": [s.result() for s in stats],
                "report": str(output_files(report)[written]),
                "kernel": kernel.result().output,
                "flaky": fetched.result(),
            }

        state = demo_on_solari(return_state=True)
        assert state.is_completed(), state
        result = state.result()
        assert [s["name"] for s in result["stats"]] == list(demo.TEXTS)
        assert Path(result["report"]).read_text().startswith("| text | words |")
        assert "hello from the VM" in result["kernel"]
        assert "attempt node" in result["flaky"]
        fr = state.state_details.flow_run_id
        runs = task_runs(fr)
        assert all(r.state.is_completed() for r in runs)
        word = next(r for r in runs if r.name.startswith("word_stats"))
        msgs = [log.message for log in logs_of(word.id)]
        assert any(m.startswith("ran in a ") and "Solari sandbox" in m for m in msgs), msgs
        assert any(": 10 words, running on" in m or "words, running on" in m for m in msgs), msgs
        for r in runs:  # every node left the same objects any runtime leaves
            keys = conduit.list_prefix(f"run/{fr}/nodes/{r.id}")
            assert any(k.endswith("/_manifest.json") for k in keys), (r.name, keys)
        assert gw.live() == []
    finally:
        gw.stop()


def test_direct_mode_flow_against_the_moto_s3_endpoint(tmp_path: Path, s3_conduit):
    gw = SolariGateway(tmp_path / "gateway", executor="process").start()
    try:

        @flow(
            task_runner=ResolutoTaskRunner(
                runtime="solari",
                runtime_options=options(gw, conduit_mode="direct"),
                conduit=s3_conduit,
                workspace=FLOWS,
                outputs_dir=tmp_path / "out",
                min_isolation="vm",
            )
        )
        def direct_flow():
            squares = sf.square.map([2, 3])
            total = sf.add_async.submit(1, wait_for=squares)
            return [s.result() for s in squares], total.result()

        state = direct_flow(return_state=True)
        assert state.is_completed(), state
        assert state.result() == ([4, 9], 11)
        fr = state.state_details.flow_run_id
        for r in task_runs(fr):
            assert any(
                k.endswith("/_manifest.json") for k in s3_conduit.list_prefix(f"run/{fr}/nodes/{r.id}")
            )
        assert not [f for f in gw.rpc_frames if f.get("method") == "fs.read"]  # nothing was relayed
        assert gw.live() == []
    finally:
        gw.stop()


def test_a_task_waiting_for_a_slot_says_so_and_spends_no_infrastructure_retry(tmp_path: Path):
    from solari_sandbox import SyncSandboxClient

    gw = SolariGateway(tmp_path / "gateway", executor="process", max_sessions=1).start()
    client = SyncSandboxClient(api_key=gw.api_key, base_url=gw.base_url)
    blocker = client.create(template="base")

    def free_a_slot() -> None:
        gw.wait_for(lambda: gw.answers[("create", 429)] >= 3)
        blocker.kill()

    t = threading.Thread(target=free_a_slot, daemon=True)
    t.start()
    try:

        @flow(
            task_runner=ResolutoTaskRunner(
                runtime="solari",
                runtime_options=options(gw, admission_backoff_max_s=0.3),
                conduit=LocalConduit(tmp_path / "conduit"),
                workspace=FLOWS,
                outputs_dir=tmp_path / "out",
                min_isolation="vm",
                infrastructure_retries=1,
            )
        )
        def admitted():
            return sf.square.submit(7).result()

        state = admitted(return_state=True)
        assert state.is_completed(), state
        assert state.result() == 49
        (tr,) = task_runs(state.state_details.flow_run_id)
        msgs = [log.message for log in logs_of(tr.id)]
        assert any("waiting for a Solari slot" in m for m in msgs), msgs
        assert not any("re-launching" in m for m in msgs), msgs
        assert tr.run_count == 1
    finally:
        t.join(30)
        client.close()
        gw.stop()


def test_a_vm_killed_mid_task_is_relaunched_by_the_runner(tmp_path: Path):
    gw = SolariGateway(tmp_path / "gateway", executor="process").start()
    killed: list[str] = []

    def kill_the_first_vm() -> None:
        vms = gw.wait_for(lambda: [s for s in gw.live() if s.commands], timeout=120)
        # Once its guest has written an event chunk: the task is running, not starting.
        gw.wait_for(
            lambda: any(p.name.startswith("events-") for p in vms[0].root.rglob("events-*")), timeout=60
        )
        killed.append(vms[0].id)
        gw.kill_vm(vms[0].id)

    t = threading.Thread(target=kill_the_first_vm, daemon=True)
    t.start()
    try:

        @flow(
            task_runner=ResolutoTaskRunner(
                runtime="solari",
                runtime_options=options(gw),
                conduit=LocalConduit(tmp_path / "conduit"),
                workspace=FLOWS,
                outputs_dir=tmp_path / "out",
                min_isolation="vm",
                infrastructure_retries=1,
            )
        )
        def survives():
            return sf.sleeper.submit(2.0).result()

        state = survives(return_state=True)
        assert state.is_completed(), state
        assert killed
        (tr,) = task_runs(state.state_details.flow_run_id)
        msgs = [log.message for log in logs_of(tr.id)]
        assert any("re-launching" in m and "lost" in m for m in msgs), msgs
        assert any(killed[0] in m for m in msgs), msgs  # the gateway's words name the VM
        assert gw.live() == []
    finally:
        t.join(30)
        gw.stop()
