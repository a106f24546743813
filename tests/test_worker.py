"""The `resoluto` worker, end to end: `prefect work-pool create --type resoluto`, a real
`prefect worker start --pool P` process against the session's Prefect API, deployments
on the pool, and evidence read back from the API, the conduit and the runtime's listing.

The process runtime (host network, min isolation 'none') proves the worker's life cycle
on this branch; gVisor runs need the egress proxy to reach the API and say so when it is
missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flows import worker_flows
from support.polling import wait_for
from support.prefect_cli import cli_env, prefect_cli, prefect_server

from guest_runner.conduit import LocalConduit
from prefect_resoluto.runtimes import get_runtime
from prefect_resoluto.runtimes._guest_layout import records
from prefect_resoluto.runtimes.labels import LABEL_RUN
from prefect_resoluto.worker.plan import egress_forwarding_supported

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect")]
FLOWS = Path(worker_flows.__file__).parent
ROOT = FLOWS.parents[1]
NO_EGRESS = "egress forwarding (issue 10) not on this branch"
needs_egress = pytest.mark.skipif(not egress_forwarding_supported(), reason=NO_EGRESS)
PROCESS = {"runtime": "process", "min_isolation": "none"}


def create_pool(cli: bool = True, floor: str | None = "none") -> str:
    """A `resoluto` pool, made as a user makes one (`prefect work-pool create --type resoluto`),
    or with ``cli=False`` (tests about something else) through the API with the template that
    command sends, the worker type's default: the same pool without an interpreter's start.

    ``floor``: the pool's isolation floor (its min_isolation default), lowered as an operator
    lowers it, for the tests' trusted `process` deployments; None keeps the built-in one."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from prefect_resoluto.worker.worker import ResolutoWorker

    name = f"sandboxes-{uuid.uuid4().hex[:8]}"
    if cli:
        proc = prefect_cli("work-pool", "create", name, "--type", "resoluto")
        assert proc.returncode == 0, proc.stdout + proc.stderr
    else:
        with get_client(sync_client=True) as c:
            c.create_work_pool(
                WorkPoolCreate(
                    name=name,
                    type="resoluto",
                    base_job_template=ResolutoWorker.get_default_base_job_template(),
                )
            )
    if floor is not None:
        set_pool_default(name, "min_isolation", floor)
    return name


def set_pool_default(pool: str, variable: str, value: Any) -> None:
    """A variable's default in the pool's base job template, as an operator edits the pool."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolUpdate

    with get_client(sync_client=True) as c:
        template = c.read_work_pool(pool).base_job_template
        template["variables"]["properties"][variable]["default"] = value
        c.update_work_pool(pool, WorkPoolUpdate(base_job_template=template))


class Worker:
    """A `prefect worker start --pool P` process; its output is kept for failure reports."""

    def __init__(self, pool: str, tmp: Path, state_dir: Path, conduit: Path, **env: str) -> None:
        self.pool = pool
        self.log_path = tmp / f"worker-{pool}.log"
        self.state_dir = state_dir
        self.conduit = conduit
        env = cli_env(
            RESOLUTO_STATE_DIR=str(state_dir),
            PREFECT_WORKER_QUERY_SECONDS="1",
            PREFECT_WORKER_PREFETCH_SECONDS="5",
            PREFECT_HOME=str(tmp / "worker-home"),
            RESOLUTO_CACHE_DIR=str(tmp / "cache"),
            PYTHONPATH=str(ROOT),
            **env,
        )
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--name", f"w-{pool}"],
                env=env,
                cwd=str(tmp),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return self.proc.returncode


@contextlib.contextmanager
def running_worker(pool: str, tmp_path: Path, **env: str) -> Iterator[Worker]:
    """A worker on ``pool``; ``env``: more of its environment."""
    w = Worker(pool, tmp_path, tmp_path / "state", tmp_path / "conduit", **env)
    try:
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="module")
def module_worker(prefect_api: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """One worker process on one pool for every test here that neither stops nor kills its
    worker: starting and stopping a worker costs more than most of these tests' own runs.
    Each test deploys its own flow, schedules its own runs and reads back only their
    evidence (their logs, their sandboxes by run label), so the tests stay independent of
    each other and of their order; the tests that stop or kill a worker start their own."""
    tmp = tmp_path_factory.mktemp("module-worker")
    with running_worker(create_pool(), tmp) as w:
        yield w


@pytest.fixture
def worker(module_worker: Worker) -> Worker:
    assert module_worker.proc.poll() is None, f"the module's worker died:\n{module_worker.output()[-6000:]}"
    return module_worker


def deploy(pool: str, entrypoint: str, conduit: Path, **job_variables: Any) -> str:
    """A deployment of tests/flows/<entrypoint> on ``pool`` (code found by its pull step)."""
    from prefect import flow

    variables = {**PROCESS, "conduit": {"path": str(conduit)}, **job_variables}
    name = f"d-{uuid.uuid4().hex[:8]}"
    source = flow.from_source(source=str(FLOWS), entrypoint=entrypoint)
    source.deploy(
        name=name,
        work_pool_name=pool,
        job_variables=variables,
        build=False,
        push=False,
        print_next_steps=False,
    )
    return f"{source.name}/{name}"


def final_run(run_id: Any, worker: Worker, timeout: float = 240) -> Any:
    from support.prefect_readback import client

    def done() -> Any:
        with client() as c:
            fr = c.read_flow_run(run_id)
        return fr if fr.state is not None and fr.state.is_final() else None

    try:
        return wait_for(done, timeout=timeout, what=f"flow run {run_id} to finish", max_delay=0.5)
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- worker output ---\n{worker.output()[-8000:]}") from None


def run_logs(run_id: Any) -> list[str]:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from support.prefect_readback import client

    with client() as c:
        logs = c.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), sort=LogSort.TIMESTAMP_ASC
        )
    return [log.message for log in logs]


def facts(run_id: Any) -> dict[str, Any]:
    """What the flow logged about its sandbox (the flow run's logs reach the API in batches,
    possibly after its final state)."""

    def found() -> list[str]:
        return [m.split("FACTS ", 1)[1] for m in run_logs(run_id) if m.startswith("FACTS ")]

    try:
        return json.loads(wait_for(found, timeout=60, what="the facts", max_delay=0.5)[-1])
    except AssertionError:
        raise AssertionError(f"the flow run never logged its facts: {run_logs(run_id)}") from None


def logs_with(run_id: Any, text: str) -> list[str]:
    """The run's logs once one of them contains ``text`` (they arrive in batches)."""

    def found() -> list[str] | None:
        logs = run_logs(run_id)
        return logs if any(text in m for m in logs) else None

    try:
        return wait_for(found, timeout=60, what=f"a log line with {text!r}", max_delay=0.5)
    except AssertionError:
        raise AssertionError(f"no log line of the run has {text!r}: {run_logs(run_id)}") from None


def started(run_id: Any) -> None:
    wait_for(
        lambda: any(m.startswith("FACTS ") for m in run_logs(run_id)),
        timeout=240,
        what="the flow to start",
        max_delay=0.5,
    )


def node_events(conduit: Path, run_id: Any) -> list[dict[str, Any]]:
    c = LocalConduit(conduit)
    out = []
    for key in sorted(c.list_prefix(f"run/{run_id}/nodes/")):
        if "/events-" in key and key.endswith(".jsonl"):
            out += [json.loads(line) for line in c.get(key).decode().splitlines() if line.strip()]
    return out


def sandbox_ids(state_dir: Path, runtime: str = "process", run_id: Any = None) -> list[str]:
    """The runtime's own listing; with ``run_id``, only that flow run's sandboxes (by the run
    label the worker gives them), as a test on the module's worker must see it."""
    ids = get_runtime(runtime, state_dir=state_dir).list_ids()  # type: ignore[attr-defined]
    if run_id is None:
        return ids
    return [
        r.id for r in records(state_dir / runtime) if r.id in ids and r.labels.get(LABEL_RUN) == str(run_id)
    ]


def schedule(deployment: str, **parameters: Any) -> Any:
    from prefect.deployments import run_deployment

    return run_deployment(deployment, parameters=parameters, timeout=0)


# --------------------------------------------------------------------------- the pool


def test_the_worker_type_is_found_through_the_entry_point():
    from importlib.metadata import entry_points

    from prefect.workers.base import BaseWorker

    from prefect_resoluto.worker.worker import ResolutoWorker

    eps = [ep for ep in entry_points(group="prefect.collections") if ep.name == "prefect_resoluto"]
    assert eps and eps[0].load().ResolutoWorker is ResolutoWorker
    assert BaseWorker.get_worker_class_from_type("resoluto") is ResolutoWorker


def test_work_pool_create_gives_the_sandbox_form_as_the_ui_receives_it():
    from prefect.client.orchestration import get_client

    pool = create_pool()
    with get_client(sync_client=True) as c:
        wp = c.read_work_pool(pool)
        # the shortcut some tests take makes the same pool
        assert c.read_work_pool(create_pool(cli=False)).base_job_template == wp.base_job_template
    assert wp.type == "resoluto"
    template = wp.base_job_template
    props = template["variables"]["properties"]
    for name in (
        "runtime",
        "image",
        "memory",
        "cpus",
        "min_isolation",
        "silence_window",
        "egress",
        "env",
        "secret_env_block",
        "conduit",
        "sandbox",
        "command",
    ):
        assert name in props, name
        assert props[name].get("description"), f"{name} has no description for the form"
        assert template["job_configuration"][name] == "{{ " + name + " }}"

    assert props["runtime"]["enum"] == ["gvisor", "container", "kubernetes", "bubblewrap", "process"]
    assert props["min_isolation"]["enum"] == ["vm", "user-kernel", "namespace", "none"]
    assert props["egress"]["type"] == "array" and props["egress"]["items"] == {"type": "string"}
    assert props["egress"]["default"] == [] if "default" in props["egress"] else True
    assert "secret_env" not in props  # secrets only through the Secret block (tests/test_forms.py)
    assert (props["silence_window"]["type"], props["silence_window"]["exclusiveMinimum"]) == ("number", 0)
    assert props["stream_output"]["default"] is True
    defs = template["variables"]["definitions"]

    def block(name: str) -> set[str]:
        return {
            defs[alt["$ref"].rsplit("/", 1)[1]]["block_type_slug"]
            for alt in props[name]["anyOf"]
            if "$ref" in alt
        }

    assert block("conduit") == {"resoluto-local-conduit", "resoluto-s3-conduit"}
    assert block("sandbox") == {"resoluto-sandbox"}
    assert block("secret_env_block") == {"secret"}
    assert "secret_access_key" in defs["S3ConduitBlock"]["secret_fields"]


def test_job_variables_are_validated_with_the_reason(tmp_path):
    from prefect_resoluto.worker.worker import ResolutoJobConfiguration

    with pytest.raises(ValueError, match="cannot parse quantity 'lots'"):
        ResolutoJobConfiguration(memory="lots")
    with pytest.raises(ValueError, match="runtime"):
        ResolutoJobConfiguration(runtime="docker")
    from prefect.blocks.system import Secret

    cfg = ResolutoJobConfiguration(
        runtime="process",
        min_isolation="none",
        memory="300Mi",
        secret_env_block=Secret(value={"TOKEN": "s3cr3t-value"}),
        egress=["api.example.test:443"],
    )
    sc = cfg.sandbox_config()
    assert sc.memory == "300Mi" and sc.secret_env == {"TOKEN": "s3cr3t-value"}
    assert sc.egress == ["api.example.test:443"] and sc.infrastructure_retries == 0
    assert "s3cr3t-value" not in repr(cfg) and "s3cr3t-value" not in cfg.model_dump_json()


@pytest.mark.sandbox
def test_a_sandbox_block_is_the_base_and_job_variables_override_it():
    from prefect.blocks.system import Secret

    from prefect_resoluto.blocks import SandboxBlock
    from prefect_resoluto.worker.worker import ResolutoJobConfiguration

    block = SandboxBlock(
        runtime="gvisor",
        memory="1Gi",
        egress=["pypi.example.test"],
        env={"A": "1"},
        secret_env={"FROM_BLOCK": "b-1234"},
        silence_window=120,
    )
    cfg = ResolutoJobConfiguration(
        sandbox=block,
        memory="3Gi",
        egress=["git.example.test:22"],
        secret_env_block=Secret(value={"FROM_SECRET": "s-1234", "FROM_BLOCK": "from-the-secret-block"}),
    ).sandbox_config()
    assert (cfg.runtime, cfg.memory, cfg.silence_window) == ("gvisor", "3Gi", 120)
    assert cfg.egress == ["pypi.example.test", "git.example.test:22"]
    assert cfg.secret_env == {"FROM_BLOCK": "from-the-secret-block", "FROM_SECRET": "s-1234"}
    with pytest.raises(ValueError, match="JSON object"):
        ResolutoJobConfiguration(secret_env_block=Secret(value="just-a-string")).sandbox_config()


# --------------------------------------------------------------------------- flow runs (process runtime)


def test_a_deployment_on_the_pool_runs_in_its_own_sandbox_with_its_logs_in_the_api(tmp_path, worker):
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client

    conduit = tmp_path / "conduit"
    block_id = Secret(
        value={"WORKER_TEST_BLOCK_SECRET": "from-a-block-5519", "WORKER_TEST_SECRET": "never-shown-7731"}
    ).save(f"worker-env-{uuid.uuid4().hex[:6]}")
    # As the UI stores a chosen block in job variables: a reference, resolved by the worker.
    dep = deploy(
        worker.pool,
        "worker_flows.py:where_am_i",
        conduit,
        secret_env_block={"$ref": {"block_document_id": str(block_id)}},
    )
    runs = [schedule(dep, marker=f"m{i}") for i in range(2)]
    done = [final_run(r.id, worker) for r in runs]
    assert all(fr.state.is_completed() for fr in done), ([fr.state for fr in done], worker.output()[-6000:])
    seen = [facts(r.id) for r in runs]
    for r, f in zip(runs, seen, strict=True):
        # The flow's code ran in the guest runner's child, one node per flow run.
        assert f["run_id"] == str(r.id) and f["node_id"].startswith("flow-run-")
        assert f["pid"] != worker.proc.pid and f["secret_seen"] is True and f["block_secret_seen"] is True
        events = node_events(conduit, r.id)
        lines = [str((e.get("data") or {}).get("line", "")) for e in events if e.get("event") == "log"]
        assert f"plain stdout from the flow: {f['marker']}" in lines, lines[-20:]
        assert all(
            "never-shown-7731" not in json.dumps(e) and "from-a-block-5519" not in json.dumps(e)
            for e in events
        )
    assert seen[0]["node_id"] != seen[1]["node_id"]
    for r, f in zip(runs, seen, strict=True):  # the worker names the sandbox in the run's logs
        wait_for(
            lambda r=r, f=f: any(
                m.startswith("sandbox rsl-") and f"run/{r.id}/nodes/{f['node_id']}" in m
                for m in run_logs(r.id)
            ),
            timeout=30,
            what="the sandbox line",
        )
    with get_client(sync_client=True) as c:
        for r in runs:
            fr = c.read_flow_run(r.id)
            assert fr.infrastructure_pid == f"process:{r.id}" and fr.work_pool_name == worker.pool
    out = worker.output()
    assert "never-shown-7731" not in out and "from-a-block-5519" not in out
    # Only this test's runs have these secrets: the flow's own print reached the worker's log, redacted.
    assert "secrets: *** ***" in out, out[-6000:]
    # The console is a Prefect worker's: the flow run's own output streamed, and the guest
    # runner's diagnostics (its staging, its egress canary) kept to the worker's log, dated
    # and at DEBUG, never a bare line of the runner's jargon.
    for f in seen:
        assert f"plain stdout from the flow: {f['marker']}" in out.splitlines(), out[-6000:]
    assert not [ln for ln in out.splitlines() if ln.startswith(("staged ", "egress canary"))], out[-6000:]
    for r in runs:
        assert all("never-shown-7731" not in m for m in run_logs(r.id))
    for r in runs:  # a finished run leaves no sandbox behind, with the worker still running
        wait_for(
            lambda r=r: sandbox_ids(worker.state_dir, run_id=r.id) == [],
            timeout=60,
            what="the finished run's sandbox to go",
        )


@contextlib.contextmanager
def scheduling_server(tmp_path: Path) -> Iterator[str]:
    """A `prefect server start` of its own: the session's test harness runs no scheduler,
    and a scheduled deployment is what the worker must serve. Its scheduler loops every
    second; the API listens on 127.0.0.1 only."""
    with prefect_server(tmp_path, PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="1") as url:
        yield url


def test_a_deployment_naming_a_saved_sandbox_block_is_accepted_and_runs_on_it(tmp_path, worker):
    """As the UI stores a chosen block: {"$ref": ...}. Every field of the sandbox block being
    optional, Prefect's server found the reference valid as the block inline too and refused
    the deployment ("valid under each of")."""
    from prefect_resoluto.blocks import SandboxBlock

    block_id = SandboxBlock(
        runtime="process", min_isolation="none", env={"WORKER_TEST_SECRET": "never-shown-7731"}
    ).save(f"saved-sandbox-{uuid.uuid4().hex[:6]}")
    dep = deploy(
        worker.pool,
        "worker_flows.py:where_am_i",
        tmp_path / "conduit",
        sandbox={"$ref": {"block_document_id": str(block_id)}},
    )
    run = schedule(dep)
    assert final_run(run.id, worker).state.is_completed()
    assert facts(run.id)["secret_seen"] is True  # the block's env: the worker resolved the reference


def test_a_scheduled_deployment_on_the_pool_runs_by_its_schedule(tmp_path):
    """`prefect work-pool create`, `prefect worker start --pool`, a deployment with a schedule
    and no run_deployment: the server's scheduler makes the run, the worker sandboxes it."""
    import datetime

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.schedules import IntervalSchedule

    conduit = tmp_path / "conduit"
    with scheduling_server(tmp_path):
        pool = create_pool()
        with running_worker(pool, tmp_path) as worker:
            source = flow.from_source(source=str(FLOWS), entrypoint="worker_flows.py:where_am_i")
            # The scheduler only makes runs for times still ahead when it first sees the
            # deployment; a busy machine may take longer than any fixed lead to deploy. A short
            # interval makes the next slot at most 20 s away whenever that is.
            anchor = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=5)
            dep_id = source.deploy(
                name="every-20s",
                work_pool_name=pool,
                job_variables={**PROCESS, "conduit": {"path": str(conduit)}},
                schedule=IntervalSchedule(interval=datetime.timedelta(seconds=20), anchor_date=anchor),
                build=False,
                push=False,
                print_next_steps=False,
            )

            def completed_run() -> Any:
                with get_client(sync_client=True) as c:
                    runs = c.read_flow_runs(
                        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep_id]))
                    )
                return next((r for r in runs if r.state is not None and r.state.is_completed()), None)

            try:
                fr = wait_for(completed_run, timeout=240, what="a scheduled run to complete", max_delay=1.0)
            except AssertionError as e:
                raise AssertionError(f"{e}\n--- worker output ---\n{worker.output()[-6000:]}") from None
            assert fr.auto_scheduled and fr.expected_start_time >= anchor - datetime.timedelta(seconds=1)
            assert facts(fr.id)["run_id"] == str(fr.id)
    assert node_events(conduit, fr.id), "the scheduled run went through a sandbox"


# Prefect glue (a job variable reaching the sandbox's limit), the same worker logic on every
# runtime: on `process`, the cheapest that shows it (issue 21). gVisor's own view of the same
# setting is test_the_memory_job_variable_is_the_gvisor_sandboxs_memory.
def test_job_variable_overrides_apply_memory(tmp_path, worker):
    conduit = tmp_path / "conduit"
    dep = deploy(worker.pool, "worker_flows.py:where_am_i", conduit, memory="700Mi")
    base = deploy(worker.pool, "worker_flows.py:where_am_i", conduit)
    big, plain = schedule(dep), schedule(base)
    for r in (big, plain):
        assert final_run(r.id, worker).state.is_completed(), worker.output()[-4000:]
    big_facts, plain_facts = facts(big.id), facts(plain.id)
    limit = 700 * 1024 * 1024
    seen = ("memory_limit", "rlimit_data", "meminfo_total")
    assert limit in [big_facts[k] for k in seen], big_facts
    assert limit not in [plain_facts[k] for k in seen], plain_facts


RUNTIMES = ["process", pytest.param("gvisor", marks=[pytest.mark.sandbox, needs_egress])]


def on_runtime(request: pytest.FixtureRequest, runtime: str) -> dict[str, Any]:
    """Job variables for ``runtime`` (a gVisor case skips where gVisor is unavailable)."""
    if runtime == "gvisor":
        request.getfixturevalue("gvisor")
        return {"runtime": "gvisor", "min_isolation": "user-kernel"}
    return dict(PROCESS)


def gone(state: Path, runtime: str, sandbox: str, host_pid: int | None) -> bool:
    """``sandbox`` left the runtime's own listing (and runsc's; on process, no flow process)."""
    rt = get_runtime(runtime, state_dir=state)
    left = rt.list_ids() + ([c["id"] for c in rt.containers()] if runtime == "gvisor" else [])  # type: ignore[attr-defined]
    return sandbox not in left and (host_pid is None or not _alive(host_pid))


# Prefect glue (the API's cancellation reaching the runtime's destroy), on `process` (issue
# 21), where the flow's own process is seen to go too; gVisor's destroy is the runtime's
# (test_runtime_gvisor.py), and a cancelled gVisor run's sandboxes going is test_deployments.py's.
def test_cancelling_from_the_api_destroys_the_sandbox(tmp_path, worker):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    state = worker.state_dir
    dep = deploy(worker.pool, "worker_flows.py:linger", tmp_path / "conduit")
    run = schedule(dep, seconds=600)
    started(run.id)
    (sandbox,) = sandbox_ids(state, "process", run.id)
    pid = facts(run.id)["pid"]
    with get_client(sync_client=True) as c:
        c.set_flow_run_state(run.id, Cancelling(), force=True)
    fr = final_run(run.id, worker, timeout=120)
    assert fr.state.is_cancelled(), fr.state
    assert sandbox in (fr.state.message or "")
    assert gone(state, "process", sandbox, pid), (
        "the sandbox (or the flow's process) outlived the cancellation"
    )


def test_deleting_a_running_flow_run_destroys_its_sandbox(tmp_path, worker):
    from prefect.client.orchestration import get_client

    state = worker.state_dir
    dep = deploy(worker.pool, "worker_flows.py:linger", tmp_path / "conduit")
    run = schedule(dep, seconds=600)
    started(run.id)
    pid = facts(run.id)["pid"]
    assert len(sandbox_ids(state, run_id=run.id)) == 1
    with get_client(sync_client=True) as c:
        c.delete_flow_run(run.id)
    wait_for(
        lambda: sandbox_ids(state, run_id=run.id) == [], timeout=60, what="the deleted run's sandbox to go"
    )
    assert not _alive(pid) and worker.proc.poll() is None


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_sandbox_killed_from_outside_marks_the_run_crashed_with_the_reason(
    tmp_path, request, runtime, worker
):
    state = worker.state_dir
    dep = deploy(worker.pool, "worker_flows.py:linger", tmp_path / "conduit", **on_runtime(request, runtime))
    run = schedule(dep, seconds=600)
    started(run.id)
    (sandbox,) = sandbox_ids(state, runtime, run.id)
    record = json.loads((state / runtime / sandbox / "sandbox.json").read_text())
    os.killpg(record["pid"], signal.SIGKILL)  # the sandbox's whole process group, from outside
    fr = final_run(run.id, worker, timeout=120)
    assert fr.state.is_crashed(), fr.state
    msg = fr.state.message or ""
    assert sandbox in msg and f"on {runtime} was killed" in msg and "SIGKILL" in msg, msg
    assert wait_for(lambda: gone(state, runtime, sandbox, None), timeout=30, what="the sandbox to be reaped")


def test_an_oom_killed_sandbox_marks_the_run_crashed_with_the_reason(tmp_path, worker):
    dep = deploy(worker.pool, "worker_flows.py:hog", tmp_path / "conduit", memory="400Mi")
    run = schedule(dep, mb=800)
    fr = final_run(run.id, worker)
    assert fr.state.is_crashed(), fr.state
    msg = fr.state.message or ""
    # The runtime saw the cgroup's OOM kill: the run says so, with the limit hit and the setting to raise.
    assert "on process was killed: OOM-killed" in msg and "memory limit is 400Mi" in msg, msg
    assert "`memory` job variable" in msg, msg
    wait_for(
        lambda: sandbox_ids(worker.state_dir, run_id=run.id) == [],
        timeout=60,
        what="the killed run's sandbox to go",
    )


def test_a_run_that_dies_before_reaching_the_api_leaves_its_output_as_evidence(tmp_path, worker):
    conduit = tmp_path / "conduit"
    cmd = f"{sys.executable} -c \"print('evidence-before-the-api', flush=True); raise SystemExit(3)\""
    dep = deploy(worker.pool, "worker_flows.py:dies_before_the_api", conduit, command=cmd)
    run = schedule(dep)
    fr = final_run(run.id, worker)
    assert fr.state.is_crashed(), fr.state
    assert "the flow run's process exited with code 3 before it reported a final state" in (
        fr.state.message or ""
    ), fr.state.message
    lines = [
        str((e.get("data") or {}).get("line", ""))
        for e in node_events(conduit, run.id)
        if e.get("event") == "log"
    ]
    assert "evidence-before-the-api" in lines
    # ... and the worker put the tail into the run's logs, since the run itself never could
    # (the worker's logs reach the API in batches: a running worker sends them a moment later).
    logs_with(run.id, "evidence-before-the-api")


def test_an_unstartable_sandbox_crashes_the_run_with_the_reason(tmp_path, worker):
    # gVisor (at or above the default floor) without the egress proxy, or a floor no
    # runtime here meets: either way the run never starts and says why.
    too_weak = deploy(
        worker.pool,
        "worker_flows.py:where_am_i",
        tmp_path / "conduit",
        runtime="process",
        min_isolation="user-kernel",
    )
    # The host network cannot enforce an allowlist: refused, never run with an open network.
    open_net = deploy(
        worker.pool, "worker_flows.py:where_am_i", tmp_path / "conduit", egress=["db.example.test:5432"]
    )
    runs = [schedule(too_weak), schedule(open_net)]
    weak, unenforceable = (final_run(r.id, worker) for r in runs)
    assert weak.state.is_crashed(), weak.state
    assert "isolation level 'none', below the required minimum 'user-kernel'" in (weak.state.message or "")
    assert unenforceable.state.is_crashed(), unenforceable.state
    assert "cannot enforce an egress allowlist" in (unenforceable.state.message or "")
    assert not any(m.startswith("FACTS ") for r in runs for m in run_logs(r.id))
    assert not any(sandbox_ids(worker.state_dir, run_id=r.id) for r in runs)


@contextlib.contextmanager
def lingering_run(tmp_path: Path) -> Iterator[tuple[str, Any, Any, str, int]]:
    """A worker of its own running one 600 s flow run: (pool, worker, run, its sandbox, its pid)."""
    pool = create_pool(cli=False)
    with running_worker(pool, tmp_path) as worker:
        dep = deploy(pool, "worker_flows.py:linger", tmp_path / "conduit")
        run = schedule(dep, seconds=600)
        started(run.id)
        (sandbox,) = sandbox_ids(tmp_path / "state")
        yield pool, worker, run, sandbox, facts(run.id)["pid"]


def test_stopping_the_worker_destroys_its_running_sandboxes(tmp_path):
    from prefect.client.orchestration import get_client

    state = tmp_path / "state"
    with lingering_run(tmp_path) as (_pool, worker, run, _sandbox, pid):
        worker.stop()
        assert sandbox_ids(state) == [], worker.output()[-4000:]
        assert not _alive(pid)
    with get_client(sync_client=True) as c:
        fr = c.read_flow_run(run.id)
    assert fr.state.is_crashed() and "worker stopped" in (fr.state.message or ""), fr.state


def test_stopping_the_worker_lets_a_finished_run_send_its_last_logs(tmp_path):
    """A run whose state is final is still sending its batched logs and running its
    completion hooks: a worker stopping then gives its sandbox a grace, not a kill."""
    from prefect.client.orchestration import get_client

    pool = create_pool(cli=False)
    state = tmp_path / "state"
    release = tmp_path / "release"
    with running_worker(pool, tmp_path) as worker:
        dep = deploy(pool, "worker_flows.py:finishes_slowly", tmp_path / "conduit")
        run = schedule(dep, release=str(release))
        assert final_run(run.id, worker).state.is_completed()
        wait_for(
            lambda: any(m.startswith("HOOK after") for m in run_logs(run.id)),
            timeout=60,
            what="the completion hook to start",
        )
        worker.proc.send_signal(signal.SIGTERM)
        wait_for(
            lambda: "finished flow run(s) to exit by themselves" in worker.output(),
            timeout=60,
            what="the stopping worker to give the finished run a grace",
        )
        assert sandbox_ids(state), "the finished run's sandbox was destroyed before its hook returned"
        release.touch()
        assert worker.proc.wait(timeout=60) is not None
    logs = run_logs(run.id)
    assert "HOOK released" in logs, logs
    assert any(m.startswith("FACTS ") for m in logs), logs
    with get_client(sync_client=True) as c:
        assert c.read_flow_run(run.id).state.is_completed()
    assert sandbox_ids(state) == []


def test_sweep_reaps_a_sandbox_left_by_a_worker_killed_outright(tmp_path):
    state = tmp_path / "state"
    with lingering_run(tmp_path) as (pool, worker, run, sandbox, pid):
        os.killpg(worker.proc.pid, signal.SIGKILL)  # no teardown: the sandbox is orphaned
        worker.proc.wait(timeout=30)
        assert sandbox_ids(state) == [sandbox] and _alive(pid)
    cli = str(Path(sys.executable).parent / "prefect-resoluto")
    proc = subprocess.run(
        [cli, "sweep", "--runtime", "process", "--label", f"resoluto.work-pool={pool}"],
        env=cli_env(RESOLUTO_STATE_DIR=str(state)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sandbox_ids(state) == [] and not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# --------------------------------------------------------------------------- gVisor


@contextlib.contextmanager
def listener() -> Iterator[int]:
    """A TCP listener on the host's loopback that answers 'pong' (a host service the
    sandbox must not reach)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"pong\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join(timeout=5)
        srv.close()


@pytest.mark.sandbox
@needs_egress
def test_gvisor_flow_run_sees_only_its_own_interfaces_and_reaches_the_api(gvisor, tmp_path, worker):
    conduit = tmp_path / "conduit"
    dep = deploy(
        worker.pool,
        "worker_flows.py:where_am_i",
        conduit,
        runtime="gvisor",
        min_isolation="user-kernel",
        memory="1Gi",
    )
    run = schedule(dep, marker="in-gvisor")
    fr = final_run(run.id, worker)
    assert fr.state.is_completed(), (fr.state, worker.output()[-6000:])
    f = facts(run.id)
    host_ifaces = sorted(name for _, name in socket.if_nameindex())
    # gVisor's own network stack: loopback and at most the one link the egress proxy gives it.
    assert f["interfaces"] != host_ifaces and "lo" in f["interfaces"] and len(f["interfaces"]) <= 2, f
    assert f["api_url"].startswith("http://prefect-api.resoluto.internal:"), f
    wait_for(
        lambda: sandbox_ids(worker.state_dir, "gvisor", run.id) == [],
        timeout=60,
        what="the finished run's sandbox to go",
    )


@pytest.mark.sandbox
@needs_egress
def test_gvisor_flow_run_cannot_reach_a_host_listener_other_than_the_api(gvisor, tmp_path, worker):
    with listener() as port:
        dep = deploy(
            worker.pool,
            "worker_flows.py:dial",
            tmp_path / "conduit",
            runtime="gvisor",
            min_isolation="user-kernel",
        )
        runs = [schedule(dep, host=h, port=port) for h in ("127.0.0.1", "prefect-api.resoluto.internal")]
        done = [final_run(r.id, worker) for r in runs]
    for r, fr in zip(runs, done, strict=True):
        assert fr.state.is_failed(), fr.state
        logs = logs_with(r.id, "DIAL REFUSED")
        assert not any("DIAL REACHED" in m for m in logs), logs


@pytest.mark.sandbox
@needs_egress
def test_gvisor_flow_run_off_its_allowlist_fails_with_the_refusal_logged(gvisor, tmp_path, worker):
    with listener() as port:
        allowed = deploy(
            worker.pool,
            "worker_flows.py:dial",
            tmp_path / "conduit",
            runtime="gvisor",
            min_isolation="user-kernel",
            egress=["allowed.resoluto.test:80"],
        )
        run = schedule(allowed, host="127.0.0.1", port=port)
        fr = final_run(run.id, worker)
    assert fr.state.is_failed(), fr.state
    logs_with(run.id, "DIAL REFUSED")


# --------------------------------------------------------------------------- pieces


def test_kill_infrastructure_destroys_the_sandbox_of_a_flow_run_started_elsewhere(tmp_path, monkeypatch):
    import anyio
    from prefect.exceptions import InfrastructureNotFound

    from prefect_resoluto.node.spec import NodeSpec, launch_spec
    from prefect_resoluto.runtimes.labels import LABEL_RUN
    from prefect_resoluto.worker.worker import ResolutoJobConfiguration, ResolutoWorker

    monkeypatch.setenv("RESOLUTO_STATE_DIR", str(tmp_path / "state"))
    rt = get_runtime("process")
    run_id = str(uuid.uuid4())
    spec = NodeSpec(
        run_id=run_id, node_id="flow-run-x", argv=[sys.executable, "-c", "import time; time.sleep(600)"]
    )
    handle = rt.launch(launch_spec(spec, LocalConduit(tmp_path / "conduit")))
    assert handle.labels[LABEL_RUN] == run_id and rt.list_ids() == [handle.id]
    cfg = ResolutoJobConfiguration(runtime="process", min_isolation="none")
    worker = ResolutoWorker(work_pool_name="unused")  # another worker than the one that launched it
    anyio.run(worker.kill_infrastructure, f"process:{run_id}", cfg)
    assert rt.list_ids() == []
    with pytest.raises(InfrastructureNotFound, match=run_id):
        anyio.run(worker.kill_infrastructure, f"process:{run_id}", cfg)


@pytest.mark.sandbox
def test_the_memory_job_variable_is_the_gvisor_sandboxs_memory(gvisor, tmp_path):
    """The job variable's path to gVisor's limit, without the API: configuration -> runtime ->
    the sandbox's own view of its memory."""
    from prefect_resoluto.node.drive import drive_node
    from prefect_resoluto.node.spec import NodeSpec
    from prefect_resoluto.worker.worker import ResolutoJobConfiguration

    cfg = ResolutoJobConfiguration(runtime="gvisor", memory="700Mi").sandbox_config()
    rt = cfg.build_runtime()
    lines: list[str] = []
    spec = NodeSpec(
        run_id=f"r{uuid.uuid4().hex[:8]}",
        node_id="flow-run-mem",
        resources=cfg.resources,
        argv=[sys.executable, "-c", "print(open('/proc/meminfo').readline())"],
    )
    outcome = drive_node(
        spec,
        LocalConduit(tmp_path / "conduit"),
        rt,
        on_event=lambda e: lines.append(str((e.get("data") or {}).get("line", ""))),
    )
    assert outcome.ok, outcome.describe()
    totals = [int(line.split()[1]) for line in lines if line.startswith("MemTotal:")]
    assert totals == [700 * 1024], lines


@pytest.mark.sandbox
def test_gvisor_sandbox_sees_the_deployment_code_read_only_and_imports_prefects_engine(gvisor, tmp_path):
    """What a gVisor flow run stands on before it talks to the API: the host's interpreter
    and virtualenv (Prefect's entry point importable) and the deployment's code directory
    bound read-only at its host path, where the pull step will chdir."""
    from prefect_resoluto.node.drive import drive_node
    from prefect_resoluto.node.spec import NodeSpec
    from prefect_resoluto.settings.config import SandboxConfig
    from prefect_resoluto.worker.plan import code_directories, with_code_mounts

    steps = [{"prefect.deployments.steps.set_working_directory": {"directory": str(FLOWS)}}]
    dirs = code_directories(steps, None)
    assert dirs == [str(FLOWS)]
    cfg = with_code_mounts(SandboxConfig(runtime="gvisor"), "gvisor", dirs)
    rt = cfg.build_runtime()
    probe = (
        "import os, importlib.util\n"
        "assert importlib.util.find_spec('prefect.engine') is not None\n"
        f"os.chdir({str(FLOWS)!r})\n"
        "print('code:', open('worker_flows.py').readline().strip())\n"
        "try:\n"
        "    open('written-from-the-sandbox', 'w')\n"
        "    print('writable')\n"
        "except OSError as e:\n"
        "    print('read-only:', e.errno)\n"
    )
    spec = NodeSpec(
        run_id=f"r{uuid.uuid4().hex[:8]}", node_id="flow-run-probe", argv=[sys.executable, "-c", probe]
    )
    lines: list[str] = []
    outcome = drive_node(
        spec,
        LocalConduit(tmp_path / "conduit"),
        rt,
        on_event=lambda e: lines.append(str((e.get("data") or {}).get("line", ""))),
    )
    assert outcome.ok, outcome.describe()
    assert f"code: {open(FLOWS / 'worker_flows.py').readline().strip()}" in lines, lines
    assert any(line.startswith("read-only:") for line in lines), lines
    assert not (FLOWS / "written-from-the-sandbox").exists()
    assert rt.list_ids() == []
