"""Blocks and deployments: what a scheduled deployment on a real Prefect API does.

Prefect glue, on the `process` runtime, the cheapest real one that shows it (issue 21): the
served deployment's tasks and a saved block's runner. A cancelled served run's gVisor
sandboxes (warm ones too) going is tests/test_pool_runner.py's.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from flows import sample_flows as sf
from prefect import flow
from pydantic import SecretStr
from support.polling import scaled, wait_for
from support.prefect_cli import cli_env

from guest_runner.conduit import LocalConduit
from prefect_resoluto import ResolutoTaskRunner
from prefect_resoluto.blocks import LocalConduitBlock, S3ConduitBlock, SandboxBlock
from prefect_resoluto.runtimes import get_runtime
from prefect_resoluto.runtimes._guest_layout import records
from prefect_resoluto.runtimes.labels import LABEL_RUN

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect")]
FLOWS = Path(sf.__file__).parent
ROOT = FLOWS.parents[1]


def test_blocks_register_from_the_cli_and_by_entry_point():
    from importlib.metadata import entry_points

    from prefect.client.orchestration import get_client

    eps = [ep for ep in entry_points(group="prefect.collections") if ep.name == "prefect_resoluto"]
    assert eps and eps[0].load().SandboxBlock is SandboxBlock
    # The session's server registered them on start, through the entry point (this is the
    # first test of the session to touch blocks; a save would register its own type).
    with get_client(sync_client=True) as c:
        assert c.read_block_type_by_slug("resoluto-sandbox").slug == "resoluto-sandbox"
    proc = subprocess.run(
        [sys.executable, "-m", "prefect", "block", "register", "-m", "prefect_resoluto"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("Resoluto Sandbox", "Resoluto Local Conduit", "Resoluto S3 Conduit"):
        assert name in proc.stdout, proc.stdout  # its table of registered blocks
    with get_client(sync_client=True) as c:
        for slug in ("resoluto-sandbox", "resoluto-local-conduit", "resoluto-s3-conduit"):
            assert c.read_block_type_by_slug(slug).slug == slug


def test_a_saved_sandbox_block_configures_the_runner_and_masks_secrets(tmp_path):
    conduit_dir = tmp_path / "conduit"
    SandboxBlock(
        runtime="process",
        min_isolation="none",
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
    block = S3ConduitBlock(
        bucket=s3_bucket,
        base_prefix="flows",
        endpoint_url=moto_server.endpoint_url,
        access_key_id="testing",
        secret_access_key=SecretStr("testing"),
    )
    c = block.to_conduit()
    c.put("run/x/nodes/y/result.json", b"{}")
    assert c.list_prefix("run/") == ["run/x/nodes/y/result.json"]
    cfg = SandboxBlock(
        runtime="kubernetes",
        kube_namespace="ns",
        kube_context="ctx",
        runtime_class="kata",
        image="img:1",
        node_selector={"pool": "sandbox"},
        conduit=block,
    ).to_config()
    assert cfg.runtime == "kubernetes" and cfg.conduit is not None
    assert cfg.runtime_options == {
        "namespace": "ns",
        "context": "ctx",
        "runtime_class": "kata",
        "node_selector": {"pool": "sandbox"},
        "image": "img:1",
    }


def serve(tmp_path: Path, conduit_dir: Path, **extra: str):
    """Start served_flow.py like a user would (`python served_flow.py`); wait for its deployment.
    Its output goes to ``tmp_path/served.log`` (a pipe nobody reads would block it)."""
    from prefect.client.orchestration import get_client

    with open(tmp_path / "served.log", "wb") as out:
        server = subprocess.Popen(
            [sys.executable, str(FLOWS / "served_flow.py")],
            env=cli_env(
                RESOLUTO_TEST_CONDUIT=conduit_dir.as_uri(),
                RESOLUTO_TEST_INTERVAL="3600",
                PYTHONPATH=str(ROOT),
                **extra,
            ),
            cwd=str(tmp_path),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + scaled(180)
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError((tmp_path / "served.log").read_text(errors="replace")[-6000:])
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


@dataclass
class Served:
    server: subprocess.Popen
    deployment: Any
    conduit: Path
    state_dir: Path
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


@pytest.fixture(scope="module")
def served(prefect_api: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One served process for the module's tests (starting one costs more than a run): each
    test makes its own deployment run and reads back only that run's nodes and sandboxes.
    Its tasks run on `process` (Prefect glue; the module's docstring)."""
    tmp = tmp_path_factory.mktemp("served")
    conduit, state_dir = tmp / "conduit", tmp / "state"
    server, deployment = serve(
        tmp, conduit, RESOLUTO_STATE_DIR=str(state_dir), RESOLUTO_TEST_RUNTIME="process"
    )
    try:
        yield Served(server, deployment, conduit, state_dir, tmp / "served.log")
    finally:
        stop(server)


def run_sandboxes(state_dir: Path, run_id: Any) -> set[str]:
    """The process runtime's sandboxes of one flow run (by the run label every node carries)."""
    return {r.id for r in records(state_dir / "process") if r.labels.get(LABEL_RUN) == str(run_id)}


def test_cancelling_a_deployment_run_destroys_its_sandboxes(served):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    assert served.server.poll() is None, served.output()
    rt = get_runtime("process", state_dir=served.state_dir)
    run = run_deployment(
        "served-sandboxed/every-few-seconds", parameters={"count": 2, "linger": 300}, timeout=0
    )

    def both_started() -> set[str] | None:
        ids = run_sandboxes(served.state_dir, run.id)
        return ids if len(ids) >= 2 else None

    sandboxes = wait_for(both_started, timeout=180, what="the run's sandboxes to start")
    assert sandboxes <= set(rt.list_ids())
    with get_client(sync_client=True) as c:
        c.set_flow_run_state(run.id, Cancelling(), force=True)

        def ended() -> Any:
            fr = c.read_flow_run(run.id)
            return fr if fr.state.type in (StateType.CANCELLED, StateType.CRASHED, StateType.FAILED) else None

        fr = wait_for(ended, timeout=60, what="the run to be cancelled", max_delay=0.5)
    assert fr.state.type == StateType.CANCELLED, fr.state

    def reaped() -> bool:  # the flow-run process reaps on its way out
        return not (sandboxes & set(rt.list_ids()))

    wait_for(reaped, timeout=90, what="the cancelled run's sandboxes to go")
    assert not run_sandboxes(served.state_dir, run.id)


def test_served_deployment_with_a_schedule_runs_its_tasks_in_sandboxes(served):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    assert served.server.poll() is None, served.output()
    deployment = served.deployment
    assert deployment.schedules and deployment.schedules[0].schedule.interval.total_seconds() == 3600

    # on demand
    run = run_deployment("served-sandboxed/every-few-seconds", parameters={"count": 2}, timeout=scaled(240))
    assert run.state.is_completed(), f"{run.state}\n--- served process output ---\n{served.output()}"
    nodes = LocalConduit(served.conduit).list_prefix(f"run/{run.id}/nodes/")
    finished = {k.split("/")[3] for k in nodes if k.endswith("/_manifest.json")}
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as c:
        trs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    assert finished == {str(t.id) for t in trs} and len(finished) == 2
