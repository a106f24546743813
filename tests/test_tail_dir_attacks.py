"""An outside review of the tail's read path on a local conduit (issue 42): the host opens the
node's directory once, with its inotify watch, and each chunk and ``_manifest.json`` by name
from that directory fd. The guest writes that directory; here the test does what it would.

FIXED: a break found by this review (failed on the tree it attacked). HOLDS: held, kept so it
keeps holding. No sleeps for synchronisation: a fake clock drives every grace and back-off.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_tail_attacks import FakeClock, P, put_chunk, put_manifest, run_to_error

from guest_runner.conduit import ConduitError, LocalConduit
from prefect_resoluto.node.tail import ChunkTailer, MissingChunk, TailError


def _watched(t: ChunkTailer) -> None:
    t.wait(0.0)  # opens the directory watch, and the directory
    if not t.watching:
        pytest.skip("no inotify here")
    assert t._dir is not None


def _armed_on_its_directory(tmp_path) -> tuple[LocalConduit, FakeClock, Path, ChunkTailer]:
    """A tail whose node directory exists and is opened and watched, its silence window armed
    (30 s), before the guest does anything to it."""
    c = LocalConduit(tmp_path / "c")
    clock = FakeClock()
    node = c.root / P
    node.mkdir(parents=True)
    t = ChunkTailer(c, P, clock=clock, silence_window=30)
    _watched(t)
    t.arm()
    return c, clock, node, t


def test_a_node_directory_that_is_a_link_is_neither_watched_nor_read_through(tmp_path):
    # FIXED: the node's directory a link to a host directory (the guest's plant where it can
    # replace it: a plain-directory slot, the process runtime). The reads refused the link
    # (O_NOFOLLOW walk) but the watch followed it: inotify_add_watch by path watched the host's
    # directory, whose every write then woke this node's tail. Now the watch is added to the
    # inode the O_NOFOLLOW walk opened, so a link gets no watch (and no read) at all.
    c = LocalConduit(tmp_path / "c")
    host_dir = tmp_path / "host-dir"
    host_dir.mkdir()
    (c.root / P).parent.mkdir(parents=True)
    (c.root / P).symlink_to(host_dir)
    t = ChunkTailer(c, P, clock=FakeClock())
    t.wait(0.0)
    assert not t.watching and t._dir is None
    (host_dir / "events-000001.jsonl").write_text("not the guest's\n")
    assert t.wait(0.05) is False  # a host write wakes nothing
    got: list[object] = []
    t.poll(got.append)
    assert got == [] and t.delivered == 0
    t.close()


def test_a_node_directory_swapped_after_the_watch_is_neither_watched_nor_read(tmp_path):
    # HOLDS: once opened, the watch and the reads stay on the directory the walk opened. The
    # guest renames it away and puts a link to a host directory in its place: a host write
    # there wakes nothing, and nothing of it is read; the tail ends by the silence window.
    host_dir = tmp_path / "host-dir"
    host_dir.mkdir()
    c, clock, node, t = _armed_on_its_directory(tmp_path)
    os.rename(node, node.with_name("moved"))
    node.symlink_to(host_dir)
    for name in ("events-000001.jsonl", "_manifest.json"):
        (host_dir / name).write_text(("{}\n" if name.startswith("_") else "") + "host\n")
    assert t.wait(0.05) is False
    ended: Exception | None = None
    for _ in range(100):
        try:
            t.poll(lambda e: pytest.fail("read a host file"))
        except (TailError, ConduitError) as e:
            # The gap probe's listing resolves the node's path: a link out of the root is an
            # InvalidKey (the driver's "conduit unavailable while tailing"), never a read.
            ended = e
            break
        clock.t += 1
        if t.silent:
            break
    assert (ended is not None or t.silent) and t.delivered == 0 and t.total is None
    t.close()


@pytest.mark.parametrize("what", ["directory", "socket"])
@pytest.mark.parametrize("target", ["chunk", "manifest"])
def test_a_directory_or_socket_named_like_a_chunk_or_manifest_is_no_object(tmp_path, what, target):
    # HOLDS (regular-file check on the opened fd): a directory opens O_RDONLY and a socket fails
    # with ENXIO; neither is read (a directory's read is EISDIR, an outage, not a protocol error).
    c = LocalConduit(tmp_path / "c")
    clock = FakeClock()
    node = c.root / P
    node.mkdir(parents=True)
    name = "events-000001.jsonl" if target == "chunk" else "_manifest.json"
    if what == "directory":
        (node / name).mkdir()
        (node / name / "events-000001.jsonl").write_text("x\n")
    else:
        # Bound by a relative name from inside the directory: a socket's path is short.
        bind = f"import socket; socket.socket(socket.AF_UNIX).bind({name!r})"
        subprocess.run([sys.executable, "-c", bind], cwd=node, check=True)
    t = ChunkTailer(c, P, clock=clock)
    _watched(t)
    if target == "chunk":
        put_manifest(c, 1)
        assert isinstance(run_to_error(t, clock), MissingChunk)
    else:
        put_chunk(c, 1, [1])
        for _ in range(5):
            t.poll(lambda e: None)
            clock.t += 60
        assert t.delivered == 1 and t.total is None and not t.result_seen
    t.close()


_LEASE_HOLDER = """
import fcntl, os, signal, sys
signal.signal(signal.SIGIO, signal.SIG_IGN)  # a lease break's signal would end it: ignored
fd = os.open(sys.argv[1], os.O_WRONLY)
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("target", ["chunk", "manifest"])
def test_a_leased_chunk_or_manifest_never_blocks_the_tail(tmp_path, target):
    # HOLDS by O_NONBLOCK on every open: a guest that owns its file (bubblewrap's root is the
    # host's) takes a write lease on it; a blocking open() then waits for the lease holder up to
    # fs.lease-break-time (45 s by default) -- the tail's thread, for every node it drives. With
    # O_NONBLOCK the open fails at once (EWOULDBLOCK): the object is "not there", the tail moves on.
    c = LocalConduit(tmp_path / "c")
    clock = FakeClock()
    put_chunk(c, 1, [1])
    put_manifest(c, 1)
    name = "events-000001.jsonl" if target == "chunk" else "_manifest.json"
    holder = subprocess.Popen(
        [sys.executable, "-c", _LEASE_HOLDER, str(c.root / P / name)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        t = ChunkTailer(c, P, clock=clock)
        _watched(t)
        got: list[object] = []
        ex = ThreadPoolExecutor(1)
        try:
            # 10 s: far less than the 45 s a blocking open would wait, far more than a poll takes.
            ex.submit(t.poll, got.append).result(timeout=10)
            assert holder.poll() is None  # the lease was still held while the tail read
        finally:
            holder.kill()  # releases a blocked open, so a failing run ends now
            ex.shutdown()
        assert t.total is None if target == "manifest" else got == []
        t.close()
    finally:
        holder.kill()
        holder.wait()


def test_a_removed_node_directory_ends_the_tail_by_silence_without_a_busy_watch(tmp_path):
    # HOLDS: the guest removes its node's directory (and makes a new one) after the host opened
    # it: the reads and the watch stay on the removed one (never the new one, never a link), the
    # watch's one IN_IGNORED wakes once and then nothing, and the silence window ends the tail.
    c, clock, node, t = _armed_on_its_directory(tmp_path)
    os.rmdir(node)
    node.mkdir()
    put_chunk(c, 1, [1])
    wakes = sum(t.wait(0.05) for _ in range(3))
    assert wakes <= 1
    for _ in range(100):
        t.poll(lambda e: pytest.fail("read the new directory through the old fd"))
        clock.t += 1
        if t.silent:
            break
    assert t.silent and t.delivered == 0
    t.close()
