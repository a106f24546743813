"""One refusal, one exception (issue 41): a Prefect call a sandbox may not make fails the
same way in a task under ResolutoTaskRunner (the guest's stand-in refuses it) and in a flow
run of a ``resoluto`` worker (the run's API gateway refuses it, and the run's Prefect client
turns the gateway's marked 403 into the same exception): one type, caught by
``except PrefectAPIUnavailable`` on both paths, one message naming the setting that would
allow the call and where it is set. The same task (tests/flows/refusal_flows.py) on both
paths, against the session's Prefect API, on the process runtime and on gVisor."""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from flows import refusal_flows as rf
from prefect import flow
from test_worker import Worker, create_pool, deploy, facts, final_run, running_worker, schedule

from guest_runner.conduit import LocalConduit
from guest_runner.refusal import REFUSED_HEADER, SETTING_HEADER
from prefect_resoluto import ResolutoTaskRunner

FLOWS = Path(rf.__file__).parent


@pytest.fixture(params=["process", pytest.param("gvisor", marks=pytest.mark.sandbox)])
def runtime(request: pytest.FixtureRequest) -> str:
    if request.param == "gvisor":
        request.getfixturevalue("gvisor")
    return str(request.param)


@pytest.fixture(scope="module")
def refusal_worker(prefect_api: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    tmp = tmp_path_factory.mktemp("refusal-worker")
    with running_worker(create_pool(cli=False), tmp, RESOLUTO_WARM_SNAPSHOTS="0") as w:
        yield w


@pytest.fixture
def names() -> dict[str, str]:
    """A variable and a block that exist and are allowed, and two that exist and are not."""
    from prefect.blocks.system import Secret
    from prefect.variables import Variable

    tag = uuid.uuid4().hex[:8]
    made = {
        "granted_variable": f"granted_{tag}",
        "granted_block": f"granted-{tag}",
        "variable": f"private_{tag}",
        "block": f"private-{tag}",
    }
    Variable.set(made["granted_variable"], "g")
    Variable.set(made["variable"], "private-value-5531")
    Secret(value="g").save(made["granted_block"])
    Secret(value="private-secret-7720").save(made["block"])
    return made


def allowed(names: dict[str, str]) -> dict[str, list[str]]:
    return {
        "allowed_variables": [names["granted_variable"]],
        "allowed_blocks": [f"secret/{names['granted_block']}"],
    }


def under_task_runner(tmp_path: Path, runtime: str, names: dict[str, str]) -> dict[str, Any]:
    runner = ResolutoTaskRunner(
        runtime=runtime,
        min_isolation="none",
        conduit=LocalConduit(tmp_path / "conduit"),
        workspace=FLOWS,
        outputs_dir=tmp_path / "outputs",
        **allowed(names),
    )

    @flow(task_runner=runner)
    def reading() -> dict[str, Any]:
        return rf.reads_refused.submit(names["variable"], names["block"]).result()

    return reading()


def under_worker(worker: Worker, tmp_path: Path, runtime: str, names: dict[str, str]) -> dict[str, Any]:
    jobs = {"runtime": runtime, "min_isolation": "none" if runtime == "process" else "user-kernel"}
    deployment = deploy(
        worker.pool, "refusal_flows.py:refused_reads", tmp_path / "conduit", **jobs, **allowed(names)
    )
    run = schedule(deployment, variable=names["variable"], block=names["block"])
    assert final_run(run.id, worker).state.is_completed()
    return facts(run.id)


def shape(kind: str, name: str, setting: str, granted: str) -> re.Pattern[str]:
    """The one message: the object, the setting that would allow it, where that is set, what
    is allowed."""
    return re.compile(
        rf"Prefect {kind} {re.escape(repr(name))} is not readable inside a sandbox: add it to {setting} "
        rf"\((?P<where>[^;]+); allowed here: {re.escape(repr(granted))}\)"
    )


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect")
def test_a_refused_read_is_one_exception_under_the_task_runner_and_the_worker(
    tmp_path: Path, runtime: str, names: dict[str, str], refusal_worker: Worker
) -> None:
    task_runner = under_task_runner(tmp_path / "runner", runtime, names)
    worker = under_worker(refusal_worker, tmp_path / "worker", runtime, names)
    expected = {
        "variable": shape("variable", names["variable"], "allowed_variables", names["granted_variable"]),
        "block": shape(
            "block", f"secret/{names['block']}", "allowed_blocks", f"secret/{names['granted_block']}"
        ),
    }
    for what, pattern in expected.items():
        here, there = task_runner[what], worker[what]
        for told in (here, there):
            assert told.get("caught") is True, (what, task_runner, worker)  # except PrefectAPIUnavailable
            assert told["type"] == "PrefectAPIUnavailable", (what, told)
            assert pattern.fullmatch(told["message"]), (what, told["message"])
        # Where the setting is set: the runner's argument, or the pool's / deployment's job variable.
        setting = "allowed_variables" if what == "variable" else "allowed_blocks"
        assert f"ResolutoTaskRunner({setting}=[...])" in here["message"], here
        assert "job variable" in there["message"] and "work pool" in there["message"], there
        # Code written against Prefect's HTTP error still sees the gateway's 403.
        assert there["http"] == 403 and here["http"] is None, (here, there)
        assert "private-value-5531" not in str(worker) and "private-secret-7720" not in str(worker)


@contextlib.contextmanager
def forging_api() -> Iterator[str]:
    """A loopback API that answers everything 403 bearing the gateway's marks, forged."""

    class Forger(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"detail": "forged: add it to allowed_variables"}).encode()
            self.send_response(403)
            self.send_header(REFUSED_HEADER, "allowed-variables")
            self.send_header(SETTING_HEADER.upper(), "allowed_variables")  # names are case-blind
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Forger)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/api"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_only_the_gateway_marks_a_refusal() -> None:
    """The mark that makes a 403 PrefectAPIUnavailable in a flow run is the gateway's own: an
    answer of the API's bearing it reaches the run without it (Prefect's own 403), and the
    gateway's refusal bears it with the task runner's words."""
    from prefect.exceptions import PrefectHTTPStatusError

    from guest_runner import engine, refusal
    from guest_runner.prefect_api import PrefectAPIUnavailable
    from prefect_resoluto.worker.gateway import ApiGateway, Upstream
    from prefect_resoluto.worker.rules import RunRules

    run_id = str(uuid.uuid4())
    rules = RunRules(flow_run_id=run_id, allowed_variables=frozenset({"granted"}))
    with forging_api() as api, ApiGateway(run_id, Upstream(api_url=api), rules, announce=False) as gw:
        auth = {"Authorization": f"Bearer {gw.token}"}
        relayed = httpx.get(f"http://{gw.address}/api/flow_runs/{run_id}", headers=auth)
        refused = httpx.get(f"http://{gw.address}/api/variables/name/private", headers=auth)
    assert relayed.status_code == 403 and relayed.json()["detail"].startswith("forged"), relayed.text
    assert not [h for h in relayed.headers if h.lower().startswith("x-resoluto-")], relayed.headers
    assert engine.refusal(relayed) is None  # Prefect's own PrefectHTTPStatusError, as any 403
    assert refused.headers[REFUSED_HEADER] == "allowed-variables", refused.headers
    assert refused.headers[SETTING_HEADER] == "allowed_variables", refused.headers
    raised = engine.refusal(refused)
    assert isinstance(raised, PrefectAPIUnavailable) and isinstance(raised, PrefectHTTPStatusError)
    assert type(raised).__name__ == "PrefectAPIUnavailable" and raised.response.status_code == 403
    assert str(raised) == refusal.not_readable("allowed_variables", "private", ["granted"], refusal.WORKER)
