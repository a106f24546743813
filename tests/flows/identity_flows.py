"""A sandboxed run that tries to act as another team's flow (issue 39, finding 1), and calls
a sub-flow of its own as any run of its deployment does (tests/test_gateway_identity.py).

``takeover`` names a flow another team registered, through the engine's own client and
with nothing but its gateway's address and token, then tries to make, read and finish a
run of it by an id it learnt elsewhere (a parameter here). Each attempt is logged as
``ATTEMPT <name>: <status> <body>``; the sub-flow's answer as ``CHILD <n>``.
"""

from __future__ import annotations

import base64
import os
import time
from typing import Any

from prefect import flow, get_run_logger, task


@flow(name="identity-child")
def identity_child(x: int) -> int:
    """A sub-flow every run of the deployment calls: its flow is registered by the first run."""
    return x + 1


@task
def parent_task() -> None:
    """A task run of the run's own: the parent its takeover attempt names."""


@flow
def takeover(victim_flow_name: str, victim_flow_id: str, victim_run_id: str) -> int:
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    log = get_run_logger()
    ctx = FlowRunContext.get()
    assert ctx is not None and ctx.flow_run is not None
    with get_client(sync_client=True) as c:
        parent = c.create_task_run(task=parent_task, flow_run_id=ctx.flow_run.id, dynamic_key="takeover")
    api = os.environ["PREFECT_API_URL"]
    token = os.environ["PREFECT_API_AUTH_STRING"]  # the run's gateway token, as its auth string
    headers = {"Authorization": "Basic " + base64.b64encode(token.encode()).decode()}
    running = {"state": {"type": "RUNNING", "name": "Running"}, "force": True}
    attempts: dict[str, tuple[str, str, Any]] = {
        "name another team's flow": ("POST", "/flows/", {"name": victim_flow_name, "tags": [], "labels": {}}),
        "name it with a forged mark": (
            "POST",
            "/flows/",
            {"name": victim_flow_name, "labels": {"resoluto.registered-by-deployment": "forged"}},
        ),
        "create a run of it": (
            "POST",
            "/flow_runs/",
            {
                "flow_id": victim_flow_id,
                "parent_task_run_id": str(parent.id),
                "parameters": {"amount": 1_000_000},
                "state": {"type": "PENDING", "name": "Pending"},
            },
        ),
        "read its run": ("GET", f"/flow_runs/{victim_run_id}", None),
        "set its run running": ("POST", f"/flow_runs/{victim_run_id}/set_state", running),
        "read the flow": ("GET", f"/flows/{victim_flow_id}", None),
    }

    def send(http: httpx.Client, method: str, path: str, body: Any) -> httpx.Response:
        # As Prefect's client: a busy server's 503 (SQLite under a loaded suite) is retried.
        for delay in (0.5, 1, 2, 4, 8, 0):
            r = http.request(method, api + path, json=body)
            if r.status_code not in (429, 502, 503) or not delay:
                return r
            time.sleep(delay)  # a retry's back-off, as the client's own
        return r

    with httpx.Client(headers=headers, timeout=60) as http:
        for name, (method, path, body) in attempts.items():
            r = send(http, method, path, body)
            log.info("ATTEMPT %s: %s %s", name, r.status_code, r.text[:600])
    try:  # the engine's own way in: the client registers the flow by name
        with get_client(sync_client=True) as c:
            out: Any = c.create_flow_from_name(victim_flow_name)
        log.info("ATTEMPT the client registers it: ALLOWED %s", out)
    except Exception as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        log.info("ATTEMPT the client registers it: %s %s", status, e)
    got = identity_child(41)
    log.info("CHILD %s", got)
    return got
