"""Attacks on the host-side code added for scale (issue 32): the directory watch, the tail's
budgets, the drive loop's clocks, the host heartbeat, the pod watch.

Each test names what was found (``FIXED:``) and goes through the real code path: a real
LocalConduit on ``tmp_path``, real inotify, the real DirWatch/ChunkTailer/drive code, and the
``process`` runtime where a sandbox is needed.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.polling import scaled
from support.runtime_contract import require

from guest_runner import wire
from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.drive import _Clocks, drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.node.tail import ChunkTailer
from prefect_resoluto.runtimes import get_runtime

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
