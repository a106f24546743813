"""The host's directory watches share one inotify instance (``prefect_resoluto.node.dirwatch``).

One instance per node ran out at the user's ``fs.inotify.max_user_instances`` (128 by
default): past it, nodes fell back to polling, and nothing else the user ran had an
instance left. Real inotify, real directories, the real reading thread throughout.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.polling import scaled
from support.quiet_hub import drain_hub

from guest_runner import wire
from guest_runner.conduit.local import TEMP_PREFIX, LocalConduit
from prefect_resoluto.node import dirwatch
from prefect_resoluto.node.dirwatch import DirWatch
from prefect_resoluto.node.tail import ChunkTailer

# A sandbox publishing names as fast as one core lets it, from a process of its own.
FLOOD = """
import os, sys, time
d, marker, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
open(marker, "w").close()
end = time.monotonic() + seconds
i = 0
while time.monotonic() < end:
    for _ in range(256):
        tmp = os.path.join(d, "t%d" % (i % 64))
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600))
        os.replace(tmp, os.path.join(d, "events-%06d.jsonl" % (i % 64)))
        i += 1
"""


def _inotify_instances() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify"
        except OSError:
            pass
    return n


def _watch(d: Path) -> DirWatch:
    d.mkdir(parents=True, exist_ok=True)
    w = DirWatch.open(str(d))
    assert w is not None, "inotify is needed here"
    return w


def _publish(d: Path, name: str) -> None:
    tmp = d / f"{TEMP_PREFIX}{name}"
    tmp.write_bytes(b"{}")
    os.replace(tmp, d / name)


@pytest.fixture(autouse=True)
def _quiet_hub() -> None:
    drain_hub()


@pytest.fixture
def watches() -> Iterator[list[DirWatch]]:
    held: list[DirWatch] = []
    try:
        yield held
    finally:
        for w in held:
            w.close()


def test_a_host_watches_more_node_directories_than_its_users_inotify_instances(
    tmp_path: Path, watches: list[DirWatch]
) -> None:
    limit = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
    if limit > 2000:
        pytest.skip(f"max_user_instances is {limit} here: more watches than that is not a unit test")
    before = _inotify_instances()
    n = limit + 50
    for i in range(n):
        w = DirWatch.open(str(_mkdir(tmp_path / f"node{i}")))
        assert w is not None, f"watch {i} of {n}: no inotify left (the limit is {limit} instances)"
        watches.append(w)
    assert _inotify_instances() - before <= 1  # one instance, shared (none new if one was open)
    for i in (0, limit - 1, limit, n - 1):  # each wakes for its own directory's object
        _publish(tmp_path / f"node{i}", "events-000001.jsonl")
        assert watches[i].wait(scaled(10)) and watches[i].only_chunks
    assert not any(w.wait(0.0) for w in watches[1 : limit - 1])


def _mkdir(d: Path) -> Path:
    d.mkdir()
    return d


def test_a_watch_wakes_for_its_own_directory_only_and_once_per_object(tmp_path: Path) -> None:
    a, b = _watch(tmp_path / "a"), _watch(tmp_path / "b")
    try:
        _publish(tmp_path / "a", wire.MANIFEST)
        assert a.wait(scaled(10)) and not a.only_chunks  # not a chunk: the manifest is due
        assert not b.wait(0.0)
        assert not a.wait(0.0)  # told once
        (tmp_path / "a" / f"{TEMP_PREFIX}x").write_bytes(b"half")  # a writer's temporary file
        _publish(tmp_path / "b", "events-000001.jsonl")
        assert b.wait(scaled(10)) and b.only_chunks
        assert not a.wait(0.0), "a temporary file woke the watch"
    finally:
        a.close()
        b.close()


def test_only_a_name_the_tail_reads_wakes_its_watch(tmp_path: Path) -> None:
    """result.json is read once the manifest is there, and a name of a sandbox's own is read
    by nobody: neither wakes the driver (a sandbox cannot wake it at will). The chunk
    published after them, by the same writer, is what the wake is for: the queue is in
    order, so the names before it were seen, and not one of them woke the watch."""
    w = _watch(tmp_path / "n")
    try:
        for name in (wire.RESULT, "junk", "events-x.jsonl", "xevents-000001.jsonl", "_manifest.json.bak"):
            _publish(tmp_path / "n", name)
        _publish(tmp_path / "n", "events-000001.jsonl")
        assert w.wait(scaled(10)) and w.only_chunks, "a name that is not the tail's woke it as the manifest"
        assert w.wakes == 1
        assert not w.wait(0.0)
        (tmp_path / "n" / wire.MANIFEST).write_bytes(b"{}")  # written in place: its close tells
        assert w.wait(scaled(10)) and not w.only_chunks
    finally:
        w.close()


def test_two_watches_of_one_directory_are_both_told_and_either_may_close_first(tmp_path: Path) -> None:
    a, b = _watch(tmp_path / "d"), _watch(tmp_path / "d")
    try:
        _publish(tmp_path / "d", "events-000001.jsonl")
        assert a.wait(scaled(10)) and b.wait(scaled(10))
        a.close()
        _publish(tmp_path / "d", "events-000002.jsonl")
        assert b.wait(scaled(10))  # the directory is still watched for b
        assert not a.wait(0.0)  # closed: sleeps, never told
    finally:
        a.close()
        b.close()


def test_a_watched_directory_removed_wakes_its_watch_and_closes_cleanly(tmp_path: Path) -> None:
    w = _watch(tmp_path / "gone")
    try:
        (tmp_path / "gone").rmdir()
        assert w.wait(scaled(10)) and not w.only_chunks  # told: a poll finds out what happened
        assert not w.wait(0.0)
    finally:
        w.close()
    again = _watch(tmp_path / "gone")  # the same path, a new directory: a new watch of it
    try:
        _publish(tmp_path / "gone", "events-000001.jsonl")
        assert again.wait(scaled(10))
    finally:
        again.close()


def test_an_overflow_of_the_shared_queue_wakes_every_watch_at_most_once_a_gap(tmp_path: Path) -> None:
    """Lost events may have been any watch's: each is woken to look (one poll), and however
    often the queue overflows, no more often than OVERFLOW_GAP."""
    a, b = _watch(tmp_path / "a"), _watch(tmp_path / "b")
    hub = dirwatch._the_hub()
    assert hub is not None
    # The kernel's IN_Q_OVERFLOW: no watch, no name.
    overflow = dirwatch.parse(struct.pack("iIII", -1, 0x4000, 0, 0))
    assert overflow == ({}, [], True)
    try:
        hub._dispatch(*overflow)
        assert a.wait(scaled(10)) and b.wait(scaled(10))
        assert not a.only_chunks
        hub._dispatch(*overflow)  # again at once: held back until the gap has passed...
        assert not a.wait(0.0) and not b.wait(0.0)
        # The reading thread, which finds overflows itself, next sleeps only until the gap
        # ends: a writer's temporary file wakes it as any event would (and tells no watch).
        (tmp_path / "a" / f"{TEMP_PREFIX}x").write_bytes(b"")
        assert a.wait(scaled(10) + dirwatch.OVERFLOW_GAP)  # ...then told, by the reading thread
        assert b.wait(scaled(10))
    finally:
        a.close()
        b.close()


def test_a_sandbox_flooding_its_directory_does_not_keep_another_nodes_watch_from_its_objects(
    tmp_path: Path,
) -> None:
    flooded, quiet = tmp_path / "flooded", tmp_path / "quiet"
    f, q = _watch(flooded), _watch(quiet)
    marker = tmp_path / "flooding"
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, str(flooded), str(marker), "600"])
    try:
        while not marker.exists():
            assert flood.poll() is None, "the flood ended before it began"
            f.wait(0.1)  # waiting on the flood itself to begin: its names wake f
        for i in range(1, 6):
            _publish(quiet, f"events-{i:06d}.jsonl")
            assert q.wait(scaled(10)), f"object {i} of the quiet node was not seen during the flood"
        cpu0, wall0 = _reader_cpu(), time.monotonic()
        spurious = sum(q.wait(0.2) for _ in range(10))  # nothing of its own lands for ~2 s
        cpu, wall = _reader_cpu() - cpu0, time.monotonic() - wall0
        # Only the overflow broadcasts, at most one per OVERFLOW_GAP, reach the quiet node.
        assert spurious <= wall / dirwatch.OVERFLOW_GAP + 2
        # The reading thread does not parse a flood name by name: a bounded share of a core
        # (before: a third of one for this flood, 66 % for one renaming 150 000 names a second).
        assert cpu < 0.25 * wall, f"the reading thread spent {cpu:.2f} s of CPU in {wall:.2f} s"
        assert flood.poll() is None  # the flood went on all along
    finally:
        flood.kill()
        flood.wait()
        f.close()
        q.close()


def _reader_cpu() -> float:
    """CPU seconds of the hub's reading thread (its /proc stat: utime + stime)."""
    (tid,) = [t.native_id for t in threading.enumerate() if t.name == "resoluto-dirwatch"]
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_finalizer_run_in_a_thread_holding_the_hubs_lock_neither_deadlocks_nor_leaks(
    tmp_path: Path,
) -> None:
    """The cyclic collector runs an unclosed tailer's finalizer in whichever thread it
    triggers in: the reading thread inside its dispatch, or a driver opening a watch. The
    finalizer took the hub's lock, which that thread held: the host hung for good."""
    prefix = wire.node_prefix("r", "n")
    (tmp_path / "c" / prefix).mkdir(parents=True)
    tailer = ChunkTailer(LocalConduit(tmp_path / "c"), prefix)
    assert tailer.wait(0.0) and tailer._watch is not None
    held = tailer._watch._watch
    hub = dirwatch._the_hub()
    assert hub is not None
    finalized = threading.Event()

    def collector_inside_the_lock() -> None:
        with hub.lock:
            tailer.__del__()  # as the collector would, here
        finalized.set()

    threading.Thread(target=collector_inside_the_lock, daemon=True).start()
    assert finalized.wait(scaled(10)), "the finalizer is waiting for a lock its own thread holds"
    _watch(tmp_path / "next").close()  # the next watch opened (or closed) releases it
    assert held.wd == -1 and all(held not in ws for ws in hub.by_wd.values())


def test_a_forked_child_closing_an_inherited_watch_leaves_the_parents_alone(tmp_path: Path) -> None:
    d = tmp_path / "node"
    w = _watch(d)
    try:
        pid = os.fork()
        if pid == 0:  # a child the host forked, tidying up what it inherited
            try:
                w.close()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        _publish(d, "events-000001.jsonl")
        assert w.wait(scaled(10)) and w.only_chunks, "the child removed the parent's watch"
    finally:
        w.close()
