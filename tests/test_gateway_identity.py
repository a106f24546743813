"""Issue 39, finding 1: a sandboxed flow run acts only as itself.

A flow is a name in Prefect, and ``POST /flows/`` an upsert: naming another team's flow
answered its id, and the gateway took the flow for the run's own. A run's flows are now its
own flow and the flows its deployment registered (a label the gateway sets when it creates
one, read back from the API's own answer). A real `prefect server` with an auth string, a
real `resoluto` worker running the attacker on gVisor, and the finer points straight at a
run's gateway with the real server behind it.
"""

from __future__ import annotations

import datetime
import threading
import uuid
from typing import Any

import httpx
import pytest
from support.prefect_cli import api_http
from test_api_gateway import (  # noqa: F401 - the module's server and worker, as there
    GVISOR,
    auth_server,
    gateway_for,
    logs_with_all,
    parked_run,
    server,
)
from test_worker import deploy, final_run

from prefect_resoluto.worker.bodies import SANDBOXED_TAG
from prefect_resoluto.worker.identity import GRANT_TAG, REGISTERED_BY


def _post(url: str, **kw: Any) -> httpx.Response:
    """A request through a gateway, retried as Prefect's client retries a busy server's 503."""
    with api_http() as c:
        return c.post(url, **kw)


def _h(gw: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {gw.token}"}


def _another_teams_flow() -> tuple[str, Any, Any]:
    """A flow another team registered (with the operator's credential, as its own deploy
    does), and a run of it parked where no worker picks it up."""
    from prefect.client.orchestration import get_client

    name = f"payments-{uuid.uuid4().hex[:6]}"
    with get_client(sync_client=True) as c:
        flow_id = c.create_flow_from_name(name)
        later = (datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1)).isoformat()
        # Scheduled for tomorrow: the server's late-runs service leaves it alone meanwhile.
        state = {"type": "SCHEDULED", "name": "Scheduled", "state_details": {"scheduled_time": later}}
        made = c._client.post("/flow_runs/", json={"flow_id": str(flow_id), "state": state})
        run = c.read_flow_run(made.json()["id"])
    return name, flow_id, run


def _admin_patch(path: str, body: dict[str, Any]) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        assert c._client.patch(path, json=body).status_code == 204


def _read_flow(flow_id: Any) -> Any:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        return c.read_flow(flow_id)


def _task_run(flow_run_id: Any) -> Any:
    from prefect import task
    from prefect.client.orchestration import get_client

    @task(name="a-task")
    def t() -> None:
        pass

    with get_client(sync_client=True) as c:
        return c.create_task_run(task=t, flow_run_id=flow_run_id, dynamic_key=uuid.uuid4().hex)


# --------------------------------------------------------------------------- from inside gVisor


@pytest.mark.prefect
@pytest.mark.sandbox
def test_a_sandboxed_run_cannot_become_another_teams_flow_and_its_own_sub_flow_runs_every_time(
    gvisor,
    server,  # noqa: F811
    tmp_path,
):
    """The finding, from inside gVisor through the worker and the gateway only: naming the
    "payments" flow another team registered (as sent, with a forged mark, through the
    engine's client) is 403 without its id; a run of it, made, read or set Running by the id
    learnt elsewhere, is 403; nothing of "payments" changes. Two runs of the deployment:
    each run's own sub-flow completes (its flow registered by the first, recognised by the
    next from the label in the API), tagged as made inside a sandbox."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentTaskRunId
    from test_worker import schedule

    name, victim_flow, victim_run = _another_teams_flow()
    deployment = deploy(server.worker.pool, "identity_flows.py:takeover", tmp_path / "conduit", **GVISOR)
    params = {
        "victim_flow_name": name,
        "victim_flow_id": str(victim_flow),
        "victim_run_id": str(victim_run.id),
    }
    expected = {
        "name another team's flow": "own-flows",
        "name it with a forged mark": "own-flows",
        "create a run of it": "own-sub-flows",
        "read its run": "own-flow-run",
        "set its run running": "own-flow-run",
        "read the flow": "own-flows",
        "the client registers it": None,
    }
    runs = []
    for _ in range(2):  # one after the other: the second finds the sub-flow's flow registered
        run = schedule(deployment, **params)
        done = final_run(run.id, server.worker)
        assert done.state.is_completed(), (done.state, server.worker.output()[-6000:])
        logs = logs_with_all(run.id, "CHILD ", "ATTEMPT the client registers it")
        attempts = {m.split(":", 1)[0][8:]: m.split(": ", 1)[1] for m in logs if m.startswith("ATTEMPT ")}
        assert set(attempts) == set(expected), logs
        for attempt, rule in expected.items():
            answer = attempts[attempt]
            assert answer.startswith("403 "), (attempt, answer)
            assert rule is None or f"(rule {rule})" in answer, (attempt, answer)
        for attempt in ("name another team's flow", "name it with a forged mark", "the client registers it"):
            assert str(victim_flow) not in attempts[attempt], attempts[attempt]  # never the flow's id
        assert "was not created by this run's deployment" in attempts["name another team's flow"]
        assert next(m for m in logs if m.startswith("CHILD ")) == "CHILD 42", logs
        runs.append(done)

    with get_client(sync_client=True) as c:
        after = c.read_flow_run(victim_run.id)
        assert (after.state_type, after.updated) == (victim_run.state_type, victim_run.updated)
        assert after.run_count == 0 and after.start_time is None, after
        assert [st.type.value for st in c.read_flow_run_states(victim_run.id)] == ["SCHEDULED"]
        made_inside = c.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_task_run_id=FlowRunFilterParentTaskRunId(is_null_=False))
        )
        assert [fr for fr in made_inside if fr.flow_id == victim_flow] == []
        children = [fr for fr in made_inside if fr.name and fr.flow_id != victim_flow]
        by_parent = {}
        for fr in children:
            parent = c.read_task_run(fr.parent_task_run_id)
            by_parent[parent.flow_run_id] = fr
        subs = [by_parent[r.id] for r in runs]
        assert all(fr.state.is_completed() for fr in subs), [fr.state for fr in subs]
        assert all(SANDBOXED_TAG in fr.tags for fr in subs), [fr.tags for fr in subs]
        child_flow = c.read_flow(subs[0].flow_id)
    assert {fr.flow_id for fr in subs} == {child_flow.id} and child_flow.name == "identity-child"
    assert child_flow.labels.get(REGISTERED_BY) == str(runs[0].deployment_id), child_flow.labels
    assert REGISTERED_BY not in (_read_flow(victim_flow).labels or {})


# --------------------------------------------------------------------------- at a run's gateway


def _register(gw: Any, name: str, **extra: Any) -> httpx.Response:
    return _post(f"http://{gw.address}/api/flows/", headers=_h(gw), json={"name": name, **extra})


@pytest.mark.prefect
def test_a_flow_is_the_run_s_only_when_its_deployment_registered_it(server):  # noqa: F811
    """By the API's own record, not the gateway's memory: a flow the deployment's run made
    is its next runs' too (a new gateway, as after a worker restart); another deployment's
    run, a run without a deployment, and a forged mark in the body get a 403 without the id;
    an operator's grant tag (never the run's) shares the flow with another deployment."""
    dep_a, dep_b = str(uuid.uuid4()), str(uuid.uuid4())
    name = f"sub-{uuid.uuid4().hex[:6]}"
    payments, payments_id, _ = _another_teams_flow()
    first, second, third = parked_run(), parked_run(), parked_run()
    with gateway_for(first, deployment_id=dep_a) as gw:
        made = _register(gw, name, tags=[], labels={})
        assert made.status_code == 201, made.text
        flow_id = made.json()["id"]
        assert flow_id in gw.rules.flows
        for body in ({}, {"labels": {REGISTERED_BY: dep_a}}, {"tags": ["theirs"]}):
            r = _register(gw, payments, **body)
            assert r.status_code == 403 and "(rule own-flows)" in r.text, (body, r.text)
            assert str(payments_id) not in r.text and str(payments_id) not in gw.rules.flows
        r = _register(gw, name, labels={"x": "y"})
        assert r.status_code == 403 and "labels" in r.text, r.text  # the run never chooses them
    assert _read_flow(flow_id).labels == {REGISTERED_BY: dep_a}
    assert (_read_flow(payments_id).labels or {}) == {}
    with gateway_for(second, deployment_id=dep_a) as gw:  # the next run of the deployment
        again = _register(gw, name)
        assert again.status_code == 200 and again.json()["id"] == flow_id, again.text
        assert flow_id in gw.rules.flows
    with gateway_for(third, deployment_id=dep_b) as gw:  # another deployment's run
        r = _register(gw, name)
        assert r.status_code == 403 and "(rule own-flows)" in r.text and flow_id not in r.text, r.text
        r = _register(gw, name, tags=[GRANT_TAG + dep_b])  # the grant is the operator's, never the run's
        assert r.status_code == 403 and "tags" in r.text, r.text
        _admin_patch(f"/flows/{flow_id}", {"tags": [GRANT_TAG + dep_b]})  # the operator shares it
        shared = _register(gw, name)
        assert shared.status_code == 200 and shared.json()["id"] == flow_id, shared.text
    with gateway_for(third) as gw:  # no deployment: nothing to mark a flow with
        r = _register(gw, f"sub-{uuid.uuid4().hex[:6]}")
        assert r.status_code == 403 and "no deployment" in r.text, r.text


@pytest.mark.prefect
def test_two_deployments_racing_for_a_new_name_get_one_flow_between_them(server):  # noqa: F811
    """The flow does not exist, two deployments' runs name it at once: one insert wins and
    marks it, the other run sees the winner's mark in the API's answer and is refused."""
    name = f"raced-{uuid.uuid4().hex[:6]}"
    deps = [str(uuid.uuid4()) for _ in range(2)]
    runs = [parked_run() for _ in deps]
    answers: dict[str, httpx.Response] = {}
    with gateway_for(runs[0], deployment_id=deps[0]) as ga, gateway_for(runs[1], deployment_id=deps[1]) as gb:
        go = threading.Barrier(2)

        def register(gw: Any, dep: str) -> None:
            go.wait()
            answers[dep] = _register(gw, name)

        threads = [threading.Thread(target=register, args=pair) for pair in ((ga, deps[0]), (gb, deps[1]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    codes = sorted(r.status_code for r in answers.values())
    assert codes in ([200, 403], [201, 403]), {d: (r.status_code, r.text) for d, r in answers.items()}
    (winner,) = [d for d, r in answers.items() if r.status_code < 300]
    flow_id = answers[winner].json()["id"]
    assert _read_flow(flow_id).labels == {REGISTERED_BY: winner}
    (loser,) = set(deps) - {winner}
    assert flow_id not in answers[loser].text


@pytest.mark.prefect
def test_a_sub_flow_run_made_through_the_gateway_is_tagged_as_made_in_a_sandbox(server):  # noqa: F811
    from prefect.client.orchestration import get_client

    own = parked_run()
    parent = _task_run(own.id)
    with gateway_for(own, deployment_id=str(uuid.uuid4())) as gw:
        made = _register(gw, f"sub-{uuid.uuid4().hex[:6]}")
        assert made.status_code == 201, made.text
        sub = {"flow_id": made.json()["id"], "parent_task_run_id": str(parent.id), "tags": ["mine"]}
        r = _post(f"http://{gw.address}/api/flow_runs/", headers=_h(gw), json=sub)
        assert r.status_code == 201, r.text
    with get_client(sync_client=True) as c:
        fr = c.read_flow_run(r.json()["id"])
    assert sorted(fr.tags) == sorted(["mine", SANDBOXED_TAG]), fr.tags


@pytest.mark.prefect
def test_a_name_a_run_registered_first_is_not_its_own_once_another_team_deploys_it(server):  # noqa: F811
    """Squatting: a sandboxed run registers "settle" before the team that owns that name has
    deployed it. Once the team's deployment of the flow exists, the squatter's next run is
    refused the flow (its runs would be the team's flow's runs, which automations trust);
    an operator's grant tag still shares it on purpose."""
    from prefect.client.orchestration import get_client

    dep = str(uuid.uuid4())
    name = f"settle-{uuid.uuid4().hex[:6]}"
    first, second = parked_run(), parked_run()
    with gateway_for(first, deployment_id=dep) as gw:
        made = _register(gw, name)
        assert made.status_code == 201, made.text
        flow_id = made.json()["id"]
    with get_client(sync_client=True) as c:  # the owning team deploys its flow of that name
        c.create_deployment(flow_id=uuid.UUID(flow_id), name=f"team-{uuid.uuid4().hex[:6]}")
    with gateway_for(second, deployment_id=dep) as gw:
        r = _register(gw, name)
        assert r.status_code == 403 and "deployed by another deployment" in r.text, r.text
        assert flow_id not in r.text and flow_id not in gw.rules.flows
        _admin_patch(f"/flows/{flow_id}", {"tags": [GRANT_TAG + dep]})  # shared on purpose
        shared = _register(gw, name)
        assert shared.status_code == 200 and shared.json()["id"] == flow_id, shared.text
