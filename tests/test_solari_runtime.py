"""The Solari runtime against the loopback gateway stand-in (tests/support/solari_gateway.py).

Whole nodes run through the official SDK: the stand-in enforces the gateway's wire
contract and runs each sandbox's commands for real -- in gVisor where the test is about
the node, as host processes where it is about the protocol (and for the direct mode,
whose VM must reach the moto S3 endpoint over the network).
"""

from __future__ import annotations

import json
import threading
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from support.solari_gateway import SolariGateway

from guest_runner import wire
from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.outcome import NodeOutcome
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes import get_runtime
from prefect_resoluto.runtimes.solari import SolariRuntime

PY = "python3"
# uvicorn's websockets implementation (the one with the ASGI denial response) is deprecated.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(autouse=True)
def _no_proxy_for_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    # The SDK's WebSocket honours proxy variables (SDK divergence 10); loopback is never proxied.
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


@pytest.fixture
def gw(tmp_path: Path):
    g = SolariGateway(tmp_path / "gateway", executor="process").start()
    yield g
    g.stop()


@pytest.fixture
def gw_gvisor(tmp_path: Path, gvisor):
    g = SolariGateway(tmp_path / "gateway", executor="gvisor").start()
    yield g
    g.stop()


def solari(g: SolariGateway, **kw: Any) -> SolariRuntime:
    kw.setdefault("template", "base")
    return get_runtime("solari", base_url=g.base_url, api_key=g.api_key, **kw)  # type: ignore[return-value]


def node(tmp_path: Path, code: str, node_id: str = "n1", run_id: str = "run-solari", **kw: Any) -> NodeSpec:
    ws = tmp_path / f"ws-{node_id}"
    ws.mkdir(exist_ok=True)
    (ws / "input.txt").write_text("from the host\n")
    return NodeSpec(run_id=run_id, node_id=node_id, argv=[PY, "-c", code], workspace=ws, **kw)


def run(spec: NodeSpec, conduit: Any, rt: SolariRuntime, **kw: Any) -> tuple[NodeOutcome, list[dict]]:
    events: list[dict] = []
    kw.setdefault("silence_window", 60)
    out = drive_node(spec, conduit, rt, on_event=events.append, min_isolation="vm", **kw)
    return out, events


def lines(events: list[dict]) -> list[str]:
    return [
        str(e["data"]["line"])
        for e in events
        if e.get("event") == "log" and e.get("name") == "stdout" and "line" in (e.get("data") or {})
    ]


def workload_lines(events: list[dict]) -> list[str]:
    spans = {e["span_id"] for e in events if e.get("kind") == "workload" and e.get("event") == "open"}
    return [
        str(e["data"]["line"]) for e in events if e.get("event") == "log" and e.get("parent_span_id") in spans
    ]


def node_keys(conduit: Any, run_id: str, node_id: str) -> list[str]:
    prefix = wire.node_prefix(run_id, node_id) + "/"
    return [k[len(prefix) :] for k in conduit.list_prefix(prefix)]


# -- the SDK and the stand-in ---------------------------------------------------------------------


def test_the_official_sdk_is_installed_at_the_version_the_notes_describe():
    assert metadata.version("solari-sandbox").startswith("0.6.")
    assert metadata.version("solari-core").startswith("0.7.")


@pytest.mark.slow
def test_stand_in_refuses_requests_without_the_bearer_key_on_rest_and_on_the_upgrade(gw: SolariGateway):
    import asyncio

    import httpx
    import websockets

    with httpx.Client(base_url=gw.base_url, trust_env=False) as http:
        assert http.get("/sandboxes", headers={"Accept": "application/json"}).status_code == 401
        ok = {"Authorization": f"Bearer {gw.api_key}", "Accept": "application/json"}
        r = http.post("/sandboxes", json={"template": "base"}, headers=ok)
        assert r.status_code == 400 and r.json()["code"] == "IdempotencyKeyRequired"
        r = http.post("/sandboxes", json={"template": None}, headers={**ok, "Idempotency-Key": "k1"})
        assert r.status_code == 400 and "null" in r.json()["message"]
        r = http.post("/sandboxes", json={"cpu": "2"}, headers={**ok, "Idempotency-Key": "k2"})
        assert r.status_code == 400
        created = http.post(
            "/sandboxes", json={"template": "base"}, headers={**ok, "Idempotency-Key": "k3"}
        ).json()
        again = http.post(
            "/sandboxes", json={"template": "base"}, headers={**ok, "Idempotency-Key": "k3"}
        ).json()
        assert created["sandboxId"] == again["sandboxId"] and len(gw.live()) == 1
        sid = created["sandboxId"]
        pool, vm, rest = sid.split(":")
        assert pool and vm and "." in rest  # <pool>:<vm>:<org>.<sig>
        assert http.get(f"/sandboxes/{sid}", headers=ok).status_code == 400  # a bare ':' in the path
        assert http.get(f"/sandboxes/{sid.replace(':', '%3A')}", headers=ok).status_code == 200

    async def upgrade(headers: dict[str, str]) -> str:
        try:
            async with websockets.connect(created["controlUrl"], additional_headers=headers, proxy=None):
                return "open"
        except websockets.InvalidStatus as e:
            return str(e.response.status_code)

    assert asyncio.run(upgrade({})) == "401"
    assert asyncio.run(upgrade({"Authorization": "Bearer wrong"})) == "401"
    assert asyncio.run(upgrade({"Authorization": f"Bearer {gw.api_key}"})) == "open"
    assert [u["authorized"] for u in gw.ws_upgrades] == [False, False, True]


# -- whole nodes ----------------------------------------------------------------------------------


@pytest.mark.sandbox
def test_node_relayed_from_a_gvisor_backed_vm_leaves_the_same_objects_as_any_runtime(
    tmp_path: Path, gw_gvisor: SolariGateway, gvisor
):
    conduit = LocalConduit(tmp_path / "conduit")
    code = (
        "import os; print(open('input.txt').read().strip()); print('token', os.environ['TOKEN']); "
        "os.makedirs('out', exist_ok=True); open('out/result.txt', 'w').write('made in the VM')"
    )
    spec = node(tmp_path, code, output_paths=["out/*"], secret_env={"TOKEN": "tok-very-secret-1"})
    rt = solari(gw_gvisor)
    out, events = run(spec, conduit, rt)
    assert out.ok, out.describe()
    assert out.isolation == "vm" and out.runtime == "solari"
    assert workload_lines(events) == ["from the host", "token ***"]
    assert (out.output_files["out/result.txt"]).read_text() == "made in the VM"

    # The same node on the gVisor runtime, into the same conduit: the same keys.
    ref = node(
        tmp_path, code, node_id="n-ref", output_paths=["out/*"], secret_env={"TOKEN": "tok-very-secret-1"}
    )
    ref_out = drive_node(ref, conduit, gvisor)
    assert ref_out.ok, ref_out.describe()

    def shape(keys: list[str]) -> tuple[list[str], bool]:
        # How many chunks a guest writes depends on timing; the keys around them may not differ.
        chunks = [wire.chunk_index(k) for k in keys if wire.chunk_index(k) is not None]
        return [k for k in keys if wire.chunk_index(k) is None], chunks == list(range(1, len(chunks) + 1))

    assert shape(node_keys(conduit, "run-solari", "n1")) == shape(node_keys(conduit, "run-solari", "n-ref"))
    assert shape(node_keys(conduit, "run-solari", "n1"))[0] == [
        "_manifest.json",
        "inbox/workspace.tar.gz",
        "outbox/output.tar.gz",
        "result.json",
    ]

    # The gateway saw escaped session ids, the bearer key on every upgrade, and no VM is left.
    assert all("%3A" in r.raw_path for r in gw_gvisor.requests if r.raw_path.startswith("/sandboxes/"))
    assert gw_gvisor.ws_upgrades and all(u["authorized"] for u in gw_gvisor.ws_upgrades)
    assert gw_gvisor.live() == []


@pytest.mark.slow
def test_relay_mirrors_each_object_once_chunks_in_order_manifest_last(tmp_path: Path, gw: SolariGateway):
    from prefect_resoluto.runtimes import solari as solari_mod

    conduit = LocalConduit(tmp_path / "conduit")
    code = (
        "import time\nfor i in range(40):\n    print('line', i, flush=True)\n    time.sleep(0.01)\n"
        "open('a.txt','w').write('a')"
    )
    spec = node(tmp_path, code, output_paths=["a.txt"])
    rt = solari(gw)
    seen: list[Any] = []
    out, events = run(spec, conduit, rt, on_launch=seen.append)
    assert out.ok, out.describe()
    assert workload_lines(events) == [f"line {i}" for i in range(40)]
    log = solari_mod._SESSIONS[seen[0].id].relay.log
    assert len(log) == len(set(log))
    rel = [k.rsplit("/nodes/n1/", 1)[1] for k in log]
    chunks = [r for r in rel if r.startswith("events-")]
    assert chunks == sorted(chunks) and len(chunks) >= 1
    assert rel[-1] == "_manifest.json"
    assert rel.index("result.json") > rel.index(chunks[-1])
    assert "outbox/output.tar.gz" in rel
    # The framing hazards were on the wire and the SDK survived each of them.
    for hazard in ("non_json_lines", "v1_frames", "frames_split", "messages_packed", "data_before_reply"):
        assert gw.hazard_counts[hazard] > 0, hazard


@pytest.mark.slow
def test_the_runtime_works_from_inside_a_running_event_loop(tmp_path: Path, gw: SolariGateway):
    # A Prefect async task calls the runtime from a thread that runs an event loop, where the
    # SDK's own sync client refuses to work; the runtime's calls go to a loop of its own.
    import asyncio

    conduit = LocalConduit(tmp_path / "conduit")

    async def inside() -> tuple[NodeOutcome, list[dict]]:
        return run(node(tmp_path, "print('from a loop')"), conduit, solari(gw))

    out, events = asyncio.run(inside())
    assert out.ok, out.describe()
    assert workload_lines(events) == ["from a loop"]


@pytest.mark.slow
def test_a_failing_task_is_a_workload_failure_with_its_exit_code(tmp_path: Path, gw: SolariGateway):
    conduit = LocalConduit(tmp_path / "conduit")
    spec = node(tmp_path, "import sys; print('about to fail'); sys.exit(3)")
    out, events = run(spec, conduit, solari(gw))
    assert out.failure == "workload" and out.exit_code == 3, out.describe()
    assert "about to fail" in workload_lines(events)
    assert gw.live() == []


@pytest.mark.slow
def test_a_quick_command_whose_exit_beats_the_start_reply_still_runs_to_its_result(
    tmp_path: Path, gw: SolariGateway
):
    conduit = LocalConduit(tmp_path / "conduit")
    out, _ = run(node(tmp_path, "pass"), conduit, solari(gw))
    assert out.ok, out.describe()
    assert gw.hazard_counts["exit_before_reply"] >= 0  # recorded when the race is won; never an error


@pytest.mark.slow
def test_429_holds_the_node_for_admission_until_a_slot_frees(tmp_path: Path, gw: SolariGateway, caplog):
    from solari_sandbox import SyncSandboxClient

    gw.max_sessions = 1
    blocker_client = SyncSandboxClient(api_key=gw.api_key, base_url=gw.base_url)
    blocker = blocker_client.create(template="base")
    conduit = LocalConduit(tmp_path / "conduit")
    spec = node(tmp_path, "print('admitted')")
    rt = solari(gw, admission_backoff_max_s=0.3)
    result: dict[str, Any] = {}
    caplog.set_level("INFO", logger="prefect_resoluto.runtimes.solari")

    def drive() -> None:
        result["out"], result["events"] = run(spec, conduit, rt, silence_window=5)

    t = threading.Thread(target=drive)
    t.start()
    gw.wait_for(lambda: gw.answers[("create", 429)] >= 3)
    assert t.is_alive()  # waiting, not failed -- and far longer than any unstartable confirmation
    gw.wait_for(lambda: any("waiting for a Solari slot" in r.getMessage() for r in caplog.records))
    blocker.kill()
    t.join(60)
    out: NodeOutcome = result["out"]
    assert out.ok, out.describe()
    assert workload_lines(result["events"]) == ["admitted"]
    # SDK divergence 1: the gateway's 429s say "retryable": true, yet no 429 was retried by the
    # SDK with the same Idempotency-Key -- every admission attempt is a fresh create of ours.
    keys_429 = [
        r.headers.get("idempotency-key") for r in gw.requests if r.method == "POST" and r.status == 429
    ]
    assert len(keys_429) == len(set(keys_429)) >= 3
    created = [
        r for r in gw.requests if r.method == "POST" and r.raw_path == "/sandboxes" and r.status == 200
    ]
    assert len(created) == 2  # the blocker and the node: no second sandbox for the node
    blocker_client.close()


@pytest.mark.slow
def test_503_and_500_are_retried_with_the_same_idempotency_key(tmp_path: Path, gw: SolariGateway):
    gw.fail("create", 503, times=2)
    gw.fail("create", 500, times=1)
    conduit = LocalConduit(tmp_path / "conduit")
    out, _ = run(node(tmp_path, "print('ok')"), conduit, solari(gw))
    assert out.ok, out.describe()
    creates = [r for r in gw.requests if r.method == "POST" and r.raw_path == "/sandboxes"]
    assert [r.status for r in creates] == [503, 503, 500, 200]
    assert len({r.headers["idempotency-key"] for r in creates}) == 1
    assert gw.answers[("create", 503)] == 2 and gw.answers[("create", 500)] == 1


@pytest.mark.slow
def test_a_429_of_another_code_also_waits_for_admission(tmp_path: Path, gw: SolariGateway):
    gw.fail("create", 429, times=2, body={"code": "TooManyRequests", "message": "slow down"})
    out, events = run(
        node(tmp_path, "print('in')"), LocalConduit(tmp_path / "c"), solari(gw, admission_backoff_max_s=0.2)
    )
    assert out.ok, out.describe()
    assert gw.answers[("create", 429)] == 2


@pytest.mark.slow
def test_no_capacity_that_outlasts_every_retry_is_unstartable_with_the_gateways_words(
    tmp_path: Path, gw: SolariGateway
):
    gw.fail("create", 503, times=1000, body={"code": "NoCapacity", "message": "no host in pool-lo1"})
    out, _ = run(
        node(tmp_path, "print('never')"), LocalConduit(tmp_path / "c"), solari(gw, capacity_retries=0)
    )
    assert out.failure == "unstartable", out.describe()
    assert "no host in pool-lo1" in out.reason and "no capacity" in out.reason
    assert gw.answers[("create", 503)] == 6  # the SDK's own attempt and its 5 retries, one key
    assert len({r.headers["idempotency-key"] for r in gw.requests if r.method == "POST"}) == 1


@pytest.mark.slow
def test_401_is_unstartable_at_once_naming_the_setting(tmp_path: Path, gw: SolariGateway):
    conduit = LocalConduit(tmp_path / "conduit")
    rt = get_runtime("solari", base_url=gw.base_url, api_key="sk-wrong-key-123")
    out, _ = run(node(tmp_path, "print('never')"), conduit, rt)
    assert out.failure == "unstartable", out.describe()
    assert "401" in out.reason and "SOLARI_API_KEY" in out.reason and "api_key" in out.reason
    assert "sk-wrong-key-123" not in out.describe()
    assert [r.status for r in gw.requests] == [401]  # refused once, never retried


@pytest.mark.slow
def test_a_refused_websocket_upgrade_is_unstartable_and_the_vm_is_reaped(tmp_path: Path, gw: SolariGateway):
    gw.refuse_upgrades = True
    conduit = LocalConduit(tmp_path / "conduit")
    out, _ = run(node(tmp_path, "print('never')"), conduit, solari(gw))
    assert out.failure == "unstartable", out.describe()
    assert "401" in out.reason and "SOLARI_API_KEY" in out.reason
    assert gw.ws_upgrades and gw.live() == []  # created, refused on the channel, killed


@pytest.mark.slow
def test_availability_probes_by_id_when_the_gateway_has_no_list_route(gw: SolariGateway):
    gw.list_route = False
    avail = solari(gw).availability()
    assert avail.ok, avail
    assert [r.method for r in gw.requests] == ["GET", "GET"] and gw.sandboxes == {}


@pytest.mark.slow
def test_402_plan_is_unstartable_naming_the_plan(tmp_path: Path, gw: SolariGateway):
    gw.fail("create", 402, body={"code": "plan_cpu_limit", "message": "plan allows 2 vCPUs"})
    conduit = LocalConduit(tmp_path / "conduit")
    out, _ = run(node(tmp_path, "print('never')"), conduit, solari(gw))
    assert out.failure == "unstartable" and "plan" in out.reason and "2 vCPUs" in out.reason, out.describe()


@pytest.mark.slow
def test_vm_killed_from_outside_mid_run_is_lost_with_the_gateways_words(tmp_path: Path, gw: SolariGateway):
    conduit = LocalConduit(tmp_path / "conduit")
    code = "import time\nprint('started', flush=True)\nwhile True:\n    time.sleep(0.05)"
    spec = node(tmp_path, code)
    result: dict[str, Any] = {}
    started = threading.Event()

    def on_event(ev: dict) -> None:
        if (ev.get("data") or {}).get("line") == "started":
            started.set()

    def drive() -> None:
        result["out"] = drive_node(
            spec, conduit, solari(gw), on_event=on_event, min_isolation="vm", silence_window=60
        )

    t = threading.Thread(target=drive)
    t.start()
    assert started.wait(60)
    [vm] = gw.live()
    gw.kill_vm(vm.id)
    t.join(60)
    out: NodeOutcome = result["out"]
    assert out.failure == "lost", out.describe()
    assert "gone" in out.reason and "404" in out.reason and vm.id in out.reason
    assert gw.live() == [] and gw.sandboxes == {}


@pytest.mark.slow
def test_socket_drops_are_reconnected_with_no_event_lost_or_duplicated(tmp_path: Path, gw: SolariGateway):
    conduit = LocalConduit(tmp_path / "conduit")
    code = "import time\nfor i in range(300):\n    print('n', i, flush=True)\n    time.sleep(0.004)"
    spec = node(tmp_path, code)
    drops_wanted = 3

    def rearm() -> None:
        for k in range(drops_wanted):
            vms = gw.wait_for(lambda: [s for s in gw.live() if s.commands])
            gw.drop_socket_after_reads(vms[0].id, 2)
            gw.wait_for(lambda k=k: gw.drops > k or not gw.live(), timeout=60)

    armer = threading.Thread(target=rearm, daemon=True)
    armer.start()
    out, events = run(spec, conduit, solari(gw))
    assert out.ok, out.describe()
    assert workload_lines(events) == [f"n {i}" for i in range(300)]
    assert gw.drops >= 1
    upgrades = [u for u in gw.ws_upgrades if u["authorized"]]
    assert len(upgrades) == gw.drops + 1  # one reconnect per drop, by the same id
    assert len({u["sandbox"] for u in upgrades}) == 1


@pytest.mark.parametrize("executor", ["process", pytest.param("gvisor", marks=pytest.mark.sandbox)])
def test_a_20000_line_node_is_relayed_complete_and_in_order(tmp_path: Path, executor: str, request):
    if executor == "gvisor":
        request.getfixturevalue("gvisor")  # skips, saying why, where gVisor is missing
    gw = SolariGateway(tmp_path / "gateway", executor=executor).start()
    request.addfinalizer(gw.stop)
    conduit = LocalConduit(tmp_path / "conduit")
    out, events = run(
        node(tmp_path, "for i in range(20000):\n    print(f'line-{i:05d}')"), conduit, solari(gw)
    )
    assert out.ok, out.describe()
    got = workload_lines(events)
    assert len(got) == 20000 and got == [f"line-{i:05d}" for i in range(20000)]


@pytest.mark.slow
def test_the_session_timeout_is_extended_while_the_node_runs(tmp_path: Path, gw: SolariGateway):
    conduit = LocalConduit(tmp_path / "conduit")
    code = "import time\nfor i in range(6):\n    print(i, flush=True)\n    time.sleep(0.5)"
    out, events = run(node(tmp_path, code), conduit, solari(gw, session_timeout_s=1.2))
    assert out.ok, out.describe()  # 3 s of work on a 1.2 s session: kept alive, never reaped
    assert gw.answers[("timeout", 200)] >= 3


@pytest.mark.slow
def test_secrets_reach_only_the_guest_commands_env(tmp_path: Path, gw: SolariGateway, s3_conduit):
    # The run's conduit is S3 with credentials; relaying, none of them reach the VM.
    secret = "sec-ret-value-77"
    spec = node(tmp_path, "import os; print(len(os.environ['TOKEN']))", secret_env={"TOKEN": secret})
    out, events = run(spec, s3_conduit, solari(gw))
    assert out.ok, out.describe()
    creds = s3_conduit.guest_credentials()
    assert creds
    hits = []
    for what, body in gw.bodies_seen():
        assert gw.api_key not in body, what
        for v in creds.values():
            assert v not in body, what
        if secret in body:
            hits.append(what)
    assert hits == ["rpc cmd.start"]
    start = next(f for f in gw.rpc_frames if f.get("method") == "cmd.start")
    assert start["params"]["env"]["TOKEN"] == secret
    assert not any(k.startswith("AWS_") for k in start["params"]["env"])
    assert json.loads(start["params"]["env"]["RESOLUTO_SECRET_ENV"]) == ["TOKEN"]
    # The relayed objects landed in S3 under the node's keys.
    assert "_manifest.json" in node_keys(s3_conduit, "run-solari", "n1")


@pytest.mark.slow
def test_direct_mode_the_guest_writes_to_s3_itself(tmp_path: Path, gw: SolariGateway, s3_conduit):
    spec = node(tmp_path, "open('o.txt','w').write('direct'); print('direct ok')", output_paths=["o.txt"])
    out, events = run(spec, s3_conduit, solari(gw, conduit_mode="direct"))
    assert out.ok, out.describe()
    assert workload_lines(events) == ["direct ok"]
    assert out.output_files["o.txt"].read_text() == "direct"
    # Nothing was relayed: the host never read an object out of the VM.
    assert not [f for f in gw.rpc_frames if f.get("method") == "fs.read"]
    start = next(f for f in gw.rpc_frames if f.get("method") == "cmd.start")
    assert start["params"]["env"]["RESOLUTO_STORE_KIND"] == "s3"


@pytest.mark.slow
def test_direct_mode_mints_scoped_store_credentials_per_node(
    tmp_path: Path, gw: SolariGateway, s3_conduit, moto_server
):
    rt = solari(
        gw,
        conduit_mode="direct",
        store_role_arn="arn:aws:iam::123456789012:role/resoluto-node",
        store_sts_endpoint=moto_server.moto_endpoint_url,
    )
    out, events = run(node(tmp_path, "print('scoped')"), s3_conduit, rt)
    assert out.ok, out.describe()
    env = next(f for f in gw.rpc_frames if f.get("method") == "cmd.start")["params"]["env"]
    host = s3_conduit.guest_credentials()
    assert env["AWS_SESSION_TOKEN"] and env["AWS_ACCESS_KEY_ID"] != host["AWS_ACCESS_KEY_ID"]
    assert host["AWS_SECRET_ACCESS_KEY"] not in json.dumps(gw.bodies_seen())
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"} <= set(
        json.loads(env["RESOLUTO_SECRET_ENV"])
    )


@pytest.mark.slow
def test_direct_mode_refuses_a_local_conduit(tmp_path: Path, gw: SolariGateway):
    from prefect_resoluto.runtimes.base import LaunchError

    conduit = LocalConduit(tmp_path / "c")
    with pytest.raises(LaunchError, match="needs an S3 conduit.*conduit_mode='relay'"):
        run(node(tmp_path, "pass"), conduit, solari(gw, conduit_mode="direct"))
    assert not [r for r in gw.requests if r.method == "POST"]
    assert conduit.list_prefix("run/") == []  # refused before anything was put


@pytest.mark.slow
def test_an_egress_allowlist_is_refused_before_anything_is_sent(tmp_path: Path, gw: SolariGateway):
    from prefect_resoluto.runtimes.base import LaunchError

    with pytest.raises(LaunchError, match="cannot enforce an egress allowlist"):
        run(node(tmp_path, "pass", egress=["pypi.org"]), LocalConduit(tmp_path / "c"), solari(gw))
    assert gw.requests == []


@pytest.mark.slow
def test_sweep_kills_only_the_labelled_vms(tmp_path: Path, gw: SolariGateway):
    from solari_sandbox import SyncSandboxClient

    rt = solari(gw)
    client = SyncSandboxClient(api_key=gw.api_key, base_url=gw.base_url)
    mine = [
        client.create(metadata={"resoluto.managed-by": "prefect-resoluto", "resoluto.run-id": "r-a"})
        for _ in range(2)
    ]
    other_run = client.create(metadata={"resoluto.managed-by": "prefect-resoluto", "resoluto.run-id": "r-b"})
    foreign = client.create(metadata={"resoluto.run-id": "r-a"})  # not ours: no managed-by
    assert rt.sweep({"resoluto.run-id": "r-a"}) == 2
    assert {s.id for s in gw.live()} == {other_run.id, foreign.id}
    assert {m.id for m in mine}.isdisjoint(gw.sandboxes)
    for h in [*mine, other_run, foreign]:
        h.close()
    client.close()


@pytest.mark.slow
def test_create_request_is_the_seeds_shape_and_what_the_sdk_sends(tmp_path: Path, gw: SolariGateway):
    from prefect_resoluto.node.spec import launch_spec
    from prefect_resoluto.runtimes.base import Resources

    conduit = LocalConduit(tmp_path / "conduit")
    spec = node(
        tmp_path,
        "pass",
        resources=Resources.from_quantities(memory="1536Mi", cpus="1.5"),
        labels={"team": "data"},
    )
    rt = solari(gw, lifecycle={"onTimeout": "kill"}, envs={"REGION": "lo"})
    rendered = rt.create_request(launch_spec(spec, conduit))
    assert rendered["cpu"] == 2 and rendered["memMb"] == 1536 and "diskGb" not in rendered
    assert all(isinstance(v, str) for v in rendered["metadata"].values())
    assert None not in rendered.values()
    out, _ = run(spec, conduit, rt)
    assert out.ok, out.describe()
    [sent] = [r.body for r in gw.requests if r.method == "POST" and r.raw_path == "/sandboxes"]

    def strip(b: dict) -> dict:
        return {**b, "metadata": {k: v for k, v in b["metadata"].items() if k != "resoluto.sandbox-id"}}

    assert strip(sent) == strip(rendered)
    assert sent["metadata"]["team"] == "data" and sent["metadata"]["resoluto.node-id"] == "n1"


def test_sandbox_block_maps_solari_fields_and_keeps_the_key_secret():
    from pydantic import SecretStr

    from prefect_resoluto.blocks import SandboxBlock

    block = SandboxBlock(
        runtime="solari",
        solari_base_url="http://127.0.0.1:1",
        solari_api_key=SecretStr("sk-b"),
        solari_template="py311",
        solari_conduit_mode="direct",
        min_isolation="vm",
    )
    cfg = block.to_config()
    assert cfg.runtime == "solari"
    assert cfg.runtime_options["template"] == "py311" and cfg.runtime_options["conduit_mode"] == "direct"
    assert "sk-b" not in repr(block) and "sk-b" not in repr(cfg)
    rt = get_runtime("solari", **cfg.runtime_options)
    assert rt._api_key == "sk-b" and "sk-b" not in repr(rt)  # type: ignore[attr-defined]


def test_without_configuration_availability_names_what_is_missing(monkeypatch):
    monkeypatch.delenv("SOLARI_API_KEY", raising=False)
    monkeypatch.delenv("SOLARI_BASE_URL", raising=False)
    assert "SOLARI_BASE_URL" in SolariRuntime().availability().why
    assert "SOLARI_API_KEY" in SolariRuntime(base_url="http://127.0.0.1:9").availability().why
    monkeypatch.setenv("SOLARI_API_KEY", "k-env")
    monkeypatch.setenv("SOLARI_BASE_URL", "http://127.0.0.1:9")
    rt = SolariRuntime()
    assert rt._api_key == "k-env" and rt.base_url == "http://127.0.0.1:9"  # type: ignore[attr-defined]
