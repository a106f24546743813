"""Attacks on the host-side code added for scale (issue 32): the directory watch, the tail's
budgets, the drive loop's clocks, the host heartbeat, the pod watch.

Each test names what was found (``FIXED:``) and goes through the real code path: a real
LocalConduit on ``tmp_path``, real inotify, the real DirWatch/ChunkTailer/drive code, and the
``process`` runtime where a sandbox is needed.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.counting_conduit import CountingConduit
from support.polling import scaled
from support.runtime_contract import require

from guest_runner import wire
from guest_runner.conduit import LocalConduit
from prefect_resoluto.node import tail
from prefect_resoluto.node.drive import _check_status, _Clocks, _prepare, _Sightings, drive_node
from prefect_resoluto.node.observer import Callbacks
from prefect_resoluto.node.outcome import FailureKind
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.node.tail import ChunkTailer, DirWatch
from prefect_resoluto.runtimes import get_runtime
from prefect_resoluto.runtimes.base import SandboxHandle, SandboxStatus
from prefect_resoluto.runtimes.process import ProcessRuntime

P = wire.node_prefix("r", "n")
#: select(2)'s FD_SETSIZE: descriptors at or above it do not fit its sets.
FD_SETSIZE = 1024


def _line(i: int) -> str:
    return wire.encode_event(wire.make_event("r", "log", "log", data={"line": f"l{i}"}, ts=1.0))


@pytest.fixture
def many_fds() -> Iterator[None]:
    """A host holding more than FD_SETSIZE descriptors (a thousand nodes in flight: each
    holds a directory watch and an exit descriptor, plus sockets and logs), so the next
    descriptor opened is numbered past select(2)'s limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FD_SETSIZE + 256
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.fail(f"the hard limit of open files ({hard}) is below {want}: this test needs more")
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    held: list[int] = []
    try:
        while not held or held[-1] < FD_SETSIZE + 16:
            held.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# FIXED: with more than 1 024 descriptors open in the host (what a thousand nodes in flight
# make: a directory watch and a pidfd each), a node's directory watch and its exit
# descriptor were numbered past select(2)'s FD_SETSIZE, and every wait of the tail and of
# the drive loop's clocks raised "ValueError: filedescriptor out of range in select()".
# Waits are now poll(2), which has no such limit.
def test_a_directory_watch_numbered_past_fd_setsize_still_wakes(tmp_path: Path, many_fds: None) -> None:
    c = LocalConduit(tmp_path / "c")
    (tmp_path / "c" / P).mkdir(parents=True)
    t = ChunkTailer(c, P)
    try:
        assert t.wait(0.0) and t.watching  # opens the watch
        assert t._watch is not None and t._watch.fd >= FD_SETSIZE
        also_r, also_w = os.pipe()  # an exit descriptor past the limit too
        try:
            assert also_r >= FD_SETSIZE
            assert not t.wait(0.0, also_r)  # nothing landed, the sandbox runs
            c.put(wire.chunk_key(P, 1), wire.encode_chunk([_line(1)]))
            assert t.wait(scaled(10), also_r)
            got: list[wire.SpanEvent] = []
            t.poll(got.append)
            assert len(got) == 1
            clocks = _Clocks(status_interval=60.0, exit_fd=also_r)
            clocks.polled(t)
            clocks.asked(time.monotonic())  # neither clock due: only the exit can wake it
            os.write(also_w, b"x")  # the sandbox exits: its descriptor is readable
            clocks.wait(t)
            assert clocks.next_status == 0.0 and clocks.exit_fd is None  # seen at once, closed
            also_r = -1
        finally:
            if also_r >= 0:
                os.close(also_r)
            os.close(also_w)
    finally:
        t.close()


def test_a_node_driven_with_more_than_fd_setsize_descriptors_open_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, many_fds: None
) -> None:
    monkeypatch.setenv("RESOLUTO_STATE_DIR", str(tmp_path / "state"))
    rt = require(get_runtime("process"))
    code = "import sys; print('hello from the node'); sys.stdout.flush()"
    out = drive_node(
        NodeSpec(run_id="r", node_id="many-fds", argv=[sys.executable, "-c", code]),
        LocalConduit(tmp_path / "c"),
        rt,
        min_isolation="none",
    )
    assert out.ok, out.describe()


#: A guest creating names in its node's directory as fast as it can: each open-for-write
#: and close is an IN_CLOSE_WRITE, alternating names so that the kernel merges none. It
#: writes ``marker`` first, and stops by itself after ``seconds`` (a bound for a broken host).
FLOOD = """
import os, sys, time
d, marker, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
names = [os.path.join(d, "events-" + "0" * 200 + str(i) + "x") for i in range(8)]
open(marker, "w").close()
end = time.monotonic() + seconds
flags = os.O_WRONLY | os.O_CREAT
while time.monotonic() < end:
    for _ in range(256):
        for name in names:
            os.close(os.open(name, flags, 0o600))
"""


@pytest.fixture
def busy_host() -> Iterator[None]:
    """The host's other work: the drivers of its other nodes, sharing the GIL with this one's
    (a host drives hundreds). Three threads that never block."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    threads = [threading.Thread(target=spin, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join()


def _wait_for_file(path: Path, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + scaled(30)
    while not path.exists():
        assert proc is None or proc.poll() is None, "the flood ended before it began"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)  # polling a condition against a deadline, not a guess


# FIXED: DirWatch.wait drained the inotify queue until it was empty. A sandbox creating names
# in its node's directory faster than the host's driver thread parses their events (which
# it did as soon as that thread shared the GIL with a few others: a host drives many nodes)
# kept the driver inside one wait for as long as the flood lasted: no poll, no status, no
# cancellation, no silence watchdog, and a host core busy. A wake now reads one bounded
# buffer of events; the rest wakes the next wait.
def test_a_flood_of_names_never_keeps_the_directory_watch_from_returning(
    tmp_path: Path, busy_host: None
) -> None:
    d = tmp_path / "node"
    d.mkdir()
    watch = DirWatch.open(str(d))
    assert watch is not None, "inotify is needed here"
    marker = tmp_path / "flooding"
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, str(d), str(marker), "600"])
    try:
        _wait_for_file(marker, flood)
        returned = threading.Event()

        def waits() -> None:
            for _ in range(20):  # twenty wakes, each within its gap, while the flood lasts
                watch.wait(scaled(30))
            returned.set()

        waiter = threading.Thread(target=waits, daemon=True)
        waiter.start()
        assert returned.wait(scaled(10)), "the directory watch is still draining a flood"
        assert flood.poll() is None  # the flood went on all along
    finally:
        flood.kill()
        flood.wait()
        watch.close()


def test_a_node_flooding_its_directory_is_still_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, busy_host: None
) -> None:
    monkeypatch.setenv("RESOLUTO_STATE_DIR", str(tmp_path / "state"))
    rt = require(get_runtime("process"))
    root = tmp_path / "c"
    marker = tmp_path / "flooding"
    node_dir = root / wire.node_prefix("r", "flood")
    cancel_at: list[float] = []

    def should_cancel() -> bool:
        if marker.exists() and not cancel_at:
            cancel_at.append(time.monotonic())
        return bool(cancel_at)

    done = threading.Event()
    outcome: list[Any] = []

    def run() -> None:
        outcome.append(
            drive_node(
                NodeSpec(
                    run_id="r",
                    node_id="flood",
                    argv=[sys.executable, "-c", FLOOD, str(node_dir), str(marker), "90"],
                ),
                LocalConduit(root),
                rt,
                min_isolation="none",
                should_cancel=should_cancel,
            )
        )
        done.set()

    driver = threading.Thread(target=run, daemon=True)
    driver.start()
    _wait_for_file(marker)
    assert done.wait(scaled(20)), "the host did not see its own cancellation while the node flooded"
    out = outcome[0]
    assert not out.ok and "cancelled by the host" in out.reason, out.describe()


# FIXED (with the one above): once a wake reads a bounded buffer, a sandbox that flooded its
# directory and then died left thousands of events queued, and every wake they caused hid its
# exit descriptor from the drive loop's clocks: the exit was seen at STATUS_BACKSTOP (30 s),
# not at once. The exit descriptor is now looked at on every wake.
def test_a_node_that_floods_then_dies_is_seen_dead_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, busy_host: None
) -> None:
    monkeypatch.setenv("RESOLUTO_STATE_DIR", str(tmp_path / "state"))
    rt = require(get_runtime("process"))
    root = tmp_path / "c"
    marker = tmp_path / "flooding"
    dying = tmp_path / "dying"
    node_dir = root / wire.node_prefix("r", "dies")
    # Floods until the host has queued far more than a wake reads, then kills its runner (the
    # sandbox's process): no result, no manifest, only the exit tells the host.
    code = FLOOD + "open(sys.argv[4], 'w').close()\nimport signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
    done = threading.Event()
    outcome: list[Any] = []

    def run() -> None:
        outcome.append(
            drive_node(
                NodeSpec(
                    run_id="r",
                    node_id="dies",
                    argv=[sys.executable, "-c", code, str(node_dir), str(marker), "3", str(dying)],
                ),
                LocalConduit(root),
                rt,
                min_isolation="none",
            )
        )
        done.set()

    driver = threading.Thread(target=run, daemon=True)
    driver.start()
    _wait_for_file(dying)
    assert done.wait(scaled(10)), "the sandbox's exit went unseen behind its queued events"
    assert outcome[0].failure is not None, outcome[0].describe()


# FIXED: a recovery listing paged on until it ran out of names. Past chunk 99 999 it starts
# at events-099999 (7-digit names sort among the 6-digit ones) and passes the node's own
# chunks a page (1 000 names) at a time, and a page of a local conduit is a scan of the whole
# directory: a guest that wrote 150 000 small chunks and a manifest saying so made the end
# check scan its directory 51 times (7.5 M names, ~8 s of the driver's thread, which sees no
# cancellation meanwhile), growing with the square of what it wrote. A listing now reads at
# most LIST_PAGES (8) pages: a chunk hidden past them is one the host never reads anyway.
def test_the_end_listing_of_a_node_of_many_chunks_reads_a_bounded_number_of_pages(tmp_path: Path) -> None:
    c = CountingConduit(tmp_path / "c")
    d = tmp_path / "c" / P
    d.mkdir(parents=True)
    n = 116_000  # 16 pages past chunk 99 999
    for i in range(1, n + 1):  # what a guest's chunks leave: one file each (empty: no events)
        with open(d / f"events-{i:06d}.jsonl", "wb"):
            pass
    c.put(wire.manifest_key(P), wire.encode_manifest(n))
    t = ChunkTailer(c, P)
    t.delivered = n  # its chunks are read: the manifest's check makes the end listing
    assert t.check_manifest() and t.finished
    assert t.listings == c.lists <= 8, c.lists  # each a scan of the whole directory here


# FIXED: a poll's budget counted chunks only (16), and a chunk may hold 32 MiB, ~240 000
# events: one poll of a guest that wrote sixteen full chunks decoded and delivered half a GiB
# (~2 s a chunk here with an observer that does nothing: ~30 s, more with Prefect's logs) before the
# driver looked at cancellation, status or silence again -- and a slot of the default 4 GiB
# holds 128 of them. A poll now also stops after the chunk that takes it past 4 MiB; the
# driver polls again at once (``behind``), after its checks.
def test_a_poll_stops_at_its_byte_budget_and_the_driver_sees_its_checks_between(tmp_path: Path) -> None:
    c = LocalConduit(tmp_path / "c")
    line = _line(0)
    per_chunk = (3 << 20) // (len(line) + 1)  # 3 MiB chunks: well under a chunk's limit
    n = 8
    for i in range(1, n + 1):
        c.put(wire.chunk_key(P, i), ("\n".join([line] * per_chunk) + "\n").encode())
    t = ChunkTailer(c, P)
    clocks = _Clocks(status_interval=1.0, exit_fd=None)
    polls = 0
    while t.delivered < n:
        before = t.delivered
        t.poll(lambda ev: None)
        polls += 1
        assert t.delivered - before <= 2, f"one poll read {t.delivered - before} chunks of 3 MiB"
        clocks.polled(t)
        if t.delivered < n:  # stopped by its budget: the next poll is due at once
            assert t.behind and clocks.next_poll - time.monotonic() <= tail.MIN_POLL
    assert t.events_delivered == n * per_chunk and polls >= n // 2


# FIXED: once the sandbox had exited, the drive loop read what it left (_drain_after_exit)
# to the end without looking at the host's cancellation: a guest that wrote its slot full of
# chunks (the default 4 GiB: 128 chunks of 32 MiB), a manifest counting them, and exited kept
# a cancelled node's driver delivering them for minutes. The drain now stops at the first
# look (between polls) that finds the node cancelled.
class _ExitedRuntime(ProcessRuntime):
    """The process runtime, whose sandbox has exited (status is all the drain asks of it)."""

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        return SandboxStatus("succeeded", exit_code=0)


def test_what_an_exited_sandbox_left_is_not_read_after_the_host_cancels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RESOLUTO_STATE_DIR", str(tmp_path / "state"))
    c = LocalConduit(tmp_path / "c")
    line = _line(0)
    per_chunk = (1 << 20) // (len(line) + 1)
    n = 40
    for i in range(1, n + 1):
        c.put(wire.chunk_key(P, i), ("\n".join([line] * per_chunk) + "\n").encode())
    c.put(wire.manifest_key(P), wire.encode_manifest(n))
    got: list[wire.SpanEvent] = []
    observer = Callbacks(on_event=got.append, should_cancel=lambda: bool(got))  # cancelled once it reads
    node = _prepare(
        NodeSpec(run_id="r", node_id="n", argv=["true"], min_isolation="none"), c, _ExitedRuntime(), observer
    )
    try:
        assert _check_status(node, SandboxHandle(id="exited", runtime="process"), _Sightings())  # the exit
    finally:
        if node.beat is not None:
            node.beat.release()
    assert node.failure is FailureKind.LOST and "cancelled" in node.reason, (node.failure, node.reason)
    assert node.tailer.delivered <= tail.CHUNKS_PER_POLL, (
        f"{node.tailer.delivered} chunks read after the cancellation"
    )
