"""`doctor`, `render --runtime solari` and `run --runtime solari`, as real subprocesses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.solari_gateway import SolariGateway, _check_create
from test_cli import Cli, last_json
from test_cli import cli as _cli_fixture

cli = _cli_fixture  # the CLI fixture of test_cli.py, under its own name here

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def gw(tmp_path: Path):
    g = SolariGateway(tmp_path / "gateway", executor="process").start()
    yield g
    g.stop()


def solari_row(report: dict) -> dict:
    return next(r for r in report["runtimes"] if r["name"] == "solari")


@pytest.mark.slow
def test_doctor_reports_sdk_configuration_and_a_read_only_gateway_probe(cli: Cli, gw: SolariGateway) -> None:
    env = {k: v for k, v in cli.env.items() if not k.startswith("SOLARI_")}
    row = solari_row(json.loads(cli.run("doctor", "--json", env=env).stdout))
    assert not row["available"] and "SOLARI_BASE_URL" in row["why"] and row["isolation"] == "vm"

    env["SOLARI_BASE_URL"] = gw.base_url
    row = solari_row(json.loads(cli.run("doctor", "--json", env=env).stdout))
    assert not row["available"] and "SOLARI_API_KEY" in row["why"]

    env["SOLARI_API_KEY"] = "sk-not-the-key"
    row = solari_row(json.loads(cli.run("doctor", "--json", env=env).stdout))
    assert not row["available"] and "401" in row["why"] and "SOLARI_API_KEY" in row["why"]
    assert "sk-not-the-key" not in row["why"]

    env["SOLARI_API_KEY"] = gw.api_key
    res = cli.run("doctor", "--json", env=env)
    row = solari_row(json.loads(res.stdout))
    assert row["available"], row
    assert gw.base_url in row["detail"]
    text = cli.run("doctor", env=env).stdout
    assert "solari" in text and gw.api_key not in text and gw.api_key not in res.stdout
    # Read-only: the gateway saw GETs and nothing else, and no sandbox exists.
    assert {r.method for r in gw.requests} == {"GET"}
    assert gw.sandboxes == {}


def test_render_prints_the_create_body_and_the_guest_command_with_secrets_redacted(cli: Cli) -> None:
    env = {**cli.env, "SOLARI_API_KEY": "sk-render-secret", "SOLARI_BASE_URL": "http://127.0.0.1:9"}
    res = cli.run(
        "render",
        "--runtime",
        "solari",
        "--runtime-option",
        "template=py311",
        "--runtime-option",
        'lifecycle={"onTimeout": "kill"}',
        "--cpus",
        "1.5",
        "--memory",
        "1Gi",
        "--secret-env",
        "DB_PASSWORD=hunter2-xyz",
        "--env",
        "MODE=fast",
        "--label",
        "team=data",
        "--min-isolation",
        "vm",
        "--",
        "python3",
        "-c",
        "print(1)",
        env=env,
    )
    assert res.returncode == 0, res.stderr
    assert "sk-render-secret" not in res.stdout and "hunter2-xyz" not in res.stdout
    doc = json.loads(res.stdout)
    body = doc["create"]
    assert _check_create(body) == ""  # the seed's CreateSandboxRequest, as the stand-in enforces it
    assert body["template"] == "py311" and body["kind"] == "sandbox"
    assert body["cpu"] == 2 and body["memMb"] == 1024 and isinstance(body["timeoutMs"], int)
    assert body["lifecycle"] == {"onTimeout": "kill"}
    assert (
        body["metadata"]["team"] == "data" and body["metadata"]["resoluto.managed-by"] == "prefect-resoluto"
    )
    assert "diskGb" not in body and "envs" not in body
    cmd = doc["command"]
    assert cmd["cmd"] == "python3" and cmd["args"] == ["-m", "guest_runner"]
    assert cmd["env"]["MODE"] == "fast" and cmd["env"]["RESOLUTO_STORE_KIND"] == "localfs"
    assert cmd["env"]["DB_PASSWORD"] != "hunter2-xyz"
    assert doc["authorization"] == "Bearer <redacted>"
    assert not any(k.startswith("AWS_") for k in cmd["env"])


def test_render_refuses_an_unknown_solari_option(cli: Cli) -> None:
    res = cli.run(
        "render", "--runtime", "solari", "--runtime-option", "conduit_mode=carrier-pigeon", "--", "true"
    )
    assert res.returncode != 0 and "conduit_mode" in res.stderr


@pytest.mark.slow
def test_run_on_solari_through_the_cli(cli: Cli, gw: SolariGateway, tmp_path: Path) -> None:
    env = {**cli.env, "SOLARI_API_KEY": gw.api_key, "SOLARI_BASE_URL": gw.base_url}
    res = cli.run(
        "run",
        "--runtime",
        "solari",
        "--min-isolation",
        "vm",
        "--json",
        "--secret-env",
        "T=tok-123",
        "--",
        "python3",
        "-c",
        "import os; print('hi from', os.environ['T'])",
        env=env,
    )
    assert res.returncode == 0, res.stderr
    assert "hi from ***" in res.stdout and "tok-123" not in res.stdout + res.stderr
    out = last_json(res.stdout)
    assert out["runtime"] == "solari" and out["isolation"] == "vm" and out["status"] == "success"
    assert gw.live() == []
    # The relayed conduit replays like any other runtime's.
    rep = cli.run("events", "--conduit", out["conduit_url"], out["run_id"], out["node_id"], env=env)
    assert rep.returncode == 0, rep.stderr
    assert "hi from ***" in rep.stdout and "tok-123" not in rep.stdout


@pytest.mark.slow
def test_sweep_reaches_the_gateway_only_when_named(cli: Cli, gw: SolariGateway) -> None:
    from solari_sandbox import SyncSandboxClient

    env = {**cli.env, "SOLARI_API_KEY": gw.api_key, "SOLARI_BASE_URL": gw.base_url}
    client = SyncSandboxClient(api_key=gw.api_key, base_url=gw.base_url)
    handles = [
        client.create(metadata={"resoluto.managed-by": "prefect-resoluto", "resoluto.run-id": "r-sweep"})
        for _ in range(2)
    ]
    before = len(gw.requests)
    res = cli.run("sweep", "--label", "resoluto.run-id=r-sweep", "--json", env=env)
    assert "solari" not in json.loads(res.stdout)["reaped"]
    assert len(gw.requests) == before and len(gw.live()) == 2  # unnamed: not even a list
    res = cli.run("sweep", "--runtime", "solari", "--label", "resoluto.run-id=r-sweep", "--json", env=env)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["reaped"] == {"solari": 2}
    assert gw.live() == []
    for h in handles:
        h.close()
    client.close()
