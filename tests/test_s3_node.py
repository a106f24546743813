"""The guest runner and the node driver on the S3 conduit (moto's server on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any

from support.guest import ROOT

from guest_runner import archive, wire
from guest_runner.conduit.s3 import S3Conduit
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.node.tail import ChunkTailer
from prefect_resoluto.runtimes import get_runtime


def guest_env_s3(endpoint: str, bucket: str, argv: list[str], **extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k.startswith("AWS_") or k in ("PATH", "NO_PROXY", "no_proxy")
    }
    env.update(
        {
            "PYTHONPATH": str(ROOT),
            "RESOLUTO_STORE_KIND": "s3",
            "RESOLUTO_STORE_BUCKET": bucket,
            "RESOLUTO_STORE_ENDPOINT": endpoint,
            "RESOLUTO_STORE_REGION": "us-east-1",
            "RESOLUTO_STORE_PREFIX": "base/run/r1/nodes/n1",
            "RESOLUTO_RUN_ID": "r1",
            "RESOLUTO_NODE_ID": "n1",
            "RESOLUTO_WORKLOAD_ARGV": json.dumps(argv),
            **extra,
        }
    )
    return env


def test_guest_runner_on_s3_produces_a_valid_node(
    moto_server, s3_bucket, s3_conduit, tmp_path, validate, s3_counter
):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "in.txt").write_text("payload")
    s3_conduit.put(wire.inbox_key("run/r1/nodes/n1", "workspace"), archive.pack(ws))
    argv = [
        sys.executable,
        "-c",
        "import os; os.makedirs('out'); open('out/r.txt','w').write(open('in.txt').read());"
        "[print(i) for i in range(2000)]",
    ]
    env = guest_env_s3(
        moto_server.endpoint_url,
        s3_bucket,
        argv,
        RESOLUTO_WORKSPACE_DIR=str(tmp_path / "guest-ws"),
        RESOLUTO_OUTPUT_PATHS='["out/**"]',
    )
    proc = subprocess.run(
        [sys.executable, "-m", "guest_runner"],
        env=env,
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    tail = ChunkTailer(s3_conduit, "run/r1/nodes/n1")
    events: list[dict] = []
    while not tail.finished:
        tail.poll(events.append)
    lines = [e["data"]["line"] for e in events if e["kind"] == "log" and e["data"]["line"].isdigit()]
    assert lines == [str(i) for i in range(2000)]
    for e in events:
        validate("event", e)
    result = json.loads(s3_conduit.get("run/r1/nodes/n1/result.json"))
    validate("result", result)
    validate("manifest", json.loads(s3_conduit.get("run/r1/nodes/n1/_manifest.json")))
    assert result["output_archive"] == "base/run/r1/nodes/n1/outbox/output.tar.gz"  # full key, base included
    got = archive.unpack(s3_conduit.get("run/r1/nodes/n1/outbox/output.tar.gz"), tmp_path / "fetched")
    assert got == ["out/r.txt"] and (tmp_path / "fetched/out/r.txt").read_text() == "payload"


def test_transient_s3_errors_during_shipping_lose_nothing(
    moto_server, s3_bucket, s3_conduit, tmp_path, s3_faults
):
    s3_faults.fail_next(3, status=503, kinds="PUT")
    env = guest_env_s3(
        moto_server.endpoint_url, s3_bucket, [sys.executable, "-c", "[print(i) for i in range(500)]"]
    )
    proc = subprocess.run(
        [sys.executable, "-m", "guest_runner"],
        env=env,
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert s3_faults.injected >= 3
    tail = ChunkTailer(s3_conduit, "run/r1/nodes/n1")
    events: list[dict] = []
    while not tail.finished:
        tail.poll(events.append)
    assert [e["data"]["line"] for e in events if e["kind"] == "log" and e["data"]["line"].isdigit()] == [
        str(i) for i in range(500)
    ]


def test_s3_outage_on_the_host_is_an_infrastructure_failure_that_keeps_earlier_data(
    moto_server, s3_bucket, tmp_path, s3_faults
):
    conduit = S3Conduit(s3_bucket, base_prefix="base", endpoint_url=moto_server.endpoint_url, max_attempts=2)
    conduit.put("run/earlier/nodes/x/result.json", b"{}")
    node = NodeSpec(
        run_id="r2",
        node_id="n2",
        argv=[sys.executable, "-c", "print('hello', flush=True); import time; time.sleep(30)"],
    )
    launched = []

    def on_event(ev: dict) -> None:
        if ev.get("data", {}).get("line") == "hello":
            s3_faults.fail_next(10_000, status=500, kinds=("LIST", "GET"))

    outcome = drive_node(
        node,
        conduit,
        get_runtime("process"),
        min_isolation="none",
        on_event=on_event,
        on_launch=launched.append,
    )
    s3_faults.clear()
    assert outcome.failure == "lost", outcome.describe()
    assert "conduit unavailable while tailing" in outcome.reason and "500" in outcome.reason
    assert conduit.get("run/earlier/nodes/x/result.json") == b"{}"
    assert get_runtime("process").list_ids() == []


def test_driver_runs_a_whole_node_over_s3(moto_server, s3_bucket, s3_conduit, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "n.txt").write_text("20")
    node = NodeSpec(
        run_id="r3",
        node_id="n3",
        workspace=ws,
        output_paths=["*.out"],
        argv=[sys.executable, "-c", "open('x.out','w').write(str(int(open('n.txt').read())+1))"],
        outputs_dir=tmp_path / "outputs",
    )
    outcome = drive_node(node, s3_conduit, get_runtime("process"), min_isolation="none")
    assert outcome.ok, outcome.describe()
    assert outcome.output_files["x.out"].read_text() == "21"
    assert outcome.conduit_url.startswith(f"s3://{s3_bucket}/base")


def _counted_node(moto_server: Any, bucket: str, node_id: str, code: str, **env: str) -> tuple[Any, NodeSpec]:
    """A host conduit and a node whose guest signs with another access key, so the counting
    proxy tells the host's requests from the guest's at the endpoint."""
    host = S3Conduit(
        bucket,
        base_prefix="base",
        endpoint_url=moto_server.endpoint_url,
        access_key_id=HOST_KEY,
        secret_access_key="tail-secret",
    )
    spec = NodeSpec(
        run_id="r4",
        node_id=node_id,
        argv=[sys.executable, "-c", code],
        env=env,
        secret_env={"AWS_ACCESS_KEY_ID": "tail-guest", "AWS_SECRET_ACCESS_KEY": "tail-secret"},
    )
    return host, spec


HOST_KEY = "tail-host"


def test_an_idle_node_on_s3_costs_the_host_no_list_in_the_steady_state(moto_server, s3_bucket, s3_counter):
    """Counted at the endpoint over a window of the guest's own clock: from the 3rd to the
    13th heartbeat chunk after the workload went quiet, the host's tail only GETs."""
    host, spec = _counted_node(
        moto_server,
        s3_bucket,
        "idle",
        "print('quiet from now on', flush=True); import time; time.sleep(600)",
        RESOLUTO_HEARTBEAT_INTERVAL="0.2",
    )
    quiet = threading.Event()
    beats = 0
    marks: list[dict[str, int]] = []

    def on_event(ev: dict) -> None:
        nonlocal beats
        if ev["data"].get("line") == "quiet from now on":
            quiet.set()
        elif ev["kind"] == "heartbeat" and quiet.is_set():
            beats += 1
            if beats in (3, 13):
                marks.append(s3_counter.snapshot(client=HOST_KEY))

    try:
        outcome = drive_node(
            spec,
            host,
            get_runtime("process"),
            min_isolation="none",
            on_event=on_event,
            should_cancel=lambda: len(marks) == 2,
        )
    finally:
        host.close()
    assert outcome.reason == "cancelled by the host", outcome.describe()
    before, after = marks
    window = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)}
    assert window.get("LIST", 0) == 0, window
    assert window.get("GET", 0) >= 10, window  # each heartbeat chunk was fetched by its key
    assert get_runtime("process").list_ids() == []


def test_a_whole_node_on_s3_costs_the_host_one_list(moto_server, s3_bucket, s3_counter):
    """The one listing is at the end (chunks beyond the manifest's count); the tail of a node
    that prints and exits otherwise only GETs its chunks, result and manifest by key."""
    host, spec = _counted_node(moto_server, s3_bucket, "short", "[print(i) for i in range(300)]")
    lines: list[str] = []
    try:
        outcome = drive_node(
            spec,
            host,
            get_runtime("process"),
            min_isolation="none",
            on_event=lambda ev: lines.append(ev["data"].get("line", "")),
        )
    finally:
        host.close()
    assert outcome.ok, outcome.describe()
    assert [x for x in lines if x.isdigit()] == [str(i) for i in range(300)]
    host_requests = s3_counter.snapshot(client=HOST_KEY)
    assert host_requests.get("LIST") == 1, host_requests
