"""A compromised runner and the conduit directory on the host (issue 30, findings 1 and 2).

The guest runner is replaced (as in tests/test_hostile_outputs.py) by a script that, in a
real sandbox started by ``drive_node``, writes into its node's directory what an attacker
would leave on the host: set-uid and set-gid copies of ``id``, a world-writable file, a
device node, a FIFO, a 1 TiB sparse file, a plain executable, and re-modes the directory
itself -- then reports success as a guest would. Afterwards nothing under the conduit root
carries a special bit or is anything but a plain file or directory, the node fails as a
protocol failure naming each plant, nothing outside the node's directory changed, and
uid 65534 running whatever the guest left gets no privilege.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_hostile_outputs import HOSTILE_GUEST, _Patched, reg, snapshot, tar_gz

from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes import get_runtime, slot
from prefect_resoluto.runtimes.base import Resources

PLANT = r"""
import os, shutil, stat
d = os.path.join(os.environ['RESOLUTO_STORE_ROOT'], os.environ['RESOLUTO_STORE_PREFIX'])
os.makedirs(d, exist_ok=True)
def attempt(what, fn):
    try:
        fn()
        print('planted', what, flush=True)
    except OSError as e:
        print('refused', what, e, flush=True)
def copy(name, mode):
    shutil.copyfile('/usr/bin/id', os.path.join(d, name))
    os.chmod(os.path.join(d, name), mode)
attempt('suid', lambda: copy('suid-id', 0o4755))
attempt('sgid', lambda: copy('sgid-id', 0o6777))
attempt('plain', lambda: copy('plain-id', 0o755))
def ww():
    with open(os.path.join(d, 'world-writable'), 'w') as f:
        f.write('x')
    os.chmod(os.path.join(d, 'world-writable'), 0o666)
attempt('world-writable', ww)
attempt('device', lambda: os.mknod(os.path.join(d, 'null-dev'), 0o666 | stat.S_IFCHR, os.makedev(1, 3)))
attempt('fifo', lambda: os.mkfifo(os.path.join(d, 'fifo')))
def sparse():
    with open(os.path.join(d, 'sparse'), 'wb') as f:
        f.truncate(1 << 40)
attempt('sparse', sparse)
def subdir():
    os.makedirs(os.path.join(d, 'sub'), exist_ok=True)
    os.chmod(os.path.join(d, 'sub'), 0o3777)
attempt('subdir', subdir)
attempt('chmod', lambda: os.chmod(d, 0o755))
"""

#: Fills the node's directory with up to 600 MiB, then reports success as a guest would.
FILL = r"""
import os
d = os.path.join(os.environ['RESOLUTO_STORE_ROOT'], os.environ['RESOLUTO_STORE_PREFIX'])
os.makedirs(d, exist_ok=True)
block = bytes(range(256)) * 4096
n = 0
try:
    with open(os.path.join(d, 'big'), 'wb') as f:
        for _ in range(600):
            f.write(block)
            f.flush()
            n += 1
except OSError as e:
    print('stopped after', n, 'MiB:', e, flush=True)
"""

RUNTIMES = ["gvisor", "bubblewrap", "container"]


@pytest.fixture(params=RUNTIMES)
def rt(request: pytest.FixtureRequest) -> Any:
    r = get_runtime(request.param)
    if not r.availability().ok:
        pytest.skip(f"{request.param} is not available here: {r.availability().why}")
    return r


def _spec(tmp_path: Path, node: str = "node1", **kw: Any) -> NodeSpec:
    return NodeSpec(
        run_id="run1",
        node_id=node,
        argv=["true"],
        outputs_dir=tmp_path / "outputs",
        output_paths=["**"],
        resources=kw.pop("resources", Resources.from_quantities(memory="256Mi", cpus="1")),
        **kw,
    )


def _hostile(script: str) -> list[str]:
    import base64

    return [
        "python3",
        "-c",
        script + "\n" + HOSTILE_GUEST,
        base64.b64encode(tar_gz([reg("ok.txt")])).decode(),
    ]


def _special(root: Path) -> list[str]:
    """Everything under ``root`` that is not a plain file or directory, or has a special bit."""
    bad = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in [*dirnames, *filenames, ""]:
            p = Path(dirpath, name)
            st = os.lstat(p)
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                bad.append(f"{p}: type {stat.S_IFMT(st.st_mode):o}")
            elif st.st_mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | stat.S_IWOTH):
                bad.append(f"{p}: mode {stat.S_IMODE(st.st_mode):04o}")
    return bad


def _run_as_nobody(path: Path) -> tuple[int, str]:
    """What uid 65534 gets running ``path``: the host opens it, the unprivileged user
    executes it through the descriptor (``/proc/self/fd``), so only the file and its mount
    decide."""
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        r = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", f"/proc/self/fd/{fd}"],
            capture_output=True,
            text=True,
            timeout=30,
            pass_fds=(fd,),
        )
    finally:
        os.close(fd)
    return r.returncode, r.stdout + r.stderr


@pytest.mark.sandbox
def test_nothing_a_compromised_runner_leaves_carries_privilege(rt, tmp_path):
    conduit = LocalConduit(tmp_path / "conduit")
    # Another node of the run, already finished: its files must not change.
    conduit.put("run/run1/nodes/other/result.json", b"{}")
    other = snapshot(conduit.root / "run/run1/nodes/other")
    with _Patched([*_hostile(PLANT), "success"]):
        outcome = drive_node(_spec(tmp_path), conduit, rt, min_isolation="none")
    assert outcome.failure == "protocol", outcome.describe()
    for name in ("'suid-id' with mode 4755", "'sgid-id' with mode 6777", "'world-writable' with mode 0666"):
        assert name in outcome.reason, outcome.reason
    assert "'sparse', 1099511627776 bytes, more than the slot's capacity" in outcome.reason
    node = conduit.root / "run/run1/nodes/node1"
    assert _special(conduit.root / "run") == []
    assert stat.S_IMODE(os.stat(node).st_mode) == 0o700  # the guest's chmod did not stay
    assert stat.S_IMODE(os.stat(node.parent).st_mode) == 0o700  # the host protects the parent
    assert snapshot(conduit.root / "run/run1/nodes/other") == other
    assert not slot.mounted(node)
    # What stayed is the host's: regular, 0600, no more than the slot held.
    kept = sorted(p.relative_to(node).as_posix() for p in node.rglob("*"))
    assert "plain-id" in kept and "suid-id" not in kept and "sparse" not in kept, kept
    assert {"fifo", "null-dev", "world-writable", "sgid-id"}.isdisjoint(kept), kept
    for p in node.rglob("*"):
        st = os.lstat(p)
        assert st.st_uid == os.getuid()
        assert stat.S_IMODE(st.st_mode) == (0o700 if p.is_dir() else 0o600), p
    # uid 65534 runs each file the guest left, reached through a descriptor the host
    # opened (so the directories on the way, the host's 0700, are not what stops it).
    for p in node.rglob("*"):
        if p.is_file():
            code, out = _run_as_nobody(p)
            assert "uid=0" not in out, (p, out)


@pytest.mark.sandbox
@pytest.mark.parametrize("disk", [None, "64Mi"])
def test_filling_the_slot_fails_the_node_and_the_host_keeps_at_most_the_allowance(rt, tmp_path, disk):
    """600 MiB written by a 256 Mi sandbox. The slot is memory charged to the sandbox (as
    its /tmp and /workspace are): without ``disk`` the memory limit stops the writer; with
    ``disk`` below it the slot is full first, a protocol failure naming ``disk``. Either way
    the host keeps at most the allowance (before: all 600 MiB, and any sparse size)."""
    conduit = LocalConduit(tmp_path / "conduit")
    resources = Resources.from_quantities(memory="256Mi", cpus="1", disk=disk)
    with _Patched([*_hostile(FILL), "success"]):
        outcome = drive_node(_spec(tmp_path, resources=resources), conduit, rt, min_isolation="none")
    if disk is None:
        assert outcome.failure in ("protocol", "killed"), outcome.describe()
        assert "`memory`" in outcome.reason or "a full slot" in outcome.reason, outcome.reason
        allowance = 256 << 20
    else:
        assert outcome.failure == "protocol", outcome.describe()
        assert (
            "a full slot: it holds at most 67108864 bytes (disk); raise the node's `disk`" in outcome.reason
        )
        allowance = 64 << 20
    stored = sum(os.lstat(p).st_blocks * 512 for p in (conduit.root / "run").rglob("*"))
    assert stored <= allowance + (1 << 20), stored
    assert _special(conduit.root / "run") == []
    assert not slot.mounted(conduit.root / "run/run1/nodes/node1")


DIRS = r"""
import os
d = os.path.join(os.environ['RESOLUTO_STORE_ROOT'], os.environ['RESOLUTO_STORE_PREFIX'])
os.makedirs(d, exist_ok=True)
made = 0
try:
    while True:  # until the slot has no inode left: a directory costs a tmpfs no bytes
        os.mkdir(os.path.join(d, 'd%06d' % made))
        made += 1
except OSError as e:
    print('stopped after', made, 'directories:', e, flush=True)
"""


@pytest.mark.sandbox
def test_empty_directories_do_not_outgrow_the_allowance_on_the_hosts_disk(rt, tmp_path):
    """Found by an outside review: a 1 MiB slot held 4 095 empty directories (free on a
    tmpfs), which settle kept as 16 MiB of directory blocks on the conduit's disk. The copy
    now charges the host's blocks, a directory's included."""
    conduit = LocalConduit(tmp_path / "conduit")
    resources = Resources.from_quantities(memory="256Mi", cpus="1", disk="1Mi")
    with _Patched([*_hostile(DIRS), "success"]):
        outcome = drive_node(_spec(tmp_path, resources=resources), conduit, rt, min_isolation="none")
    assert outcome.failure == "protocol", outcome.describe()
    assert "a directory past the slot's capacity" in outcome.reason, outcome.reason
    stored = sum(os.lstat(p).st_blocks * 512 for p in (conduit.root / "run").rglob("*"))
    assert stored <= (1 << 20) + (64 << 10), stored
    assert not slot.mounted(conduit.root / "run/run1/nodes/node1")


def test_a_disk_setting_sizes_the_slot(tmp_path):
    """The slot's size is the node's ``disk`` (else its memory limit), mounted nosuid,
    nodev, noexec; settle keeps the files in the durable directory under it."""
    d = tmp_path / "n"
    assert slot.mount(d, 8 << 20)
    opts = next(line.split()[3] for line in open("/proc/self/mounts") if line.split()[1] == str(d))
    assert {"nosuid", "nodev", "noexec", "size=8192k"} <= set(opts.split(",")), opts
    (d / "events").mkdir()
    (d / "events" / "a").write_bytes(b"x" * 1000)
    done = slot.settle(d, 8 << 20, "disk")
    assert done.problems == [] and done.kept == 1000
    assert not slot.mounted(d) and (d / "events" / "a").read_bytes() == b"x" * 1000
    assert slot.capacity_of(1 << 30, 256 << 20) == (1 << 30, "disk")
    assert slot.capacity_of(None, 256 << 20) == (256 << 20, "memory")


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is needed")
def test_setpriv_is_what_the_privilege_check_uses():
    code, out = _run_as_nobody(Path("/usr/bin/id"))
    assert code == 0 and "uid=65534" in out, out
    # And a set-uid root copy on an ordinary filesystem does give euid=0: the check can fail.
    # (The host makes one itself, exactly what gVisor used to leave in the conduit.)
    bad = Path(os.environ.get("TMPDIR", "/var/tmp")) / f"resoluto-suid-{os.getpid()}"
    shutil.copyfile("/usr/bin/id", bad)
    try:
        os.chmod(bad, 0o4755)
        code, out = _run_as_nobody(bad)
        assert "euid=0" in out, out
    finally:
        bad.unlink()


def test_a_node_directory_left_by_an_earlier_run_is_replaced(tmp_path):
    d = tmp_path / "n"
    d.mkdir()
    (d / "stale.txt").write_text("from an earlier run of this node id")
    assert slot.mount(d, 1 << 20)
    (d / "fresh.txt").write_text("this run")
    assert slot.settle(d, 1 << 20, "memory").problems == []
    assert sorted(p.name for p in d.iterdir()) == ["fresh.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["n"]


def test_without_the_right_to_mount_a_slot_is_a_plain_directory_cleaned_after_the_node(tmp_path, monkeypatch):
    """The weaker mode (a host not running as root): mount(2) refused with EPERM, the slot
    is a plain directory; settle still removes and names every special file and resets
    the modes (nothing bounds the size: docs/security.md)."""
    import errno as _errno

    real = slot._call

    def refuse(fn: str, *args: object) -> None:
        if fn == "mount":
            raise OSError(_errno.EPERM, "Operation not permitted")
        real(fn, *args)

    monkeypatch.setattr(slot, "_call", refuse)
    d = tmp_path / "n"
    assert slot.mount(d, 1 << 20) is False and not slot.mounted(d)
    (d / "ok").write_text("x")
    os.mkfifo(d / "fifo")
    (d / "suid").write_text("y")
    os.chmod(d / "suid", 0o4755)
    os.chmod(d, 0o755)
    done = slot.settle(d, 1 << 20, "memory")
    assert "'fifo', a FIFO" in done.reason() and "'suid' with mode 4755" in done.reason()
    assert sorted(os.listdir(d)) == ["ok"]
    assert stat.S_IMODE(os.stat(d / "ok").st_mode) == 0o600 and stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_a_set_uid_file_in_a_live_slot_gives_nobody_privilege(tmp_path):
    """While the node runs, its files are on the slot: a set-uid root copy of ``id`` there
    (what gVisor's gofer makes of a guest's chmod 4755) does not even execute (noexec), and
    the same copy off the slot would have given euid=0
    (test_setpriv_is_what_the_privilege_check_uses)."""
    d = tmp_path / "n"
    assert slot.mount(d, 8 << 20)
    try:
        shutil.copyfile("/usr/bin/id", d / "id")
        os.chmod(d / "id", 0o4755)
        code, out = _run_as_nobody(d / "id")
        assert code != 0 and "uid=" not in out, out
    finally:
        slot.release(d)
