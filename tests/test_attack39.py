"""Issue 39's closing attack pass: an outsider's attacks through the documented surfaces.

Each test asserts the secure behaviour; a failing test is a break. The gateway's attacks are
sent with a run's token straight to its gateway, the real (auth-string) server behind it, as
tests/test_api_gateway.py drives it.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from support.polling import wait_for
from test_api_gateway import (  # noqa: F401 - the module's server and worker, as there
    auth_server,
    gateway_for,
    parked_run,
    server,
)


def gvisor_runner(tmp_path: Path, memory: str = "256Mi") -> Any:
    """A cold gVisor runner of the drop-in flows whose one attempt is the attacker's."""
    from flows import dropin_flows as df

    from guest_runner.conduit import LocalConduit
    from prefect_resoluto import ResolutoTaskRunner

    return ResolutoTaskRunner(
        runtime="gvisor",
        conduit=LocalConduit(tmp_path / "conduit"),
        workspace=Path(df.__file__).parent,
        outputs_dir=tmp_path / "outputs",
        memory=memory,
        infrastructure_retries=0,
        warm_pool=0,
    )


def _task_run(flow_run_id: Any, name: str = "victim-task") -> Any:
    from prefect import task
    from prefect.client.orchestration import get_client

    @task(name=name)
    def t() -> None:
        pass

    with get_client(sync_client=True) as c:
        return c.create_task_run(task=t, flow_run_id=flow_run_id, dynamic_key=uuid.uuid4().hex)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat()


def _task_run_event(own_run: Any, task_run_id: str, task_run_payload: dict[str, Any], state: str) -> str:
    """A task-run state event as Prefect's engine sends it (resource: the task run; related:
    this flow run in the role `flow-run`), with the `task_run` payload the sandbox chooses."""
    return json.dumps(
        {
            "id": str(uuid.uuid4()),
            "occurred": _now(),
            "event": f"prefect.task-run.{state.title()}",
            "resource": {
                "prefect.resource.id": f"prefect.task-run.{task_run_id}",
                "prefect.resource.name": task_run_payload.get("name", "t"),
                "prefect.state-type": state,
                "prefect.state-name": state.title(),
                "prefect.orchestration": "client",
            },
            "related": [
                {
                    "prefect.resource.id": f"prefect.flow-run.{own_run.id}",
                    "prefect.resource.role": "flow-run",
                    "prefect.resource.name": own_run.name,
                },
            ],
            "payload": {
                "intended": {"from": None, "to": state},
                "initial_state": None,
                "validated_state": {"type": state, "name": state.title(), "message": "", "state_details": {}},
                "task_run": task_run_payload,
            },
        }
    )


def _send_events(gw: Any, events: list[str]) -> None:
    from websockets.asyncio.client import connect
    from websockets.typing import Subprotocol

    async def talk() -> None:
        async with connect(f"ws://{gw.address}/api/events/in", subprotocols=[Subprotocol("prefect")]) as ws:
            await ws.send(json.dumps({"type": "auth", "token": gw.token}))
            assert json.loads(await ws.recv()) == {"type": "auth_success"}
            for e in events:
                await ws.send(e)

    asyncio.run(talk())


def _read_task_run(task_run_id: Any) -> Any:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        try:
            return c.read_task_run(task_run_id)
        except Exception:
            return None


def _task_runs_of(flow_run_id: Any) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as c:
        return c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def _honest_payload(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "task_key": f"{name}-key",
        "dynamic_key": "0",
        "empirical_policy": {},
        "tags": [],
        "labels": {},
        "task_inputs": {},
        "run_count": 1,
        "flow_run_run_count": 1,
        "expected_start_time": _now(),
    }


def _sent_through(gw: Any, own: Any, attack: list[str]) -> None:
    """Send ``attack`` then an honest event of the run's own fresh task run, and wait until the
    server recorded the honest one: the recorder has taken the attack's batch by then."""
    marker = str(uuid.uuid4())
    _send_events(gw, [*attack, _task_run_event(own, marker, _honest_payload("marker"), "RUNNING")])
    wait_for(lambda: _read_task_run(marker), timeout=90, what="the run's own marker task run recorded")


@pytest.mark.prefect
def test_a_task_run_event_payload_cannot_rewrite_another_runs_task_run(server):  # noqa: F811
    """The resource and the `flow-run` related resource are the run's own (a fresh task run id),
    but the event's `payload.task_run` names the victim's task run by `id` and `flow_run_id`:
    Prefect's task-run recorder spreads that payload over the resource's ids."""
    own, victim = parked_run(), parked_run()
    victim_task = _task_run(victim.id)
    before = _read_task_run(victim_task.id)
    with gateway_for(own) as gw:
        payload = {
            **_honest_payload("pwned"),
            "id": str(victim_task.id),
            "flow_run_id": str(victim.id),
            "task_key": victim_task.task_key,
            "dynamic_key": victim_task.dynamic_key,
        }
        _sent_through(gw, own, [_task_run_event(own, str(uuid.uuid4()), payload, "COMPLETED")])
    after = _read_task_run(victim_task.id)
    assert after is not None and after.flow_run_id == victim.id
    assert after.name == before.name, f"the victim's task run was renamed by another run: {after.name}"
    assert (after.state.type if after.state else None) == (before.state.type if before.state else None), (
        f"the victim's task run state was set by another run: {after.state}"
    )


@pytest.mark.prefect
def test_a_task_run_event_payload_cannot_plant_a_task_run_in_another_run(server):  # noqa: F811
    """A fresh task run id, related flow run the run's own, `payload.task_run.flow_run_id` the
    victim's: no task run appears in the victim's flow run."""
    own, victim = parked_run(), parked_run()
    planted = str(uuid.uuid4())
    with gateway_for(own) as gw:
        payload = {**_honest_payload("planted"), "flow_run_id": str(victim.id)}
        _sent_through(gw, own, [_task_run_event(own, planted, payload, "COMPLETED")])
        assert gw.refused == 1, "the event naming another run in its payload is refused"
    assert [tr.name for tr in _task_runs_of(victim.id)] == [], "a task run was planted in another flow run"
    tr = _read_task_run(planted)
    assert tr is None or tr.flow_run_id == own.id, tr


# --------------------------------------------------------------------------- what a sandbox's events make the host do

#: A replaced guest runner writing the log events of ``LINES`` (a JSON list of (line, level,
#: logger)), then a successful result and the manifest, as tests/test_event_values.py's.
EVENTS_GUEST = r"""
import json, os, sys
from guest_runner import wire
run, node = os.environ["RESOLUTO_RUN_ID"], os.environ["RESOLUTO_NODE_ID"]
d = os.path.join(os.environ["RESOLUTO_STORE_ROOT"], os.environ["RESOLUTO_STORE_PREFIX"])
os.makedirs(d, exist_ok=True)
spec = json.loads(sys.argv[1])
lines = []
for text, level, logger, n in spec:
    for i in range(n):
        data = {"line": text % i if "%d" in text else text, "level": level}
        if logger is not None:
            data["logger"] = logger % i if "%d" in logger else logger
        lines.append(wire.encode_event(wire.make_event(run, "log", "log", data=data, ts=1.7e9)))
def put(rel, b):
    with open(os.path.join(d, ".resoluto-tmp-x"), "wb") as f:
        f.write(b)
    os.rename(os.path.join(d, ".resoluto-tmp-x"), os.path.join(d, rel))
put("events-000001.jsonl", wire.encode_chunk(lines))
put("result.json", wire.encode_result(wire.make_result(node, "success", 0, None)))
put("_manifest.json", wire.encode_manifest(1))
"""


def _run_with_guest_events(tmp_path: Any, spec: list[tuple[str, str, str | None, int]]) -> tuple[Any, str]:
    """A real flow whose one task's gVisor sandbox leaves the events ``spec`` describes."""
    from flows import dropin_flows as df
    from prefect import flow
    from test_hostile_outputs import _Patched

    runner = gvisor_runner(tmp_path)

    @flow(task_runner=runner)
    def attacked() -> str:
        try:
            return f"ok: {df.double.submit(1).result()}"
        except BaseException as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"

    with _Patched(["python3", "-c", EVENTS_GUEST, json.dumps(spec)]):
        state = attacked(return_state=True)
    return state, str(state.result(raise_on_failure=False))


@pytest.mark.prefect
@pytest.mark.sandbox
@pytest.mark.usefixtures("prefect")
def test_a_log_level_no_logger_knows_is_no_exception_out_of_the_host(gvisor, tmp_path):
    """`level` is checked as a string: a string naming no level (or a number's text) must be a
    protocol failure or a plain line, never an exception of the host's logging."""
    spec = [
        ("before", "INFO", None, 1),
        ("odd level", "NOTALEVEL", None, 1),
        ("numeric level", "50", None, 1),
        ("empty level", "", None, 1),
        ("after", "INFO", None, 1),
    ]
    state, shown = _run_with_guest_events(tmp_path, spec)
    # the replaced runner leaves no return value: the node's own verdict, not the host's fault
    assert "left no .resoluto/return.json" in shown or "broke the wire protocol" in shown, shown
    for exc in ("TypeError", "ValueError", "KeyError", "AttributeError"):
        assert exc not in shown, shown


@pytest.mark.prefect
@pytest.mark.sandbox
@pytest.mark.usefixtures("prefect")
def test_distinct_logger_names_cost_the_host_no_lasting_loggers(gvisor, tmp_path):
    """Each distinct `logger` a guest names must not become a logging.Logger the host's
    process keeps for ever (Logger.manager.loggerDict is never pruned): 20 000 names in one
    node would then outlive the node, outside any per-node allowance. 4 000 names (each a
    line the host forwards to the API) are four times what the assertion allows: a Logger
    per name fails it as surely as 20 000 did."""
    import logging

    before = len(logging.Logger.manager.loggerDict)
    spec = [("x", "INFO", "a.b%d.c.d", 4_000)]
    state, shown = _run_with_guest_events(tmp_path, spec)
    grown = len(logging.Logger.manager.loggerDict) - before
    assert grown < 1_000, f"the host now keeps {grown} more loggers ({shown[:200]})"


# --------------------------------------------------------------------------- many websockets at one gateway


def _own_sockets_to(port: int) -> int:
    """Established TCP connections of this process (the gateway's) to ``port``."""
    import os

    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    n = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            next(f)
            for row in f:
                cols = row.split()
                if cols[3] == "01" and int(cols[2].rsplit(":", 1)[1], 16) == port and cols[9] in inodes:
                    n += 1
    return n


def _operator_get(api: Any, run_id: Any) -> int | str:
    """The operator's own read of a run, straight at the API (no gateway): its status, or what
    went wrong within 60 s."""
    import httpx

    try:
        return httpx.get(
            f"{api.url}/flow_runs/{run_id}",
            headers={"Authorization": "Basic " + base64.b64encode(api.auth.encode()).decode()},
            timeout=60,
        ).status_code
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"


@pytest.mark.prefect
def test_many_event_websockets_from_one_run_hold_few_upstream_connections(server):  # noqa: F811
    """A run opens 200 events websockets at its gateway, authenticated, each sending one event of
    its own and staying open: the worker's gateway must not open 200 connections to the API for
    one run (its HTTP requests are 8 at once), and it still answers the run."""
    from urllib.parse import urlsplit

    from websockets.asyncio.client import connect
    from websockets.typing import Subprotocol

    own = parked_run()
    assert _operator_get(server, own.id) == 200
    api_port = urlsplit(server.url).port or 80
    base = _own_sockets_to(api_port)
    counts: list[int] = []
    with gateway_for(own) as gw:
        ev = json.dumps(
            {
                "id": str(uuid.uuid4()),
                "occurred": _now(),
                "event": "prefect.test.event",
                "resource": {"prefect.resource.id": f"prefect.flow-run.{own.id}"},
                "related": [],
                "payload": {},
            }
        )

        async def one(stack: Any) -> None:
            ws = await stack.enter_async_context(
                connect(
                    f"ws://{gw.address}/api/events/in", subprotocols=[Subprotocol("prefect")], open_timeout=60
                )
            )
            await ws.send(json.dumps({"type": "auth", "token": gw.token}))
            await ws.recv()
            await ws.send(ev)

        async def flood() -> None:
            import contextlib

            async with contextlib.AsyncExitStack() as stack:
                results = await asyncio.gather(*(one(stack) for _ in range(200)), return_exceptions=True)
                opened = sum(1 for r in results if r is None)
                await asyncio.sleep(0)  # the loop runs the gateway's threads meanwhile
                counts.append(opened)
                for _ in range(40):  # let upstream connections settle, measuring as they do
                    await asyncio.sleep(0.25)
                    counts.append(await asyncio.to_thread(_own_sockets_to, api_port) - base)
                # another client of the same API (the operator, any other run's gateway)
                counts.append(await asyncio.to_thread(_operator_get, server, own.id))

        asyncio.run(flood())
    opened, *upstream, status = counts
    assert max(upstream) <= 32, f"{opened} websockets of one run held {max(upstream)} connections to the API"
    assert status == 200, f"the API answered another client {status} while one run held its websockets"


def _peak_rss_kib() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _raw_websocket(gw: Any, path: str) -> Any:
    """An events websocket opened by hand, so that a frame can be sent a piece at a time
    (the client holds none of it)."""
    import socket

    s = socket.create_connection((gw.host, gw.port), timeout=60)
    key = base64.b64encode(uuid.uuid4().bytes).decode()
    s.sendall(
        (
            f"GET {path} HTTP/1.1\r\nHost: g\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: prefect\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(4096)
    assert head.startswith(b"HTTP/1.1 101"), head
    return s


def _frame_head(length: int) -> bytes:
    import struct

    # FIN + text; masked (a client's), 64-bit length; a zero mask key leaves the payload as is
    return b"\x81" + bytes([0x80 | 127]) + struct.pack(">Q", length) + b"\x00\x00\x00\x00"


@pytest.mark.prefect
def test_one_huge_event_message_is_refused_before_the_worker_holds_it(server):  # noqa: F811
    """An authenticated run sends one 256 MiB events message, a MiB at a time: the worker (here,
    the test's process, where the gateway runs) must not grow by it (its bodies are capped at
    a few MiB before they are read)."""
    own = parked_run()
    with gateway_for(own) as gw:
        s = _raw_websocket(gw, "/api/events/in")
        auth = json.dumps({"type": "auth", "token": gw.token}).encode()
        s.sendall(_frame_head(len(auth))[:1] + bytes([0x80 | len(auth)]) + b"\x00\x00\x00\x00" + auth)
        s.recv(4096)  # auth_success
        base = _peak_rss_kib()
        size = 256 * 1024 * 1024
        piece = b'{"x":"' + b"a" * (1024 * 1024 - 6)
        sent = 0
        try:
            s.sendall(_frame_head(size))
            while sent < size:
                chunk = piece if sent == 0 else b"a" * min(1024 * 1024, size - sent)
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # closed by the gateway: what a bounded reader does
        s.close()
        grown_mib = (_peak_rss_kib() - base) / 1024
    assert grown_mib < 64, f"one events message of {sent >> 20} MiB grew the worker by {grown_mib:.0f} MiB"


@pytest.mark.prefect
def test_no_spelling_of_the_pools_path_reads_its_base_job_template(server):  # noqa: F811
    """`own-work_pools` answers the run's pool without its base job template. Spellings the API
    reads as the same pool (percent-escapes, a trailing slash, a query, upper case) must not
    bring the template back."""
    import http.client

    own = parked_run()
    pool = server.worker.pool
    escaped = "".join(f"%{ord(c):02X}" for c in pool)
    first_escaped = f"%{ord(pool[0]):02X}{pool[1:]}"
    paths = [
        f"/api/work_pools/{pool}",
        f"/api/work_pools/{pool}/",
        f"/api/work_pools/{pool}?",
        f"/api/work_pools/{pool}?include=base_job_template",
        f"/api/work_pools/{escaped}",
        f"/api/work_pools/{first_escaped}",
        f"/api/work_pools/{pool}%2F",
        f"/api//work_pools/{pool}",
        f"/api/work_pools/./{pool}",
        f"/api/work_pools/{pool}#x",
        f"/api/Work_Pools/{pool}",
    ]
    leaked = []
    with gateway_for(own, deployment_id=None, work_pool_name=pool) as gw:
        for path in paths:
            conn = http.client.HTTPConnection(gw.host, gw.port, timeout=60)
            conn.request("GET", path, headers={"Authorization": f"Bearer {gw.token}"})
            r = conn.getresponse()
            body = r.read()
            conn.close()
            if r.status == 200 and json.loads(body).get("base_job_template"):
                leaked.append(path)
    assert leaked == [], f"the pool's base job template through {leaked}"


#: Opens argv[3] TCP connections to argv[1]:argv[2] and holds them, sending a byte of a head
#: now and then (each connection a slow sandbox request), until its stdin closes.
HOLDER = r"""
import socket, sys, threading, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
socks = []
for _ in range(n):
    try:
        socks.append(socket.create_connection((host, port), timeout=10))
    except OSError:
        break
print(len(socks), flush=True)
def drip():
    # each round: one more byte of a head on every connection, and how many the gateway
    # still holds (one it closed answers a send with a reset)
    while True:
        live = 0
        for s in socks:
            try:
                s.send(b"G")
                live += 1
            except OSError:
                pass
        print(live, flush=True)
        time.sleep(1)
threading.Thread(target=drip, daemon=True).start()
sys.stdin.read()
"""


def _open_fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


@pytest.mark.prefect
def test_one_runs_idle_connections_do_not_take_the_workers_file_descriptors(server):  # noqa: F811
    """A run opens 1 000 connections to its gateway and drips a head byte by byte: the worker's
    process (here the test's, where the gateway runs) must not hold a descriptor for each
    (its file descriptors are every run's: at its RLIMIT_NOFILE every gateway and sandbox of
    the worker fails). 1 000 is four times the descriptors the assertion allows."""
    import subprocess
    import sys

    import httpx

    own = parked_run()
    with gateway_for(own) as gw:
        base = _open_fds()
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, gw.host, str(gw.port), "1000"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

        def settled() -> tuple[int] | None:
            """The descriptors the gateway holds once it holds 256 (the break), or once the
            holder finds all but 256 of its connections closed (the gateway has dealt with
            them): an event either way, not a deadline that the secure case sits out."""
            if (n := _open_fds() - base) >= min(opened, 256):
                return (n,)
            line = holder.stdout.readline()  # type: ignore[union-attr]  # its next round, <= 1 s
            assert line, "the holder of the connections ended"
            return (_open_fds() - base,) if int(line) <= 256 else None

        try:
            opened = int(holder.stdout.readline())  # type: ignore[union-attr]
            (held,) = (
                wait_for(settled, timeout=60, what="the gateway to deal with its connections")
                if opened
                else (0,)
            )
            status: int | str = httpx.get(
                f"http://{gw.address}/api/flow_runs/{own.id}",
                headers={"Authorization": f"Bearer {gw.token}"},
                timeout=30,
            ).status_code
        except httpx.HTTPError as e:
            status = f"{type(e).__name__}"
        finally:
            holder.stdin.close()  # type: ignore[union-attr]
            holder.wait(timeout=60)
    # the run's own request meanwhile (its own business: its 8 slots are its own): {status}
    assert held < 256, (
        f"{opened} idle connections of one run hold {held} of the worker's descriptors (own request: {status})"
    )


# --------------------------------------------------------------------------- a sandbox's exception


@pytest.mark.prefect
@pytest.mark.sandbox
@pytest.mark.usefixtures("prefect")
def test_a_huge_exception_message_costs_the_flow_process_a_bounded_amount(gvisor, tmp_path):
    """A compromised runner's `.resoluto/error.json` with a 48 MiB message (well inside the
    256 Mi node's allowance, 48 KiB gzipped): the flow process (this one) must not grow by
    many times it, nor send it whole as the task run's state message."""
    import gzip
    import io
    import resource
    import tarfile

    from flows import dropin_flows as df
    from prefect import flow
    from support.prefect_readback import task_runs
    from test_hostile_outputs import _Patched, hostile_command

    size = 48 * 1024 * 1024
    record = (
        b'{"type": "ValueError", "module": "builtins", "qualname": "ValueError", "exception": true, "message": "'
        + b"[" * size
        + b'"}'
    )
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        ti = tarfile.TarInfo(".resoluto/error.json")
        ti.size = len(record)
        t.addfile(ti, io.BytesIO(record))
    outbox = gzip.compress(buf.getvalue(), 9)
    del record, buf

    runner = gvisor_runner(tmp_path)

    @flow(task_runner=runner)
    def victim() -> int:
        try:
            df.double.submit(1).result()
        except BaseException as e:  # noqa: BLE001
            return len(str(e))
        return -1

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with _Patched(hostile_command(outbox, status="failure")):
        state = victim(return_state=True)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    shown = state.result()
    (tr,) = task_runs(state.state_details.flow_run_id)
    stored = len(tr.state.message or "")
    # measured on the tree of this pass: +585 MiB, the host exception 50 331 648 characters
    assert stored < 1024 * 1024, f"the task run's state message holds {stored} characters of the sandbox's"
    assert grown_mib < 3 * 48, (
        f"a 48 MiB exception message grew the flow process by {grown_mib:.0f} MiB"
        f" (the host's exception holds {shown} characters)"
    )


#: A replaced guest runner writing argv[1] chunks of ~30 MiB, each all span events (open and
#: close of spans under the node), none of them a log line, then a result and the manifest.
SPANS_GUEST = r"""
import os, sys
from guest_runner import wire
run, node = os.environ["RESOLUTO_RUN_ID"], os.environ["RESOLUTO_NODE_ID"]
d = os.path.join(os.environ["RESOLUTO_STORE_ROOT"], os.environ["RESOLUTO_STORE_PREFIX"])
os.makedirs(d, exist_ok=True)
chunks = int(sys.argv[1])
def put(rel, b):
    with open(os.path.join(d, ".resoluto-tmp-x"), "wb") as f:
        f.write(b)
    os.rename(os.path.join(d, ".resoluto-tmp-x"), os.path.join(d, rel))
root = wire.make_event(run, "node", "open", name=node)
n = 0
for c in range(1, chunks + 1):
    lines = [wire.encode_event(root)] if c == 1 else []
    size = 0
    while size < 30 * 1024 * 1024:
        n += 1
        ev = wire.make_event(run, "step", "open", parent_span_id=root["span_id"], name="s%0120d" % n)
        lines.append(wire.encode_event(ev))
        lines.append(wire.encode_event(dict(ev, event="close", status="success")))
        size += len(lines[-1]) * 2
    if c == chunks:
        lines.append(wire.encode_event(dict(root, event="close", status="success")))
    put("events-%06d.jsonl" % c, wire.encode_chunk(lines))
put("result.json", wire.encode_result(wire.make_result(node, "success", 0, None)))
put("_manifest.json", wire.encode_manifest(chunks))
print("spans", n, flush=True)
"""


@pytest.mark.prefect
@pytest.mark.sandbox
@pytest.mark.usefixtures("prefect")
def test_a_flood_of_span_events_costs_the_flow_process_a_bounded_amount(gvisor, tmp_path):
    """Not a log line among them, so no log allowance applies: 2 chunks of 30 MiB of span
    events (~370 000 spans) from a 512 Mi node. The flow process must not keep them all (kept
    as they arrive, they cost it more than twice what the assertion allows)."""
    import resource

    from flows import dropin_flows as df
    from prefect import flow
    from test_hostile_outputs import _Patched

    runner = gvisor_runner(tmp_path, memory="512Mi")

    @flow(task_runner=runner)
    def victim() -> str:
        try:
            return f"ok: {df.double.submit(1).result()}"
        except BaseException as e:  # noqa: BLE001
            return f"{type(e).__name__}: {str(e)[:300]}"

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with _Patched(["python3", "-c", SPANS_GUEST, "2"]):
        state = victim(return_state=True)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    shown = state.result()
    # measured: +27 MiB; with the events kept as they arrive, +307 MiB
    assert grown_mib < 128, f"60 MiB of span events grew the flow process by {grown_mib:.0f} MiB ({shown})"


#: A replaced guest runner whose every free-text field carries terminal controls: the node
#: and workload spans' names, statuses and argv, a log line's level and logger, an error.
CLI_FORGER = r"""
import os
from guest_runner import wire
run, node = os.environ["RESOLUTO_RUN_ID"], os.environ["RESOLUTO_NODE_ID"]
prefix = os.environ["RESOLUTO_STORE_PREFIX"]
d = os.path.join(os.environ["RESOLUTO_STORE_ROOT"], prefix)
os.makedirs(d, exist_ok=True)
E = "\x1b]0;PWNED\x07\x1b[2J\r\n\u202e"
def put(rel, b):
    with open(os.path.join(d, ".resoluto-tmp-x"), "wb") as f:
        f.write(b)
    os.rename(os.path.join(d, ".resoluto-tmp-x"), os.path.join(d, rel))
root = wire.make_event(run, "node", "open", name=node + E, data={"argv": ["true" + E]})
wl = wire.make_event(run, "workload", "open", parent_span_id=root["span_id"], name="w" + E, data={"argv": ["x" + E, E]})
log = wire.make_event(run, "log", "log", parent_span_id=wl["span_id"], data={"line": "l" + E, "level": "ERROR" + E, "logger": "g" + E})
wlc = dict(wl, event="close", status="success" + E, data={"exit_code": 0})
err = wire.make_event(run, "error", "log", parent_span_id=wl["span_id"], data={"line": "e" + E, "level": "ERROR"})
rc = dict(root, event="close", status="success" + E, data={"exit_code": 0})
put("events-000001.jsonl", wire.encode_chunk([wire.encode_event(x) for x in (root, wl, log, err, wlc, rc)]))
put("result.json", wire.encode_result(wire.make_result(node, "success", 0, None, reason="r" + E)))
put("_manifest.json", wire.encode_manifest(1))
"""


@pytest.mark.sandbox
def test_the_run_cli_escapes_every_field_a_forged_event_stream_carries(gvisor, tmp_path, capsys):
    """`prefect-resoluto run` (stdout and its stderr notes: spans opening and closing, the
    verdict) with a guest whose span names, statuses, argv, levels and loggers carry controls."""
    import re

    from test_hostile_outputs import _Patched

    from prefect_resoluto import cli

    with _Patched(["python3", "-c", CLI_FORGER]):
        code = cli.main(
            ["run", "--runtime", "gvisor", "--conduit", str(tmp_path / "c"), "--run-id", "run1"]
            + ["--node-id", "node1", "--", "true"]
        )
    shown = capsys.readouterr()
    printed = shown.out + shown.err
    raw = [
        ln
        for ln in printed.splitlines()
        if re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e]", ln)
    ]
    assert "PWNED" in printed, printed
    assert raw == [], f"exit {code}; lines with raw controls: {raw}"
    assert not any(ln.startswith("\\x1b") or ln.startswith("[2J") for ln in printed.splitlines()), printed


# --------------------------------------------------------------------------- a trusted task worker


TRUSTED_TASKS = r"""
import os, sys
from pathlib import Path
from prefect import task

@task(name="approve-payment")
def approve_payment() -> None:
    Path(os.environ["MARKER"]).write_text(f"ran on the host as pid {os.getpid()}")
"""

SERVE = r"""
from trusted_tasks import approve_payment
from prefect.task_worker import serve
print("KEY", approve_payment.task_key, flush=True)
serve(approve_payment)
"""


@pytest.mark.prefect
@pytest.mark.parametrize("how", ["set_state", "create"])
def test_a_run_cannot_schedule_a_background_task_a_trusted_task_worker_runs(server, tmp_path, how):  # noqa: F811
    """An operator serves a task on a trusted host (`prefect task serve`, a TaskWorker). A
    sandboxed run creates a task run of its own with that task's key and sets it Scheduled
    with `state_details.deferred`: Prefect enqueues it for the task's workers. The trusted
    host must never run it."""
    import os
    import subprocess
    import sys
    import threading

    (tmp_path / "trusted_tasks.py").write_text(TRUSTED_TASKS)
    marker = tmp_path / "host-marker"
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path),
        "PREFECT_API_URL": server.url,
        "PREFECT_API_AUTH_STRING": server.auth,
        "MARKER": str(marker),
    }
    served = subprocess.Popen(
        [sys.executable, "-c", SERVE],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(iter(served.stdout.readline, "")), daemon=True).start()  # type: ignore[union-attr]
    try:
        key = wait_for(
            lambda: next((ln.split()[1] for ln in out if ln.startswith("KEY ")), None),
            timeout=90,
            what="the key",
        )
        wait_for(lambda: any("Subscribing to runs" in ln for ln in out), timeout=90, what="the task worker")
        own = parked_run()
        with gateway_for(own) as gw:
            import httpx

            h = {"Authorization": f"Bearer {gw.token}"}
            base = f"http://{gw.address}/api"
            deferred = {"type": "SCHEDULED", "name": "Scheduled", "state_details": {"deferred": True}}
            body = {
                "flow_run_id": str(own.id),
                "task_key": key,
                "dynamic_key": uuid.uuid4().hex,
                "name": "approve-payment",
            }
            if how == "create":
                body["state"] = deferred
            created = httpx.post(f"{base}/task_runs/", headers=h, json=body, timeout=60)
            answers: list[Any] = [created.status_code, created.text[:300]]
            if how == "set_state" and created.status_code in (200, 201):
                tr = created.json()["id"]
                scheduled = httpx.post(
                    f"{base}/task_runs/{tr}/set_state",
                    headers=h,
                    json={"state": deferred, "force": True},
                    timeout=60,
                )
                answers += [scheduled.status_code, scheduled.text[:300]]
        ran = None
        if answers[-2] in (200, 201):
            try:
                ran = wait_for(
                    lambda: marker.exists() and marker.read_text(),
                    timeout=60,
                    what="the trusted host running it",
                )
            except AssertionError:
                ran = None
    finally:
        served.terminate()
        served.wait(timeout=60)
    assert not ran, f"a sandboxed run made a trusted task worker run its task: {ran} ({answers})"


@pytest.mark.prefect
@pytest.mark.parametrize("where", ["validated_state", "task_run.state"])
@pytest.mark.parametrize("detail", [("deferred", "yes"), ("task_parameters_id", "UUID")])
def test_a_task_run_event_cannot_record_a_background_task_run(server, where, detail):  # noqa: F811
    """Prefect's task-run recorder writes a task-run event's state as sent (its
    `validated_state`, or a `state` in its `task_run` payload, which overrides it): a Scheduled
    state with `state_details.deferred` (`"yes"`: the server's pydantic reads it as true) or a
    `task_parameters_id` is a background task run in the API, made by the sandbox."""
    own = parked_run()
    key, value = detail
    value = str(uuid.uuid4()) if value == "UUID" else value
    tr = str(uuid.uuid4())
    event = json.loads(_task_run_event(own, tr, _honest_payload("approve-payment"), "SCHEDULED"))
    state = {"type": "SCHEDULED", "name": "Scheduled", "message": "", "state_details": {key: value}}
    if where == "validated_state":
        event["payload"]["validated_state"] = state
    else:
        event["payload"]["task_run"]["state"] = {**state, "id": str(uuid.uuid4()), "timestamp": _now()}
    with gateway_for(own) as gw:
        _sent_through(gw, own, [json.dumps(event)])
    recorded = _read_task_run(tr)
    details = recorded.state.state_details if recorded is not None and recorded.state else None
    assert details is None or not (details.deferred or details.task_parameters_id), (
        f"a sandbox's event recorded a background task run: {recorded.state}"
    )


# --------------------------------------------------------------------------- exception classes a sandbox names


@pytest.mark.prefect
@pytest.mark.sandbox
@pytest.mark.usefixtures("prefect")
@pytest.mark.parametrize(
    ("module", "qualname"),
    [
        ("builtins", "SystemExit"),
        ("builtins", "KeyboardInterrupt"),
        ("asyncio.exceptions", "CancelledError"),
        ("prefect.exceptions", "Pause"),
        ("prefect.exceptions", "Abort"),
        ("prefect.exceptions", "CancelledRun"),
        ("prefect.exceptions", "TerminationSignal"),
    ],
)
def test_an_exception_class_that_stops_the_host_is_not_raised_there(gvisor, tmp_path, module, qualname):
    """error.json names a class the host has (builtins, modules already imported): one that is
    no Exception but a BaseException that stops the host's process or cancels its work must
    not be raised in the flow process as is: the task fails, the flow goes on."""
    import tarfile

    from flows import dropin_flows as df
    from prefect import flow
    from test_hostile_outputs import _Patched, hostile_command, tar_gz

    record = json.dumps(
        {
            "type": qualname,
            "module": module,
            "qualname": qualname,
            "exception": True,
            "message": "from the sandbox",
        }
    ).encode()
    ti = tarfile.TarInfo(".resoluto/error.json")
    ti.size = len(record)
    outbox = tar_gz([(ti, record)])
    runner = gvisor_runner(tmp_path)

    @flow(task_runner=runner)
    def victim() -> str:
        try:
            df.double.submit(1).result()
        except Exception as e:  # noqa: BLE001
            return f"failed: {type(e).__name__}"
        return "no error"

    with _Patched(hostile_command(outbox, status="failure")):
        try:
            state = victim(return_state=True)
            raised = None
        except BaseException as e:  # noqa: BLE001
            state, raised = None, e
    assert raised is None, f"the sandbox's {qualname} was raised out of the host's flow: {raised!r}"
    assert state is not None and state.is_completed(), state
    assert str(state.result()).startswith("failed: "), state.result()


# --------------------------------------------------------------------------- reading what is not the run's


@pytest.mark.prefect
def test_no_read_endpoint_hands_a_run_another_runs_data(server):  # noqa: F811
    """Another run's artifact (by key and id), logs, task runs, graph and counts, and the
    server's settings, through every read the API offers: none may answer with them."""
    import http.client

    from prefect.client.orchestration import get_client

    own, victim = parked_run(), parked_run()
    victim_task = _task_run(victim.id)
    secret_text = f"victim-report-{uuid.uuid4().hex}"
    key = f"victim-key-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as c:
        r = c._client.post(
            "/artifacts/",
            json={"key": key, "type": "markdown", "data": secret_text, "flow_run_id": str(victim.id)},
        )
        art = r.json()["id"]
        c._client.post(
            "/logs/",
            json=[
                {
                    "name": "victim",
                    "level": 20,
                    "message": secret_text,
                    "timestamp": _now(),
                    "flow_run_id": str(victim.id),
                    "task_run_id": str(victim_task.id),
                }
            ],
        )
    reads = [
        ("GET", f"/api/artifacts/{key}/latest", None),
        ("GET", f"/api/artifacts/{art}", None),
        ("POST", "/api/artifacts/filter", {}),
        ("POST", "/api/artifacts/latest/filter", {}),
        ("POST", "/api/logs/filter", {}),
        ("POST", "/api/logs/filter", {"logs": {"flow_run_id": {"any_": [str(victim.id)]}}}),
        ("GET", f"/api/task_runs/{victim_task.id}", None),
        ("POST", "/api/task_runs/filter", {"flow_runs": {"id": {"any_": [str(victim.id)]}}}),
        ("GET", f"/api/flow_runs/{victim.id}/graph", None),
        ("GET", f"/api/flow_runs/{victim.id}/graph-v2", None),
        ("POST", "/api/ui/flow_runs/history", {}),
        ("POST", "/api/ui/task_runs/dashboard/counts", {}),
        ("POST", "/api/flow_runs/count", {}),
        ("POST", "/api/flows/filter", {}),
        ("POST", "/api/deployments/filter", {}),
        ("POST", "/api/ui/flows/next-runs", {"flow_ids": []}),
        ("GET", "/api/admin/settings", None),
        ("POST", "/api/events/filter", {}),
        ("POST", "/api/automations/filter", {}),
        ("POST", "/api/v2/concurrency_limits/filter", {}),
        ("POST", "/api/work_pools/filter", {}),
        ("POST", "/api/block_documents/filter", {}),
        ("GET", f"/api/flow_runs/{own.id}/../{victim.id}", None),
    ]
    leaked = []
    with gateway_for(own) as gw:
        for method, path, body in reads:
            conn = http.client.HTTPConnection(gw.host, gw.port, timeout=60)
            headers = {"Authorization": f"Bearer {gw.token}", "Content-Type": "application/json"}
            conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
            r = conn.getresponse()
            text = r.read().decode(errors="replace")
            conn.close()
            if r.status < 400 and (
                secret_text in text or str(victim.id) in text or key in text or "database" in text
            ):
                leaked.append((method, path, r.status, text[:200]))
    assert leaked == [], leaked
