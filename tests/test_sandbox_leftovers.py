"""What a sandbox leaves in a local runtime's state directory, and who removes it
(issue 39, finding 4).

On bubblewrap a task nested 3 000 directories in ``/workspace`` with 64 MiB at the bottom:
destroy's recursive removal died ("maximum recursion depth exceeded") after the record had
gone, so no ``sweep`` found the rest, and ``/workspace`` had no size at all (a 256 Mi task
wrote 2 GiB). Now ``/workspace`` is a tmpfs sized like the node's slot, trees are removed
by directory descriptors with no recursion, and ``sweep`` finds what a half-removed
sandbox left, record or not. Every check runs real sandboxes on this machine.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from support.runtime_contract import require, spec, wait_terminal

from guest_runner.conduit import LocalConduit
from prefect_resoluto.host import state as host_state
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes.base import Resources
from prefect_resoluto.runtimes.bubblewrap import BubblewrapRuntime
from prefect_resoluto.runtimes.process import ProcessRuntime

DEPTH = 3000

#: The attacker's nest: DEPTH directories, each entered by a relative name (no path is
#: ever longer than one name), with a file at the bottom, a FIFO, a link out of the tree
#: and a directory of mode 000 on the way.
NEST = f"""
import os
top = os.getcwd()
os.symlink('/etc', 'out')
for i in range({DEPTH}):
    os.mkdir('d')
    os.chdir('d')
    if i == 10:
        os.mkfifo('fifo')
        os.symlink('../../../../../../../../../../..', 'up')
        os.mkdir('locked')
        open('locked/x', 'w').close()
        os.chmod('locked', 0)
with open('bottom.bin', 'wb') as f:
    f.write(b'x' * (4 << 20))
os.chdir(top)
print('nested', {DEPTH}, flush=True)
"""


LOCK = ".lock"


def _leftovers(state: Path) -> list[str]:
    """What the runtime's state directory holds besides its own lock (no walk: too deep)."""
    return sorted(n for n in os.listdir(state) if n != LOCK) if state.is_dir() else []


@pytest.fixture
def bwrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> BubblewrapRuntime:
    monkeypatch.setenv("RESOLUTO_STATE_DIR", str(tmp_path / "state"))
    return require(BubblewrapRuntime())  # type: ignore[return-value]


@pytest.fixture
def process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ProcessRuntime:
    monkeypatch.setenv("RESOLUTO_STATE_DIR", str(tmp_path / "state"))
    return require(ProcessRuntime())  # type: ignore[return-value]


@pytest.mark.sandbox
def test_a_deep_nest_in_the_workspace_is_gone_after_destroy(bwrap: BubblewrapRuntime) -> None:
    h = bwrap.launch(spec(NEST, resources=Resources(memory_bytes=256 << 20)))
    try:
        st = wait_terminal(bwrap, h)
        assert st.phase == "succeeded" and f"nested {DEPTH}" in bwrap.logs(h), bwrap.logs(h)
    finally:
        bwrap.destroy(h)
    assert _leftovers(bwrap.state) == [] and bwrap.list_ids() == []


def test_a_deep_nest_on_the_hosts_disk_is_removed_by_destroy(process: ProcessRuntime) -> None:
    """The process runtime's workspace is a directory of the host's disk: the remover
    itself takes the nest apart (it used to recurse, and stop, 1 000 levels down)."""
    h = process.launch(spec(NEST))
    try:
        st = wait_terminal(process, h)
        assert st.phase == "succeeded" and f"nested {DEPTH}" in process.logs(h), process.logs(h)
    finally:
        process.destroy(h)
    assert _leftovers(process.state) == [] and process.list_ids() == []
    assert os.path.isdir("/etc") and os.listdir("/etc")  # the links out were never followed


def _nest(root: Path, depth: int, name: str) -> int:
    """``depth`` directories called ``name`` under ``root``, made by descriptors (the path
    is far past PATH_MAX); returns the deepest one's descriptor."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir(name, dir_fd=fd)
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = sub
    return fd


def test_the_remover_takes_any_depth_and_never_follows_a_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("the host's")
    tree = tmp_path / "tree"
    tree.mkdir()
    os.symlink(outside, tree / "link")
    os.symlink("..", tree / "dotdot")
    fd = _nest(tree, 1200, "n" * 255)  # past the recursion limit shutil.rmtree stopped at
    try:
        os.symlink(outside, "out", dir_fd=fd)
        os.mkfifo("fifo", dir_fd=fd)
        with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "wb") as f:
            f.write(b"x" * 4096)
        os.mkdir("locked", 0o000, dir_fd=fd)
        os.fchmod(fd, 0o000)
    finally:
        os.close(fd)
    assert host_state.remove_tree(tree) is True
    assert not tree.exists() and (outside / "keep").read_text() == "the host's"
    assert host_state.remove_tree(tree) is True  # nothing there: nothing to do


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_the_remover_does_not_empty_a_mount_inside_the_tree(tmp_path: Path) -> None:
    from prefect_resoluto.runtimes import slot

    tree = tmp_path / "tree"
    inner = tree / "a" / "mnt"
    assert slot.mount(inner, 1 << 20)
    try:
        (inner / "held").write_text("another filesystem's")
        assert host_state.remove_tree(tree) is False
        assert (inner / "held").read_text() == "another filesystem's"
    finally:
        slot.release(inner)
    assert host_state.remove_tree(tree) is True and not tree.exists()


@pytest.mark.sandbox
@pytest.mark.parametrize("left", ["no record", "destroy interrupted"])
def test_sweep_removes_what_a_half_removed_sandbox_left(bwrap: BubblewrapRuntime, left: str) -> None:
    """A destroy that lost its record first (today's order) or stopped half-way: any
    ``sweep``, whatever its labels, finds the rest by scanning the state directory."""
    h = bwrap.launch(spec("print('done', flush=True)", labels={"run": "r1"}))
    assert wait_terminal(bwrap, h).phase == "succeeded", bwrap.logs(h)
    d = bwrap.state / h.id
    (d / "bulk").write_bytes(b"y" * (1 << 20))  # what the removal had not reached yet
    if left == "no record":
        (d / host_state.RECORD_NAME).unlink()
    else:
        with pytest.MonkeyPatch.context() as m:  # a host killed right after the rename
            m.setattr(host_state, "remove_tree", lambda path: False)
            bwrap.destroy(h)
        assert _leftovers(bwrap.state) != []
    assert bwrap.list_ids() == []
    bwrap.sweep({"run": "some other run"})
    assert _leftovers(bwrap.state) == []


@pytest.mark.sandbox
def test_a_sweep_leaves_live_sandboxes_and_the_runtimes_own_directories(
    bwrap: BubblewrapRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bwrap, "own_entries", frozenset({"cache"}))
    (bwrap.state / "cache").mkdir()
    h = bwrap.launch(spec("import time; print('up', flush=True); time.sleep(60)"))
    try:
        bwrap.sweep({"run": "some other run"})
        assert bwrap.status(h).phase == "running" and bwrap.list_ids() == [h.id]
        assert (bwrap.state / "cache").is_dir()
    finally:
        bwrap.destroy(h)


WRITE_PAST = r"""
import errno, os, sys
written = 0
try:
    with open(os.path.join(os.environ.get('RESOLUTO_WORKSPACE_DIR', '.'), 'fill'), 'wb') as f:
        for _ in range(64):
            f.write(b'z' * (1 << 20))
            f.flush()
            written += 1
except OSError as e:
    print('stopped after', written, 'MiB:', errno.errorcode.get(e.errno), flush=True)
    raise
print('wrote', written, 'MiB', flush=True)
"""


@pytest.mark.sandbox
def test_writing_past_the_workspace_gets_enospc(bwrap: BubblewrapRuntime) -> None:
    """``disk=8Mi``: ``/workspace`` holds 8 MiB (a task limited to 256Mi once wrote 2 GiB)."""
    h = bwrap.launch(spec(WRITE_PAST, resources=Resources(memory_bytes=256 << 20, disk_bytes=8 << 20)))
    try:
        st = wait_terminal(bwrap, h)
        logs = bwrap.logs(h)
        assert st.phase == "failed" and not st.infrastructure, (st, logs)
        assert "MiB: ENOSPC" in logs, logs
        written = int(logs.split("stopped after ", 1)[1].split()[0])
        assert written <= 8, logs
    finally:
        bwrap.destroy(h)


@pytest.mark.sandbox
def test_a_node_writing_past_its_workspace_fails_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RESOLUTO_STATE_DIR", str(tmp_path / "state"))
    rt = require(BubblewrapRuntime())
    node = NodeSpec(
        run_id="run1",
        node_id="fill",
        argv=[sys.executable, "-c", WRITE_PAST],
        outputs_dir=tmp_path / "outputs",
        resources=Resources.from_quantities(memory="256Mi", cpus="1", disk="8Mi"),
    )
    seen: list[str] = []
    outcome = drive_node(
        node,
        LocalConduit(tmp_path / "conduit"),
        rt,
        min_isolation="none",
        on_event=lambda ev: seen.append(json.dumps(ev.get("data", {}))),
    )
    assert not outcome.ok and not outcome.infrastructure_failure, outcome.describe()
    assert outcome.reason == "workload exited with code 1", outcome.describe()
    told = "\n".join(seen)  # the task's own traceback, as its log lines
    assert "No space left on device" in told and "stopped after" in told, told
    assert _leftovers(rt.state) == []


def test_a_sandbox_id_may_not_take_the_state_directorys_own_names() -> None:
    for bad in (".lock", ".removing-x", "..", "a/b", ""):
        with pytest.raises(ValueError):
            host_state.sandbox_dir(Path("/nonexistent"), bad)
    assert host_state.LOCK_NAME == LOCK


def test_a_plain_directory_slot_loses_what_is_nested_past_its_depth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the right to mount, the slot is a plain directory on the conduit's disk:
    what a guest nested past ``slot.MAX_DEPTH`` there used to stay, unreported below it."""
    import errno

    from prefect_resoluto.runtimes import slot

    real = slot._call

    def refuse(fn: str, *args: object) -> None:
        if fn == "mount":
            raise OSError(errno.EPERM, "Operation not permitted")
        real(fn, *args)

    monkeypatch.setattr(slot, "_call", refuse)
    d = tmp_path / "n"
    assert slot.mount(d, 1 << 20) is False
    (d / "ok").write_text("x")
    os.close(_nest(d, slot.MAX_DEPTH + 40, "d"))
    done = slot.settle(d, 1 << 20, "memory")
    assert f"directories nested deeper than {slot.MAX_DEPTH}" in done.reason(), done.reason()
    deepest = d.joinpath(*["d"] * slot.MAX_DEPTH)
    assert deepest.is_dir() and os.listdir(deepest) == [] and (d / "ok").read_text() == "x"
