"""Issue 29: a hostile flow run stays inside its sandbox.

A real `prefect server` with an auth string, a real `resoluto` worker, and the attacks of
the issue: from inside a gVisor sandbox through the worker and the gateway (the planter
flow), planted on the pool directly (what the worker must refuse whoever planted it), and
the finer points straight at a run's gateway with the real server behind it.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.polling import scaled, wait_for
from support.prefect_cli import api_http
from test_api_gateway import (  # noqa: F401 - the module's server and worker, as there
    GVISOR,
    auth_server,
    gateway_for,
    logs_with_all,
    parked_run,
    server,
)
from test_worker import create_pool, deploy, final_run, run_logs, running_worker

from prefect_resoluto.worker import gateway as api_gateway
from prefect_resoluto.worker import relay_limits

PROCESS = {"runtime": "process", "min_isolation": "none"}


def _admin_post(path: str, body: dict[str, Any]) -> httpx.Response:
    """A raw request with the worker's own credential (the test is the operator here)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        return c._client.post(path, json=body)


def _task_run(flow_run_id: Any, tags: list[str] | None = None) -> Any:
    from prefect import task
    from prefect.client.orchestration import get_client

    @task(name="a-task", tags=tags or [])
    def t() -> None:
        pass

    with get_client(sync_client=True) as c:
        return c.create_task_run(task=t, flow_run_id=flow_run_id, dynamic_key=uuid.uuid4().hex)


# --------------------------------------------------------------------------- from inside gVisor


@pytest.mark.prefect
@pytest.mark.sandbox
def test_a_hostile_run_in_gvisor_plants_lists_claims_and_takes_slots_in_vain(gvisor, server, tmp_path):  # noqa: F811
    """Findings 1-5 from inside the sandbox: planting a run on the pool (with a host command,
    with a templated Secret), listing every run, claiming another by its idempotency key,
    taking another tag's slots. Each is refused naming what it sent, nothing is planted,
    nothing ran on the host, the victim is unchanged; the run's own tag slot still passes."""
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentTaskRunId
    from test_worker import schedule

    tag = uuid.uuid4().hex[:6]
    marker = tmp_path / "planted-command-ran"
    Secret(value="planted-9931").save(f"plant-{tag}")
    victim = parked_run()
    key = f"victim-key-{tag}"
    made = _admin_post("/flow_runs/", {"flow_id": str(victim.flow_id), "idempotency_key": key})
    assert made.status_code == 201, made.text
    victim_id = made.json()["id"]
    with get_client(sync_client=True) as c:
        victim_before = c.read_flow_run(victim_id)
    other_tag = f"theirs-{tag}"
    with get_client(sync_client=True) as c:
        c.create_concurrency_limit(tag=other_tag, concurrency_limit=1)
    run = schedule(
        deploy(server.worker.pool, "gateway_flows.py:planter", tmp_path / "conduit", **GVISOR),
        pool=server.worker.pool,
        marker=str(marker),
        secret_block=f"plant-{tag}",
        other_tag=other_tag,
        victim_flow=str(victim.flow_id),
        victim_key=key,
    )
    done = final_run(run.id, server.worker)
    assert done.state.is_completed(), (done.state, server.worker.output()[-6000:])
    logs = logs_with_all(run.id, "OWN TAG ")
    attempts = {m.split(":", 1)[0][8:]: m.split(": ", 1)[1] for m in logs if m.startswith("ATTEMPT ")}
    assert len(attempts) == 7, logs
    expected = {
        "plant a run on the pool": ("own-sub-flows", "job_variables", "work_pool_name"),
        "plant a run without a pool field, but scheduled": ("own-sub-flows", "Pending, not 'SCHEDULED'"),
        "template a secret": ("own-sub-flows", "job_variables"),
        "list every run": ("own-runs-only", "'or_'"),
        "list by parent, widened": ("own-runs-only", "'or_'"),
        "claim another run by its idempotency key": ("own-sub-flows", "idempotency_key"),
        "take another tag's slots": ("own-task-concurrency", other_tag),
    }
    for name, (rule, *said) in expected.items():
        answer = attempts[name]
        assert answer.startswith("403 ") and f"(rule {rule})" in answer, (name, answer)
        assert all(s in answer for s in said), (name, answer)
    assert next(m for m in logs if m.startswith("OWN TAG ")).startswith("OWN TAG 2"), logs
    assert "planted-9931" not in "\n".join(logs)
    assert not marker.exists()
    with get_client(sync_client=True) as c:
        planted = c.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_task_run_id=FlowRunFilterParentTaskRunId(is_null_=False))
        )
        assert [fr for fr in planted if fr.flow_id == done.flow_id] == []
        after = c.read_flow_run(victim_id)
        assert (after.state_type, after.updated) == (victim_before.state_type, victim_before.updated)
        limit = c.read_global_concurrency_limit_by_name(f"tag:{other_tag}")
        assert limit.active_slots == 0, limit
    assert run_logs(victim_id) == []


# --------------------------------------------------------------------------- planted on the pool


@pytest.mark.prefect
def test_the_worker_refuses_a_run_without_a_deployment_before_launching_anything(server, tmp_path):  # noqa: F811
    """Finding 1 at the worker: a run planted on the pool with a host command in its job
    variables (by anyone who can create a run) is Crashed with the reason, nothing launched."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Scheduled

    @flow(name="planted")
    def planted() -> None:
        pass

    own = parked_run()
    parent = _task_run(own.id)
    markers = {k: tmp_path / f"ran-{k}" for k in ("bare", "sub")}
    runs = {}
    with get_client(sync_client=True) as c:
        for kind, marker in markers.items():
            runs[kind] = c.create_flow_run(
                planted,
                state=Scheduled(),
                work_pool_name=server.worker.pool,
                parent_task_run_id=parent.id if kind == "sub" else None,
                job_variables={**PROCESS, "command": f"touch {marker}"},
            )
    for kind, fr in runs.items():
        done = final_run(fr.id, server.worker)
        message = done.state.message or ""
        assert done.state.is_crashed(), (kind, done.state, server.worker.output()[-4000:])
        assert "refuses flow run" in message and "it has no deployment" in message, message
        assert "nothing was launched" in message, message
        if kind == "sub":
            assert str(parent.id) in message, message
    assert not any(m.exists() for m in markers.values())


@pytest.mark.prefect
def test_a_runs_own_job_variables_set_only_what_the_pool_lets_it(server, tmp_path):  # noqa: F811
    """Finding 2 at the worker: a run of a deployment (run_deployment, a custom run) may set
    the pool's run_overridable keys only, never a template the worker would resolve with its
    own credential, never what chooses the isolation or the command."""
    from prefect.blocks.system import Secret
    from prefect.deployments import run_deployment

    tag = uuid.uuid4().hex[:6]
    Secret(value="templated-5521").save(f"tmpl-{tag}")
    dep = deploy(server.worker.pool, "worker_flows.py:where_am_i", tmp_path / "conduit", **PROCESS)
    cases = {
        "template": ({"env": {"X": "{{ prefect.blocks.secret.tmpl-" + tag + " }}"}}, "hold templates at"),
        "command": (
            {"command": f"touch {tmp_path / 'ran'}"},
            "which only the pool and the deployment choose",
        ),
        "floor": ({"min_isolation": "none"}, "which only the pool and the deployment choose"),
        "grants": ({"allowed_blocks": [f"secret/tmpl-{tag}"]}, "which only the pool and the deployment"),
        "off the list": ({"stream_output": False}, "does not let a run override"),
    }
    runs = {k: run_deployment(dep, job_variables=v, timeout=0) for k, (v, _) in cases.items()}
    allowed = run_deployment(dep, job_variables={"memory": "1Gi", "env": {"PLAIN": "1"}}, timeout=0)
    for kind, fr in runs.items():
        done = final_run(fr.id, server.worker)
        assert done.state.is_crashed(), (kind, done.state)
        assert cases[kind][1] in (done.state.message or ""), (kind, done.state.message)
        assert "templated-5521" not in json.dumps(run_logs(fr.id))
    assert not (tmp_path / "ran").exists()
    assert final_run(allowed.id, server.worker).state.is_completed()


@pytest.mark.prefect
def test_the_pools_floor_is_not_lowered_by_a_deployment(tmp_path, server):  # noqa: F811
    pool = create_pool(cli=False, floor=None)  # the built-in floor: user-kernel
    with running_worker(pool, tmp_path) as worker:
        dep = deploy(pool, "worker_flows.py:where_am_i", tmp_path / "conduit", **PROCESS)
        from prefect.deployments import run_deployment

        done = final_run(run_deployment(dep, timeout=0).id, worker)
    assert done.state.is_crashed(), done.state
    assert "below the pool's floor 'user-kernel'" in (done.state.message or ""), done.state.message


# --------------------------------------------------------------------------- at the gateway


def _post(url: str, **kw: Any) -> httpx.Response:
    """A request through a gateway, retried as Prefect's client retries a busy server's 503."""
    with api_http() as c:
        return c.post(url, **kw)


def _get(url: str, **kw: Any) -> httpx.Response:
    with api_http() as c:
        return c.get(url, **kw)


def _h(gw: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {gw.token}"}


@pytest.mark.prefect
def test_listings_are_the_gateways_own_and_name_only_the_runs_ids(server):  # noqa: F811
    own, other = parked_run(), parked_run()
    with gateway_for(own) as gw:
        base = f"http://{gw.address}/api"
        for body in (
            {"flow_runs": {"operator": "or_", "id": {"any_": [str(own.id)]}, "name": {"like_": ""}}},
            {"flow_runs": {"id": {"any_": [str(own.id)]}, "name": {"like_": ""}}},
            {"flow_runs": {"id": {"any_": [str(own.id)], "not_any_": [str(other.id)]}}},
            {"flow_runs": {"id": {"any_": [str(own.id)]}}, "flows": {"name": {"like_": ""}}},
            {"flow_runs": {"id": {"any_": [str(own.id), str(other.id)]}}},
        ):
            r = _post(f"{base}/flow_runs/filter", headers=_h(gw), json=body)
            assert r.status_code == 403 and "(rule own-runs-only)" in r.text, (body, r.text)
        r = _post(
            f"{base}/flow_runs/filter",
            headers=_h(gw),
            json={"flow_runs": {"id": {"any_": [str(own.id)]}}, "offset": 0},
        )
        assert r.status_code == 200 and [fr["id"] for fr in r.json()] == [str(own.id)], r.text


class _NoApi:
    """The rules' API when the ids named are all the run's already: never asked."""

    async def upstream_get(self, rel: str) -> tuple[int, Any]:
        raise AssertionError(f"asked the API for {rel}")

    async def upstream_post(self, rel: str, body: Any) -> tuple[int, Any]:
        raise AssertionError(f"asked the API for {rel}")


def test_a_run_cannot_lease_concurrency_slots_for_longer_than_the_engine_does() -> None:
    """A run's own task runs take slots of their tags' limits; a lease it sends for a year
    would hold them long after the run is gone: the gateway forwards at most the engine's
    300 s (renewed while the task runs), and a lease that is no number of seconds not at all."""
    from prefect_resoluto.worker.bodies import MAX_LEASE_SECONDS, Rebuilt, Refusal, engine_fields

    body = {"names": ["tag:db"], "slots": 1, "mode": "concurrency", "holder": {"type": "task_run", "id": "x"}}
    for path in (
        "/v2/concurrency_limits/increment-with-lease",
        f"/v2/concurrency_limits/leases/{uuid.uuid4()}/renew",
    ):
        fields = body if "increment" in path else {}
        year = engine_fields("POST", path, {**fields, "lease_duration": 365 * 86400})
        assert isinstance(year, Rebuilt) and year.body["lease_duration"] == MAX_LEASE_SECONDS, year
        short = engine_fields("POST", path, {**fields, "lease_duration": 30})
        assert isinstance(short, Rebuilt) and short.body["lease_duration"] == 30, short
        for bad in ("forever", True, -1, 0, None):
            refused = engine_fields("POST", path, {**fields, "lease_duration": bad})
            assert isinstance(refused, Refusal), (bad, refused)


def test_a_listing_the_gateway_builds_asks_for_no_more_rows_than_can_match() -> None:
    """Issue 39: the limit a run sends is its own, the one forwarded the gateway's: a listing
    by ids asks for at most one row per id named, whatever limit the run sent (a huge one,
    none); by parent task runs at most Prefect's own page (the engine asks for one)."""
    import asyncio

    from prefect_resoluto.worker.bodies import MAX_LISTED, Rebuilt
    from prefect_resoluto.worker.rules import RunRules

    own = [str(uuid.uuid4()) for _ in range(3)]
    parents = [str(uuid.uuid4()) for _ in range(2)]
    rules = RunRules(flow_run_id=own[0], flow_runs=set(own), task_runs=set(parents))

    def forwarded(body: dict[str, Any]) -> Any:
        verdict = asyncio.run(rules.check_http("POST", "/flow_runs/filter", {}, body, _NoApi()))
        assert isinstance(verdict, Rebuilt), verdict
        return verdict.body["limit"]

    by_id = {"flow_runs": {"id": {"any_": own}}}
    assert forwarded({**by_id, "limit": 1_000_000}) == 3
    assert forwarded(by_id) == 3
    assert forwarded({**by_id, "limit": 2}) == 2
    assert forwarded({"flow_runs": {"id": {"any_": own[:1]}}, "limit": 200, "offset": 0}) == 1
    by_parent = {"flow_runs": {"parent_task_run_id": {"any_": parents}}}
    assert forwarded({**by_parent, "limit": 1, "sort": "EXPECTED_START_TIME_DESC"}) == 1  # the engine's
    assert forwarded(by_parent) == MAX_LISTED
    assert forwarded({**by_parent, "limit": 1_000_000}) == MAX_LISTED


@pytest.mark.prefect
def test_a_sub_flow_is_pending_in_no_pool_and_only_a_201_is_claimed(server):  # noqa: F811
    """Finding 4 and the sub-flow's body: the run's own sub-flow is created from the body the
    gateway built (no pool, queue, job variables; Pending), and claimed from its 201; an
    idempotency key is refused, and a 200 (an existing object) is never claimed."""
    from prefect.client.orchestration import get_client

    own = parked_run()
    parent = _task_run(own.id)
    with gateway_for(own, flow_id=str(own.flow_id)) as gw:
        base = f"http://{gw.address}/api"
        body = {
            "flow_id": str(own.flow_id),
            "parent_task_run_id": str(parent.id),
            "state": {
                "type": "PENDING",
                "name": "Pending",
                "message": None,
                "state_details": {},
                "data": None,
            },
            "parameters": {"x": 1},
            "tags": ["t"],
            "empirical_policy": {"retries": None, "retry_delay": 0},
        }
        r = _post(f"{base}/flow_runs/", headers=_h(gw), json={**body, "idempotency_key": "k"})
        assert r.status_code == 403 and "idempotency_key" in r.text, r.text
        r = _post(f"{base}/flow_runs/", headers=_h(gw), json=body)
        assert r.status_code == 201, r.text
        sub = r.json()["id"]
        assert sub in gw.rules.flow_runs
        assert _get(f"{base}/flow_runs/{sub}", headers=_h(gw)).status_code == 200
        gw.rules.note_response("POST", "/flow_runs", body, 200, {"id": str(uuid.uuid4())})
        assert len(gw.rules.flow_runs) == 2  # itself and the sub-flow: the 200's object is not the run's
    with get_client(sync_client=True) as c:
        fr = c.read_flow_run(sub)
    assert fr.state.is_pending() and fr.work_queue_id is None and fr.work_pool_name is None, fr
    assert fr.job_variables in ({}, None) and fr.idempotency_key is None and fr.deployment_id is None


@pytest.mark.prefect
def test_a_runs_slots_are_its_own_task_runs_tags_only(server):  # noqa: F811
    from prefect.client.orchestration import get_client

    own = parked_run()
    tag = uuid.uuid4().hex[:6]
    with get_client(sync_client=True) as c:
        c.create_concurrency_limit(tag=f"theirs-{tag}", concurrency_limit=1)
    mine = _task_run(own.id, tags=[f"mine-{tag}"])
    with gateway_for(own) as gw:
        url = f"http://{gw.address}/api/v2/concurrency_limits/increment-with-lease"

        def ask(name: str) -> httpx.Response:
            holder = {"type": "task_run", "id": str(mine.id)}
            body = {"names": [f"tag:{name}"], "slots": 1, "mode": "concurrency", "holder": holder}
            return _post(url, headers=_h(gw), json={**body, "lease_duration": 60})

        theirs = ask(f"theirs-{tag}")
        assert theirs.status_code == 403 and "(rule own-task-concurrency)" in theirs.text, theirs.text
        assert ask(f"mine-{tag}").status_code == 200
    with get_client(sync_client=True) as c:
        assert c.read_global_concurrency_limit_by_name(f"tag:theirs-{tag}").active_slots == 0


@pytest.fixture
def quick_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api_gateway, "HEAD_TIMEOUT", 1.0)
    monkeypatch.setattr(api_gateway, "BODY_TIMEOUT", 1.0)


def _raw(gw: Any, data: bytes) -> socket.socket:
    s = socket.create_connection((gw.host, gw.port), timeout=scaled(30))
    s.sendall(data)
    return s


def _answer(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
        if b"\r\n\r\n" in out:
            break
    return out


@pytest.mark.prefect
def test_the_gateway_bounds_what_one_sandbox_can_make_it_do(server, quick_timeouts, caplog):  # noqa: F811
    """Finding 6: a declared size over the endpoint's cap is refused before the body is read;
    a deep or huge nesting is refused before it is parsed; a half-sent head or body is
    dropped; 300 unknown task-run ids are one refusal, 150 one upstream query; refusals on
    the worker's log are capped and their control characters escaped."""
    caplog.set_level(logging.WARNING, logger="prefect_resoluto.worker.gateway")
    own = parked_run()
    with gateway_for(own) as gw:
        auth = f"Authorization: Bearer {gw.token}\r\n".encode()
        head = b"POST /api/logs/ HTTP/1.1\r\nHost: g\r\n" + auth + b"Content-Type: application/json\r\n"
        with _raw(gw, head + b"Content-Length: 100000000\r\n\r\n") as s:  # and never a byte of it
            assert _answer(s).startswith(b"HTTP/1.1 413 "), "refused before the body"
        with _raw(gw, head + b"Content-Length: 10\r\n\r\n[{") as s:
            assert _answer(s).startswith(b"HTTP/1.1 408 ")
        with _raw(gw, b"GET /api/flow_runs/x HTTP/1.1\r\nHost: g\r\n") as s:  # a head never finished
            s.settimeout(scaled(30))
            assert s.recv(1) == b"", "closed"
        for body in (b"[" * 5000 + b"]" * 5000, b"[" + b"{}," * 150_000 + b"{}]"):
            r = _post(f"http://{gw.address}/api/logs/", headers=_h(gw), content=body)
            assert r.status_code == 403 and "(rule body-shape)" in r.text, r.text[:300]

        queries: list[str] = []
        post = gw.upstream_post

        async def counted(rel: str, body: Any) -> tuple[int, Any]:
            queries.append(rel)
            return await post(rel, body)

        gw.upstream_post = counted  # type: ignore[method-assign]

        def logs(n: int) -> list[dict[str, Any]]:
            now = "2026-01-01T00:00:00Z"
            return [
                {
                    "name": "x",
                    "level": 20,
                    "message": "m",
                    "timestamp": now,
                    "flow_run_id": str(own.id),
                    "task_run_id": str(uuid.uuid4()),
                }
                for _ in range(n)
            ]

        r = _post(f"http://{gw.address}/api/logs/", headers=_h(gw), json=logs(300))
        assert r.status_code == 403 and queries == [], r.text
        r = _post(f"http://{gw.address}/api/logs/", headers=_h(gw), json=logs(150))
        assert r.status_code == 201 and queries == ["task_runs/filter"], (r.text, queries)

        for _ in range(api_gateway.MAX_LOGGED_REFUSALS + 5):
            _get(f"http://{gw.address}/api/x%1b[31m%07", headers=_h(gw))
        lines = [r.getMessage() for r in caplog.records if r.name == "prefect_resoluto.worker.gateway"]
        assert len(lines) == api_gateway.MAX_LOGGED_REFUSALS + 1, len(lines)
        assert not any(re.search(r"[\x00-\x1f\x7f]", m) for m in lines)
        assert "\\x1b[31m\\x07" in lines[-2] and "the rest are counted" in lines[-1]


# --------------------------------------------------------------------------- properties

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**7) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_KEYS = [
    "flow_id", "flow_version", "name", "parameters", "context", "tags", "parent_task_run_id", "state",
    "empirical_policy", "work_pool_name", "work_queue_name", "job_variables", "deployment_id",
    "idempotency_key", "infrastructure_pid", "labels",
]  # fmt: skip


@pytest.fixture(scope="module")
def hypothesis_target(auth_server: Any) -> Iterator[tuple[Any, Any, Any, Any]]:  # noqa: F811
    """A run's gateway, one of its task runs, and another run (the victim) on the module's server."""
    own, victim = parked_run(), parked_run()
    parent = _task_run(own.id)
    with gateway_for(own, flow_id=str(own.flow_id)) as gw:
        yield own, parent, gw, victim


@pytest.mark.prefect
@pytest.mark.parametrize("field", ["state", "empirical_policy", "parameters", "context", "tags"])
@pytest.mark.parametrize("value", [False, True, 0, 7, "PENDING", ["PENDING"]], ids=repr)
def test_a_sub_flows_field_of_the_wrong_json_type_is_refused_not_an_error(hypothesis_target, field, value):
    """Found by the property below: ``"state": false`` made the gateway's own check fail (a
    500, the request lost). Every field of a sub-flow's creation, of a JSON type the engine
    never sends, is a refusal naming the rule; nothing is created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentTaskRunId

    own, parent, gw, _victim = hypothesis_target

    def children() -> int:
        with get_client(sync_client=True) as c:
            return len(
                c.read_flow_runs(
                    flow_run_filter=FlowRunFilter(
                        parent_task_run_id=FlowRunFilterParentTaskRunId(any_=[parent.id])
                    )
                )
            )

    before = children()
    body = {"flow_id": str(own.flow_id), "parent_task_run_id": str(parent.id), field: value}
    r = _post(f"http://{gw.address}/api/flow_runs/", headers=_h(gw), json=body)
    engines = (field == "tags" and isinstance(value, list)) or (field != "state" and value in (False, 0))
    if engines:  # a list of tags, or a falsy policy, parameters or context: the engine's empty one
        assert r.status_code == 201, (field, value, r.status_code, r.text)
        return
    assert r.status_code == 403, (field, value, r.status_code, r.text)
    assert "own-sub-flows" in r.text, r.text
    assert children() == before


_LISTINGS_OF_WRONG_TYPES = [
    {"sort": ["ID_DESC"]},
    {"sort": {"ID_DESC": 1}},
    {"limit": [1]},
    {"offset": {"0": 0}},
    {"flow_runs": {"state": {"type": 5}}},
    {"flow_runs": {"state": {"type": True}}},
    {"flow_runs": {"state": {"name": ["Running"]}}},
    {"flow_runs": {"state": {"type": {"any_": [["RUNNING"]]}}}},
    {"flow_runs": {"state": []}},
    {"flow_runs": {"id": 5}},
    {"flow_runs": {"id": {"any_": "ids"}}},
    {"flow_runs": {"id": {"any_": [{"id": 1}]}}},
    {"flow_runs": {"id": {"operator": ["and_"]}}},
]


@pytest.mark.prefect
@pytest.mark.parametrize("part", _LISTINGS_OF_WRONG_TYPES, ids=lambda p: json.dumps(p, separators=(",", ":")))
def test_a_listing_with_a_field_of_the_wrong_json_type_is_refused_not_an_error(hypothesis_target, part):
    """A run's ``POST /flow_runs/filter`` by its own id, with one field of a JSON type the
    engine never sends (a list for a sort, a number for a state filter ...): a refusal
    naming the rule, never the gateway's own error (a 500 on an unhashable sort, a state
    condition that is no object)."""
    own, _parent, gw, _victim = hypothesis_target
    runs = {"id": {"any_": [str(own.id)]}, **part.get("flow_runs", {})}
    if isinstance(runs["id"], dict) and "any_" not in runs["id"]:
        runs["id"] = {"any_": [str(own.id)], **runs["id"]}
    body = {**part, "flow_runs": runs}
    r = _post(f"http://{gw.address}/api/flow_runs/filter", headers=_h(gw), json=body)
    assert r.status_code == 403, (body, r.status_code, r.text)
    assert "own-runs-only" in r.text, r.text


@pytest.mark.prefect
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    data=st.data(),
    keys=st.lists(st.sampled_from(_KEYS), unique=True, max_size=8),
)
def test_no_body_a_run_sends_makes_a_run_any_worker_would_start(hypothesis_target, data, keys):
    """Property: whatever body a run sends to create a flow run or list them, nothing outside
    the run is read, and what is created is a Pending sub-flow in no pool or queue."""
    from prefect.client.orchestration import get_client

    own, parent, gw, _victim = hypothesis_target
    valid = {
        "flow_id": str(own.flow_id),
        "parent_task_run_id": str(parent.id),
        "state": st.sampled_from([{"type": t} for t in ("PENDING", "SCHEDULED", "RUNNING")]),
        "work_pool_name": st.just(server_pool_name()),
        "tags": st.lists(st.text(max_size=5), max_size=2),
    }
    body: dict[str, Any] = {}
    for k in ["flow_id", "parent_task_run_id", *keys]:
        choice = valid.get(k)
        if isinstance(choice, str) and data.draw(st.booleans()):
            body[k] = choice
        elif isinstance(choice, st.SearchStrategy) and data.draw(st.booleans()):
            body[k] = data.draw(choice)
        else:
            body[k] = data.draw(_JSON)
    base = f"http://{gw.address}/api"
    r = _post(f"{base}/flow_runs/", headers=_h(gw), json=body)
    assert r.status_code in (201, 403, 422), (r.status_code, r.text, body)
    if r.status_code == 201:
        with get_client(sync_client=True) as c:
            fr = c.read_flow_run(r.json()["id"])
        assert fr.state.is_pending() and fr.work_queue_id is None and fr.work_pool_name is None, (fr, body)
        assert not fr.job_variables and fr.deployment_id is None and fr.idempotency_key is None
    listing = {
        "flow_runs": {k: data.draw(_JSON) for k in keys[:2]},
        **{k: data.draw(_JSON) for k in keys[2:4]},
    }
    r = _post(f"{base}/flow_runs/filter", headers=_h(gw), json=listing)
    assert r.status_code in (200, 403, 422), (r.status_code, r.text)
    if r.status_code == 200:
        assert {fr["id"] for fr in r.json()} <= gw.rules.flow_runs, listing


def server_pool_name() -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        return next(p.name for p in c.read_work_pools() if p.type == "resoluto")


@pytest.mark.prefect
def test_a_process_pools_worker_never_receives_a_run_a_sandbox_created(server, tmp_path):  # noqa: F811
    """An ordinary `process` pool with Prefect's own process worker on the same server: a run's
    gateway refuses to create a flow run in it (or any queue, or Scheduled), and the sub-flow
    it may create, even set Scheduled, is in no queue: the process worker, seen picking up
    a canary after that, never touches it."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.states import Scheduled
    from prefect.workers.process import ProcessWorker
    from test_worker import Worker

    pool = f"ordinary-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as c:
        c.create_work_pool(
            WorkPoolCreate(
                name=pool, type="process", base_job_template=ProcessWorker.get_default_base_job_template()
            )
        )
    own = parked_run()
    parent = _task_run(own.id)
    worker = Worker(pool, tmp_path, tmp_path / "state", tmp_path / "conduit")
    try:
        with gateway_for(own, flow_id=str(own.flow_id)) as gw:
            base = f"http://{gw.address}/api"
            sub = {"flow_id": str(own.flow_id), "parent_task_run_id": str(parent.id)}
            for extra in (
                {"work_pool_name": pool},
                {"work_queue_name": "default"},
                {"work_pool_name": pool, "state": {"type": "SCHEDULED"}},
                {"state": {"type": "SCHEDULED"}},
            ):
                r = _post(f"{base}/flow_runs/", headers=_h(gw), json={**sub, **extra})
                assert r.status_code == 403 and "(rule own-sub-flows)" in r.text, (extra, r.text)
            made = _post(f"{base}/flow_runs/", headers=_h(gw), json=sub)
            assert made.status_code == 201, made.text
            sub_id = made.json()["id"]
            scheduled = {"state": {"type": "SCHEDULED", "name": "Scheduled"}, "force": True}
            r = _post(f"{base}/flow_runs/{sub_id}/set_state", headers=_h(gw), json=scheduled)
            assert r.status_code in (200, 201), r.text

        @flow(name="canary")
        def canary() -> None:
            pass

        with get_client(sync_client=True) as c:
            probe = c.create_flow_run(canary, state=Scheduled(), work_pool_name=pool)

            def picked_up() -> bool:
                state = c.read_flow_run(probe.id).state
                return state is not None and not state.is_scheduled()

            wait_for(picked_up, timeout=120, what="the process worker to pick up its canary")
            after = c.read_flow_run(sub_id)
        assert after.state.is_scheduled() and after.work_queue_id is None and after.work_pool_name is None, (
            after
        )
        assert sub_id not in worker.output()
    finally:
        worker.stop()


def test_a_sandbox_blocks_floor_does_not_lower_the_pools() -> None:
    """A deployment may choose a sandbox block; its min_isolation counts against the pool's floor too."""
    from prefect_resoluto.blocks import SandboxBlock
    from prefect_resoluto.runtimes.base import IsolationLevel
    from prefect_resoluto.worker.admission import RunRefused
    from prefect_resoluto.worker.worker import ResolutoJobConfiguration

    cfg = ResolutoJobConfiguration(sandbox=SandboxBlock(runtime="process", min_isolation="none"))
    cfg._isolation_floor = IsolationLevel.USER_KERNEL
    with pytest.raises(RunRefused, match="below the pool's floor 'user-kernel'"):
        cfg.sandbox_config()
    cfg._isolation_floor = IsolationLevel.NONE
    assert cfg.sandbox_config().min_isolation.label == "none"


@pytest.mark.prefect
def test_a_deeply_nested_event_is_dropped_not_a_recursion_error(server):  # noqa: F811
    import asyncio

    from websockets.asyncio.client import connect
    from websockets.typing import Subprotocol

    own = parked_run()

    async def send(gw: Any) -> None:
        async with connect(f"ws://{gw.address}/api/events/in", subprotocols=[Subprotocol("prefect")]) as ws:
            await ws.send(json.dumps({"type": "auth", "token": gw.token}))
            assert json.loads(await ws.recv()) == {"type": "auth_success"}
            await ws.send("[" * 100_000 + "]" * 100_000)
            await ws.send(
                json.dumps({"event": "x", "resource": {"prefect.resource.id": "prefect.flow-run.other"}})
            )

    with gateway_for(own) as gw:
        asyncio.run(send(gw))
        wait_for(lambda: gw.refused >= 2, timeout=30, what="both events judged")
        assert gw.refused == 2
    warnings = wait_for(
        lambda: (w := [m for m in run_logs(own.id) if "refused (rule" in m]) and len(w) >= 2 and w,
        timeout=60,
        what="the refusals in the run's logs",
    )
    assert any("(rule body-shape)" in m for m in warnings), warnings


_RUN_CHOICE = st.sampled_from(["own", "other", "random", "junk"])


@pytest.mark.prefect
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), which=st.lists(_RUN_CHOICE, min_size=1, max_size=3), extra=_JSON)
def test_no_log_artifact_or_task_run_lands_outside_the_run(hypothesis_target, data, which, extra):
    """Property over the other admitted writes: whatever ids and fields a run sends, nothing
    is written into another run (its logs, artifacts and task runs stay empty)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )

    own, parent, gw, victim = hypothesis_target
    ids = {"own": str(own.id), "other": str(victim.id), "random": str(uuid.uuid4()), "junk": extra}
    base = f"http://{gw.address}/api"
    now = "2026-01-01T00:00:00Z"
    for w in which:
        run_id = ids[w]
        task = data.draw(st.sampled_from([None, str(parent.id), str(uuid.uuid4()), extra]))
        line = {
            "name": "x",
            "level": 20,
            "message": "m",
            "timestamp": now,
            "flow_run_id": run_id,
            "task_run_id": task,
        }
        bodies = {
            "/logs/": [line, {**line, "flow_run_id": str(own.id)}],
            "/artifacts/": {"type": "markdown", "data": "x", "flow_run_id": run_id, "task_run_id": task},
            "/task_runs/": {
                "flow_run_id": run_id,
                "task_key": "k",
                "dynamic_key": uuid.uuid4().hex,
                "name": "n",
            },
        }
        for path, body in bodies.items():
            r = _post(base + path, headers=_h(gw), json=body)
            assert r.status_code in (200, 201, 403, 422), (path, r.status_code, r.text)
    with get_client(sync_client=True) as c:
        assert run_logs(victim.id) == []
        assert not c.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[victim.id]))
        )
        assert not c.read_task_runs(
            task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[victim.id]))
        )


@pytest.mark.prefect
def test_one_runs_stalled_requests_hold_only_its_own_few_slots(server, monkeypatch):  # noqa: F811
    """Concurrency per run: bodies that never finish occupy at most MAX_CONCURRENT slots of
    that run's gateway, each freed by the body timeout (408); a request behind them is then
    answered."""
    import concurrent.futures

    monkeypatch.setattr(api_gateway, "BODY_TIMEOUT", 3.0)
    own = parked_run()
    with gateway_for(own) as gw:
        auth = f"Authorization: Bearer {gw.token}\r\n".encode()
        head = b"POST /api/logs/ HTTP/1.1\r\nHost: g\r\n" + auth + b"Content-Length: 10\r\n\r\n[{"
        stalled = [_raw(gw, head) for _ in range(api_gateway.MAX_CONCURRENT)]
        assert gw._busy is not None
        wait_for(gw._busy.locked, timeout=30, what="every slot held by a stalled body")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            behind = pool.submit(
                httpx.get, f"http://{gw.address}/api/flow_runs/{own.id}", headers=_h(gw), timeout=120
            )
            answers = [_answer(s) for s in stalled]
            assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), answers
            assert behind.result().status_code == 200
        for s in stalled:
            s.close()


@pytest.mark.prefect
def test_every_admitted_write_is_rebuilt_from_the_engines_fields(server):  # noqa: F811
    """A field Prefect's client does not send to an endpoint is refused, naming it; what the
    engine sends passes (its own run's state, a log line, a task run)."""
    own = parked_run()
    with gateway_for(own) as gw:
        base = f"http://{gw.address}/api"
        now = "2026-01-01T00:00:00Z"
        line = {"name": "x", "level": 20, "message": "m", "timestamp": now, "flow_run_id": str(own.id)}
        refused = [
            (f"/flow_runs/{own.id}/set_state", {"state": {"type": "RUNNING", "extra": 1}}, "state.extra"),
            (
                f"/flow_runs/{own.id}/set_state",
                {"state": {"type": "RUNNING"}, "orchestration": 1},
                "orchestration",
            ),
            ("/logs/", [{**line, "worker_secret": 1}], "worker_secret"),
            (
                "/task_runs/",
                {"flow_run_id": str(own.id), "task_key": "k", "dynamic_key": "0", "rogue": 1},
                "rogue",
            ),
        ]
        for path, body, named in refused:
            r = _post(base + path, headers=_h(gw), json=body)
            assert r.status_code == 403 and "(rule engine-fields)" in r.text and named in r.text, (
                path,
                r.text,
            )
        assert _post(base + "/logs/", headers=_h(gw), json=[line]).status_code == 201
        r = _post(
            base + f"/flow_runs/{own.id}/set_state", headers=_h(gw), json={"state": {"type": "PENDING"}}
        )
        assert r.status_code in (200, 201), r.text


# --------------------------------------------------------------------------- answers (issue 39, finding 2)

MIB = 1 << 20


def _final(run_id: Any) -> bool:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        state = c.read_flow_run(run_id).state
    return state is not None and state.is_final()


def _rss_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


@pytest.mark.prefect
def test_a_run_listing_its_big_sub_flows_at_once_leaves_the_workers_memory_flat(server, tmp_path):  # noqa: F811
    """Finding 2 through a real worker: the run makes 24 sub-flow runs of ~1 MiB each (under
    the body cap), then lists all their ids 8 times at once (admitted: its own runs). Each
    answer (~24 MiB) is over the worker's cap per answer (set lower here, as an operator
    sets it): every listing is refused with the cap named, nothing of it is read, and the
    worker's peak resident memory grows by less than 80 MiB (today's tree: ~400 MiB)."""
    from prefect.variables import Variable
    from test_worker import schedule

    cap = 8 * MIB
    pool = create_pool(cli=False)
    release = f"release_{uuid.uuid4().hex[:6]}"
    env = {"RESOLUTO_WARM_SNAPSHOTS": "0", "RESOLUTO_GATEWAY_MAX_ANSWER": str(cap)}
    with running_worker(pool, tmp_path, **env) as worker:
        dep = deploy(
            pool, "gateway_flows.py:hoarder", tmp_path / "conduit", allowed_variables=[release], **PROCESS
        )
        run = schedule(
            dep,
            count=24,
            param_bytes=256 << 10,
            context_bytes=768 << 10,
            at_once=8,
            ids_per_listing=24,
            release=release,
        )
        wait_for(
            lambda: any(m.startswith("MADE 24") for m in run_logs(run.id)) or _final(run.id),
            timeout=240,
            what="the run's 24 sub-flow runs",
        )
        assert not _final(run.id), run_logs(run.id)[-3:]
        pid = worker.proc.pid
        before = _rss_kib(pid, "VmRSS")
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) from here on
        Variable.set(release, "go")
        done = final_run(run.id, worker)
        peak = _rss_kib(pid, "VmHWM")
    growth = (peak - before) / 1024
    assert done.state.is_completed(), (done.state, worker.output()[-6000:])
    assert growth < 80, (
        f"the worker grew from {before / 1024:.0f} MiB by {growth:.0f} MiB relaying 8 listings"
    )
    listed = wait_for(
        lambda: len(got := [m[7:] for m in run_logs(run.id) if m.startswith("LISTED ")]) == 8 and got,
        timeout=60,
        what="the 8 listings' answers",
    )
    for answer in listed:
        assert answer.startswith("507 ") and "RESOLUTO_GATEWAY_MAX_ANSWER" in answer, listed
        assert f"{cap} bytes" in answer, answer


@pytest.mark.prefect
def test_a_run_holding_its_whole_budget_for_answers_holds_up_no_other_run(server, tmp_path):  # noqa: F811
    """Issue 39: one run of the pool lists its own sub-flow runs (answer: its whole budget
    for answers in flight but 1 KiB, set to 6 MiB here) on a socket it never reads from,
    and holds it. Its answer over the budget is refused (507), its own small read waits
    for the budget it holds and is refused (503), both naming the setting. Meanwhile another
    run of the pool on the same worker does ordinary engine work (tasks, a sub-flow) and
    completes without one answer refused: its budget is its own. Only then does the hoarder
    let go, and its read passes."""
    from prefect.variables import Variable
    from test_worker import schedule

    budget = 6 * MIB
    pool = create_pool(cli=False)
    release = f"release_{uuid.uuid4().hex[:6]}"
    env = {"RESOLUTO_WARM_SNAPSHOTS": "0", "RESOLUTO_GATEWAY_RUN_BUDGET": str(budget)}
    with running_worker(pool, tmp_path, **env) as worker:
        conduit = tmp_path / "conduit"
        hoarder = schedule(
            deploy(pool, "gateway_flows.py:budget_hoarder", conduit, allowed_variables=[release], **PROCESS),
            budget=budget,
            margin=1024,
            release=release,
        )

        def holding() -> list[str] | None:
            got = run_logs(hoarder.id)
            return got if any(m.startswith("OVER ") for m in got) or _final(hoarder.id) else None

        logs = wait_for(holding, timeout=240, what="the hoarder holding its budget")
        assert not _final(hoarder.id), (logs, worker.output()[-4000:])
        head = next(m for m in logs if m.startswith("HOLDING "))
        length = re.search(r"content-length: (\d+)", head.lower())
        assert head.startswith("HOLDING HTTP/1.1 200 ") and length, head
        assert budget - 2048 < int(length.group(1)) <= budget, head  # all of it but ~1 KiB
        over = next(m for m in logs if m.startswith("OVER "))
        assert over.startswith("OVER 507 ") and "RESOLUTO_GATEWAY_RUN_BUDGET" in over, over
        other = schedule(deploy(pool, "gateway_flows.py:neighbour", conduit, **PROCESS), n=3)
        done = final_run(other.id, worker)
        assert not _final(hoarder.id), run_logs(hoarder.id)[-3:]  # still holding
        Variable.set(release, "check")
        hoarded = final_run(hoarder.id, worker)
    assert done.state.is_completed(), (done.state, worker.output()[-6000:])
    theirs = run_logs(other.id)
    assert not [m for m in theirs if "answer-size" in m or "RESOLUTO_GATEWAY" in m], theirs
    assert hoarded.state.is_completed(), (hoarded.state, worker.output()[-6000:])
    logs = logs_with_all(hoarder.id, "WAITED ", "AFTER ")
    waited = next(m for m in logs if m.startswith("WAITED "))
    assert waited.startswith("WAITED 503 ") and "RESOLUTO_GATEWAY_RUN_BUDGET" in waited, waited
    assert f"{budget} bytes" in waited, waited
    assert next(m for m in logs if m.startswith("AFTER ")) == "AFTER 200", logs


@pytest.mark.prefect
def test_three_runs_listing_big_answers_at_once_stream_them_through_a_flat_worker(server, tmp_path):  # noqa: F811
    """Finding 2 by every run of the pool at once, on answers the gateway relays: three runs
    on one worker each make 16 sub-flow runs of ~1 MiB and list them all three times at
    once. Each answer (~16 MiB) is over what the gateway reads whole (8 MiB) and under its
    cap per answer (32 MiB): all nine reach their sandboxes whole and correct, streamed
    through the worker, whose peak resident memory grows by less than one answer (read
    whole, the nine would be ~144 MiB)."""
    from prefect.variables import Variable
    from test_worker import schedule

    runs, count, at_once = 3, 16, 3
    release = f"release_{uuid.uuid4().hex[:6]}"
    worker = server.worker
    dep = deploy(
        worker.pool, "gateway_flows.py:hoarder", tmp_path / "conduit", allowed_variables=[release], **PROCESS
    )
    made = [
        schedule(
            dep,
            count=count,
            param_bytes=256 << 10,
            context_bytes=768 << 10,
            at_once=at_once,
            ids_per_listing=count,
            release=release,
        )
        for _ in range(runs)
    ]
    for run in made:
        wait_for(
            lambda: any(m.startswith(f"MADE {count}") for m in run_logs(run.id)) or _final(run.id),  # noqa: B023
            timeout=300,
            what="each run's sub-flow runs",
        )
        assert not _final(run.id), run_logs(run.id)[-3:]
    pid = worker.proc.pid
    before = _rss_kib(pid, "VmRSS")
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) from here on
    Variable.set(release, "go")
    done = [final_run(run.id, worker) for run in made]
    peak = _rss_kib(pid, "VmHWM")
    growth = (peak - before) / 1024
    assert all(d.state.is_completed() for d in done), ([d.state for d in done], worker.output()[-6000:])
    for run in made:
        listed = wait_for(
            lambda: (
                len(got := [m[7:] for m in run_logs(run.id) if m.startswith("LISTED ")]) == at_once  # noqa: B023
                and got
            ),
            timeout=60,
            what="the listings' answers",
        )
        for answer in listed:
            status, size, rows, whole = answer.split(" ", 3)
            assert (status, rows, whole) == ("200", str(count), "whole"), answer
            assert int(size) > 2 * relay_limits.MAX_READ - MIB, answer  # twice what it reads whole
    answer_mib = int(size) / MIB
    assert growth < answer_mib, (
        f"the worker grew from {before / 1024:.0f} MiB by {growth:.0f} MiB relaying "
        f"{runs * at_once} answers of {answer_mib:.0f} MiB at once"
    )


@pytest.mark.prefect
def test_a_run_past_its_few_events_websockets_is_closed_and_told_in_its_logs(server):  # noqa: F811
    """Events websockets are each a connection to the API: a run holds MAX_WEBSOCKETS at once;
    one more is closed 1013 with the bound in its reason and a WARNING in the run's logs, and
    once one of its own closes, the run opens another."""
    import asyncio
    import contextlib

    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed
    from websockets.typing import Subprotocol

    own = parked_run()
    with gateway_for(own) as gw:

        async def opened(stack: contextlib.AsyncExitStack) -> Any:
            ws = await stack.enter_async_context(
                connect(f"ws://{gw.address}/api/events/in", subprotocols=[Subprotocol("prefect")])
            )
            await ws.send(json.dumps({"type": "auth", "token": gw.token}))
            return ws, await ws.recv()

        async def attempt() -> tuple[list[Any], Any, Any]:
            async with contextlib.AsyncExitStack() as stack:
                held = [await opened(stack) for _ in range(api_gateway.MAX_WEBSOCKETS)]
                try:
                    extra = await opened(stack)
                except ConnectionClosed as e:
                    extra = (e.rcvd.code, e.rcvd.reason) if e.rcvd else None
                assert extra is not None and extra[0] == 1013, f"one past the bound: {extra}"
                await held[0][0].close()
                await asyncio.to_thread(
                    wait_for,
                    lambda: gw._websockets < api_gateway.MAX_WEBSOCKETS,
                    timeout=30,
                    what="the gateway to let the closed websocket go",
                )
                again = await opened(stack)
                return [json.loads(reply) for _, reply in held], extra, json.loads(again[1])

        replies, extra, again = asyncio.run(attempt())
    assert replies == [{"type": "auth_success"}] * api_gateway.MAX_WEBSOCKETS
    assert str(api_gateway.MAX_WEBSOCKETS) in extra[1], extra
    assert again == {"type": "auth_success"}
    wait_for(
        lambda: any("rule websockets" in line for line in run_logs(own.id)),
        timeout=60,
        what="the refused websocket as a WARNING in the run's logs",
    )


# --------------------------------------------------------------------------- an outsider's fuzzing (issue 41's review)


@pytest.mark.prefect
@pytest.mark.parametrize("form", ["upper", "braces", "urn", "hex"])
def test_another_runs_task_run_named_in_another_form_of_its_id_is_refused(hypothesis_target, form):
    """The victim's task run, named by an upper-case (or braced, urn:, unhyphenated) form of
    its id: the gateway looked that form up among the API's lower-case ids, missed, took it
    for a task run not created yet and claimed it; the API, reading any form, then failed the
    victim's task run. Only the API's own form of an id is one."""
    from prefect.client.orchestration import get_client

    _own, _parent, gw, victim = hypothesis_target
    theirs = _task_run(victim.id)
    ident = {
        "upper": str(theirs.id).upper(),
        "braces": "{" + str(theirs.id) + "}",
        "urn": f"urn:uuid:{theirs.id}",
        "hex": theirs.id.hex,
    }[form]
    base = f"http://{gw.address}/api"
    r = _post(
        f"{base}/task_runs/{ident}/set_state",
        headers=_h(gw),
        json={"state": {"type": "FAILED"}, "force": True},
    )
    assert r.status_code == 403 and "own-task-runs" in r.text, (r.status_code, r.text)
    logged = _post(
        f"{base}/logs/",
        headers=_h(gw),
        json=[{"name": "x", "level": 20, "message": "m", "timestamp": "2026-01-01T00:00:00Z",
               "flow_run_id": str(_own.id), "task_run_id": ident}],
    )  # fmt: skip
    assert logged.status_code == 403, (logged.status_code, logged.text)
    with get_client(sync_client=True) as c:
        assert c.read_task_run(theirs.id).state.is_pending()
    assert str(theirs.id) not in gw.rules.task_runs and ident not in gw.rules.task_runs


@pytest.mark.prefect
def test_a_refusal_quoting_a_lone_surrogate_is_still_a_refusal(hypothesis_target):
    """A task run id of one lone surrogate (``"\\ud800"`` in the JSON) was quoted in the
    refusal, whose JSON answer then failed to encode: a 500. Bodies holding one are refused
    as no engine's (none can send it: it is no UTF-8); a refusal's own text is escaped."""
    from prefect_resoluto.worker.bodies import Refusal

    own, _parent, gw, _victim = hypothesis_target
    fields = json.dumps({"flow_run_id": str(own.id), "key": "k", "type": "markdown", "data": "d"})
    raw = fields[:-1] + ', "task_run_id": "\\ud800"}'  # json.dumps would escape the backslash
    r = _post(
        f"http://{gw.address}/api/artifacts/",
        headers={**_h(gw), "content-type": "application/json"},
        content=raw.encode(),
    )
    assert r.status_code == 403 and "body-shape" in r.text, (r.status_code, r.text)
    named = _post(
        f"http://{gw.address}/api/flows/",
        headers={**_h(gw), "content-type": "application/json"},
        content=b'{"name": "x\\udfff"}',
    )
    assert named.status_code == 403 and "body-shape" in named.text, (named.status_code, named.text)
    assert Refusal("r", "task run \ud800 refused").why == "task run \\ud800 refused"


def _events_socket(
    gw: Any, stream: str, *frames: Any, auth: Any = None, closes: bool = True
) -> tuple[Any, list[Any]]:
    """Open the gateway's events websocket ``stream`` as Prefect's client does (its auth
    message: ``auth`` or the run's token), send ``frames``, and return how the gateway
    closed it (code, reason) and what it answered before; ``closes=False``: only its answer
    to the auth, then this side closes."""
    import asyncio

    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed
    from websockets.typing import Subprotocol

    async def go() -> tuple[Any, list[Any]]:
        got: list[Any] = []
        async with connect(
            f"ws://{gw.address}/api/events/{stream}", subprotocols=[Subprotocol("prefect")]
        ) as ws:
            await ws.send(json.dumps({"type": "auth", "token": gw.token}) if auth is None else auth)
            try:
                got.append(await ws.recv())
                for frame in frames:
                    await ws.send(frame)
                while closes:
                    got.append(await ws.recv())
            except ConnectionClosed as e:
                return ((e.rcvd.code, e.rcvd.reason) if e.rcvd else None), got
        return None, got

    return asyncio.run(go())


@pytest.mark.prefect
def test_events_websockets_refuse_what_no_engine_sends_and_stay_up(server):  # noqa: F811
    """Three ways an events websocket failed inside the gateway (an exception in the ASGI
    app, the socket dropped without a close frame): an auth token holding a lone surrogate,
    a subscription whose resource filter is no object, a binary frame. Each is now closed
    with a reason, and the run's next websocket still works."""
    own = parked_run()
    with gateway_for(own) as gw:
        closed, got = _events_socket(gw, "in", auth='{"type": "auth", "token": "\\ud800"}')
        assert closed == (1008, "Invalid token") and got == [], (closed, got)
        for resource in ("true", '"x"', "1", "[1]"):
            flt = f'{{"type": "filter", "filter": {{"resource": {resource}}}}}'
            closed, got = _events_socket(gw, "out", flt)
            assert closed is not None and closed[0] == 1008 and closed[1] == "own-events-out", (
                resource,
                closed,
            )
        closed, got = _events_socket(gw, "in", b"\x00binary")
        assert closed == (1003, "events are text frames"), closed
        closed, got = _events_socket(gw, "out", b"\x00binary")
        assert closed == (1003, "events are text frames"), closed
        # and the gateway still serves the run
        closed, got = _events_socket(gw, "in", closes=False)
        assert closed is None and json.loads(got[0]) == {"type": "auth_success"}, (closed, got)


def test_a_body_of_unterminated_escaped_quotes_is_judged_in_one_pass():
    """``"`` then ``\\"`` x N, never closed: the old string pattern retried from every quote,
    O(N^2) (80 KB: 13 s of the gateway's event loop, 1 MB: ~30 min). Judged now in one pass.
    Checked by the pattern's own work, not a clock: it blanks the whole rest as one string,
    from the first quote, so it tries no later start."""
    from prefect_resoluto.worker import bodies

    for tail in (b"", b"\\"):
        raw = b'{"a": "' + b'\\"' * 500_000 + tail
        matches = list(bodies._STRING.finditer(raw))
        assert [(m.start(), m.end()) for m in matches] == [(1, 4), (6, len(raw))], tail
        assert bodies.parse_bounded(raw) == bodies.Refusal("body-shape", bodies.NOT_JSON)
    done = bodies.parse_bounded(b'{"a": "x\\"[{", "b": [1, {"c": "\\\\"}], "d": "\\ud83d\\ude00"}')
    assert done == {"a": 'x"[{', "b": [1, {"c": "\\"}], "d": "\U0001f600"}


def _patch(url: str, **kw: Any) -> httpx.Response:
    with api_http() as c:
        return c.patch(url, **kw)


@pytest.mark.prefect
def test_a_runs_writes_to_itself_are_rebuilt_from_the_engines_fields(hypothesis_target):
    """The writes a run may make to its own flow run were forwarded with its values as sent:
    any labels, any policy (a billion retries), any state details, a lease of a billion slots.
    Each now carries only what the engine sends, of the engine's types; the rest is refused."""
    from prefect.client.orchestration import get_client

    own, parent, gw, _victim = hypothesis_target
    base, h = f"http://{gw.address}/api", _h(gw)
    refused = {
        "labels": _patch(f"{base}/flow_runs/{own.id}/labels", headers=h, json={"team": "payments"}),
        "labels not an object": _patch(f"{base}/flow_runs/{own.id}/labels", headers=h, json=[1]),
        "retries": _patch(
            f"{base}/flow_runs/{own.id}", headers=h, json={"empirical_policy": {"retries": 10**9}}
        ),
        "resuming": _patch(
            f"{base}/flow_runs/{own.id}", headers=h, json={"empirical_policy": {"resuming": 1}}
        ),
        "name": _patch(f"{base}/flow_runs/{own.id}", headers=h, json={"name": {"a": 1}}),
        "force": _post(
            f"{base}/flow_runs/{own.id}/set_state",
            headers=h,
            json={"state": {"type": "RUNNING"}, "force": "yes"},
        ),
        "deferred": _post(
            f"{base}/flow_runs/{own.id}/set_state",
            headers=h,
            json={"state": {"type": "SCHEDULED", "state_details": {"deferred": True}}},
        ),
        "slots": _post(
            f"{base}/v2/concurrency_limits/increment-with-lease",
            headers=h,
            json={"names": ["tag:x"], "slots": 10**6, "holder": {"type": "task_run", "id": str(parent.id)}},
        ),
        "holder": _post(
            f"{base}/v2/concurrency_limits/increment-with-lease",
            headers=h,
            json={"names": ["tag:x"], "holder": {"type": "task_run", "id": str(parent.id), "extra": 1}},
        ),
    }
    for what, r in refused.items():
        assert r.status_code == 403, (what, r.status_code, r.text)
    traced = _patch(
        f"{base}/flow_runs/{own.id}/labels", headers=h, json={"__OTEL_TRACEPARENT": "00-ab-cd-01"}
    )
    renamed = _patch(
        f"{base}/flow_runs/{own.id}",
        headers=h,
        json={"name": "renamed", "empirical_policy": {"retries": 2, "retry_delay": 1, "resuming": False}},
    )
    assert traced.status_code < 300 and renamed.status_code < 300, (traced.text, renamed.text)
    with get_client(sync_client=True) as c:
        now = c.read_flow_run(own.id)
    assert now.name == "renamed" and now.empirical_policy.retries == 2
    assert "team" not in now.labels and now.labels.get("__OTEL_TRACEPARENT") == "00-ab-cd-01"


def test_a_flow_runs_proposed_state_details_are_rebuilt():
    """What the engine does not send in a flow run's state details is dropped, as a task run's."""
    from prefect_resoluto.worker.bodies import Rebuilt, engine_fields

    path = f"/flow_runs/{uuid.uuid4()}/set_state"
    got = engine_fields(
        "POST", path, {"state": {"type": "RUNNING", "state_details": {"pause_key": "p", "evil": 1}}}
    )
    assert isinstance(got, Rebuilt) and got.body == {
        "state": {"type": "RUNNING", "state_details": {"pause_key": "p"}}
    }


@pytest.mark.prefect
@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16", "utf-32"])
def test_a_body_not_in_utf8_is_refused_before_it_is_read(hypothesis_target, encoding):
    """json.loads reads bytes as UTF-16 and -32 too, where the gateway's byte patterns saw
    another body: an artifact nested 500 deep reached the API (201) past MAX_DEPTH. The
    engine's JSON is UTF-8: anything else is refused, unread."""
    from prefect_resoluto.worker import bodies

    own, _parent, gw, _victim = hypothesis_target
    text = json.dumps({"flow_run_id": str(own.id), "key": "deep", "type": "markdown"})
    text = text[:-1] + ', "data": ["\\"", ' + "[" * 500 + "]" * 500 + ', "x"]}'
    r = _post(
        f"http://{gw.address}/api/artifacts/",
        headers={**_h(gw), "content-type": "application/json"},
        content=text.encode(encoding),
    )
    assert r.status_code == 403 and bodies.NOT_JSON in r.text, (r.status_code, r.text)
    r = _post(
        f"http://{gw.address}/api/artifacts/",
        headers={**_h(gw), "content-type": "application/json"},
        content=text.encode("utf-8"),
    )
    assert r.status_code == 403 and "nested deeper" in r.text, (r.status_code, r.text)


def test_an_ownership_check_the_api_cannot_answer_is_a_refusal_not_an_error():
    """The rules ask the API whose a task run is; with the API away that was the gateway's
    500. It is a refusal now (the engine retries as it would a busy API)."""
    from prefect_resoluto.worker.gateway import ApiGateway, Upstream
    from prefect_resoluto.worker.rules import RunRules

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_id = str(uuid.uuid4())
    upstream = Upstream(api_url=f"http://127.0.0.1:{port}/api")
    with ApiGateway(run_id, upstream, RunRules(flow_run_id=run_id)) as gw:
        r = httpx.get(f"http://{gw.address}/api/task_runs/{uuid.uuid4()}", headers=_h(gw))
        assert r.status_code == 403 and "own-task-runs" in r.text, (r.status_code, r.text)
        logs = [{"name": "x", "level": 20, "message": "m", "timestamp": "2026-01-01T00:00:00Z",
                 "flow_run_id": run_id, "task_run_id": str(uuid.uuid4())}]  # fmt: skip
        r = httpx.post(f"http://{gw.address}/api/logs/", headers=_h(gw), json=logs)
        assert r.status_code == 403 and "own-logs" in r.text, (r.status_code, r.text)


@pytest.mark.prefect
def test_an_event_stream_the_api_closes_closes_the_sandboxs_with_a_reason(server):  # noqa: F811
    """An event of the run's own that Prefect cannot read (no id, no time): the API closes its
    stream. The sandbox's socket is closed then too (1011, the reason), where the next event
    failed in the gateway's app and the socket dropped with no close."""
    own = parked_run()
    bad = json.dumps({"event": "x", "resource": {"prefect.resource.id": f"prefect.flow-run.{own.id}"}})
    with gateway_for(own) as gw:
        closed, got = _events_socket(gw, "in", bad)
        assert json.loads(got[0]) == {"type": "auth_success"}, got
        assert closed == (1011, "the Prefect API closed its event stream"), closed
        closed, got = _events_socket(gw, "in", closes=False)  # the run's next one works
        assert json.loads(got[0]) == {"type": "auth_success"}, got


class _CountingApi:
    """The rules' API answering a task-run listing with the runs it holds; counts the asks."""

    def __init__(self, runs: dict[str, str]) -> None:
        self.runs, self.asked = runs, 0  # task run id -> its flow run id

    async def upstream_get(self, rel: str) -> tuple[int, Any]:
        raise AssertionError(f"asked the API for {rel} one by one")

    async def upstream_post(self, rel: str, body: Any) -> tuple[int, Any]:
        self.asked += 1
        ids = body["task_runs"]["id"]["any_"]
        return 200, [{"id": i, "flow_run_id": self.runs[i], "tags": []} for i in ids if i in self.runs]


def test_an_events_related_task_runs_are_judged_in_one_query_and_one_foreign_refuses_it() -> None:
    """An event's related task runs were each a query of their own (20 000 related ids: 20 000
    queries, all claimed while unknown), and each related resource rebuilt the run's sets
    (8 000 entries against 10 000 artifacts: 3.5 s of the worker's CPU). Now one query for
    all of them, each other resource a lookup; one task run of another run refuses the event."""
    import asyncio

    from prefect_resoluto.worker.bodies import Refusal
    from prefect_resoluto.worker.rules import RunRules

    own_run, other_run = str(uuid.uuid4()), str(uuid.uuid4())
    mine = [str(uuid.uuid4()) for _ in range(150)]
    theirs = str(uuid.uuid4())
    artifacts = {str(uuid.uuid4()) for _ in range(10_000)}
    rules = RunRules(flow_run_id=own_run, flow_runs={own_run}, artifacts=set(artifacts))
    api = _CountingApi({**dict.fromkeys(mine, own_run), theirs: other_run})

    def event(task_runs: list[str]) -> dict[str, Any]:
        related = [
            {"prefect.resource.id": f"prefect.task-run.{t}", "prefect.resource.role": "x"} for t in task_runs
        ]
        related += [
            {"prefect.resource.id": f"prefect.artifact.{a}", "prefect.resource.role": "a"} for a in artifacts
        ]
        return {
            "event": "e",
            "resource": {"prefect.resource.id": f"prefect.flow-run.{own_run}"},
            "related": related,
        }

    assert asyncio.run(rules.check_event(event(mine), api)) is None
    assert api.asked == 1
    refused = asyncio.run(rules.check_event(event([*mine[:5], theirs]), api))
    assert isinstance(refused, Refusal) and theirs in refused.why, refused
    assert api.asked == 2 and theirs in rules.foreign
    stranger = {"prefect.resource.id": f"prefect.artifact.{uuid.uuid4()}", "prefect.resource.role": "a"}
    odd = {**event([]), "related": [stranger]}
    assert isinstance(asyncio.run(rules.check_event(odd, api)), Refusal)
