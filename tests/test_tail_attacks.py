"""An outside review of the host's event tail (prefect_resoluto/node/tail.py): a hostile guest
writes into its node's directory, on a local conduit and on S3 (moto behind the counting proxy),
and the host must stay bounded and end the node with a clear error.

Tests marked FIXED were breaks found by that review (each failed on the tree it attacked);
the others held then and must keep holding.
No sleeps for synchronisation: a fake clock drives every grace and back-off.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.quiet_hub import drain_hub

from guest_runner import wire
from guest_runner.conduit import Conduit, LocalConduit
from prefect_resoluto.node import tail
from prefect_resoluto.node.tail import ChunkTailer, MalformedChunk, ManifestMismatch, MissingChunk, TailError

P = wire.node_prefix("r", "n")


def ev_line(i: int, kind: str = "log") -> str:
    return wire.encode_event(wire.make_event("r", kind, "log", data={"line": str(i)}, ts=float(i)))


def put_chunk(c: Conduit, idx: int, items: list[int], kind: str = "log") -> None:
    c.put(wire.chunk_key(P, idx), wire.encode_chunk([ev_line(i, kind) for i in items]))


def put_manifest(c: Conduit, total: int) -> None:
    c.put(wire.result_key(P), wire.encode_result(wire.make_result("n", "success", 0)))
    c.put(wire.manifest_key(P), wire.encode_manifest(total))


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Counting(LocalConduit):
    """A local conduit that records its requests and how many keys each listing returned."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.calls: list[tuple[str, str]] = []
        self.listed: list[int] = []

    def list_prefix(self, prefix, start_after=None, shallow=False, limit=None):
        self.calls.append(("LIST", start_after or ""))
        keys = super().list_prefix(prefix, start_after, shallow, limit)
        self.listed.append(len(keys))
        return keys

    def get_stream(self, key):
        self.calls.append(("GET", key))
        return super().get_stream(key)


class Store:
    def __init__(self, kind: str, conduit: Conduit, counts, raw_put) -> None:
        self.kind, self.conduit, self._counts, self.raw_put = kind, conduit, counts, raw_put
        self._base: dict[str, int] = {}

    def reset(self) -> None:
        self._base = dict(self._counts())

    def requests(self) -> dict[str, int]:
        now = self._counts()
        return {k: now[k] - self._base.get(k, 0) for k in now if now[k] - self._base.get(k, 0)}

    def put_many(self, rels: list[str], data: bytes = b"") -> None:
        """What a guest writes in bulk, straight to the store (not counted as the host's)."""
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda r: self.raw_put(r, data), rels))


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        c = Counting(tmp_path / "c")
        node = c.root / P

        def raw_put(rel: str, data: bytes) -> None:
            node.mkdir(parents=True, exist_ok=True)
            (node / rel).write_bytes(data)

        return Store(
            "local",
            c,
            lambda: {k: sum(1 for kind, _ in c.calls if kind == k) for k in ("LIST", "GET")},
            raw_put,
        )
    moto = request.getfixturevalue("moto_server")
    counter = request.getfixturevalue("s3_counter")
    conduit = request.getfixturevalue("s3_conduit")
    raw = moto.raw_client()
    request.addfinalizer(raw.close)

    def s3_put(rel: str, data: bytes) -> None:
        raw.put_object(Bucket=conduit.bucket, Key=f"{conduit.base_prefix}/{P}/{rel}", Body=data)

    # This test's bucket only: a thread another test left behind (a host's heartbeat, a sweep)
    # may still be talking to the session's endpoint about its own bucket.
    return Store("s3", conduit, lambda: counter.snapshot(conduit.bucket), s3_put)


def collect(t: ChunkTailer) -> list[str]:
    got: list[str] = []
    t.poll(lambda e: got.append(e["data"].get("line", "")))
    return got


def run_to_error(t: ChunkTailer, clock: FakeClock, step: float = 0.5, rounds: int = 40) -> TailError:
    """Poll, advancing the fake clock, until the tail raises (a bounded number of rounds)."""
    for _ in range(rounds):
        try:
            t.poll(lambda e: None)
        except TailError as e:
            return e
        clock.t += step
    raise AssertionError(f"no error after {rounds} polls: delivered={t.delivered} total={t.total}")


# -- 1. JSON nested deeper than the parser's recursion limit ---------------------------------------
DEEP = "[" * 100_000


def test_deeply_nested_event_line_is_a_tail_error(store):
    # FIXED: json.loads raises RecursionError (not ValueError), which wire.decode_event does not
    # catch; it escapes ChunkTailer.poll as a non-TailError, and drive's _poll only catches
    # TailError/ConduitError (see test_deeply_nested_line_through_drive_node_is_a_protocol_failure).
    c = store.conduit
    c.put(wire.chunk_key(P, 1), (ev_line(1) + "\n" + DEEP + "\n").encode())
    t = ChunkTailer(c, P)
    got: list[str] = []
    with pytest.raises(TailError) as ei:
        t.poll(lambda e: got.append(e["data"]["line"]))
    assert got == ["1"]  # what preceded the fault was delivered
    assert "line 2" in str(ei.value)


def test_deeply_nested_manifest_is_a_manifest_mismatch(store):
    # FIXED: the same RecursionError out of wire.decode_manifest (4096 bytes are plenty), escaping
    # check_manifest/poll instead of ManifestMismatch.
    c = store.conduit
    put_chunk(c, 1, [1])
    c.put(wire.manifest_key(P), b"[" * 4000)
    t = ChunkTailer(c, P)
    with pytest.raises(ManifestMismatch):
        t.poll(lambda e: None)


def test_deeply_nested_line_through_drive_node_is_a_protocol_failure(local_conduit, tmp_path):
    conduit = local_conduit
    # FIXED: through the real path (process runtime, the guest replaced by a hostile script):
    # drive_node, documented "never raises for a failed node", raises RecursionError; the node gets
    # no outcome at all instead of a protocol failure.
    from test_hostile_outputs import _Patched

    from prefect_resoluto.node.drive import drive_node
    from prefect_resoluto.node.spec import NodeSpec
    from prefect_resoluto.runtimes import get_runtime

    script = r"""
import json, os
d = os.path.join(os.environ["RESOLUTO_STORE_ROOT"], os.environ["RESOLUTO_STORE_PREFIX"])
os.makedirs(d, exist_ok=True)
def put(rel, b):
    tmp = os.path.join(d, ".resoluto-tmp-x")
    with open(tmp, "wb") as f:
        f.write(b)
    os.rename(tmp, os.path.join(d, rel))
put("events-000001.jsonl", b"[" * 100000 + b"\n")
put("result.json", json.dumps({"node_id": os.environ["RESOLUTO_NODE_ID"], "status": "success", "exit_code": 0,
    "output_archive": None, "observed_phase": "", "reason": "", "substrate_logs": ""}).encode())
put("_manifest.json", b'{"total_chunks": 1}')
"""
    spec = NodeSpec(run_id="run1", node_id="node1", argv=["true"])
    with _Patched([sys.executable, "-c", script]):
        outcome = drive_node(spec, conduit, get_runtime("process"), min_isolation="none")
    assert outcome.failure == "protocol", outcome.describe()


# -- 2. Listings: the end check and the gap probe hold every key the guest wrote -------------------
def _list_cost(store: Store) -> int:
    r = store.requests()
    return r.get("LIST", 0)


def test_end_listing_is_bounded_whatever_the_guest_wrote_beyond_the_manifest(store):
    # FIXED: the one listing at the end pages through every key under "events-" after the last
    # chunk and holds them all (S3Conduit.list_prefix collects every page; the local walk every
    # name in the directory). 1 100 junk keys that are not even chunk names cost 2 LIST pages on
    # S3 and are all held in memory; the node still succeeds. Millions cost thousands of
    # sequential LIST requests and ~100+ bytes each of host memory, all inside one poll.
    c = store.conduit
    n = 1100
    store.put_many([f"events-z{i:07d}" for i in range(n)])
    put_chunk(c, 1, [1])
    put_manifest(c, 1)
    t = ChunkTailer(c, P)
    store.reset()
    assert collect(t) == ["1"] and t.finished  # junk is not a chunk: the node "succeeds"
    if store.kind == "s3":
        assert _list_cost(store) <= 1, store.requests()  # 2 pages here
    else:
        assert max(c.listed) <= 1000, c.listed  # all 1 100 names held


def test_end_listing_memory_on_a_local_conduit(tmp_path):
    # FIXED: 50 000 empty files named events-<junk> in the node's directory (inodes, no blocks):
    # the end listing's peak Python allocation grows with them (7.7 MiB here, 15.5 MiB for 100 000: ~160 bytes a name, linear).
    c = Counting(tmp_path / "c")
    node = c.root / P
    node.mkdir(parents=True)
    for i in range(50_000):
        os.close(os.open(node / f"events-{i:07d}x", os.O_CREAT | os.O_WRONLY, 0o644))
    put_chunk(c, 1, [1])
    put_manifest(c, 1)
    # Measured in a process of its own: tracemalloc's peak counts every thread's allocations,
    # and this one's may hold others (a heartbeat writer lingering after an earlier test).
    probe = (
        "import sys, tracemalloc\n"
        "from guest_runner.conduit import LocalConduit\n"
        "from prefect_resoluto.node.tail import ChunkTailer\n"
        f"t = ChunkTailer(LocalConduit({str(c.root)!r}), {P!r})\n"
        "tracemalloc.start()\n"
        "t.poll(lambda e: None)\n"
        "print(t.finished, tracemalloc.get_traced_memory()[1])\n"
    )
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, check=True)
    finished, peak = out.stdout.split()
    assert finished == "True"
    assert int(peak) < 4 << 20, f"end listing peak {int(peak) / 2**20:.1f} MiB for 50 000 junk names"


def test_gap_probe_listing_is_bounded(store):
    # FIXED (cost): chunks 2..1101 written, chunk 1 never. The gap probe (after 30 s of silence)
    # lists all 1 100 keys (2 LIST pages on S3) to learn the one fact it needs (some chunk after
    # the next exists). The error itself is right: MissingChunk naming events-000001.jsonl.
    c, clock = store.conduit, FakeClock()
    body = wire.encode_chunk([ev_line(0)])
    store.put_many([f"events-{i:06d}.jsonl" for i in range(2, 1102)], body)
    t = ChunkTailer(c, P, clock=clock)
    t.arm()
    store.reset()
    clock.t += tail.GAP_PROBE_AFTER + 0.1
    t.poll(lambda e: None)
    lists = _list_cost(store)
    clock.t += tail.MISSING_CHUNK_GRACE + 0.1
    with pytest.raises(MissingChunk, match="events-000001.jsonl is missing"):
        t.poll(lambda e: None)
    if store.kind == "s3":
        assert lists <= 1, store.requests()
    else:
        assert max(c.listed) <= 1000, c.listed


def test_a_later_chunk_past_the_six_digit_boundary_is_listed():
    # FIXED (latent): _chunks_after lists with StartAfter=events-999999.jsonl, and
    # "events-1000000.jsonl" < "events-999999.jsonl" as strings: a chunk beyond a manifest of
    # 999 999, or a gap at chunk 1 000 000, is never seen by the recovery listing (the end check
    # passes; a gap is only caught by the 600 s silence window). Called directly: a real stream
    # of a million chunks is too long for a test.
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        c = LocalConduit(d)
        c.put(wire.chunk_key(P, 1_000_000), wire.encode_chunk([ev_line(1)]))
        t = ChunkTailer(c, P)
        assert t._chunk_after(999_999) == wire.chunk_key(P, 1_000_000)


# -- 3. The manifest -----------------------------------------------------------------------------
@pytest.mark.parametrize("total", [10**12, int("9" * 4000)])
def test_a_manifest_claiming_absurdly_many_chunks_ends_after_the_grace(store, total):
    # HOLDS: nothing is allocated per declared chunk; MissingChunk after the 2 s grace.
    c, clock = store.conduit, FakeClock()
    put_chunk(c, 1, [1])
    c.put(wire.manifest_key(P), b'{"total_chunks": %d}' % total)
    t = ChunkTailer(c, P, clock=clock)
    store.reset()
    e = run_to_error(t, clock)
    assert isinstance(e, MissingChunk) and "events-000002.jsonl is missing" in str(e)
    assert t.events_delivered == 1
    assert _list_cost(store) == 0


@pytest.mark.parametrize(
    "raw",
    [
        b'{"total_chunks": 1' + b" " * 5000 + b"}",
        b'{"total_chunks": -1}',
        b'{"total_chunks": 1.0}',
        b'{"total_chunks": true}',
        b"\xff\xfe",
        b"null",
        b'{"total_chunks": "1"}',
    ],
)
def test_a_bad_or_huge_manifest_is_a_mismatch(store, raw):
    # HOLDS
    c = store.conduit
    put_chunk(c, 1, [1])
    c.put(wire.manifest_key(P), raw)
    t = ChunkTailer(c, P)
    with pytest.raises(ManifestMismatch):
        t.poll(lambda e: None)


def test_a_manifest_that_changes_after_it_was_read_is_not_reread(store):
    # HOLDS: the first manifest read is final.
    c, clock = store.conduit, FakeClock()
    put_chunk(c, 1, [1])
    put_manifest(c, 2)
    t = ChunkTailer(c, P, clock=clock)
    assert collect(t) == ["1"] and t.total == 2
    c.put(wire.manifest_key(P), wire.encode_manifest(1))  # shrinks
    put_chunk(c, 2, [2])
    assert collect(t) == ["2"] and t.finished and t.total == 2


def test_a_chunk_replaced_after_it_was_read_is_never_read_again(store):
    # HOLDS: first version wins, each chunk is delivered once.
    c = store.conduit
    put_chunk(c, 1, [1])
    t = ChunkTailer(c, P)
    assert collect(t) == ["1"]
    put_chunk(c, 1, [666, 667])
    put_chunk(c, 2, [2])
    put_manifest(c, 2)
    t.check_manifest()
    assert collect(t) == ["2"] and t.finished and t.events_delivered == 2


# -- 4. Chunk names ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name",
    [
        "events-1.jsonl",
        "events-+00001.jsonl",
        "events-0000001.jsonl",
        "events-00001.jsonl",
        "events-000001.jsonl.tmp",
        "Events-000001.jsonl",
    ],
)
def test_odd_width_chunk_names_are_never_read_as_chunk_one(store, name):
    # HOLDS: only the canonical key is fetched; the missing chunk is named after the grace.
    c, clock = store.conduit, FakeClock()
    store.raw_put(name, wire.encode_chunk([ev_line(1)]).decode().encode())
    put_manifest(c, 1)
    t = ChunkTailer(c, P, clock=clock)
    e = run_to_error(t, clock)
    assert isinstance(e, MissingChunk) and "events-000001.jsonl is missing" in str(e)
    assert t.events_delivered == 0


def test_a_unicode_digit_key_is_not_reported_as_a_canonical_chunk(store):
    # FIXED (misreport): wire._CHUNK_RE uses \d, which matches any Unicode digit, and int()
    # accepts them: "events-٠٠٠٠٠٢.jsonl" counts as chunk 2 and the node fails with
    # "_manifest.json declares 1 chunk(s) but .../events-000002.jsonl exists too", naming a key
    # that does not exist. (Same for "events-0000002.jsonl": the error should name the key found.)
    c = store.conduit
    put_chunk(c, 1, [1])
    store.raw_put("events-\u0660\u0660\u0660\u0660\u0660\u0662.jsonl", wire.encode_chunk([ev_line(2)]))
    put_manifest(c, 1)
    t = ChunkTailer(c, P)
    try:
        t.poll(lambda e: None)
    except ManifestMismatch as e:
        assert "\u0662" in str(e), f"the error names a key that does not exist: {e}"
    else:
        assert t.finished


def test_a_nested_key_named_like_a_chunk_is_not_a_chunk(store):
    # HOLDS: "events-000001.jsonl/child" (an S3 "directory", a local directory) is not chunk 1.
    c, clock = store.conduit, FakeClock()
    if store.kind == "s3":
        store.raw_put("events-000001.jsonl/child", wire.encode_chunk([ev_line(1)]))
    else:
        d = c.root / P / "events-000001.jsonl"
        d.mkdir(parents=True)
        (d / "child").write_bytes(wire.encode_chunk([ev_line(1)]))
    put_manifest(c, 1)
    t = ChunkTailer(c, P, clock=clock)
    e = run_to_error(t, clock)
    assert isinstance(e, MissingChunk) and t.events_delivered == 0


@pytest.mark.parametrize("watched", [False, True], ids=["walked", "watched"])
@pytest.mark.parametrize("what", ["fifo", "symlink", "symlink-dir", "dangling"])
@pytest.mark.parametrize("target", ["chunk", "manifest"])
def test_special_files_named_like_a_chunk_or_manifest_never_hang_or_leak(tmp_path, what, target, watched):
    # HOLDS: O_NOFOLLOW | O_NONBLOCK and a regular-file check: absent, never followed or blocked on.
    # Watched: the tail reads by name from the node's directory, opened with its watch (issue 42).
    c = LocalConduit(tmp_path / "c")
    clock = FakeClock()
    node = c.root / P
    node.mkdir(parents=True)
    outside = tmp_path / "outside.jsonl"
    outside.write_text(ev_line(99) + "\n")
    name = "events-000001.jsonl" if target == "chunk" else "_manifest.json"
    p = node / name
    if what == "fifo":
        os.mkfifo(p)
    elif what == "symlink":
        os.symlink(outside, p)
    elif what == "symlink-dir":
        os.symlink(tmp_path, p)
    else:
        os.symlink(tmp_path / "nowhere", p)
    if target == "chunk":
        put_manifest(c, 1)
    else:
        put_chunk(c, 1, [1])
    t = ChunkTailer(c, P, clock=clock)
    if watched:
        t.wait(0.0)  # opens the directory watch, and the directory
        if not t.watching:
            pytest.skip("no inotify here")
        assert t._dir is not None
    got: list[str] = []
    if target == "chunk":
        e = run_to_error(t, clock)
        assert isinstance(e, MissingChunk)
    else:
        for _ in range(5):
            t.poll(lambda e: got.append(e["data"]["line"]))
            clock.t += 60
        assert got == ["1"] and t.total is None  # no manifest: the exit path says NO_RESULT
    assert "99" not in got


# -- 5. A chunk read while it changes (local, written in place) ------------------------------------
def test_a_chunk_that_grows_while_read_is_cut_at_the_limit(tmp_path):
    # HOLDS: the guest appends a 1 MiB line to the chunk each time the host delivers one; the read
    # stops at MAX_CHUNK_BYTES with a TailError, having delivered what came before.
    c = LocalConduit(tmp_path / "c")
    put_chunk(c, 1, [1])
    path = c.root / wire.chunk_key(P, 1)
    fat = (
        wire.encode_event(wire.make_event("r", "log", "log", data={"line": "x" * (1 << 20)})) + "\n"
    ).encode()
    t = ChunkTailer(c, P)
    n = [0]

    def grow(ev) -> None:
        n[0] += 1
        with open(path, "ab") as f:
            f.write(fat)

    with pytest.raises(TailError, match="refused"):
        t.poll(grow)
    assert 1 < n[0] <= (wire.MAX_CHUNK_BYTES >> 20) + 1


# -- 6. CPU per chunk ------------------------------------------------------------------------------
class _CountingStream:
    def __init__(self, f, counter: list[int]) -> None:
        self._f, self._n = f, counter

    def readline(self, *a):
        self._n[0] += 1
        return self._f.readline(*a)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


def test_a_chunk_of_blank_lines_costs_bounded_host_cpu(tmp_path):
    # FIXED (CPU): blank lines are skipped one readline at a time, with no cap on lines per chunk:
    # one 32 MiB chunk of b"\n" is 33.5 M iterations, ~18 s of host CPU on this box (an honest
    # 32 MiB chunk of events: ~1.3 s), all inside one poll during which the driver checks neither
    # cancellation nor status; a poll reads every chunk present, so N such chunks block it N x 18 s.
    # Here 1 MiB of blank lines: more than a million line reads for one event.
    n = [0]

    class C(LocalConduit):
        def get_stream(self, key):
            return _CountingStream(super().get_stream(key), n)

    c = C(tmp_path / "c")
    c.put(wire.chunk_key(P, 1), b"\n" * (1 << 20) + (ev_line(1) + "\n").encode())
    t = ChunkTailer(c, P)
    try:
        t.poll(lambda e: None)
    except TailError:
        pass  # refusing such a chunk is fine
    assert n[0] <= 100_000, f"{n[0]} line reads for one event"


# -- 7. Liveness -----------------------------------------------------------------------------------
def test_a_guest_that_only_heartbeats_costs_a_bounded_request_rate(store):
    # HOLDS (by design): heartbeats keep the node alive forever (the tail has no deadline of its own),
    # but each costs one GET, the poll backs off to MAX_POLL, the manifest to MANIFEST_MAX, no LIST.
    c, clock = store.conduit, FakeClock()
    t = ChunkTailer(c, P, clock=clock)
    t.arm()
    store.reset()
    polls, hb = 0, 0
    for _minute in range(5):  # 5 simulated minutes, a heartbeat chunk every 10 s
        for _s in range(0, 60, 10):
            hb += 1
            put_chunk(c, hb, [hb], kind="heartbeat")
            elapsed = 0.0
            while elapsed < 10.0:
                t.poll(lambda e: None)
                polls += 1
                assert not t.silent
                d = t.next_delay()
                clock.t += d
                elapsed += d
    req = store.requests()
    assert t.delivered == hb and t.listings == 0 and req.get("LIST", 0) == 0
    assert polls <= 5 * 60 / tail.MAX_POLL * 1.2, polls
    assert req["GET"] <= polls + hb + 5 * 3, req


def test_result_without_manifest_is_no_result_after_exit(local_conduit, tmp_path):
    conduit = local_conduit
    # HOLDS: a result.json (even "success") without _manifest.json: the node is no_result.
    from test_hostile_outputs import _Patched

    from prefect_resoluto.node.drive import drive_node
    from prefect_resoluto.node.spec import NodeSpec
    from prefect_resoluto.runtimes import get_runtime

    script = r"""
import json, os
d = os.path.join(os.environ["RESOLUTO_STORE_ROOT"], os.environ["RESOLUTO_STORE_PREFIX"])
os.makedirs(d, exist_ok=True)
with open(os.path.join(d, "result.json"), "w") as f:
    json.dump({"node_id": os.environ["RESOLUTO_NODE_ID"], "status": "success", "exit_code": 0,
               "output_archive": None, "observed_phase": "", "reason": "", "substrate_logs": ""}, f)
"""
    spec = NodeSpec(run_id="run1", node_id="node1", argv=["true"])
    with _Patched([sys.executable, "-c", script]):
        outcome = drive_node(spec, conduit, get_runtime("process"), min_isolation="none")
    assert outcome.failure == "no_result", outcome.describe()
    assert "_manifest.json" in outcome.reason


# -- 8. The local conduit's directory watch, and a chunk written in place slowly ------------------
def test_a_wake_flood_costs_one_poll_per_guest_write(tmp_path):
    # HOLDS (bounded by the guest's own effort, no amplification beyond 1:1; since issue 42 not
    # even that): only a name the tail reads (a chunk's, the manifest's) wakes it, so a guest
    # renaming junk into its directory wakes nothing; the chunk it renames in after 100 of them
    # wakes the tail once (the queue is in order: the junk was seen before it), for one poll.
    # (100: well under a flood's read, dirwatch.FLOOD_BYTES, which wakes every watch to look.)
    drain_hub()
    c = Counting(tmp_path / "c")
    node = c.root / P
    node.mkdir(parents=True)
    t = ChunkTailer(c, P)
    t.poll(lambda e: None)
    assert t.wait(0.0)  # the watch opening: its first wait asks for a poll
    c.calls.clear()
    for i in range(100):
        (node / f".resoluto-tmp-{i}").write_bytes(b"")
        os.replace(node / f".resoluto-tmp-{i}", node / f"junk-{i}")
    put_chunk(c, 1, [1])
    wakes = 0
    while t.wait(5.0 if not wakes else 0.0):
        wakes += 1
        t.poll(lambda e: None)
    t.close()
    assert wakes == 1 and t.delivered == 1, wakes
    # The chunk and the look for the next: no manifest looked up for the junk, no listing.
    assert c.calls == [("GET", wire.chunk_key(P, 1)), ("GET", wire.chunk_key(P, 2))], c.calls


def test_a_chunk_written_in_place_is_read_as_it_stands(tmp_path):
    # HOLDS by contract (chunks are published whole by rename; a guest that writes in place loses
    # only its own events): read mid-write at a line boundary, chunk 1 counts as delivered and its
    # later lines are never read; the node still "finishes". Mid-line, it is a MalformedChunk.
    c = LocalConduit(tmp_path / "c")
    node = c.root / P
    node.mkdir(parents=True)
    t = ChunkTailer(c, P)
    got: list[str] = []
    with open(node / "events-000001.jsonl", "w") as f:
        f.write(ev_line(1) + "\n")
        f.flush()
        t.poll(lambda e: got.append(e["data"]["line"]))
        f.write(ev_line(2) + "\n")
    put_chunk(c, 2, [3])
    put_manifest(c, 2)
    t.check_manifest()
    t.poll(lambda e: got.append(e["data"]["line"]))
    assert got == ["1", "3"] and t.finished  # event 2 silently gone (guest-inflicted)
    p2 = wire.node_prefix("r", "m")
    (c.root / p2).mkdir(parents=True)
    with open(c.root / p2 / "events-000001.jsonl", "w") as f:
        f.write(ev_line(4)[:20])
        f.flush()
        with pytest.raises(MalformedChunk):
            ChunkTailer(c, p2).poll(lambda e: None)


def test_deeply_nested_call_files_are_clear_errors(tmp_path):
    """The same nesting in a Python call's return.json / error.json (read by the task runner):
    a WireError naming the file, or the error record saying it is malformed, never a
    RecursionError."""
    from guest_runner import call
    from prefect_resoluto.task_runner.call_spec import read_outcome

    ret = tmp_path / "ret"
    ret.mkdir()
    (ret / call.RETURN_FILE).parent.mkdir(parents=True, exist_ok=True)
    (ret / call.RETURN_FILE).write_text('{"value": ' + DEEP + "}")
    with pytest.raises(wire.WireError, match=call.RETURN_FILE):
        read_outcome(ret)
    err = tmp_path / "err"
    err.mkdir()
    (err / call.ERROR_FILE).parent.mkdir(parents=True, exist_ok=True)
    (err / call.ERROR_FILE).write_text(DEEP)
    with pytest.raises(Exception, match="malformed") as info:
        read_outcome(err)
    assert not isinstance(info.value, RecursionError)
