"""The host tail: contiguous order, manifest EOF, contract violations, silence, flat poll cost.

The wire-level cases run on both conduits (a local directory, and S3: moto behind the
counting proxy), since the tail reads both through one path: a GET of the next chunk key.
"""

from __future__ import annotations

import pytest

from guest_runner import wire
from guest_runner.conduit import Conduit, LocalConduit
from prefect_resoluto.node import tail
from prefect_resoluto.node.tail import ChunkTailer, MalformedChunk, ManifestMismatch, MissingChunk, TailError

P = wire.node_prefix("r", "n")


def ev_line(i: int, kind: str = "log") -> str:
    return wire.encode_event(wire.make_event("r", kind, "log", data={"line": str(i)}, ts=float(i)))


def put_chunk(c: Conduit, idx: int, items: list[int], kind: str = "log") -> None:
    c.put(wire.chunk_key(P, idx), wire.encode_chunk([ev_line(i, kind) for i in items]))


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Counting(LocalConduit):
    def __init__(self, root) -> None:
        super().__init__(root)
        self.calls: list[tuple[str, str]] = []

    def list_prefix(self, prefix, start_after=None, shallow=False, limit=None):
        self.calls.append(("LIST", start_after or ""))
        return super().list_prefix(prefix, start_after, shallow, limit)

    def get(self, key):
        self.calls.append(("GET", key))
        return super().get(key)

    def get_stream(self, key):  # how the tail reads a chunk: streamed, bounded
        self.calls.append(("GET", key))
        return super().get_stream(key)


def test_a_poll_reads_a_bounded_number_of_chunks_then_asks_to_be_called_again(local_conduit):
    """However fast a guest writes, the driver regains control between polls (status,
    cancellation, silence): a poll reads at most CHUNKS_PER_POLL chunks, then asks for
    the shortest delay."""
    n = tail.CHUNKS_PER_POLL * 2 + 1
    for i in range(1, n + 1):
        put_chunk(local_conduit, i, [i])
    t = ChunkTailer(local_conduit, P, clock=FakeClock(), min_poll=0.0)
    assert len(drain(t)) == tail.CHUNKS_PER_POLL and t.next_delay() == 0.0
    assert len(drain(t)) == tail.CHUNKS_PER_POLL
    assert drain(t) == [str(n)]


def drain(t: ChunkTailer) -> list[str]:
    got: list[str] = []
    t.poll(lambda e: got.append(e["data"]["line"]))
    return got


class Store:
    """A conduit and the requests the tail made of it, by kind: counted by the conduit itself
    (local) or at the S3 endpoint (the counting proxy in front of moto)."""

    def __init__(self, conduit: Conduit, counts) -> None:
        self.conduit, self._counts = conduit, counts
        self._base: dict[str, int] = {}

    def reset(self) -> None:
        self._base = dict(self._counts())

    def requests(self) -> dict[str, int]:
        now = self._counts()
        return {k: now[k] - self._base.get(k, 0) for k in now if now[k] - self._base.get(k, 0)}


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        c = Counting(tmp_path / "c")
        return Store(c, lambda: {k: sum(1 for kind, _ in c.calls if kind == k) for k in ("LIST", "GET")})
    counter = request.getfixturevalue("s3_counter")
    conduit = request.getfixturevalue("s3_conduit")
    return Store(conduit, counter.snapshot)


def finish_manifest(c: Conduit, total: int) -> None:
    c.put(wire.result_key(P), wire.encode_result(wire.make_result("n", "success", 0)))
    c.put(wire.manifest_key(P), wire.encode_manifest(total))


def test_chunks_appearing_out_of_order_are_delivered_in_order(store):
    c, clock = store.conduit, FakeClock()
    t = ChunkTailer(c, P, clock=clock)
    put_chunk(c, 2, [3, 4])
    put_chunk(c, 3, [5])
    assert drain(t) == []  # chunk 1 missing: 2 and 3 are held back, never skipped
    put_chunk(c, 1, [1, 2])
    assert drain(t) == ["1", "2", "3", "4", "5"]
    put_chunk(c, 4, [6])
    finish_manifest(c, 4)
    assert drain(t) == ["6"] and not t.finished  # the manifest is not due again yet
    clock.t += tail.MANIFEST_START
    assert drain(t) == [] and t.finished and t.total == 4


def test_a_tail_started_late_reads_from_chunk_one_in_order_without_listing(store):
    """A restart or an adoption: the chunks are all there before the tail is."""
    c = store.conduit
    for i in range(1, 6):
        put_chunk(c, i, [i])
    store.reset()
    t = ChunkTailer(c, P)
    assert drain(t) == ["1", "2", "3", "4", "5"] and not t.finished
    # the manifest (due at once, absent), the five chunks, the sixth's "no such key"
    assert store.requests() == {"GET": 7}
    finish_manifest(c, 5)
    assert t.check_manifest() and t.finished


def test_manifest_before_any_poll_is_found(store):
    c = store.conduit
    put_chunk(c, 1, [1])
    c.put(wire.manifest_key(P), wire.encode_manifest(1))
    t = ChunkTailer(c, P)
    assert drain(t) == ["1"] and t.finished


def test_the_manifest_is_looked_for_on_a_backed_off_cadence(tmp_path):
    c, clock = Counting(tmp_path / "c"), FakeClock()
    t = ChunkTailer(c, P, clock=clock)
    looks: list[float] = []
    for _ in range(400):  # ten idle minutes, a poll every 1.5 s
        c.calls.clear()
        drain(t)
        if ("GET", wire.manifest_key(P)) in c.calls:
            looks.append(clock.t - 1000.0)
        clock.t += 1.5
    assert looks[0] == 0.0 and tail.MANIFEST_START <= looks[1] < tail.MANIFEST_START + 1.5
    late = [x for x in looks if x >= 300]
    assert 5 <= len(late) <= 300 / tail.MANIFEST_MAX + 1, looks  # two a minute once backed off


def test_a_root_span_closing_makes_the_manifest_due_at_once(local_conduit):
    clock = FakeClock()
    t = ChunkTailer(local_conduit, P, clock=clock)
    put_chunk(local_conduit, 1, [1])
    drain(t)  # the manifest: looked for, absent, next due later
    finish_manifest(local_conduit, 2)
    root_close = wire.make_event("r", "node", "close", status="success")
    local_conduit.put(wire.chunk_key(P, 2), wire.encode_chunk([wire.encode_event(root_close)]))
    t.poll(lambda e: None)  # delivers the close: the manifest is due now, not in MANIFEST_START
    assert drain(t) == [] and t.finished


def test_empty_stream_with_zero_chunk_manifest(local_conduit):
    local_conduit.put(wire.result_key(P), b"{}")
    local_conduit.put(wire.manifest_key(P), wire.encode_manifest(0))
    t = ChunkTailer(local_conduit, P)
    assert drain(t) == [] and t.finished


def test_malformed_line_names_key_and_line_after_delivering_earlier_lines(local_conduit):
    body = "\n".join([ev_line(1), ev_line(2), "{this is not json", ev_line(4)]) + "\n"
    local_conduit.put(wire.chunk_key(P, 1), body.encode())
    t = ChunkTailer(local_conduit, P)
    got: list[str] = []
    with pytest.raises(MalformedChunk, match=r"events-000001\.jsonl at line 3: not valid JSON") as exc:
        t.poll(lambda e: got.append(e["data"]["line"]))
    assert got == ["1", "2"]
    assert exc.value.key.endswith("events-000001.jsonl") and exc.value.line_no == 3


def test_non_utf8_chunk_is_malformed(local_conduit):
    local_conduit.put(wire.chunk_key(P, 1), (ev_line(1) + "\n").encode() + b"\xff\xfe\n")
    with pytest.raises(MalformedChunk, match="line 2: not UTF-8"):
        ChunkTailer(local_conduit, P).poll(lambda e: None)


def test_a_missing_chunk_with_later_chunks_and_a_manifest_is_reported_after_grace(store):
    c, clock = store.conduit, FakeClock()
    for i in (1, 3, 4):
        put_chunk(c, i, [i])
    finish_manifest(c, 4)
    t = ChunkTailer(c, P, clock=clock)
    assert drain(t) == ["1"]
    clock.t += 1
    assert drain(t) == []  # within the grace: chunk 2 may still land
    clock.t += tail.MISSING_CHUNK_GRACE
    got: list[str] = []
    with pytest.raises(
        MissingChunk,
        match=r"events-000002\.jsonl is missing: the manifest declares 4 chunk\(s\) and 1 were read",
    ):
        t.poll(lambda e: got.append(e["data"]["line"]))
    assert got == [] and t.delivered == 1  # 3 and 4 are never delivered over the gap


def test_a_manifest_without_its_last_chunk_is_reported_after_every_earlier_event(store):
    c, clock = store.conduit, FakeClock()
    put_chunk(c, 1, [1])
    put_chunk(c, 2, [2, 3])
    finish_manifest(c, 3)
    t = ChunkTailer(c, P, clock=clock)
    got: list[str] = []
    t.poll(lambda e: got.append(e["data"]["line"]))
    clock.t += tail.MISSING_CHUNK_GRACE + 0.1
    with pytest.raises(
        MissingChunk, match=r"events-000003\.jsonl is missing: .* 3 chunk\(s\) and 2 were read"
    ):
        t.poll(lambda e: got.append(e["data"]["line"]))
    assert got == ["1", "2", "3"]


def test_a_late_chunk_under_a_manifest_is_waited_for_within_the_grace(store):
    c, clock = store.conduit, FakeClock()
    put_chunk(c, 1, [1])
    finish_manifest(c, 2)
    t = ChunkTailer(c, P, clock=clock)
    assert drain(t) == ["1"]
    clock.t += tail.MISSING_CHUNK_GRACE - 0.5
    put_chunk(c, 2, [2])
    clock.t += 1  # past the grace since the manifest, but chunk 2 is there now
    assert drain(t) == ["2"] and t.finished


def test_manifest_fewer_than_chunks_is_a_mismatch(store):
    c = store.conduit
    for i in (1, 2, 3):
        put_chunk(c, i, [i])
    c.put(wire.manifest_key(P), wire.encode_manifest(2))
    t = ChunkTailer(c, P)
    got: list[str] = []
    with pytest.raises(ManifestMismatch, match=r"declares 2 chunk\(s\) but .*events-000003\.jsonl exists"):
        t.poll(lambda e: got.append(e["data"]["line"]))
    assert got == ["1", "2"]


def test_a_chunk_beyond_the_manifest_found_by_the_one_listing_at_the_end(store):
    """Chunk 4 exists with 3 missing: no GET of the next key sees it; the end's listing does."""
    c, clock = store.conduit, FakeClock()
    for i in (1, 2, 4):
        put_chunk(c, i, [i])
    t = ChunkTailer(c, P, clock=clock)
    assert drain(t) == ["1", "2"]
    c.put(wire.manifest_key(P), wire.encode_manifest(2))
    clock.t += tail.MANIFEST_START
    store.reset()
    with pytest.raises(ManifestMismatch, match=r"declares 2 chunk\(s\) but .*events-000004\.jsonl exists"):
        drain(t)
    assert store.requests()["LIST"] == 1 and t.listings == 1


def test_a_chunk_read_before_a_manifest_that_leaves_it_out_is_a_mismatch(store):
    c, clock = store.conduit, FakeClock()
    for i in (1, 2, 3):
        put_chunk(c, i, [i])
    t = ChunkTailer(c, P, clock=clock)
    assert drain(t) == ["1", "2", "3"]
    c.put(wire.manifest_key(P), wire.encode_manifest(2))
    clock.t += tail.MANIFEST_START
    with pytest.raises(ManifestMismatch, match=r"declares 2 chunk\(s\) but .*events-000003\.jsonl exists"):
        drain(t)


def test_a_gap_while_the_sandbox_runs_is_found_by_one_backed_off_listing(store):
    c, clock = store.conduit, FakeClock()
    put_chunk(c, 1, [1])
    put_chunk(c, 3, [3])
    t = ChunkTailer(c, P, clock=clock)
    t.arm()
    assert drain(t) == ["1"]
    store.reset()
    for _ in range(10):  # a quiet stretch short of the probe: GETs only
        clock.t += (tail.GAP_PROBE_AFTER - 1) / 10
        assert drain(t) == []
    assert "LIST" not in store.requests() and t.listings == 0
    clock.t += 1
    drain(t)  # nothing for GAP_PROBE_AFTER: one listing, which finds chunk 3 over the gap
    assert store.requests()["LIST"] == 1
    drain(t)
    assert store.requests()["LIST"] == 1  # found once; the grace runs on GETs
    clock.t += tail.MISSING_CHUNK_GRACE + 0.1
    with pytest.raises(MissingChunk, match=r"events-000002\.jsonl is missing: .*events-000003\.jsonl exists"):
        drain(t)


def test_a_quiet_guest_with_no_gap_lists_only_as_its_silence_doubles(store):
    c, clock = store.conduit, FakeClock()
    put_chunk(c, 1, [1])
    t = ChunkTailer(c, P, clock=clock, silence_window=10_000)
    t.arm()
    drain(t)
    store.reset()
    for _ in range(int(7 * tail.GAP_PROBE_AFTER / 3)):  # seven probe periods of nothing, a poll each 3 s
        clock.t += 3
        drain(t)
    # listings at 30, 60 and 120 s of silence (the next at 240 s: beyond this stretch)
    assert store.requests().get("LIST") == 3 == t.listings


def test_corrupt_manifest_is_a_contract_error(local_conduit):
    local_conduit.put(wire.manifest_key(P), b'{"chunks": 2}')
    with pytest.raises(ManifestMismatch, match="total_chunks"):
        ChunkTailer(local_conduit, P).poll(lambda e: None)


def test_silence_watchdog_arms_only_when_told_and_heartbeats_keep_it_quiet(local_conduit):
    clock = FakeClock()
    t = ChunkTailer(local_conduit, P, silence_window=30, clock=clock)
    clock.t += 1000
    drain(t)
    assert not t.silent  # not armed: a pending sandbox is never "silent"
    t.arm()
    clock.t += 29
    drain(t)
    assert not t.silent
    put_chunk(local_conduit, 1, [0], kind="heartbeat")
    clock.t += 2
    drain(t)
    assert not t.silent  # the heartbeat arrived: quiet, not dead
    clock.t += 31
    drain(t)
    assert t.silent
    with pytest.raises(TailError, match="no events for"):
        t.follow(lambda e: None, sleep=lambda s: None)


def test_polling_backs_off_while_silent_and_resets_on_real_events(local_conduit):
    t = ChunkTailer(local_conduit, P, min_poll=0.01, max_poll=1.0)
    delays = []
    for _ in range(20):
        drain(t)
        delays.append(t.next_delay())
    assert delays == sorted(delays) and delays[-1] == 1.0 and delays[0] > 0.01
    put_chunk(local_conduit, 1, [1], kind="heartbeat")
    drain(t)
    assert t.next_delay() == 1.0  # heartbeats are liveness, not activity
    put_chunk(local_conduit, 2, [2])
    drain(t)
    assert t.next_delay() == 0.01


@pytest.mark.parametrize("already", [10, 1000])
def test_poll_cost_does_not_grow_with_chunks_already_read(tmp_path, already):
    c = Counting(tmp_path / "c")
    for i in range(1, already + 1):
        put_chunk(c, i, [i])
    t = ChunkTailer(c, P, clock=FakeClock())  # held still: the manifest is not due again
    while drain(t):  # a poll reads at most tail.CHUNKS_PER_POLL chunks
        pass
    assert t.delivered == already
    c.calls.clear()
    drain(t)  # an idle poll: one GET of the next chunk's key, no LIST
    assert c.calls == [("GET", wire.chunk_key(P, already + 1))]
    put_chunk(c, already + 1, [0])
    c.calls.clear()
    drain(t)
    assert c.calls == [("GET", wire.chunk_key(P, already + 1)), ("GET", wire.chunk_key(P, already + 2))]


def test_an_idle_poll_is_one_get_of_the_next_key(store):
    c = store.conduit
    put_chunk(c, 1, [1])
    t = ChunkTailer(c, P, clock=FakeClock())
    drain(t)
    store.reset()
    for _ in range(5):
        drain(t)
    assert store.requests() == {"GET": 5}


def test_the_tail_never_lists_what_a_sandbox_nested_below_the_node(local_conduit):
    """Found by an outside review: each poll walked the whole node directory and held every
    key, ~30 000 deep ones taking 85 MB of the host's memory. The tail lists the top level."""
    listed: list[str] = []
    list_prefix = local_conduit.list_prefix

    def recording(prefix, start_after=None, shallow=False, limit=None):
        keys = list_prefix(prefix, start_after, shallow, limit)
        listed.extend(keys)
        return keys

    local_conduit.list_prefix = recording
    for i in range(50):  # named like chunks, so only a shallow listing leaves them out
        local_conduit.put(f"{P}/events-deep-{i:03d}/" + "x" * 200, b"")
    put_chunk(local_conduit, 1, [1])
    put_chunk(local_conduit, 3, [3])
    finish_manifest(local_conduit, 1)
    t = ChunkTailer(local_conduit, P)
    with pytest.raises(ManifestMismatch, match=r"events-000003\.jsonl exists"):
        drain(t)
    assert listed and not [k for k in listed if "/" in k[len(P) + 1 :]], listed[:5]
