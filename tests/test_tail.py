"""The host tail: contiguous order, manifest EOF, contract violations, silence, flat poll cost."""

from __future__ import annotations

import pytest

from guest_runner import wire
from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.tail import ChunkTailer, MalformedChunk, ManifestMismatch, MissingChunk, TailError

P = wire.node_prefix("r", "n")


def ev_line(i: int, kind: str = "log") -> str:
    return wire.encode_event(wire.make_event("r", kind, "log", data={"line": str(i)}, ts=float(i)))


def put_chunk(c: LocalConduit, idx: int, items: list[int], kind: str = "log") -> None:
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

    def list_prefix(self, prefix, start_after=None, shallow=False):
        self.calls.append(("LIST", start_after or ""))
        return super().list_prefix(prefix, start_after, shallow)

    def get(self, key):
        self.calls.append(("GET", key))
        return super().get(key)

    def get_stream(self, key):  # how the tail reads a chunk: streamed, bounded
        self.calls.append(("GET", key))
        return super().get_stream(key)


def drain(t: ChunkTailer) -> list[str]:
    got: list[str] = []
    t.poll(lambda e: got.append(e["data"]["line"]))
    return got


def test_delivers_in_order_and_only_contiguously(local_conduit):
    t = ChunkTailer(local_conduit, P)
    put_chunk(local_conduit, 2, [3, 4])
    assert drain(t) == []  # chunk 1 missing: 2 is held back, never skipped
    put_chunk(local_conduit, 1, [1, 2])
    assert drain(t) == ["1", "2", "3", "4"]
    put_chunk(local_conduit, 3, [5])
    local_conduit.put(wire.result_key(P), wire.encode_result(wire.make_result("n", "success", 0)))
    local_conduit.put(wire.manifest_key(P), wire.encode_manifest(3))
    assert drain(t) == ["5"]
    assert t.finished and t.total == 3


def test_manifest_before_any_poll_is_found(local_conduit):
    put_chunk(local_conduit, 1, [1])
    local_conduit.put(wire.manifest_key(P), wire.encode_manifest(1))
    t = ChunkTailer(local_conduit, P)
    assert drain(t) == ["1"] and t.finished


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


def test_gap_under_a_manifest_is_reported_after_grace(local_conduit):
    clock = FakeClock()
    put_chunk(local_conduit, 1, [1])
    put_chunk(local_conduit, 3, [3])
    local_conduit.put(wire.result_key(P), b"{}")
    local_conduit.put(wire.manifest_key(P), wire.encode_manifest(3))
    t = ChunkTailer(local_conduit, P, clock=clock)
    assert drain(t) == ["1"]
    clock.t += 1
    assert drain(t) == []
    clock.t += 5
    with pytest.raises(
        MissingChunk,
        match=r"events-000002\.jsonl is missing: the manifest declares 3 chunk\(s\) and 1 were read",
    ):
        drain(t)


def test_manifest_fewer_than_chunks_is_a_mismatch(local_conduit):
    for i in (1, 2, 3):
        put_chunk(local_conduit, i, [i])
    local_conduit.put(wire.manifest_key(P), wire.encode_manifest(2))
    t = ChunkTailer(local_conduit, P)
    got: list[str] = []
    with pytest.raises(ManifestMismatch, match=r"declares 2 chunk\(s\) but .*events-000003\.jsonl exists"):
        t.poll(lambda e: got.append(e["data"]["line"]))
    assert got == ["1", "2"]


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
    t = ChunkTailer(c, P)
    drain(t)
    assert t.delivered == already
    c.calls.clear()
    drain(t)  # an idle poll: one LIST, starting after the last chunk seen, no GET
    assert c.calls == [("LIST", wire.chunk_key(P, already))]
    put_chunk(c, already + 1, [0])
    c.calls.clear()
    drain(t)
    assert [k for k, _ in c.calls] == ["LIST", "GET"]


def test_the_tail_never_lists_what_a_sandbox_nested_below_the_node(local_conduit):
    """Found by an outside review: each poll walked the whole node directory and held every
    key, ~30 000 deep ones taking 85 MB of the host's memory. The tail lists the top level."""
    listed: list[str] = []
    list_prefix = local_conduit.list_prefix

    def recording(prefix, start_after=None, shallow=False):
        keys = list_prefix(prefix, start_after, shallow)
        listed.extend(keys)
        return keys

    local_conduit.list_prefix = recording
    for i in range(50):
        local_conduit.put(f"{P}/deep/{i:03d}/" + "x" * 200, b"")
    put_chunk(local_conduit, 1, [1])
    local_conduit.put(wire.result_key(P), wire.encode_result(wire.make_result("n", "success", 0)))
    local_conduit.put(wire.manifest_key(P), wire.encode_manifest(1))
    t = ChunkTailer(local_conduit, P)
    assert drain(t) == ["1"] and t.finished
    assert listed and not [k for k in listed if "/" in k[len(P) + 1 :]], listed[:5]
