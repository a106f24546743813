"""A malformed value in a guest's event is a protocol failure naming the node (issue 39,
finding 6), never an exception out of the host's handlers.

A replaced guest runner may write any JSON it likes in an event's fields: ``"ts": Infinity``
(which Python's json reads by default, and ``int(record.created)`` then raises
OverflowError out of the log forwarder), ``1e400`` (read as infinity), a timestamp past the
year 9999 or before the epoch, a 4000-digit integer, ``true`` where a number belongs, an
object where a string does, junk nested in ``data``. The property tests feed such chunks
through the host's real path: a local conduit, the node's ChunkTailer and the task runner's
EventLogForwarder building the API rows Prefect's handler would send. The end-to-end test
runs a real task run whose gVisor sandbox writes ``"ts": Infinity``.
"""

from __future__ import annotations

import itertools
import json
import logging
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from flows import dropin_flows as df
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prefect import flow

from guest_runner import wire
from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.tail import ChunkTailer, MalformedChunk
from prefect_resoluto.task_runner.logs import ApiLogBatcher, EventLogForwarder

FLOWS = Path(df.__file__).parent
RUN = "run-values"
_nodes = itertools.count()
BAD = "__BAD_VALUE__"


@contextmanager
def forwarding() -> Iterator[tuple[ApiLogBatcher, list[logging.LogRecord]]]:
    """The task runner's forwarder as a task run has it: Prefect's API handler on its
    logger (rows built, queued on a batcher that sends nothing here) and a console handler."""
    from prefect.logging.handlers import APILogHandler

    seen: list[logging.LogRecord] = []

    class Console(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            self.format(record)  # as a console handler renders it
            seen.append(record)

    target = logging.getLogger("prefect.task_runs")
    handlers = [APILogHandler(), Console()]
    level = target.level
    target.setLevel(logging.DEBUG)
    for h in handlers:
        target.addHandler(h)
    try:
        yield ApiLogBatcher(), seen
    finally:
        for h in handlers:
            target.removeHandler(h)
        target.setLevel(level)


def forwarder(batcher: ApiLogBatcher, node_id: str) -> EventLogForwarder:
    import uuid

    return EventLogForwarder(
        task_run_id=uuid.uuid4(), flow_run_id=uuid.uuid4(), node_id=node_id, batcher=batcher
    )


def good(i: int) -> dict[str, Any]:
    return dict(
        wire.make_event(RUN, "log", "log", data={"line": f"line {i}", "level": "WARNING"}, ts=1.7e9 + i)
    )


def with_raw(ev: dict[str, Any], path: tuple[str, ...], raw: str) -> str:
    """``ev`` encoded with the value at ``path`` (a field, or ``data`` then a key) replaced by
    the JSON text ``raw``, as a hostile writer would put it on the line."""
    ev = json.loads(json.dumps(ev))
    holder = ev
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = BAD
    line = wire.encode_event(ev)  # type: ignore[arg-type]
    assert line.count(f'"{BAD}"') == 1
    return line.replace(f'"{BAD}"', raw)


def tail_chunk(lines: list[str]) -> tuple[str, str, list[dict[str, Any]], int, Exception | None]:
    """One chunk of ``lines`` through a fresh node's tailer into its forwarder: (the chunk's
    key, the node id, the events delivered, the API rows built, what the poll raised)."""
    node = f"node{next(_nodes)}"
    with tempfile.TemporaryDirectory() as d, forwarding() as (batcher, _console):
        conduit = LocalConduit(Path(d))
        prefix = wire.node_prefix(RUN, node)
        key = wire.chunk_key(prefix, 1)
        conduit.put(key, wire.encode_chunk(lines))
        fwd = forwarder(batcher, node)
        delivered: list[dict[str, Any]] = []

        def on_event(ev: wire.SpanEvent) -> None:
            delivered.append(dict(ev))
            fwd(ev)

        tailer = ChunkTailer(conduit, prefix)
        raised: Exception | None = None
        try:
            tailer.poll(on_event)
        except Exception as e:  # noqa: BLE001 -- what escapes is the finding
            raised = e
        finally:
            tailer.close()
        return key, node, delivered, len(batcher._pending), raised


def _huge_int() -> st.SearchStrategy[str]:
    return st.integers(min_value=int(wire.MAX_EVENT_TS) + 1, max_value=10**4000).map(str) | st.just(
        "9" * 5000
    )


_NON_FINITE = st.sampled_from(["Infinity", "-Infinity", "NaN", "1e400", "-1e400", "1E999"])
_NOT_A_NUMBER = st.sampled_from(['"1700000000"', "true", "false", "null", "[]", "{}", "[1.5]", '{"ts": 1}'])
_NOT_A_STRING = st.sampled_from(
    ["1", "0", "-3.5", "true", "false", "null", "[]", '["x"]', "{}", '{"a": "b"}']
)
# Junk nested in data: values Python's json would read (and the host once forwarded).
_NESTED_JUNK = st.sampled_from(
    ['{"a": [1, {"b": NaN}]}', "[Infinity]", '{"x": -Infinity}', "[[[1e400]]]", '{"deep": [{"n": 1E999}]}']
)

#: (where, the raw JSON put there, what the failure names)
MALFORMED = st.one_of(
    st.tuples(st.just(("ts",)), _NON_FINITE | _NOT_A_NUMBER | _huge_int(), st.just("ts")),
    st.tuples(
        st.just(("ts",)),
        st.floats(max_value=-1e-6, allow_nan=False, allow_infinity=False).map(repr)
        | st.floats(min_value=wire.MAX_EVENT_TS + 1, allow_nan=False, allow_infinity=False).map(repr)
        | st.integers(max_value=-1).map(str),
        st.just("ts"),
    ),
    st.tuples(
        st.sampled_from(
            [("run_id",), ("span_id",), ("parent_span_id",), ("kind",), ("name",), ("event",), ("status",)]
        ),
        _NOT_A_STRING,
        st.just(""),
    ),
    st.tuples(
        st.just(("data",)),
        st.sampled_from(['"line"', "1", "true", "null", "[]", '[{"line": "x"}]']),
        st.just("data"),
    ),
    st.tuples(st.sampled_from([("data", "line"), ("data", "level")]), _NOT_A_STRING, st.just("data.")),
    st.tuples(
        st.just(("data", "logger")), _NOT_A_STRING.filter(lambda v: v != "null"), st.just("data.logger")
    ),
    st.tuples(
        st.just(("data", "argv")),
        st.sampled_from(['"ls -l"', "[1, 2]", '["ls", null]', '[["x"]]', "{}", "true"]),
        st.just("data.argv"),
    ),
    st.tuples(
        st.just(("data", "exit_code")),
        st.sampled_from(["true", "false", "1.5", '"0"', "[]", "{}", str(2**31 + 1), str(-(2**63))])
        | _NON_FINITE,
        st.just(""),
    ),
    st.tuples(
        st.just(("data", "artifact")), st.sampled_from(['"x"', "1", "[]", "true"]), st.just("data.artifact")
    ),
    st.tuples(st.just(("data", "extra")), _NESTED_JUNK, st.just("")),
)


def _target(path: tuple[str, ...]) -> dict[str, Any]:
    """A well-formed event that has the field ``path`` names (a close carries exit_code, an
    open argv, an artifact log its record)."""
    if path == ("data", "exit_code"):
        return dict(
            wire.make_event(
                RUN, "workload", "close", name="w", status="failure", data={"exit_code": 1}, ts=1.7e9
            )
        )
    if path == ("data", "argv"):
        return dict(wire.make_event(RUN, "workload", "open", name="w", data={"argv": ["true"]}, ts=1.7e9))
    if path == ("data", "artifact"):
        return dict(wire.make_event(RUN, "artifact", "log", data={"line": "a", "artifact": {}}, ts=1.7e9))
    ev = good(1)
    ev["data"] = dict(ev["data"], logger="lg", extra=1)
    return ev


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=MALFORMED, before=st.integers(min_value=0, max_value=3))
def test_a_malformed_value_is_a_protocol_failure_naming_the_node_and_the_rest_is_orderly(case, before):
    """Every malformed value: a MalformedChunk (what the driver turns into the node's
    protocol failure) naming the node's chunk, the line and the field; every event before it
    forwarded, with its API row; nothing after it; nothing else raised."""
    path, raw, names = case
    lines = [wire.encode_event(good(i)) for i in range(before)]  # type: ignore[arg-type]
    lines += [with_raw(_target(path), path, raw), wire.encode_event(good(99))]  # type: ignore[arg-type]
    key, node, delivered, rows, raised = tail_chunk(lines)
    assert isinstance(raised, MalformedChunk), f"{path}={raw[:60]}: {type(raised).__name__}: {raised}"
    message = str(raised)
    assert key in message and f"/nodes/{node}/" in message and f"line {before + 1}" in message, message
    # What it names: the value JSON itself refuses (NaN, Infinity, 1e400, 5000 digits), or the field.
    refused_by_json = any(t in raw for t in ("NaN", "Infinity", "e400", "E999")) or len(raw) > 4300
    assert ("not valid JSON" if refused_by_json else names or path[-1]) in message, message
    assert [e["data"]["line"] for e in delivered] == [f"line {i}" for i in range(before)]
    assert rows == before, "each event before the bad one reached the API rows"


_TEXT = st.text(max_size=40)
_SCALAR = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT
)
_JSONISH = st.recursive(
    _SCALAR,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=10,
)

WELL_FORMED = st.fixed_dictionaries(
    {
        "run_id": _TEXT,
        "span_id": _TEXT,
        "parent_span_id": _TEXT,
        "kind": st.sampled_from(["log", "error", "workload", "node", "artifact", "heartbeat"]) | _TEXT,
        "name": _TEXT,
        "event": st.sampled_from(wire.EVENT_KINDS),
        "ts": st.floats(min_value=0, max_value=wire.MAX_EVENT_TS)
        | st.integers(min_value=0, max_value=int(wire.MAX_EVENT_TS)),
        "status": st.sampled_from(["", "success", "failure", "other"]) | _TEXT,
        "data": st.fixed_dictionaries(
            {},
            optional={
                "line": _TEXT,
                "level": st.sampled_from(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", ""]) | _TEXT,
                "logger": st.none() | _TEXT,
                "argv": st.lists(_TEXT, max_size=4),
                "exit_code": st.none() | st.integers(min_value=-(2**31), max_value=2**31),
                "other": _JSONISH,
            },
        ),
    }
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(WELL_FORMED, min_size=1, max_size=4))
def test_well_formed_values_are_forwarded_whole(events):
    """The other side: any event the check lets through is forwarded without an exception,
    every one of them, each with a row whose timestamp Prefect takes."""
    lines = [json.dumps(e, separators=(",", ":"), ensure_ascii=False) for e in events]
    _key, _node, delivered, _rows, raised = tail_chunk(lines)
    assert raised is None, f"{type(raised).__name__}: {raised}"
    assert len(delivered) == len(events)
    assert all(isinstance(e["ts"], float) for e in delivered)


def test_a_chunk_of_the_finding_fails_as_a_protocol_failure():
    """The finding's line, exactly: a log event with ``"ts": Infinity`` between two good ones."""
    bad = wire.encode_event(good(1)).replace('"ts":1700000001.0', '"ts":Infinity')  # type: ignore[arg-type]
    assert '"ts":Infinity' in bad
    _key, node, delivered, rows, raised = tail_chunk(
        [wire.encode_event(good(0)), bad, wire.encode_event(good(2))]  # type: ignore[arg-type]
    )
    assert isinstance(raised, MalformedChunk) and "Infinity" in str(raised) and node in str(raised), raised
    assert len(delivered) == 1 and rows == 1


#: A replaced guest runner: a good log line, then one whose ts is Infinity, then another
#: good one, then a successful result and the manifest, as a guest would leave them.
INFINITE_TS_GUEST = r"""
import os
from guest_runner import wire
run, node = os.environ["RESOLUTO_RUN_ID"], os.environ["RESOLUTO_NODE_ID"]
d = os.path.join(os.environ["RESOLUTO_STORE_ROOT"], os.environ["RESOLUTO_STORE_PREFIX"])
os.makedirs(d, exist_ok=True)
def line(text, ts):
    return wire.encode_event(wire.make_event(run, "log", "log", data={"line": text, "level": "WARNING"}, ts=ts))
bad = line("the bad line", 1.0).replace('"ts":1.0', '"ts":Infinity')
def put(rel, b):
    with open(os.path.join(d, ".resoluto-tmp-x"), "wb") as f:
        f.write(b)
    os.rename(os.path.join(d, ".resoluto-tmp-x"), os.path.join(d, rel))
put("events-000001.jsonl", wire.encode_chunk([line("before the bad line", 1.7e9), bad, line("after it", 1.7e9)]))
put("result.json", wire.encode_result(wire.make_result(node, "success", 0, None)))
put("_manifest.json", wire.encode_manifest(1))
"""


@pytest.mark.prefect
@pytest.mark.sandbox
@pytest.mark.usefixtures("prefect")
def test_an_infinite_ts_from_a_real_sandbox_fails_the_task_as_a_protocol_failure(gvisor, tmp_path):
    from support.prefect_readback import task_runs
    from test_hostile_outputs import _Patched, _runner
    from test_task_runner import logs_of

    conduit = LocalConduit(tmp_path / "conduit")
    runner = _runner(tmp_path, conduit)

    @flow(task_runner=runner)
    def victim() -> str:
        try:
            df.double.submit(1).result()
        except BaseException as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return "no error"

    with _Patched(["python3", "-c", INFINITE_TS_GUEST]):
        state = victim(return_state=True)
    shown = state.result()
    assert "OverflowError" not in shown, shown
    assert "broke the wire protocol" in shown and "Infinity" in shown, shown
    (tr,) = task_runs(state.state_details.flow_run_id)
    assert tr.state is not None and tr.state.is_failed()
    assert "broke the wire protocol" in (tr.state.message or ""), tr.state.message
    assert "/nodes/" in (tr.state.message or "") and "events-000001.jsonl at line 2" in (
        tr.state.message or ""
    )
    messages = [entry.message for entry in logs_of(tr.id)]
    assert "before the bad line" in messages, messages  # the event before the fault is kept
    assert "after it" not in messages
