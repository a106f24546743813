"""What the host reads of a conduit is bounded and streamed (issue 30, finding 3).

A compromised runner in a real gVisor/bubblewrap sandbox writes an event chunk, a line, a
manifest or a result far bigger than any guest writes; the host refuses each as a
protocol failure naming the limit, having read no more than the limit (counted on the
streams it opened). S3 refuses from ContentLength before reading the body. A hypothesis
property checks the line reader against the whole-read it replaces.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hostile_outputs import _Patched

from guest_runner import wire
from guest_runner.conduit import LocalConduit
from prefect_resoluto.node import bounded
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes import get_runtime
from prefect_resoluto.runtimes.base import Resources


class _Counted(io.RawIOBase):
    def __init__(self, f: BinaryIO, sink: list[int]) -> None:
        super().__init__()
        self._f, self._sink = f, sink

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self._f.read(len(b))
        self._sink.append(len(data))
        b[: len(data)] = data
        return len(data)

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        self._f.close()
        super().close()


class CountingConduit(LocalConduit):
    """Counts the bytes the host reads of each object."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.read: dict[str, list[int]] = {}

    def get(self, key: str) -> bytes:
        data = super().get(key)
        self.read.setdefault(key, []).append(len(data))
        return data

    def get_stream(self, key: str) -> BinaryIO:
        return io.BufferedReader(_Counted(super().get_stream(key), self.read.setdefault(key, [])))

    def bytes_read(self, suffix: str) -> int:
        return sum(sum(v) for k, v in self.read.items() if k.endswith(suffix))


#: Writes one object of the node (argv: its name, what to write: big-chunk | long-line |
#: big-manifest | big-result), the rest as an honest guest would, then succeeds.
WRITER = r"""
import os, sys
from guest_runner import wire
run, node = os.environ["RESOLUTO_RUN_ID"], os.environ["RESOLUTO_NODE_ID"]
prefix = os.environ["RESOLUTO_STORE_PREFIX"]
d = os.path.join(os.environ["RESOLUTO_STORE_ROOT"], prefix)
os.makedirs(d, exist_ok=True)
what = sys.argv[1]
ev = wire.make_event(run, "node", "open", name=node)
close = dict(ev, event="close", status="success", ts=ev["ts"] + 0.001)
good = wire.encode_chunk([wire.encode_event(ev), wire.encode_event(close)])
def put(rel, b):
    with open(os.path.join(d, ".tmp"), "wb") as f:
        f.write(b)
    os.rename(os.path.join(d, ".tmp"), os.path.join(d, rel))
def big(n, line):  # written whole, then published (as a guest does: the host sees it whole)
    with open(os.path.join(d, ".tmp"), "wb") as f:
        one = (wire.encode_event(dict(ev, event="log", kind="log", data={"line": "x" * (1 << 20)})) + "\n").encode()
        if line:
            f.write(b'{"pad": "' + b"y" * n + b'"}\n')
        else:
            for _ in range(n // len(one) + 1):
                f.write(one)
        f.write(good)
    os.rename(os.path.join(d, ".tmp"), os.path.join(d, "events-000001.jsonl"))
if what == "big-chunk":
    big(40 << 20, False)
elif what == "long-line":
    big(20 << 20, True)
else:
    put("events-000001.jsonl", good)
result = wire.encode_result(wire.make_result(node, "success", 0, None))
if what == "big-result":
    result = result[:-1] + b', "reason": "' + b"r" * (20 << 20) + b'"}'
put("result.json", result)
put("_manifest.json", b'{"total_chunks": 1' + (b" " * (8 << 20) if what == "big-manifest" else b"") + b"}")
"""


@pytest.fixture(params=["gvisor", "bubblewrap"])
def rt(request: pytest.FixtureRequest) -> Any:
    r = get_runtime(request.param)
    if not r.availability().ok:
        pytest.skip(f"{request.param} is not available here: {r.availability().why}")
    return r


@pytest.mark.sandbox
@pytest.mark.parametrize(
    "what,said,limit,suffix",
    [
        (
            "big-chunk",
            "more than the 33554432 bytes the host reads of an event chunk",
            wire.MAX_CHUNK_BYTES,
            ".jsonl",
        ),
        ("long-line", "line 1 is longer than 16777216 bytes", wire.MAX_LINE_BYTES, ".jsonl"),
        (
            "big-manifest",
            "the 4096 bytes the host reads of a manifest",
            wire.MAX_MANIFEST_BYTES,
            "_manifest.json",
        ),
        ("big-result", "the 16777216 bytes the host reads of a result", wire.MAX_RESULT_BYTES, "result.json"),
    ],
)
def test_an_oversized_object_is_refused_having_read_at_most_the_limit(
    rt, tmp_path, what, said, limit, suffix
):
    conduit = CountingConduit(tmp_path / "conduit")
    spec = NodeSpec(
        run_id="run1",
        node_id="node1",
        argv=["true"],
        resources=Resources.from_quantities(memory="512Mi", cpus="1"),
    )
    with _Patched(["python3", "-c", WRITER, what]):
        outcome = drive_node(spec, conduit, rt, min_isolation="none")
    assert outcome.failure == "protocol", outcome.describe()
    assert said in outcome.reason, outcome.reason
    # The local conduit says the size before any byte: nothing of the object was read.
    assert conduit.bytes_read(suffix) <= limit + (1 << 20), conduit.read


def test_s3_refuses_from_content_length_without_reading_the_body(s3_conduit, monkeypatch):
    from guest_runner.conduit import s3 as s3conduit

    s3_conduit.put("run/r/nodes/n/events-000001.jsonl", b"z" * (1 << 20))
    reads: list[int | None] = []
    real = s3conduit._Body.read

    def counted(self: Any, size: int | None = -1) -> bytes:
        data: bytes = real(self, size)
        reads.append(len(data))
        return data

    monkeypatch.setattr(s3conduit._Body, "read", counted)
    with pytest.raises(bounded.TooLarge, match="1048576 bytes, more than the 65536 bytes"):
        list(bounded.chunk_lines(s3_conduit, "run/r/nodes/n/events-000001.jsonl", max_bytes=1 << 16))
    assert reads == []
    lines = list(bounded.chunk_lines(s3_conduit, "run/r/nodes/n/events-000001.jsonl", max_line=1 << 20))
    assert lines == [(1, b"z" * (1 << 20))]
    assert max(reads) <= 1 << 20  # in pieces, never the whole body at once beyond the buffer


# -- the property: the bounded line reader is the whole read it replaces, or refuses ----------
lines_st = st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=20)


@settings(max_examples=300, deadline=None)
@given(lines=lines_st, trailing=st.booleans(), max_line=st.integers(1, 50), max_bytes=st.integers(1, 600))
def test_chunk_lines_matches_a_whole_read_within_the_limits(
    tmp_path_factory, lines, trailing, max_line, max_bytes
):
    raw = b"\n".join(lines) + (b"\n" if trailing and lines else b"")
    conduit = LocalConduit(tmp_path_factory.mktemp("c"))
    conduit.put("run/r/nodes/n/events-000001.jsonl", raw)
    whole = raw.split(b"\n")
    if raw.endswith(b"\n") or not raw:
        whole = whole[:-1]
    expected = list(enumerate(whole, start=1))
    too_big = len(raw) > max_bytes or any(len(x) > max_line for x in whole)
    try:
        got = list(
            bounded.chunk_lines(
                conduit, "run/r/nodes/n/events-000001.jsonl", max_bytes=max_bytes, max_line=max_line
            )
        )
    except bounded.TooLarge:
        assert too_big
    else:
        assert not too_big and got == expected


@settings(max_examples=100, deadline=None)
@given(events=st.lists(st.text(max_size=30), min_size=1, max_size=10))
def test_honest_chunks_read_as_before(tmp_path_factory, events):
    """A chunk as resoluto-sandbox 0.1.0 writes it (wire.encode_chunk) reads the same."""
    evs = [wire.make_event("r", "log", "log", data={"line": t}) for t in events]
    raw = wire.encode_chunk([wire.encode_event(e) for e in evs])
    conduit = LocalConduit(tmp_path_factory.mktemp("c"))
    conduit.put("k/events-000001.jsonl", raw)
    got = [
        wire.decode_event(line.decode()) for _, line in bounded.chunk_lines(conduit, "k/events-000001.jsonl")
    ]
    assert [g["data"]["line"] for g in got] == events
