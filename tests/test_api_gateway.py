"""The flow run's API gateway (issue 20): a sandboxed flow run holds no credential of the
worker's and can act only on its own run.

A real `prefect server` that requires an auth string (PREFECT_SERVER_API_AUTH_STRING),
one real `prefect worker start` on a `resoluto` pool, flows on gVisor; the gateway's
pieces against the same server (its rules, tokens, life) and, for the bearer header that
Prefect Cloud validates and a server cannot, against a loopback recorder that enforces it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import json
import re
import secrets
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from support.gateway_server import AUTH_PREFIX, AuthServer
from support.polling import wait_for
from support.prefect_cli import api_http, as_api
from test_worker import deploy, final_run, logs_with, run_logs

from guest_runner.refusal import REFUSED_HEADER, SETTING_HEADER

if TYPE_CHECKING:
    from prefect_resoluto.worker.gateway import ApiGateway

LOGGER_NAME = "prefect_resoluto.gateway"  # the gateway's lines in a run's logs

GVISOR = {"runtime": "gvisor", "min_isolation": "user-kernel"}


def credential_patterns() -> list[str]:
    """Regexes of the worker's credential in every form a client sends it: the auth string
    itself and its base64 (the Basic header). Only the fixed prefix is written here; the
    random part is matched by its shape, so the patterns themselves reveal nothing."""
    b64_prefix = base64.b64encode(AUTH_PREFIX.encode()).decode()  # 15 bytes: a whole number of groups
    return [re.escape(AUTH_PREFIX) + "[0-9a-f]{32}", re.escape(b64_prefix) + "[A-Za-z0-9+/]{40,}"]


@pytest.fixture(scope="module")
def auth_server(gateway_prefect: AuthServer) -> Iterator[AuthServer]:
    """The test process's server with an auth string, and its worker (support/gateway_server.py),
    as the current API for this module's tests."""
    with as_api(gateway_prefect.url, gateway_prefect.auth):
        yield gateway_prefect


@pytest.fixture
def server(auth_server: AuthServer) -> AuthServer:
    w = auth_server.worker
    assert w.proc.poll() is None, f"the module's worker died:\n{w.output()[-6000:]}"
    return auth_server


def parked_run() -> Any:
    """A flow run no worker picks up (no deployment): the object a hostile run aims at."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Scheduled

    @flow(name="victim")
    def victim() -> None:
        pass

    with get_client(sync_client=True) as c:
        return c.create_flow_run(victim, state=Scheduled())


def logs_with_all(run_id: Any, *texts: str) -> list[str]:
    """The run's logs once each of ``texts`` is in one of them: the flow's own lines come in
    the engine's batches, the gateway's one by one, in no set order."""

    def found() -> list[str] | None:
        logs = run_logs(run_id)
        return logs if all(any(t in m for m in logs) for t in texts) else None

    try:
        return wait_for(found, timeout=60, what=f"log lines with {texts}", max_delay=0.5)
    except AssertionError:
        raise AssertionError(f"the run's logs lack one of {texts}: {run_logs(run_id)}") from None


def gateway_port(run_id: Any) -> int:
    line = next(m for m in logs_with(run_id, "resoluto gateway (") if "resoluto gateway (" in m)
    return int(re.search(r"gateway \(127\.0\.0\.1:(\d+),", line).group(1))  # type: ignore[union-attr]


# --------------------------------------------------------------------------- through the worker, on gVisor


@pytest.mark.prefect
@pytest.mark.sandbox
def test_flows_behind_the_gateway_on_gvisor(gvisor, server: AuthServer, tmp_path: Path) -> None:
    """A hostile flow is refused every attempt, each logged, the objects it aimed at
    unchanged; an ordinary one (tasks, a retry, a tagged task, logs, an artifact, a result,
    an allowed block and variable) completes; neither finds the worker's credential, nor is
    it in any file of theirs on the host; each gateway dies with its run."""
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        DeploymentFilter,
        DeploymentFilterName,
        FlowRunFilter,
        FlowRunFilterParentTaskRunId,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )
    from prefect.variables import Variable
    from test_worker import schedule

    tag = uuid.uuid4().hex[:6]
    allowed_block, other_block, release = f"allowed-{tag}", f"other-{tag}", f"release_{tag}"
    Secret(value="allowed-value").save(allowed_block)
    Secret(value="other-value-9917").save(other_block)
    Variable.set(f"allowed_{tag}", "v-allowed")
    Variable.set(f"other_{tag}", "v-other-4410")
    with get_client(sync_client=True) as c:  # the ordinary flow's tagged task takes a slot of it
        c.create_concurrency_limit(tag="gateway-test", concurrency_limit=5)
    conduit = tmp_path / "conduit"
    jobs = {
        **GVISOR,
        "allowed_blocks": [f"secret/{allowed_block}"],
        "allowed_variables": [f"allowed_{tag}", release],
    }
    victim = parked_run()
    patterns = credential_patterns()
    hostile = schedule(
        deploy(server.worker.pool, "gateway_flows.py:hostile", conduit, **jobs),
        victim=str(victim.id),
        patterns=patterns,
        other_block=other_block,
        other_variable=f"other_{tag}",
        release=release,
    )
    ordinary = schedule(
        deploy(server.worker.pool, "gateway_flows.py:ordinary", conduit, **jobs),
        patterns=patterns,
        block=allowed_block,
        variable=f"allowed_{tag}",
    )

    # While the hostile run waits for its release: every file its sandbox has on the host.
    logs_with_all(hostile.id, "FACTS ")
    b64 = base64.b64encode(server.auth.encode()).decode().encode()
    for root in (conduit, server.worker.state_dir):
        for path in [p for p in root.rglob("*") if p.is_file()]:
            data = path.read_bytes()
            assert server.auth.encode() not in data and b64 not in data, path
    Variable.set(release, "go")

    # The hostile run: every attempt refused with the rule named, and the gateway says so in its logs.
    hostile_logs = logs_with_all(hostile.id, "ATTEMPT emitted an event")
    attempts = [m for m in hostile_logs if m.startswith("ATTEMPT ") and "emitted" not in m]
    assert len(attempts) == 9, "\n".join(hostile_logs)
    for m in attempts:
        if m.startswith(("ATTEMPT read a Secret block", "ATTEMPT read a variable")):
            assert ": refused 403 Prefect " in m and "is not readable inside a sandbox: add it to " in m, m
        else:
            assert ": refused 403 refused by the resoluto gateway (rule " in m, m
    hostile_facts = json.loads(next(m for m in hostile_logs if m.startswith("FACTS "))[6:])
    assert hostile_facts["credential_found"] == [], hostile_facts
    hostile_logs = logs_with_all(hostile.id, "(rule own-events)")
    warnings = [m for m in hostile_logs if m.startswith("resoluto gateway refused (rule ")]
    rules = {re.match(r"resoluto gateway refused \(rule ([\w-]+)\)", m).group(1) for m in warnings}  # type: ignore[union-attr]
    assert rules >= {
        "allowed-blocks",
        "allowed-variables",
        "own-flow-run",
        "own-runs-only",
        "not-this-run",
        "own-logs",
        "own-events",
    }, warnings
    assert not any("other-value-9917" in m or "v-other-4410" in m for m in hostile_logs)
    with get_client(sync_client=True) as c:
        assert c.read_flow_run(victim.id).state.type == victim.state.type  # unchanged
        assert run_logs(victim.id) == []
        assert "hostile-pool" not in {p.name for p in c.read_work_pools()}
        assert not c.read_deployments(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["hostile-deployment"]))
        )

    done = {r.id: final_run(r.id, server.worker) for r in (ordinary, hostile)}
    assert all(fr.state.is_completed() for fr in done.values()), (
        [fr.state for fr in done.values()],
        server.worker.output()[-6000:],
    )
    # The ordinary run, as under any worker: its tasks (one retried), logs, artifact, block, variable.
    ordinary_logs = logs_with_all(
        ordinary.id, "FACTS ", "flaky attempt 2", "resoluto gateway (", "sandbox rsl-"
    )
    facts = json.loads(next(m for m in ordinary_logs if m.startswith("FACTS "))[6:])
    assert facts["credential_found"] == [], facts
    assert facts["api_url"].startswith("http://prefect-api.resoluto.internal:"), facts
    assert facts["block_ok"] is True and facts["variable"] == "v-allowed" and facts["total"] == 13, facts
    assert facts["child"] == 14, facts  # the sub-flow ran as a flow run of its own, behind the same gateway
    with get_client(sync_client=True) as c:

        def completed_task_runs() -> list[Any] | None:
            found = c.read_task_runs(
                task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[ordinary.id]))
            )
            done = [tr for tr in found if tr.state is not None and tr.state.is_completed()]
            return done if len(done) == 4 else None  # flaky, add x2, and the sub-flow's tracking task

        task_runs = wait_for(
            completed_task_runs, timeout=60, what="the task runs' states (sent as events through the gateway)"
        )
        assert sorted(tr.name.split("-")[0] for tr in task_runs) == ["add", "add", "child", "flaky"], (
            task_runs
        )
        (sub,) = c.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_task_run_id=FlowRunFilterParentTaskRunId(
                    any_=[next(tr.id for tr in task_runs if tr.name.startswith("child"))]
                )
            )
        )
        assert sub.state.is_completed(), sub.state
        assert next(tr for tr in task_runs if tr.name.startswith("flaky")).run_count == 2
        artifacts = c.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[ordinary.id]))
        )
        assert [(a.key, a.data) for a in artifacts if a.key == "gateway-total"] == [
            ("gateway-total", "# total\n13")
        ], [(a.key, a.type, a.flow_run_id) for a in artifacts]
    # the run's first lines say it is behind the gateway, and what it may read
    first = next(m for m in ordinary_logs if "resoluto gateway (" in m)
    assert ordinary_logs.index(first) < min(
        i for i, m in enumerate(ordinary_logs) if m.startswith("sandbox rsl-")
    )
    assert (
        f"secret/{allowed_block}" in first
        and f"allowed_{tag}" in first
        and "the worker's auth string" in first
    ), first
    assert not [m for m in ordinary_logs if m.startswith("resoluto gateway refused")], ordinary_logs

    # Each gateway died with its run: no listener left on its port.
    for r in (ordinary, hostile):
        port = gateway_port(r.id)
        wait_for(lambda port=port: not _listening(port), timeout=60, what=f"the gateway on {port} to close")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex(("127.0.0.1", port)) == 0


# --------------------------------------------------------------------------- the gateway's pieces


@contextlib.contextmanager
def gateway_for(run: Any, **rules: Any) -> Iterator[ApiGateway]:
    from prefect_resoluto.worker.gateway import ApiGateway, Upstream
    from prefect_resoluto.worker.rules import RunRules

    with ApiGateway(str(run.id), Upstream.from_settings(), RunRules(flow_run_id=str(run.id), **rules)) as gw:
        yield gw


@pytest.mark.prefect
def test_a_token_is_for_its_own_run_and_dies_with_its_gateway(server: AuthServer) -> None:
    a, b = parked_run(), parked_run()
    with gateway_for(a) as ga, gateway_for(b) as gb:
        url = f"http://{ga.address}/api/flow_runs/{a.id}"
        basic = {"Authorization": "Basic " + base64.b64encode(ga.token.encode()).decode()}
        with api_http() as http:  # what reaches Prefect may meet its retryable 503
            assert http.get(url, headers=basic).json()["id"] == str(a.id)
            assert http.get(url, headers={"Authorization": f"Bearer {ga.token}"}).status_code == 200
        assert httpx.get(url).status_code == 401
        # run A's token at run B's gateway, for A's run or B's: refused
        for rid in (a.id, b.id):
            r = httpx.get(
                f"http://{gb.address}/api/flow_runs/{rid}", headers={"Authorization": f"Bearer {ga.token}"}
            )
            assert r.status_code == 401, r.text
        # the worker's own credential is no token of a gateway's either
        worker_basic = {"Authorization": "Basic " + base64.b64encode(server.auth.encode()).decode()}
        assert httpx.get(url, headers=worker_basic).status_code == 401
        port = ga.port
    assert not _listening(port)
    with pytest.raises(httpx.ConnectError):
        httpx.get(url, headers=basic)


@pytest.mark.prefect
def test_each_rule_refuses_with_its_name_and_a_warning_in_the_runs_logs(server: AuthServer) -> None:
    """The requests a flow holding the worker's credential could make, one per rule, sent
    with the run's token straight to its gateway (the real server behind it)."""
    from prefect.client.orchestration import get_client

    own, other = parked_run(), parked_run()
    with get_client(sync_client=True) as c:
        other_task = c.create_task_run(task=_a_task(), flow_run_id=other.id, dynamic_key="0")
    task_state = other_task.state.type if other_task.state else None
    with gateway_for(own, deployment_id=None, work_pool_name=server.worker.pool) as gw:
        h = {"Authorization": f"Bearer {gw.token}"}
        base = f"http://{gw.address}/api"
        now = "2026-01-01T00:00:00Z"
        cases = [
            ("GET", f"/flow_runs/{other.id}", None, "own-flow-run"),
            ("POST", f"/flow_runs/{other.id}/set_state", {"state": {"type": "COMPLETED"}}, "own-flow-run"),
            ("DELETE", f"/flow_runs/{own.id}", None, "own-flow-run"),
            ("PATCH", f"/flow_runs/{own.id}", {"infrastructure_pid": "process:x"}, "own-flow-run-fields"),
            ("POST", "/flow_runs/filter", {}, "own-runs-only"),
            (
                "POST",
                "/flow_runs/filter",
                {"flow_runs": {"id": {"any_": [str(own.id), str(other.id)]}}},
                "own-runs-only",
            ),
            (
                "POST",
                "/task_runs/",
                {"flow_run_id": str(other.id), "task_key": "k", "dynamic_key": "1", "name": "n"},
                "own-task-runs",
            ),
            (
                "POST",
                f"/task_runs/{other_task.id}/set_state",
                {"state": {"type": "COMPLETED"}},
                "own-task-runs",
            ),
            ("POST", "/task_runs/filter", {}, "own-task-runs"),
            (
                "POST",
                "/logs/",
                [{"name": "x", "level": 20, "message": "m", "timestamp": now, "flow_run_id": str(other.id)}],
                "own-logs",
            ),
            (
                "POST",
                "/logs/",
                [
                    {
                        "name": "x",
                        "level": 20,
                        "message": "m",
                        "timestamp": now,
                        "flow_run_id": str(own.id),
                        "task_run_id": str(other_task.id),
                    }
                ],
                "own-logs",
            ),
            (
                "POST",
                "/artifacts/",
                {"type": "markdown", "data": "x", "flow_run_id": str(other.id)},
                "own-artifacts",
            ),
            ("GET", f"/deployments/{uuid.uuid4()}", None, "own-deployments"),
            ("POST", "/deployments/", {"name": "d", "flow_id": str(own.flow_id)}, "not-this-run"),
            ("POST", "/work_pools/", {"name": "p", "type": "process"}, "not-this-run"),
            ("GET", "/block_types/slug/secret/block_documents/name/anything", None, "allowed-blocks"),
            ("POST", "/block_documents/filter", {}, "read-named-only"),
            ("GET", "/variables/name/anything", None, "allowed-variables"),
            ("POST", "/variables/filter", {}, "read-named-only"),
            ("POST", "/events/filter", {}, "not-this-run"),
            ("GET", "/work_pools/some-other-pool", None, "own-work_pools"),
            ("POST", "/flow_runs/", {"flow_id": str(own.flow_id), "name": "x"}, "own-sub-flows"),
            (
                "POST",
                "/flow_runs/",
                {"flow_id": str(own.flow_id), "parent_task_run_id": str(other_task.id)},
                "own-sub-flows",
            ),
            ("GET", f"/flows/{uuid.uuid4()}", None, "own-flows"),
        ]
        for method, path, body, rule in cases:
            r = httpx.request(method, base + path, headers=h, json=body)
            assert r.status_code == 403, (method, path, r.status_code, r.text)
            # the rule in a header the gateway sets (its mark: guest_runner.engine raises on it)
            assert r.headers.get(REFUSED_HEADER) == rule, (method, path, r.headers)
            setting = {"allowed-blocks": "allowed_blocks", "allowed-variables": "allowed_variables"}.get(rule)
            assert r.headers.get(SETTING_HEADER) == setting, (method, path, r.headers)
            if setting:  # the caller is told the setting that would allow it, as a sandboxed task is
                assert f"is not readable inside a sandbox: add it to {setting} (" in r.json()["detail"], (
                    r.text
                )
            else:
                assert f"(rule {rule})" in r.json()["detail"], (method, path, r.text)
        # a path a URL library would fold (http.client sends it as written; httpx would not)
        conn = http.client.HTTPConnection(gw.host, gw.port, timeout=30)
        conn.request("GET", f"/api/flow_runs/{own.id}/../../work_pools/", headers=h)
        folded = conn.getresponse()
        assert folded.status == 403 and b"(rule path)" in folded.read()
        conn.close()
        cases.append(("GET", "folded", None, "path"))
        assert gw.refused == len(cases)
        # what the run does need passes: itself, its own logs, its pool without the pool's defaults
        with api_http() as api:  # what reaches Prefect may meet its retryable 503
            assert api.get(f"{base}/flow_runs/{own.id}", headers=h).status_code == 200
            pool = api.get(f"{base}/work_pools/{server.worker.pool}", headers=h).json()
            assert pool["name"] == server.worker.pool and pool["base_job_template"] == {}, pool
            log = [
                {
                    "name": "t",
                    "level": 20,
                    "message": "own line",
                    "timestamp": now,
                    "flow_run_id": str(own.id),
                }
            ]
            assert api.post(f"{base}/logs/", headers=h, json=log).status_code == 201
    warnings = wait_for(
        lambda: (w := _logs_named(own.id, LOGGER_NAME)) and len(w) >= len(cases) and w,
        timeout=60,
        what="the gateway's warnings in the run's logs",
    )
    assert all(m.startswith("resoluto gateway refused (rule ") for m in warnings), warnings
    assert run_logs(other.id) == []
    with get_client(sync_client=True) as c:
        assert c.read_flow_run(other.id).state.is_scheduled()
        after = c.read_task_run(other_task.id).state
        assert (after.type if after else None) == task_state


@pytest.mark.prefect
def test_the_events_websocket_admits_the_runs_own_events_only(server: AuthServer) -> None:
    """Task-run states travel as events: the run's own pass (under the server's auth string
    upstream), an event about another run is dropped and logged."""
    from websockets.asyncio.client import connect
    from websockets.typing import Subprotocol

    own, other = parked_run(), parked_run()

    def event(resource: str, related: list[dict[str, str]]) -> str:
        return json.dumps(
            {
                "id": str(uuid.uuid4()),
                "occurred": "2026-01-01T00:00:00Z",
                "event": "prefect.test.event",
                "resource": {"prefect.resource.id": resource},
                "related": related,
                "payload": {},
            }
        )

    async def talk(gw: ApiGateway, token: str) -> list[Any]:
        async with connect(f"ws://{gw.address}/api/events/in", subprotocols=[Subprotocol("prefect")]) as ws:
            await ws.send(json.dumps({"type": "auth", "token": token}))
            reply = json.loads(await ws.recv())
            if reply.get("type") != "auth_success":
                return [reply]
            await ws.send(event(f"prefect.flow-run.{own.id}", []))
            await ws.send(event(f"prefect.flow-run.{other.id}", []))
            await ws.send(
                event(
                    f"prefect.flow-run.{own.id}",
                    [{"prefect.resource.id": f"prefect.flow-run.{other.id}", "prefect.resource.role": "x"}],
                )
            )
            await ws.send(
                event(
                    f"prefect.task-run.{uuid.uuid4()}",
                    [
                        {
                            "prefect.resource.id": f"prefect.flow-run.{other.id}",
                            "prefect.resource.role": "flow-run",
                        }
                    ],
                )
            )
            return [reply]

    with gateway_for(own) as gw:
        with pytest.raises(Exception, match="1008|Invalid token"):
            asyncio.run(talk(gw, "not-the-token"))
        assert asyncio.run(talk(gw, gw.token)) == [{"type": "auth_success"}]
        wait_for(lambda: gw.refused >= 3, timeout=30, what="three refusals")
        assert gw.refused == 3
    warnings = wait_for(
        lambda: (w := _logs_named(own.id, LOGGER_NAME)) and len(w) >= 3 and w,
        timeout=60,
        what="the refusals in the run's logs",
    )
    assert all("(rule own-events)" in m for m in warnings), warnings


@pytest.mark.prefect
def test_the_events_subscription_is_narrowed_to_the_run(server: AuthServer) -> None:
    """The engine's suspension observer subscribes to every run's Suspended events: through
    the gateway it follows its own run only; one naming another run is closed and logged."""
    from websockets.asyncio.client import connect
    from websockets.typing import Subprotocol

    own, other = parked_run(), parked_run()

    async def subscribe(gw: ApiGateway, flt: dict[str, Any]) -> str:
        async with connect(f"ws://{gw.address}/api/events/out", subprotocols=[Subprotocol("prefect")]) as ws:
            await ws.send(json.dumps({"type": "auth", "token": gw.token}))
            assert json.loads(await ws.recv()) == {"type": "auth_success"}
            before = gw.subscriptions
            await ws.send(json.dumps({"type": "filter", "filter": flt}))
            recv = asyncio.ensure_future(ws.recv())
            while not recv.done() and gw.subscriptions == before:  # relayed upstream, or closed
                await asyncio.wait({recv}, timeout=0.05)
            if recv.done():
                return f"closed: {recv.exception()}"
            recv.cancel()
            return "relayed"

    with gateway_for(own) as gw:
        narrowed, refusal = gw.rules.events_out_filter(
            {"type": "filter", "filter": {"event": {"name": ["prefect.flow-run.Suspended"]}}}
        )
        assert refusal is None and narrowed["filter"]["resource"]["id"] == [f"prefect.flow-run.{own.id}"]
        assert asyncio.run(subscribe(gw, {"event": {"name": ["prefect.flow-run.Suspended"]}})) == "relayed"
        closed = asyncio.run(subscribe(gw, {"resource": {"id": [f"prefect.flow-run.{other.id}"]}}))
        assert closed.startswith("closed") and "own-events-out" in closed, closed
        assert gw.refused == 1
    assert wait_for(
        lambda: _logs_named(own.id, LOGGER_NAME), timeout=60, what="the refusal in the run's logs"
    ) == [
        "resoluto gateway refused (rule own-events-out): a subscription may follow only this flow run's events"
    ]


def _a_task() -> Any:
    from prefect import task

    @task(name="other-task")
    def t() -> None:
        pass

    return t


def _logs_named(run_id: Any, name: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    with get_client(sync_client=True) as c:
        logs = c.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), sort=LogSort.TIMESTAMP_ASC
        )
    return [log.message for log in logs if log.name == name]


# --------------------------------------------------------------------------- bearer keys (Prefect Cloud)


@contextlib.contextmanager
def bearer_recorder(key: str) -> Iterator[tuple[str, list[tuple[str, str | None]]]]:
    """A loopback API that, as Prefect Cloud does, answers only ``Authorization: Bearer <key>``
    (401 otherwise), on HTTP and on the events websocket's upgrade; it records what it saw."""
    from websockets.asyncio.server import serve
    from websockets.datastructures import Headers
    from websockets.http11 import Response

    seen: list[tuple[str, str | None]] = []
    ready = threading.Event()
    stop: dict[str, Any] = {}

    def respond(status: int, body: bytes) -> Response:
        return Response(
            status, "", Headers({"Content-Type": "application/json", "Content-Length": str(len(body))}), body
        )

    def check(connection: Any, request: Any) -> Response | None:
        auth = request.headers.get("Authorization")
        seen.append((request.path, auth))
        if auth != f"Bearer {key}":
            return respond(401, b'{"detail": "bad key"}')
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return None  # on to the websocket handshake
        return respond(200, json.dumps({"path": request.path}).encode())

    async def events(ws: Any) -> None:
        async for message in ws:
            seen.append(("event", message))

    async def main() -> None:
        async with serve(events, "127.0.0.1", 0, process_request=check) as srv:
            stop["loop"], stop["future"] = (
                asyncio.get_running_loop(),
                asyncio.get_running_loop().create_future(),
            )
            stop["port"] = srv.sockets[0].getsockname()[1]
            ready.set()
            await stop["future"]

    t = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    t.start()
    assert ready.wait(30)
    try:
        yield f"http://127.0.0.1:{stop['port']}/api/accounts/a/workspaces/w", seen
    finally:
        stop["loop"].call_soon_threadsafe(stop["future"].set_result, None)
        t.join(timeout=10)


def test_a_bearer_key_is_sent_as_exactly_the_header_cloud_validates() -> None:
    from websockets.asyncio.client import connect
    from websockets.typing import Subprotocol

    from prefect_resoluto.worker.gateway import ApiGateway, Upstream
    from prefect_resoluto.worker.rules import RunRules

    key = "pnu_" + secrets.token_hex(16)
    run_id = str(uuid.uuid4())
    with bearer_recorder(key) as (api, seen):
        upstream = Upstream(api_url=api, api_key=key)
        assert upstream.scheme == "bearer" and key not in repr(upstream)
        with ApiGateway(run_id, upstream, RunRules(flow_run_id=run_id)) as gw:
            r = httpx.get(
                f"http://{gw.address}/api/flow_runs/{run_id}", headers={"Authorization": f"Bearer {gw.token}"}
            )
            assert r.status_code == 200 and r.json() == {
                "path": f"/api/accounts/a/workspaces/w/flow_runs/{run_id}"
            }

            async def send_event() -> None:
                async with connect(
                    f"ws://{gw.address}/api/events/in", subprotocols=[Subprotocol("prefect")]
                ) as ws:
                    await ws.send(json.dumps({"type": "auth", "token": gw.token}))
                    assert json.loads(await ws.recv()) == {"type": "auth_success"}
                    await ws.send(
                        json.dumps(
                            {
                                "id": str(uuid.uuid4()),
                                "occurred": "2026-01-01T00:00:00Z",
                                "event": "e",
                                "resource": {"prefect.resource.id": f"prefect.flow-run.{run_id}"},
                                "related": [],
                            }
                        )
                    )

            asyncio.run(send_event())
            wait_for(lambda: any(p == "event" for p, _ in seen), timeout=30, what="the event upstream")
            token = gw.token
        # the recorder enforces what it checks: the run's token, or the key in another form, is refused
        for wrong in (f"Bearer {token}", f"bearer {key}", f"Basic {key}"):
            assert httpx.get(api + "/x", headers={"Authorization": wrong}).status_code == 401
        seen[:] = [(p, a) for p, a in seen if p != "/api/accounts/a/workspaces/w/x"]
    auths = {a for p, a in seen if p != "event"}
    assert auths == {f"Bearer {key}"}, seen  # the key, exactly; never the run's token
    assert not any(token in (a or "") for _, a in seen)


def test_the_pools_form_names_what_a_run_may_read() -> None:
    from prefect_resoluto.worker.worker import ResolutoJobConfiguration, ResolutoWorker

    template = ResolutoWorker.get_default_base_job_template()
    props = template["variables"]["properties"]
    for name in ("allowed_blocks", "allowed_variables", "api_gateway_address"):
        assert props[name].get("description"), name
        assert template["job_configuration"][name] == "{{ " + name + " }}"
    assert props["allowed_blocks"]["type"] == "array"
    with pytest.raises(ValueError, match="block-type-slug/name"):
        ResolutoJobConfiguration(allowed_blocks=["just-a-name"])


def test_doctors_probe_sees_a_gateway_refuse_forward_and_close(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect_resoluto.worker import gateway as api_gateway

    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "x:y")
    report = api_gateway.probe()
    assert report["ok"], report
    assert report["credential"] == "PREFECT_API_AUTH_STRING (basic auth)"
    assert "x:y" not in json.dumps(report)
    # a probe that cannot bind says why instead of taking doctor down
    monkeypatch.setattr(
        api_gateway.ApiGateway, "start", lambda self: (_ for _ in ()).throw(OSError("no port"))
    )
    broken = api_gateway.probe()
    assert not broken["ok"] and "no port" in broken["why"]


@contextlib.contextmanager
def request_recorder() -> Iterator[tuple[str, list[tuple[str, dict[str, str], bytes]]]]:
    """A loopback API that answers every request 200 ``{}`` and records its method and path,
    headers (lower-cased names) and body, as they reached it."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[tuple[str, dict[str, str], bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def _any(self) -> None:
            n = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(n) if n else b""
            seen.append(
                (f"{self.command} {self.path}", {k.lower(): v for k, v in self.headers.items()}, body)
            )
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_GET = do_POST = do_PATCH = do_DELETE = _any

        def log_message(self, *args: Any) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/api", seen
    finally:
        srv.shutdown()
        t.join(timeout=10)


def test_the_api_gets_only_bytes_the_gateway_judged() -> None:
    """A body on a GET (never the engine's) is not forwarded; a Content-Encoding the run sets
    is not either: the API reads exactly the bytes judged, as JSON."""
    from prefect_resoluto.worker.gateway import ApiGateway, Upstream
    from prefect_resoluto.worker.rules import RunRules

    run_id = str(uuid.uuid4())
    with (
        request_recorder() as (api, seen),
        ApiGateway(run_id, Upstream(api_url=api), RunRules(flow_run_id=run_id)) as gw,
    ):
        h = {"Authorization": f"Bearer {gw.token}"}
        r = httpx.request(
            "GET", f"http://{gw.address}/api/flow_runs/{run_id}", headers=h, content=b'{"smuggled": 1}'
        )
        assert r.status_code == 200, r.text
        r = httpx.patch(
            f"http://{gw.address}/api/flow_runs/{run_id}",
            headers={**h, "content-type": "application/json", "content-encoding": "gzip"},
            content=json.dumps({"name": "n"}).encode(),
        )
        assert r.status_code == 200, r.text
    (get, get_headers, get_body), (patch, patch_headers, patch_body) = seen
    assert get == f"GET /api/flow_runs/{run_id}" and get_body == b"", seen
    assert patch == f"PATCH /api/flow_runs/{run_id}" and json.loads(patch_body) == {"name": "n"}, seen
    assert "content-encoding" not in patch_headers and "content-encoding" not in get_headers, seen
