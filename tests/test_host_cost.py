"""What the host pays for a node while it runs: nothing per tick of its age, nothing kept after it.

The node's driver is told where it can be -- a local conduit's directory watch wakes it when
an object lands, a local child's exit descriptor when the sandbox exits -- so a node that
runs long is neither listed nor asked for its status over and over; and what the runtime
remembers of destroyed sandboxes stays bounded however many nodes a host drives.
"""

from __future__ import annotations

import os
import select
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

import pytest
from support.counting_conduit import CountingConduit
from support.polling import scaled, wait_for
from support.quiet_hub import drain_hub
from support.runtime_contract import require, spec, wait_terminal

from guest_runner.conduit import LocalConduit, ObjectNotFound
from guest_runner.conduit.local import TEMP_PREFIX
from prefect_resoluto.node import drive as drive_mod
from prefect_resoluto.node import tail
from prefect_resoluto.node.drive import POLL_BACKSTOP, STATUS_BACKSTOP, _Clocks, drive, drive_node
from prefect_resoluto.node.observer import NodeObserver
from prefect_resoluto.node.outcome import NodeOutcome
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.node.tail import ChunkTailer, DirWatch
from prefect_resoluto.node.wake import WakeEvent
from prefect_resoluto.runtimes import _local
from prefect_resoluto.runtimes.base import SandboxHandle, SandboxStatus
from prefect_resoluto.runtimes.process import ProcessRuntime

#: Seconds the quiet node sleeps: long enough for the old 0.2 s status clock to tick 25 times.
NAP = 5.0


class CountingRuntime(ProcessRuntime):
    def __init__(self) -> None:
        super().__init__()
        self.status_calls = 0

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        self.status_calls += 1
        return super().status(handle)


@pytest.fixture
def rt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CountingRuntime:
    monkeypatch.setenv("RESOLUTO_STATE_DIR", str(tmp_path / "state"))
    return require(CountingRuntime())  # type: ignore[return-value]


def test_a_quiet_node_is_neither_listed_nor_asked_its_status_while_it_sleeps(rt, tmp_path):
    conduit = CountingConduit(tmp_path / "conduit")
    assert NAP < min(POLL_BACKSTOP, STATUS_BACKSTOP)  # no backstop falls inside the nap
    out = drive_node(
        NodeSpec(run_id="r", node_id="quiet", argv=[sys.executable, "-c", f"import time; time.sleep({NAP})"]),
        conduit,
        rt,
        min_isolation="none",
    )
    assert out.ok, out.describe()
    objects = len(conduit.list_prefix("run/r/nodes/quiet/", shallow=True))
    lists = conduit.lists - 1  # the count just taken
    # A status at the start (arming the silence watchdog), once the result is in, and the
    # exit seen (``_settle``: a few looks within 0.5 s); every 0.2 s (25 and more over the
    # nap) before the exit descriptor.
    assert rt.status_calls <= 12, rt.status_calls
    # A poll (a GET of the next chunk's key, the manifest when due) per object that landed
    # (chunks, result, manifest), plus the start and the end (the result, the outbox);
    # before the directory watch was the path, one every 1.5 s at most while quiet and a
    # burst right after every arrival again. Listings: recovery and the outbox only.
    print(f"requests: {conduit.gets} GETs, {lists} LISTs for {objects} objects")
    assert lists <= 3, lists
    assert conduit.gets <= 3 * objects + 6, (conduit.gets, objects)


class LookupConduit(LocalConduit):
    """A local conduit that records each object the host looks for, and whether it was there."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.lookups: list[tuple[str, bool]] = []

    def get_stream(self, key: str) -> BinaryIO:
        try:
            stream = super().get_stream(key)
        except ObjectNotFound:
            self.lookups.append((key.rsplit("/", 1)[-1], False))
            raise
        self.lookups.append((key.rsplit("/", 1)[-1], True))
        return stream


def test_a_node_watched_from_its_start_looks_for_no_object_before_it_lands(rt, tmp_path, monkeypatch):
    # The watch opens before the sandbox does (it is told of every object the guest writes):
    # neither the first chunk nor the manifest is looked for before it is there; only the
    # chunk after each one read is (that is how a poll knows it has read all). The backstops
    # are put out of reach, so what is measured is the path, not a clock.
    monkeypatch.setattr(tail, "MANIFEST_WATCHED", 3600.0)
    monkeypatch.setattr(drive_mod, "POLL_BACKSTOP", 3600.0)
    conduit = LookupConduit(tmp_path / "conduit")
    out = drive_node(
        NodeSpec(run_id="r", node_id="seen", argv=[sys.executable, "-c", "print('one line')"]),
        conduit,
        rt,
        min_isolation="none",
    )
    assert out.ok, out.describe()
    missed = [name for name, found in conduit.lookups if not found]
    read = [name for name, found in conduit.lookups if found]
    assert "_manifest.json" in read and "_manifest.json" not in missed, conduit.lookups
    assert "events-000001.jsonl" in read and "events-000001.jsonl" not in missed, conduit.lookups
    chunks = [n for n in read if n.startswith("events-")]
    assert len(missed) <= len(chunks), conduit.lookups  # one look past each poll's last chunk at most


def test_the_exit_descriptor_fires_when_the_sandbox_exits(rt, tmp_path):
    h = rt.launch(spec("import sys; sys.stdin.read()", hold_stdin=True))  # waits for its stdin
    fd = rt.exit_fd(h)
    try:
        assert fd is not None
        assert not select.select([fd], [], [], 0)[0]  # running: not readable
        rt.assign(h, b"")  # closes its stdin: it exits
        assert select.select([fd], [], [], scaled(30))[0]
        assert wait_terminal(rt, h).phase == "succeeded"
    finally:
        if fd is not None:
            os.close(fd)
        rt.destroy(h)
    assert rt.exit_fd(h) is None  # destroyed: nothing to watch
    assert rt.exit_fd(SandboxHandle(id="never-launched", runtime=rt.name)) is None


def test_the_directory_watch_wakes_for_objects_not_for_temporary_files(tmp_path):
    drain_hub()
    watch = DirWatch.open(str(tmp_path))
    if watch is None:
        pytest.skip("no inotify here")
    try:
        tmp = tmp_path / f"{TEMP_PREFIX}abc"
        tmp.write_bytes(b"half an object")  # a writer's temporary file: closed after writing
        assert not watch.wait(0.0)
        os.replace(tmp, tmp_path / "events-000001.jsonl")  # published
        assert watch.wait(scaled(10))
        (tmp_path / "events-000002.jsonl").write_bytes(b"{}")  # written in place (another writer)
        assert watch.wait(scaled(10))
    finally:
        watch.close()


def test_what_the_runtime_keeps_of_destroyed_sandboxes_is_bounded(rt, monkeypatch):
    monkeypatch.setattr(_local, "DESTROYED_KEPT", 3)
    monkeypatch.setattr(_local, "_DESTROYED", {})
    handles = [rt.launch(spec("pass")) for _ in range(5)]
    for h in handles:
        wait_terminal(rt, h)
        rt.destroy(h)
    assert len(_local._DESTROYED) == 3
    assert rt.status(handles[-1]).gone  # the newest are still answered for


def _manifest_looks(
    tmp_path: Path,
) -> tuple[CountingConduit, str, str, list[str], list[float], ChunkTailer]:
    """A tailer on a frozen clock whose conduit notes every key it is asked for."""
    from guest_runner import wire

    conduit = CountingConduit(tmp_path / "conduit")
    prefix = wire.node_prefix("r", "n")
    looked: list[str] = []
    get_stream = conduit.get_stream

    def counted(key: str) -> BinaryIO:
        looked.append(key)
        return get_stream(key)

    conduit.get_stream = counted  # type: ignore[method-assign]
    now = [1000.0]
    return (
        conduit,
        prefix,
        wire.manifest_key(prefix),
        looked,
        now,
        ChunkTailer(conduit, prefix, clock=lambda: now[0]),
    )


def test_a_chunk_landing_does_not_make_the_manifest_due_but_the_manifest_landing_does(tmp_path):
    """Each chunk's wake used to look the manifest up as well: one more failed lookup per
    object the guest writes. Only a landing that is not a chunk makes it due at once."""
    from guest_runner import wire

    conduit, prefix, manifest, looked, now, tailer = _manifest_looks(tmp_path)  # clock frozen: no schedule
    (tmp_path / "conduit" / prefix).mkdir(parents=True)
    if not tailer.wait(0.0) or not tailer.watching:  # opens the watch
        pytest.skip("no inotify here")
    try:
        tailer.poll(lambda ev: None)  # the first poll looks (a node may be done already)
        assert looked.count(manifest) == 1
        line = wire.encode_event(wire.make_event("r", "log", "log", data={"line": "x"}, ts=1.0))
        conduit.put(wire.chunk_key(prefix, 1), wire.encode_chunk([line]))
        assert tailer.wait(scaled(10))
        assert tailer.poll(lambda ev: None) == 1
        assert looked.count(manifest) == 1, "a chunk's arrival looked the manifest up"
        conduit.put(manifest, wire.encode_manifest(1))
        assert tailer.wait(scaled(10))
        tailer.poll(lambda ev: None)
        assert looked.count(manifest) == 2 and tailer.finished
    finally:
        tailer.close()


def test_under_a_watch_the_manifest_is_looked_up_when_it_lands_not_on_a_schedule(tmp_path):
    """A root span's close and the manifest's own backed-off schedule each looked the
    manifest up before it was there: two failed lookups a node (and a poll each) that the
    watch makes needless, since the manifest's landing wakes the tail itself."""
    from guest_runner import wire

    conduit, prefix, manifest, looked, now, tailer = _manifest_looks(tmp_path)
    (tmp_path / "conduit" / prefix).mkdir(parents=True)
    assert tailer.wait(0.0) and tailer.watching, "inotify is needed here"
    try:
        tailer.poll(lambda ev: None)
        assert looked.count(manifest) == 1  # at the start: a node may be done already
        root_closed = wire.encode_event(
            wire.make_event("r", "node", "close", span_id="s", status="ok", ts=1.0)
        )
        conduit.put(wire.chunk_key(prefix, 1), wire.encode_chunk([root_closed]))
        assert tailer.wait(scaled(10))
        assert tailer.poll(lambda ev: None) == 1
        now[0] += tail.MANIFEST_START + 1  # the unwatched schedule's first look is past
        tailer.poll(lambda ev: None)
        assert looked.count(manifest) == 1, "looked up before anything but a chunk landed"
        assert not tailer.gapped
        clocks = _Clocks(status_interval=60.0, exit_fd=None)
        clocks.polled(tailer)
        assert clocks.next_poll - time.monotonic() > POLL_BACKSTOP / 2  # nothing to look for
        conduit.put(manifest, wire.encode_manifest(2))  # and chunk 2 is not there (yet)
        assert tailer.wait(scaled(10))
        tailer.poll(lambda ev: None)
        assert looked.count(manifest) == 2 and tailer.gapped and not tailer.finished
        clocks.polled(tailer)  # a chunk is owed: polled on the tail's pace, not the backstop's
        assert clocks.next_poll - time.monotonic() <= tail.MAX_POLL
    finally:
        tailer.close()


def test_without_a_watch_a_root_span_closing_makes_the_manifest_due_at_once(tmp_path):
    from guest_runner import wire

    conduit, prefix, manifest, looked, _now, tailer = _manifest_looks(tmp_path)
    tailer._watch_tried = True  # as on S3: polled only
    tailer.poll(lambda ev: None)
    root_closed = wire.encode_event(wire.make_event("r", "node", "close", span_id="s", status="ok", ts=1.0))
    conduit.put(wire.chunk_key(prefix, 1), wire.encode_chunk([root_closed]))
    tailer.poll(lambda ev: None)
    tailer.poll(lambda ev: None)  # the frozen clock: only the close made it due
    assert not tailer.watching and looked.count(manifest) == 2


def test_a_sandbox_creating_names_in_a_loop_wakes_the_host_at_most_every_gap(tmp_path):
    """A hostile guest publishing names as fast as it can (a chunk's: no other name wakes the
    host): each wake drains what landed during the gap, so the host wakes (and polls) at most
    once per MIN_WAKE_GAP."""
    drain_hub()
    watch = DirWatch.open(str(tmp_path))
    if watch is None:
        pytest.skip("no inotify here")
    stop = threading.Event()

    def flood() -> None:
        i = 0
        while not stop.is_set():
            tmp = tmp_path / f"x{i % 64}.part"
            tmp.write_bytes(b"")
            os.replace(tmp, tmp_path / f"events-{i % 64 + 1:06d}.jsonl")
            i += 1

    writer = threading.Thread(target=flood, daemon=True)
    writer.start()
    try:
        began = time.monotonic()
        for _ in range(30):
            assert watch.wait(scaled(30))
        elapsed = time.monotonic() - began
    finally:
        stop.set()
        writer.join()
        watch.close()
    assert watch.wakes == 30
    assert elapsed >= 29 * tail.MIN_WAKE_GAP  # before: 30 wakes in a few hundred microseconds


def test_a_poll_stopped_by_its_budget_is_followed_by_another_at_once(tmp_path):
    """A poll reads at most CHUNKS_PER_POLL chunks; no directory event will come for those
    already there, so the driver's next poll is due at once, not at the watch's backstop."""
    from test_tail_attacks import P, put_chunk, put_manifest

    c = LocalConduit(tmp_path / "c")
    n = tail.CHUNKS_PER_POLL * 2 + 3
    for i in range(1, n + 1):
        put_chunk(c, i, [i])
    t = ChunkTailer(c, P)
    assert t.wait(0.0) and t.watching
    clocks = _Clocks(status_interval=1.0, exit_fd=None)
    got: list[object] = []
    polls = 0
    while not t.finished:
        t.poll(got.append)
        polls += 1
        clocks.polled(t)
        due_in = clocks.next_poll - time.monotonic()
        if t.delivered < n:
            assert t.behind and due_in <= tail.MIN_POLL, (t.delivered, due_in)
        else:
            assert not t.behind and due_in > tail.MIN_POLL  # caught up: the watch wakes it
            put_manifest(c, n)
            t.check_manifest()
    assert len(got) == n and polls == 3
    t.close()


class Announcing(NodeObserver):
    """A host that announces its cancellations (a WakeEvent): the driver need not look for them."""

    def __init__(self) -> None:
        self.cancel = WakeEvent()
        self.launched_at: float | None = None
        self.seen_cancelled_at: float | None = None

    def launched(self, handle: SandboxHandle) -> None:
        self.launched_at = time.monotonic()

    def cancelled(self) -> bool:
        if self.cancel.is_set():
            self.seen_cancelled_at = self.seen_cancelled_at or time.monotonic()
            return True
        return False

    def wake_fds(self) -> tuple[int, ...]:
        return (self.cancel.fileno(),)

    def cancel_polled(self) -> bool:
        return False


def counting_timer_wakes(
    monkeypatch: pytest.MonkeyPatch, asleep: threading.Event | None = None
) -> list[float]:
    """When the driver's waits ran out their timeout (a timer's wake, not the node's: a guest's
    temporary file also ends a wait, with nothing landed); ``asleep`` is set when the driver
    goes to sleep for more than a second."""
    timed_out: list[float] = []
    real = ChunkTailer.wait

    def wait(self: ChunkTailer, timeout: float, also: object = None) -> bool:
        if asleep is not None and timeout > 1.0:
            asleep.set()
        began = time.monotonic()
        woke = real(self, timeout, also)  # type: ignore[arg-type]
        if not woke and timeout > 0 and time.monotonic() - began >= timeout:
            timed_out.append(time.monotonic())
        return woke

    monkeypatch.setattr(ChunkTailer, "wait", wait)
    return timed_out


def test_a_node_whose_host_announces_cancellation_is_not_woken_while_it_sleeps(rt, tmp_path, monkeypatch):
    """Issue 42: every sleeping node's driver woke every WAKE (2 s) to look for a cancellation,
    a thousand nodes a thousand timers. A host whose cancellations wake the driver (the task
    runner's) leaves it asleep until something happens; the conduit's backstop poll only."""
    timed_out = counting_timer_wakes(monkeypatch)
    observer = Announcing()
    out = drive(
        NodeSpec(
            run_id="r",
            node_id="calm",
            argv=[sys.executable, "-c", f"import time; time.sleep({NAP})"],
            min_isolation="none",
        ),
        LocalConduit(tmp_path / "conduit"),
        rt,
        observer,
    )
    assert out.ok, out.describe()
    assert observer.launched_at is not None
    assert NAP < POLL_BACKSTOP
    # The guest sleeps NAP seconds after its launch: it cannot have exited before.
    during = [t for t in timed_out if observer.launched_at < t < observer.launched_at + NAP]
    assert during == [], f"{len(during)} timer wakes during a {NAP} s nap"  # before: one every 2 s


def test_an_announced_cancellation_wakes_the_sleeping_node_at_once(rt, tmp_path, monkeypatch):
    """...and a cancellation it announces is seen when it is made, not at the next backstop."""
    asleep = threading.Event()
    counting_timer_wakes(monkeypatch, asleep)
    observer = Announcing()
    result: dict[str, object] = {}
    spec_ = NodeSpec(
        run_id="r",
        node_id="cancelled",
        argv=[sys.executable, "-c", "import time; time.sleep(3600)"],
        min_isolation="none",
    )
    driver = threading.Thread(
        target=lambda: result.update(out=drive(spec_, LocalConduit(tmp_path / "conduit"), rt, observer))
    )
    driver.start()
    try:
        wait_for(
            lambda: asleep.is_set() or not driver.is_alive(),
            timeout=scaled(60),
            what="the driver asleep on its node",
        )
        cancelled_at = time.monotonic()
        observer.cancel.set()
    finally:
        driver.join(scaled(120))
    out = result["out"]
    assert isinstance(out, NodeOutcome) and out.failure == "lost" and "cancelled" in out.reason
    assert observer.seen_cancelled_at is not None
    # The backstop would have taken POLL_BACKSTOP (10 s); the wake is the set() itself.
    assert observer.seen_cancelled_at - cancelled_at < POLL_BACKSTOP / 2
