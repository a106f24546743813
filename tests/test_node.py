"""The node driver against real sandboxes: the happy path and every liveness path."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest
from support.polling import scaled

from guest_runner import wire
from guest_runner.conduit import LocalConduit
from prefect_resoluto.node import tail
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.outcome import SandboxKilled, SandboxLost
from prefect_resoluto.node.spec import NodeSpec, NodeSpecError
from prefect_resoluto.runtimes import get_runtime
from prefect_resoluto.runtimes.base import IsolationTooWeak, LaunchError, Resources


@pytest.fixture
def conduit(tmp_path: Path) -> LocalConduit:
    return LocalConduit(tmp_path / "conduit")


def spec(tmp_path: Path, argv: list[str], **kw) -> NodeSpec:
    return NodeSpec(
        run_id=kw.pop("run_id", "run1"),
        node_id=kw.pop("node_id", "node1"),
        argv=argv,
        outputs_dir=tmp_path / "outputs",
        **kw,
    )


@pytest.mark.sandbox
def test_happy_path_on_gvisor(gvisor, conduit, tmp_path, validate):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "input.txt").write_text("41")
    events: list[dict] = []
    code = (
        "n = int(open('input.txt').read()); import os; os.makedirs('out', exist_ok=True); "
        "open('out/answer.txt', 'w').write(str(n + 1)); print('answered')"
    )
    outcome = drive_node(
        spec(
            tmp_path,
            ["python3", "-c", code],
            workspace=ws,
            output_paths=["out/*.txt"],
            resources=Resources.from_quantities(memory="256Mi", cpus="1"),
        ),
        conduit,
        gvisor,
        on_event=events.append,
    )
    assert outcome.ok, outcome.describe()
    assert outcome.exit_code == 0 and outcome.failure is None
    assert outcome.runtime == "gvisor" and outcome.isolation == "user-kernel"
    assert outcome.observed_phase == "succeeded"
    assert outcome.output_files["out/answer.txt"].read_text() == "42"
    assert outcome.conduit_prefix == "run/run1/nodes/node1"
    assert {"launch", "first_event", "finish"} <= set(outcome.timings)
    assert [e["data"]["line"] for e in events if e["kind"] == "log" and e["data"].get("line") == "answered"]
    for e in events:
        validate("event", e)
    validate("result", json.loads(conduit.get("run/run1/nodes/node1/result.json")))
    assert gvisor.list_ids() == []


@pytest.mark.sandbox
def test_sandbox_killed_from_outside_mid_run_is_detected_classified_and_reaped(gvisor, conduit, tmp_path):
    launched = []
    killer_started = []

    def on_event(ev: dict) -> None:
        if ev.get("data", {}).get("line") == "started" and not killer_started:
            killer_started.append(True)
            os.kill(launched[0].data["pid"], signal.SIGKILL)

    outcome = drive_node(
        spec(tmp_path, ["python3", "-c", "print('started', flush=True); import time; time.sleep(120)"]),
        conduit,
        gvisor,
        on_event=on_event,
        on_launch=launched.append,
    )
    assert not outcome.ok and outcome.infrastructure_failure
    assert outcome.failure in ("killed", "no_result"), outcome.describe()
    assert "SIGKILL" in outcome.reason or "without writing _manifest.json" in outcome.reason
    with pytest.raises((SandboxKilled, Exception)) as exc:
        outcome.raise_for_failure()
    assert outcome.node_id in str(exc.value)
    assert gvisor.list_ids() == [] and gvisor.containers() == []


def test_a_frozen_sandbox_trips_the_silence_watchdog(conduit, tmp_path):
    """process runtime: freezing a sandbox from outside needs its host pid group."""
    rt = get_runtime("process")
    launched = []

    def on_event(ev: dict) -> None:
        if ev.get("data", {}).get("line") == "working":
            os.killpg(launched[0].data["pid"], signal.SIGSTOP)

    started = time.monotonic()
    outcome = drive_node(
        spec(tmp_path, [sys.executable, "-c", "print('working', flush=True); import time; time.sleep(3600)"]),
        conduit,
        rt,
        on_event=on_event,
        on_launch=launched.append,
        min_isolation="none",
        silence_window=2.0,
    )
    assert outcome.failure == "lost", outcome.describe()
    assert "silence window 2s" in outcome.reason and "presumed dead" in outcome.reason
    assert time.monotonic() - started < scaled(60)  # declared lost, not run out (an hour)
    with pytest.raises(SandboxLost):
        outcome.raise_for_failure()
    assert rt.list_ids() == []


def test_guest_heartbeat_keeps_a_quiet_node_alive(conduit, tmp_path):
    rt = get_runtime("process")
    outcome = drive_node(
        spec(
            tmp_path,
            [sys.executable, "-c", "import time; time.sleep(4); print('done')"],
            env={"RESOLUTO_HEARTBEAT_INTERVAL": "0.5"},
        ),
        conduit,
        rt,
        min_isolation="none",
        silence_window=2.0,
    )
    assert outcome.ok, outcome.describe()
    chunks = [
        json.loads(line)
        for k in conduit.list_prefix("run/run1/nodes/node1/events-")
        for line in conduit.get(k).decode().splitlines()
    ]
    assert sum(1 for e in chunks if e["kind"] == "heartbeat") >= 2


def test_a_quiet_node_outlives_a_silence_window_shorter_than_the_guests_own_heartbeat(conduit, tmp_path):
    """The guest's heartbeat is 10 s when quiet: a window under it ended every live node that
    printed nothing for that long ("presumed dead"). The host now tells the guest a heartbeat
    of a quarter of the window, without the user setting one."""
    window = min(scaled(2.0), 8.0)  # a busy machine's guest waits longer to run, and its beats
    outcome = drive_node(
        spec(tmp_path, [sys.executable, "-c", f"import time; time.sleep({window * 2.5})"]),
        conduit,
        get_runtime("process"),
        min_isolation="none",
        silence_window=window,
    )
    assert outcome.ok, outcome.describe()
    beats = [
        json.loads(line)
        for k in conduit.list_prefix("run/run1/nodes/node1/events-")
        for line in conduit.get(k).decode().splitlines()
        if json.loads(line)["kind"] == "heartbeat"
    ]
    assert len(beats) >= 2


def test_the_guests_heartbeat_is_paced_to_the_silence_window(conduit, tmp_path):
    from prefect_resoluto.node.spec import guest_env

    key = wire.ENV_HEARTBEAT_INTERVAL
    # The default 600 s window: a beat every 25 s, not the guest's own 10 s (a chunk each),
    # and within a gap probe's 30 s, so the host's tail of a live node never lists.
    assert guest_env(spec(tmp_path, ["true"]), conduit, "p")[key] == "25"
    assert tail.MAX_HEARTBEAT_INTERVAL < tail.GAP_PROBE_AFTER
    assert guest_env(spec(tmp_path, ["true"], silence_window=2.0), conduit, "p")[key] == "0.5"
    # However long the window, a quiet guest still beats (and an unbounded one gets a number).
    assert guest_env(spec(tmp_path, ["true"], silence_window=86400.0), conduit, "p")[key] == "25"
    assert guest_env(spec(tmp_path, ["true"], silence_window=float("inf")), conduit, "p")[key] == "25"
    mine = spec(tmp_path, ["true"], silence_window=2.0, env={key: "0.25"})
    assert guest_env(mine, conduit, "p")[key] == "0.25"  # the user's own is kept


@pytest.mark.sandbox
def test_a_sandbox_that_exits_without_a_result_says_so_with_substrate_logs(gvisor, conduit, tmp_path):
    s = spec(tmp_path, ["true"])
    outcome = _drive_with_command(
        s, conduit, gvisor, ["/bin/sh", "-c", "echo the guest never ran >&2; exit 3"]
    )
    assert outcome.failure == "no_result"
    assert "without writing _manifest.json" in outcome.reason and "exit code 3" in outcome.reason
    assert "the guest never ran" in outcome.substrate_logs
    assert gvisor.list_ids() == []


def _drive_with_command(s: NodeSpec, conduit, runtime, command: list[str]):
    """Replace the guest runner with ``command`` (the LaunchSpec escape hatch)."""
    import prefect_resoluto.node.drive as node

    real = node.launch_spec

    def patched(spec, conduit):
        ls = real(spec, conduit)
        ls.command = command
        return ls

    node.launch_spec = patched
    try:
        return drive_node(s, conduit, runtime)
    finally:
        node.launch_spec = real


@pytest.mark.sandbox
def test_an_unstartable_sandbox_fails_fast(conduit, tmp_path):
    rt = get_runtime("container", image="localhost/resoluto-no-such-image:never")
    avail = rt.availability()
    if not avail.ok:
        pytest.skip(f"the container runtime is not available here: {avail.why}")
    # A run id of its own: containers are the host's, not this test's state directory's, and a
    # sweep of "run1" would find (and remove) another test's live container of that run id.
    run_id = f"run-unstartable-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    outcome = drive_node(spec(tmp_path, ["true"], run_id=run_id), conduit, rt)
    assert outcome.failure == "unstartable", outcome.describe()
    assert "resoluto-no-such-image" in outcome.reason
    assert time.monotonic() - started < 60
    assert rt.sweep({"resoluto.run-id": run_id}) == 0


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"argv": []}, "argv must be a non-empty list"),
        ({"argv": ["echo"], "workspace": Path("/nonexistent/ws")}, "does not exist"),
        ({"argv": ["echo"], "output_paths": ["../escape"]}, "escapes the workspace"),
        ({"argv": ["echo"], "node_id": "../x"}, "not a valid identifier"),
        ({"argv": ["echo"], "env": {"A=B": "x"}}, "invalid environment variable name"),
        ({"argv": ["echo"], "silence_window": float("nan")}, "silence_window must be positive"),
        ({"argv": ["echo"], "silence_window": 0.0}, "silence_window must be positive"),
    ],
)
def test_bad_node_specs_fail_before_anything_is_written(conduit, tmp_path, kw, message):
    with pytest.raises(NodeSpecError, match=message):
        drive_node(
            NodeSpec(run_id="run1", node_id=kw.pop("node_id", "n"), **kw),
            conduit,
            get_runtime("process"),
            min_isolation="none",
        )
    assert conduit.list_prefix("") == []


def test_isolation_floor_and_egress_refusals_write_nothing(conduit, tmp_path):
    with pytest.raises(IsolationTooWeak, match="min_isolation='none'"):
        drive_node(spec(tmp_path, ["true"]), conduit, get_runtime("process"))
    with pytest.raises(LaunchError, match="cannot enforce an egress allowlist"):
        drive_node(
            spec(tmp_path, ["true"], egress=["10.0.0.0/8"]),
            conduit,
            get_runtime("process"),
            min_isolation="none",
        )
    assert conduit.list_prefix("") == []


def test_bad_quantities_and_unknown_runtimes_are_clear():
    with pytest.raises(ValueError, match="cannot parse quantity '12 parsecs'"):
        Resources.from_quantities(memory="12 parsecs")
    with pytest.raises(ValueError, match="unknown sandbox runtime 'firecracker'; known runtimes: "):
        get_runtime("firecracker")


def test_hostile_outbox_is_refused_and_earlier_data_kept(conduit, tmp_path):
    """A guest that plants a traversal member in its outbox: the host refuses it by name."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        ti = tarfile.TarInfo("../../../evil.txt")
        ti.size = 1
        t.addfile(ti, io.BytesIO(b"x"))
    planted = tmp_path / "planted.tar.gz"
    planted.write_bytes(buf.getvalue())
    code = (
        "import shutil, os; d = os.environ['RESOLUTO_STORE_ROOT'] + '/' + os.environ['RESOLUTO_STORE_PREFIX']"
        " + '/outbox'; os.makedirs(d, exist_ok=True); "
        f"shutil.copy({str(planted)!r}, d + '/evil.tar.gz'); print('planted')"
    )
    outcome = drive_node(
        spec(tmp_path, [sys.executable, "-c", code], output_paths=["**"]),
        conduit,
        get_runtime("process"),
        min_isolation="none",
    )
    assert outcome.failure == "protocol"
    assert "outbox rejected" in outcome.reason and "'../../../evil.txt'" in outcome.reason
    assert not (tmp_path / "evil.txt").exists()
    assert wire.decode_result(conduit.get("run/run1/nodes/node1/result.json"))["status"] == "success"


def test_a_conduit_and_outputs_inside_the_workspace_are_not_shipped(tmp_path):
    """Otherwise every node's inbox would carry every earlier node's inbox."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "code.py").write_text("x = 1\n")
    conduit = LocalConduit(ws / "conduit")
    rt = get_runtime("process")
    sizes = []
    for i in range(3):
        s = NodeSpec(
            run_id="run1",
            node_id=f"n{i}",
            argv=[sys.executable, "-c", "import os; print(sorted(os.listdir('.')))"],
            workspace=ws,
            outputs_dir=ws / "outputs" / f"n{i}",
            output_paths=["*.py"],
            workspace_skip=[ws / "outputs"],
        )
        events: list[dict] = []
        outcome = drive_node(s, conduit, rt, min_isolation="none", on_event=events.append)
        assert outcome.ok, outcome.describe()
        assert "['code.py']" in [e.get("data", {}).get("line") for e in events]
        sizes.append(len(conduit.get(f"run/run1/nodes/n{i}/inbox/workspace.tar.gz")))
    assert sizes[0] == sizes[1] == sizes[2]
