"""Flows that run behind the resoluto worker's API gateway (tests/test_api_gateway.py).

``ordinary`` is what a normal flow does: tasks, a retry, logs, an artifact, a persisted
result, an allowed Secret block and an allowed variable. ``hostile`` tries what a flow
holding the worker's credential could do; each attempt is logged as ``ATTEMPT <name>:
refused <status> <detail>`` or ``ATTEMPT <name>: ALLOWED``. Both look for the worker's
credential everywhere the sandbox lets them look.
"""

from __future__ import annotations

import base64
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact

_ATTEMPTS = {"n": 0}


def find_credential(patterns: list[str]) -> list[str]:
    """Where any of ``patterns`` (regexes of the worker's credential) occurs: the environment,
    every process's argv and environment, and the files of the workspace, HOME and /tmp."""
    rx = [re.compile(p.encode()) for p in patterns]
    found: list[str] = []

    def look(where: str, data: bytes) -> None:
        if any(r.search(data) for r in rx):
            found.append(where)

    look("env", "\0".join(f"{k}={v}" for k, v in os.environ.items()).encode())
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            for part in ("cmdline", "environ"):
                try:
                    look(f"/proc/{proc.name}/{part}", (proc / part).read_bytes())
                except OSError:
                    pass
    roots = {Path.cwd(), Path.home(), Path("/tmp")}
    if os.environ.get("RESOLUTO_STORE_ROOT"):
        roots.add(Path(os.environ["RESOLUTO_STORE_ROOT"]))  # the conduit, as the sandbox sees it
    for root in roots:
        for dirpath, _dirs, files in os.walk(root):
            for name in files:
                p = Path(dirpath) / name
                try:
                    if p.is_file() and p.stat().st_size < 4 << 20:
                        look(str(p), p.read_bytes())
                except OSError:
                    pass
    return found


@task(retries=2, retry_delay_seconds=0)
def flaky(x: int) -> int:
    _ATTEMPTS["n"] += 1
    get_run_logger().info("flaky attempt %d", _ATTEMPTS["n"])
    if _ATTEMPTS["n"] < 2:
        raise ValueError("the first attempt fails")
    return x * 2


@task(tags=["gateway-test"])  # a tagged task asks the API for its tag's concurrency slot
def add(a: int, b: int) -> int:
    return a + b


@flow
def child(x: int) -> int:
    """A sub-flow: a flow run of its own, created by this run's engine through the gateway."""
    get_run_logger().info("child flow %d", x)
    return add(x, 1)


@flow(persist_result=True)
def ordinary(patterns: list[str], block: str, variable: str) -> int:
    from prefect.blocks.system import Secret
    from prefect.variables import Variable

    log = get_run_logger()
    doubled = flaky(3)
    total = sum(f.result() for f in [add.submit(doubled, i) for i in range(2)])
    create_markdown_artifact(f"# total\n{total}", key="gateway-total", description="the flow's total")
    facts = {
        "api_url": os.environ.get("PREFECT_API_URL"),
        "block_ok": Secret.load(block).get() == "allowed-value",
        "variable": Variable.get(variable),
        "credential_found": find_credential(patterns),
        "total": total,
        "child": child(total),
    }
    log.info("FACTS %s", json.dumps(facts))
    return total


def _flush_logs() -> None:
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()


def _attempt(name: str, fn) -> None:  # type: ignore[no-untyped-def]
    log = get_run_logger()
    try:
        out = fn()
    except Exception as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        detail = ""
        try:
            detail = e.response.json().get("detail", "")  # type: ignore[attr-defined]
        except Exception:
            detail = str(e)
        log.info("ATTEMPT %s: refused %s %s", name, status, detail)
        return
    log.info("ATTEMPT %s: ALLOWED %r", name, out)


@flow
def hostile(victim: str, patterns: list[str], other_block: str, other_variable: str, release: str) -> None:
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import LogCreate, WorkPoolCreate
    from prefect.context import FlowRunContext
    from prefect.events import emit_event
    from prefect.states import Completed
    from prefect.types._datetime import now
    from prefect.variables import Variable

    log = get_run_logger()
    ctx = FlowRunContext.get()
    assert ctx is not None and ctx.flow_run is not None
    own_flow = ctx.flow_run.flow_id
    log.info("FACTS %s", json.dumps({"credential_found": find_credential(patterns)}))
    _flush_logs()
    # The test looks at this sandbox's files on the host meanwhile, then sets the variable.
    deadline = time.monotonic() + 180
    while Variable.get(release) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    with get_client(sync_client=True) as c:
        _attempt("read a Secret block it was not given", lambda: Secret.load(other_block).get())
        _attempt("read a variable it was not given", lambda: Variable.get(other_variable))
        _attempt("read another run", lambda: c.read_flow_run(victim))
        _attempt("set another run's state", lambda: c.set_flow_run_state(victim, Completed(), force=True))
        _attempt("list other runs", lambda: c.read_flow_runs(limit=5))
        _attempt(
            "create a work pool",
            lambda: c.create_work_pool(WorkPoolCreate(name="hostile-pool", type="process")),
        )
        _attempt(
            "create a deployment",
            lambda: c.create_deployment(
                flow_id=own_flow, name="hostile-deployment", work_pool_name="hostile-pool"
            ),
        )
        _attempt(
            "write another run's logs",
            lambda: c.create_logs(
                [LogCreate(name="x", level=20, message="forged", timestamp=now("UTC"), flow_run_id=victim)]
            ),
        )
        _attempt("read the work pools", lambda: c.read_work_pools())
    # An event about another run (an automation trigger): the websocket cannot answer it; the
    # gateway drops it and says so in this run's logs.
    emit_event(
        event="prefect.flow-run.Completed", resource={"prefect.resource.id": f"prefect.flow-run.{victim}"}
    )
    log.info("ATTEMPT emitted an event about another run")


@task
def own_task() -> None:
    """A task run of the planter's own: the parent its planted runs name."""


@flow
def planter(
    pool: str, marker: str, secret_block: str, other_tag: str, victim_flow: str, victim_key: str
) -> None:
    """Issue 29's attacks, from inside the sandbox with nothing but the gateway's address and
    token: each is logged ``ATTEMPT <name>: <status> <body>``."""
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    assert ctx is not None and ctx.flow_run is not None
    own, own_flow = str(ctx.flow_run.id), str(ctx.flow_run.flow_id)
    with get_client(sync_client=True) as c:
        parent = c.create_task_run(task=own_task, flow_run_id=ctx.flow_run.id, dynamic_key="planted")
        tagged = c.create_task_run(
            task=own_task.with_options(tags=["mine"]), flow_run_id=ctx.flow_run.id, dynamic_key="t"
        )
    api = os.environ["PREFECT_API_URL"]
    token = os.environ["PREFECT_API_AUTH_STRING"]  # the run's gateway token, as its auth string
    headers = {"Authorization": "Basic " + base64.b64encode(token.encode()).decode()}
    planted = {
        "flow_id": own_flow,
        "parent_task_run_id": str(parent.id),
        "work_pool_name": pool,
        "state": {"type": "SCHEDULED"},
        "job_variables": {"runtime": "process", "min_isolation": "none", "command": f"touch {marker}"},
    }
    attempts = {
        "plant a run on the pool": ("POST", "/flow_runs/", planted),
        "plant a run without a pool field, but scheduled": (
            "POST",
            "/flow_runs/",
            {"flow_id": own_flow, "parent_task_run_id": str(parent.id), "state": {"type": "SCHEDULED"}},
        ),
        "template a secret": (
            "POST",
            "/flow_runs/",
            {
                "flow_id": own_flow,
                "parent_task_run_id": str(parent.id),
                "job_variables": {"env": {"X": "{{ prefect.blocks.secret." + secret_block + " }}"}},
            },
        ),
        "list every run": (
            "POST",
            "/flow_runs/filter",
            {"flow_runs": {"operator": "or_", "id": {"any_": [own]}, "name": {"like_": ""}}},
        ),
        "list by parent, widened": (
            "POST",
            "/flow_runs/filter",
            {
                "flow_runs": {
                    "operator": "or_",
                    "parent_task_run_id": {"any_": [str(parent.id)]},
                    "name": {"like_": ""},
                }
            },
        ),
        "claim another run by its idempotency key": (
            "POST",
            "/flow_runs/",
            {"flow_id": victim_flow, "idempotency_key": victim_key, "parent_task_run_id": str(parent.id)},
        ),
        "take another tag's slots": (
            "POST",
            "/v2/concurrency_limits/increment-with-lease",
            {
                "names": [f"tag:{other_tag}"],
                "slots": 1,
                "mode": "concurrency",
                "holder": {"type": "task_run", "id": str(tagged.id)},
                "lease_duration": 60,
            },
        ),
    }

    def send(http: httpx.Client, method: str, path: str, body: Any) -> httpx.Response:
        # As Prefect's client: a busy server's 503 (SQLite under a loaded suite) is retried.
        for delay in (0.5, 1, 2, 4, 8, 0):
            r = http.request(method, api + path, json=body)
            if r.status_code not in (429, 502, 503) or not delay:
                return r
            time.sleep(delay)  # a retry's back-off, as the client's own
        return r

    with httpx.Client(base_url=api, headers=headers, timeout=60) as http:
        for name, (method, path, body) in attempts.items():
            r = send(http, method, path, body)
            get_run_logger().info("ATTEMPT %s: %s %s", name, r.status_code, r.text[:600])
        # what the engine itself does for a tagged task passes: its own tag
        r = send(
            http,
            "POST",
            "/v2/concurrency_limits/increment-with-lease",
            {
                "names": ["tag:mine"],
                "slots": 1,
                "mode": "concurrency",
                "holder": {"type": "task_run", "id": str(tagged.id)},
                "lease_duration": 60,
            },
        )
        get_run_logger().info("OWN TAG %s", r.status_code)
    _flush_logs()


def _retried(send: Any) -> Any:
    """As Prefect's client: a busy server's 503 (SQLite under a loaded suite) is retried
    (longer than the client: several runs writing MBs at once keep SQLite busy longer)."""
    for delay in (0.5, 1, 2, 4, 8, 8, 8, 8, 8, 0):
        r = send()
        if r.status_code not in (429, 502, 503) or not delay:
            return r
        time.sleep(delay)  # a retry's back-off, as the client's own
    return r


@flow
def hoarder(
    count: int, param_bytes: int, context_bytes: int, at_once: int, ids_per_listing: int, release: str
) -> None:
    """Issue 39 finding 2: ``count`` sub-flow runs of its own flow, each with ``param_bytes``
    of parameters and ``context_bytes`` of context (under the gateway's body cap), then
    ``at_once`` listings at once of ``ids_per_listing`` of their ids (admitted: its own
    runs), each logged ``LISTED <status> <bytes> <detail>``; the test reads the worker's
    memory between ``MADE`` and setting the variable ``release``."""
    import concurrent.futures

    import httpx
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext
    from prefect.variables import Variable

    ctx = FlowRunContext.get()
    assert ctx is not None and ctx.flow_run is not None
    own_flow = str(ctx.flow_run.flow_id)
    with get_client(sync_client=True) as c:
        parent = c.create_task_run(task=own_task, flow_run_id=ctx.flow_run.id, dynamic_key="hoard")
    api = os.environ["PREFECT_API_URL"]
    token = os.environ["PREFECT_API_AUTH_STRING"]
    headers = {"Authorization": "Basic " + base64.b64encode(token.encode()).decode()}
    made: list[str] = []
    with httpx.Client(base_url=api, headers=headers, timeout=120) as http:
        for i in range(count):
            body = {
                "flow_id": own_flow,
                "parent_task_run_id": str(parent.id),
                "name": f"hoard-{i}",
                "parameters": {"p": "x" * param_bytes},
                "context": {"c": "y" * context_bytes},
                "state": {"type": "PENDING", "name": "Pending"},
            }
            r = _retried(lambda: http.post("/flow_runs/", json=body))  # noqa: B023 - called at once
            assert r.status_code == 201, (r.status_code, r.text[:300])
            made.append(r.json()["id"])
        get_run_logger().info("MADE %d", len(made))
        _flush_logs()
        deadline = time.monotonic() + 180
        while Variable.get(release) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        listing = {"flow_runs": {"id": {"any_": made[:ids_per_listing]}}, "limit": ids_per_listing}

        def ask(_: int) -> str:
            try:
                r = _retried(lambda: http.post("/flow_runs/filter", json=listing))
            except httpx.HTTPError as e:
                return f"error 0 {type(e).__name__}: {e}"
            if r.status_code != 200:
                return f"{r.status_code} {len(r.content)} {r.text[:300]}"
            rows = r.json()  # delivered whole and correct: every run named, every byte of it
            whole = sorted(row["id"] for row in rows) == sorted(listing["flow_runs"]["id"]["any_"]) and all(
                row["parameters"] == {"p": "x" * param_bytes} and row["context"] == {"c": "y" * context_bytes}
                for row in rows
            )
            return f"200 {len(r.content)} {len(rows)} {'whole' if whole else 'WRONG'}"

        with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
            answers = list(pool.map(ask, range(at_once)))
    for a in answers:
        get_run_logger().info("LISTED %s", a)
    _flush_logs()


def _raw_hold(api: str, token: str, path: str, body: Any) -> tuple[Any, str]:
    """A request whose answer is never read, as a hoarder sends it: a socket whose receive
    buffer is as small as the kernel allows, the answer's head read and nothing more."""
    import socket
    import urllib.parse

    url = urllib.parse.urlsplit(api)
    raw = json.dumps(body).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.connect((url.hostname, url.port))
    auth = base64.b64encode(token.encode()).decode()
    s.sendall(
        f"POST {url.path}{path} HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Basic {auth}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    head = b""
    while b"\r\n\r\n" not in head:
        got = s.recv(1)
        if not got:
            break
        head += got
    return s, head.split(b"\r\n\r\n")[0].decode(errors="replace")


@flow
def budget_hoarder(budget: int, margin: int, release: str) -> None:
    """Issue 39: one run holding its whole budget for answers in flight. It lists its own
    sub-flow runs, made so that the listing's answer is ``budget - margin`` bytes, and never
    reads the answer (``HOLDING <head>``); then asks for more than its budget (``OVER <status>
    <detail>``), and a small read of its own waits for the budget it holds (``WAITED <status>
    <detail>``). Once the variable ``release`` is ``check`` it lets go of the answer, and the
    same read passes (``AFTER <status>``)."""
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext
    from prefect.variables import Variable

    log = get_run_logger()
    ctx = FlowRunContext.get()
    assert ctx is not None and ctx.flow_run is not None
    with get_client(sync_client=True) as c:
        parent = c.create_task_run(task=own_task, flow_run_id=ctx.flow_run.id, dynamic_key="hold")
    api = os.environ["PREFECT_API_URL"]
    token = os.environ["PREFECT_API_AUTH_STRING"]
    headers = {"Authorization": "Basic " + base64.b64encode(token.encode()).decode()}
    chunk = 3 << 19  # 1.5 MiB of context a run: under the gateway's 2 MiB body cap
    with httpx.Client(base_url=api, headers=headers, timeout=120) as http:

        def make(name: str, size: int) -> str:
            body = {
                "flow_id": str(ctx.flow_run.flow_id),
                "parent_task_run_id": str(parent.id),
                "name": name,
                "context": {"c": "y" * size},  # parameters are at most 512 KiB (Prefect's own bound)
                "state": {"type": "PENDING", "name": "Pending"},
            }
            r = _retried(lambda: http.post("/flow_runs/", json=body))
            assert r.status_code == 201, (r.status_code, r.text[:300])
            return str(r.json()["id"])

        def listing(ids: list[str]) -> dict[str, Any]:
            return {"flow_runs": {"id": {"any_": ids}}, "limit": len(ids)}

        probe = make("hold-probe", 1000)
        r = _retried(lambda: http.get(f"/flow_runs/{probe}"))
        assert r.status_code == 200, r.text[:300]
        per_run = len(r.content) - 1000  # a run's answer besides its context
        made = [make(f"hold-{i}", chunk) for i in range(-(-(budget - margin) // chunk) - 1)]
        r = _retried(lambda: http.post("/flow_runs/filter", json=listing(made)))
        assert r.status_code == 200, r.text[:300]
        # The last run tops the listing up to budget - margin: a comma, its overhead, the rest.
        last = budget - margin - len(r.content) - 1 - per_run
        assert 0 < last <= chunk, (budget, len(r.content), per_run)
        made.append(make("hold-last", last))
        held, head = _raw_hold(api, token, "/flow_runs/filter", listing(made))
        log.info("HOLDING %s", " ".join(head.splitlines()))
        r = http.post("/flow_runs/filter", json=listing([*made, probe]))
        log.info("OVER %s %s", r.status_code, r.text[:400])
        _flush_logs()
        r = http.get(f"/flow_runs/{probe}")
        log.info("WAITED %s %s", r.status_code, r.text[:400])
        _flush_logs()
        deadline = time.monotonic() + 300
        while Variable.get(release) != "check" and time.monotonic() < deadline:
            time.sleep(0.2)
        held.close()
        log.info("AFTER %s", _retried(lambda: http.get(f"/flow_runs/{probe}")).status_code)
    _flush_logs()


@flow
def neighbour(n: int) -> int:
    """Ordinary engine work beside a hoarding run: tasks, a sub-flow, logs, a result."""
    total = sum(f.result() for f in [add.submit(i, 1) for i in range(n)])
    # A sub-flow of its own name: a flow belongs to the deployment whose run registered it
    # first, and `ordinary`'s deployment, on the same server, registers `child`.
    total = child.with_options(name="neighbour-child")(total)
    get_run_logger().info("NEIGHBOUR %d", total)
    return total
