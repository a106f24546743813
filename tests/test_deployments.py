"""Blocks and deployments: what a scheduled deployment on a real Prefect API does."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flows import sample_flows as sf
from prefect import flow
from pydantic import SecretStr

from guest_runner.conduit import LocalConduit
from prefect_resoluto import ResolutoTaskRunner
from prefect_resoluto.blocks import LocalConduitBlock, S3ConduitBlock, SandboxBlock
from prefect_resoluto.runtimes import get_runtime

pytestmark = pytest.mark.usefixtures("prefect")
FLOWS = Path(sf.__file__).parent
ROOT = FLOWS.parents[1]


def api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    return str(PREFECT_API_URL.value())


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(PREFECT_API_URL=api_url(), PREFECT_SERVER_ANALYTICS_ENABLED="false", **extra)
    return env


def test_blocks_register_from_the_cli_and_by_entry_point():
    from importlib.metadata import entry_points

    from prefect.client.orchestration import get_client

    eps = [ep for ep in entry_points(group="prefect.collections") if ep.name == "prefect_resoluto"]
    assert eps and eps[0].load().SandboxBlock is SandboxBlock
    # The session's server registered them on start, through the entry point (this is the
    # first test of the session to touch blocks; a save would register its own type).
    with get_client(sync_client=True) as c:
        assert c.read_block_type_by_slug("resoluto-sandbox").slug == "resoluto-sandbox"
    proc = subprocess.run([sys.executable, "-m", "prefect", "block", "register", "-m", "prefect_resoluto.blocks"],
                          env=cli_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with get_client(sync_client=True) as c:
        for slug in ("resoluto-sandbox", "resoluto-local-conduit", "resoluto-s3-conduit"):
            assert c.read_block_type_by_slug(slug).slug == slug


def test_a_saved_sandbox_block_configures_the_runner_and_masks_secrets(gvisor, tmp_path):
    conduit_dir = tmp_path / "conduit"
    SandboxBlock(
        runtime="gvisor",
        env={"GREETING": "from-the-block"},
        secret_env={"API_TOKEN": "block-secret-123456"},
        conduit=LocalConduitBlock(path=str(conduit_dir)),
        infrastructure_retries=0,
    ).save("test-sandbox", overwrite=True)

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        doc = c.read_block_document_by_name("test-sandbox", "resoluto-sandbox", include_secrets=False)
    assert "block-secret-123456" not in str(doc.data)

    @flow(task_runner=ResolutoTaskRunner(sandbox="test-sandbox", workspace=FLOWS, outputs_dir=tmp_path / "o"))
    def configured_by_block():
        return sf.env_value.submit("GREETING").result(), sf.env_value.submit("API_TOKEN").result()

    state = configured_by_block(return_state=True)
    assert state.result() == ("from-the-block", "block-secret-123456")
    fr = state.state_details.flow_run_id
    assert LocalConduit(conduit_dir).list_prefix(f"run/{fr}/nodes/"), "the block's conduit was used"


def test_block_field_validation_and_s3_conduit_block(moto_server, s3_bucket):
    with pytest.raises(ValueError, match="absolute"):
        LocalConduitBlock(path="relative/dir")
    with pytest.raises(ValueError, match="unknown isolation level"):
        SandboxBlock(min_isolation="bulletproof")
    block = S3ConduitBlock(bucket=s3_bucket, base_prefix="flows", endpoint_url=moto_server.endpoint_url,
                           access_key_id="testing", secret_access_key=SecretStr("testing"))
    c = block.to_conduit()
    c.put("run/x/nodes/y/result.json", b"{}")
    assert c.list_prefix("run/") == ["run/x/nodes/y/result.json"]
    cfg = SandboxBlock(runtime="kubernetes", kube_namespace="ns", kube_context="ctx", runtime_class="kata",
                       image="img:1", node_selector={"pool": "sandbox"}, conduit=block).to_config()
    assert cfg.runtime == "kubernetes" and cfg.conduit is not None
    assert cfg.runtime_options == {"namespace": "ns", "context": "ctx", "runtime_class": "kata",
                                   "node_selector": {"pool": "sandbox"}, "image": "img:1"}


def serve(tmp_path: Path, conduit_dir: Path, **extra: str):
    """Start served_flow.py like a user would (`python served_flow.py`); wait for its deployment."""
    from prefect.client.orchestration import get_client

    server = subprocess.Popen(
        [sys.executable, str(FLOWS / "served_flow.py")],
        env=cli_env(RESOLUTO_TEST_CONDUIT=conduit_dir.as_uri(), RESOLUTO_TEST_INTERVAL="3600",
                    PYTHONPATH=str(ROOT), **extra),
        cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(server.stdout.read() if server.stdout else "the served process died")
        with get_client(sync_client=True) as c:
            try:
                return server, c.read_deployment_by_name("served-sandboxed/every-few-seconds")
            except Exception:
                time.sleep(0.5)  # polling the API for the deployment to appear
    server.kill()
    raise AssertionError("the served deployment never registered")


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


def test_cancelling_a_deployment_run_destroys_its_sandboxes(gvisor, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    state_dir = tmp_path / "state"
    server, _ = serve(tmp_path, tmp_path / "conduit", RESOLUTO_STATE_DIR=str(state_dir))
    rt = get_runtime("gvisor", state_dir=state_dir)
    try:
        run = run_deployment("served-sandboxed/every-few-seconds", parameters={"count": 2, "linger": 300},
                             timeout=0)
        deadline = time.monotonic() + 180
        while len(rt.list_ids()) < 2:
            assert time.monotonic() < deadline, "the run's sandboxes never started"
            time.sleep(0.1)  # polling the runtime's own listing
        with get_client(sync_client=True) as c:
            c.set_flow_run_state(run.id, Cancelling(), force=True)
            while True:
                fr = c.read_flow_run(run.id)
                if fr.state.type in (StateType.CANCELLED, StateType.CRASHED, StateType.FAILED):
                    break
                assert time.monotonic() < deadline + 60, f"the run was never cancelled: {fr.state}"
                time.sleep(0.2)  # polling the API for the cancellation
        assert fr.state.type == StateType.CANCELLED, fr.state
        while rt.list_ids() and time.monotonic() < deadline + 90:
            time.sleep(0.1)  # the flow-run process reaps on its way out
        assert rt.list_ids() == [] and rt.containers() == []
    finally:
        stop(server)


def test_served_deployment_with_a_schedule_runs_its_tasks_in_sandboxes(gvisor, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    conduit_dir = tmp_path / "conduit"
    server, deployment = serve(tmp_path, conduit_dir)
    try:
        assert deployment.schedules and deployment.schedules[0].schedule.interval.total_seconds() == 3600

        # on demand
        run = run_deployment("served-sandboxed/every-few-seconds", parameters={"count": 2}, timeout=240)
        if not run.state.is_completed():
            server.terminate()
            out = server.communicate(timeout=30)[0]
            raise AssertionError(f"{run.state}\n--- served process output ---\n{out[-6000:]}")
        nodes = LocalConduit(conduit_dir).list_prefix(f"run/{run.id}/nodes/")
        finished = {k.split("/")[3] for k in nodes if k.endswith("/_manifest.json")}
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        with get_client(sync_client=True) as c:
            trs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
        assert finished == {str(t.id) for t in trs} and len(finished) == 2
    finally:
        stop(server)
