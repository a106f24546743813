"""Per-sandbox resource limits through a host cgroup (v1 or v2), for runtimes that have
none of their own (bubblewrap, plain processes).

Why a cgroup and not rlimits: RLIMIT_AS counts reserved address space, which Python,
its thread stacks and native libraries over-reserve wildly; RLIMIT_NPROC is per user,
not per sandbox. A cgroup limits what the whole process tree really uses, and reports
OOM kills. When no writable cgroup hierarchy exists (unprivileged user, read-only
cgroupfs) the caller falls back to RLIMIT_DATA (private writable memory, per process,
approximate) and says so in ``availability().detail``.
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from .base import Resources

CGROUP_FS = Path("/sys/fs/cgroup")
PARENT = "resoluto"
# A process is moved into the cgroups before exec'ing the sandbox tool, so everything it
# forks is already inside: `sh` writes its own pid (thread-safe, unlike preexec_fn).
_ENTER = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


@dataclass
class Cgroup:
    """One sandbox's cgroup directories (one per v1 controller, or one v2 directory)."""

    dirs: list[str]
    version: int

    def enter_argv(self, argv: list[str]) -> list[str]:
        procs = [str(Path(d) / "cgroup.procs") for d in self.dirs]
        return ["/bin/sh", "-c", _ENTER, "sh", *procs, "--", *argv]

    def oom_killed(self) -> bool:
        # Only the file this hierarchy keeps the count in (v2 memory.events, v1 the memory
        # controller's memory.oom_control): an open that cannot succeed, in every
        # controller's directory at every sandbox's exit, was CPU for nothing.
        name = _OOM_FILE[self.version]
        dirs = self.dirs if self.version == 2 else filter(_is_memory_v1, self.dirs)
        return any(_counts_an_oom_kill(os.path.join(d, name)) for d in dirs)

    def pids(self) -> list[int]:
        found: set[int] = set()
        for d in self.dirs:
            found.update(_members(os.path.join(d, "cgroup.procs")))
        return sorted(found)

    def kill_all(self) -> None:
        # Anything that escaped the process group (a daemonised child) still lives here.
        kill(self.pids())

    def remove_empty(self) -> bool:
        """Remove each directory the kernel lets go as it is (no process, no cgroup inside);
        True when none is left. The kernel refuses a busy one, so an exited sandbox's
        cgroup goes without its members being read first."""
        left: list[str] = []
        for d in self.dirs:
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError as e:
                # Busy, or refused for a reason that may hold for a path that is not there at
                # all (a file where a hierarchy was, a read-only mount): only a directory stays.
                if e.errno in (errno.EBUSY, errno.ENOTEMPTY) or os.path.isdir(d):
                    left.append(d)
        self.dirs = left
        return not left

    def remove(self, deadline: float | None = None) -> bool:
        """Remove each directory; True when none is left. A directory that will not go has
        cgroups of its own inside (a workload with root made them, and may have parked a
        process there, out of ``cgroup.procs``'s sight and of its process group): every
        process of the host inside any of them is killed first (one look at ``/proc``,
        whatever their number), then they are removed, deepest first, until ``deadline``.
        A process still exiting keeps a cgroup busy after it has left ``cgroup.procs``: the
        caller tries again."""
        left: list[str] = []
        swept = False
        for d in self.dirs:
            try:
                os.rmdir(d)
                continue
            except FileNotFoundError:
                continue
            except OSError:
                pass
            if not swept:
                kill_inside(self.dirs)
                swept = True
            _remove_nested(d, deadline)
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError:
                left.append(d)
        self.dirs = left
        return not left


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Cgroups entered per removal round: a workload may nest as many as it likes.
MAX_NESTED = 10_000


def kill_inside(dirs: list[str]) -> None:
    """SIGKILL every process of the host whose cgroup, in any hierarchy, is one of ``dirs``'
    (``<mount>/resoluto/<name>``) or below it: found from ``/proc``, so a process in a cgroup
    nested however deep or wide is found at the cost of one look at each process. Each is
    signalled through a pidfd taken before its cgroup is read again: never a recycled pid."""
    names = {"/" + PARENT + "/" + os.path.basename(d.rstrip("/")) for d in dirs}
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        if not _in_cgroups(pid, names):
            continue
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue  # gone
        try:
            if _in_cgroups(pid, names):  # still that process: the pidfd pins it
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(pidfd)


def _in_cgroups(pid: int, names: set[str]) -> bool:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            text = f.read()
    except OSError:
        return False
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        for name in names:
            if path == name or path.startswith(name + "/"):
                return True
    return False


def _remove_nested(top: str, deadline: float | None = None) -> None:
    """Kill the members of every cgroup under ``top`` (and of ``top``) and remove them,
    deepest first, until ``deadline`` (``time.monotonic()``). Depth first by descriptor, going
    up by ``..``: no recursion, no path to outgrow PATH_MAX, one descriptor open. A cgroup that
    will not go (a member still exiting) is skipped for this round."""
    try:
        fd = os.open(top, _DIR)
    except OSError:
        return
    names: list[str] = []  # from top down to fd
    busy: set[int] = set()  # inodes of cgroups that would not go this round
    entered = 0
    try:
        while True:
            out_of_time = deadline is not None and time.monotonic() > deadline
            sub = _a_subdir(fd, busy) if entered < MAX_NESTED and not out_of_time else None
            if sub is not None:
                entered += 1
                try:
                    nxt = os.open(sub[0], _DIR, dir_fd=fd)
                except OSError:
                    busy.add(sub[1])
                    continue
                os.close(fd)
                fd = nxt
                names.append(sub[0])
                continue
            kill(_members("cgroup.procs", fd))
            if not names:
                return
            ino = os.fstat(fd).st_ino
            up = os.open("..", _DIR, dir_fd=fd)
            os.close(fd)
            fd = up
            try:
                os.rmdir(names.pop(), dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError:
                busy.add(ino)
    finally:
        os.close(fd)


def _a_subdir(fd: int, busy: set[int]) -> tuple[str, int] | None:
    """A child cgroup of ``fd`` (name, inode) not known to be busy, or None."""
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False) and entry.inode() not in busy:
                return entry.name, entry.inode()
    return None


def _members(procs: str, dir_fd: int | None = None) -> list[int]:
    """The processes a ``cgroup.procs`` file lists (its path, or its name in ``dir_fd``);
    none when it cannot be read."""
    try:
        with open(procs, opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW, dir_fd=dir_fd)) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def _is_memory_v1(d: str) -> bool:
    """Whether ``d`` (``<controller mount>/resoluto/<name>``) is under the v1 memory
    controller, mounted alone or with others (``memory,foo``)."""
    return _mounts_memory(os.path.dirname(os.path.dirname(d)))


def _mounts_memory(mount: str) -> bool:
    """Whether the v1 controller mount ``mount`` is the memory controller's (alone or shared)."""
    return "memory" in os.path.basename(mount).split(",")


#: The file each hierarchy counts a cgroup's OOM kills in (v1: the memory controller's).
_OOM_FILE = {1: "memory.oom_control", 2: "memory.events"}


def _counts_an_oom_kill(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError:
        return False
    for line in text.splitlines():
        key, _, value = line.partition(b" ")
        if key == b"oom_kill" and value.strip().isdigit() and int(value) > 0:
            return True
    return False


def oom_killed(name: str) -> bool:
    """Whether the sandbox cgroup ``name`` has had a process OOM-killed: one read of the one
    file that counts them, its path worked out from the hierarchy (looked at once), not from
    a lookup of the cgroup's directories. Asked at every status of a running gVisor sandbox,
    of which the warm pool takes several a second while sandboxes start; False where there
    is no such cgroup."""
    parent = _oom_parent()
    return parent is not None and _counts_an_oom_kill(os.path.join(parent[0], name, parent[1]))


@functools.lru_cache(maxsize=1)
def _oom_parent() -> tuple[str, str] | None:
    """(the directory holding every sandbox's cgroup in the hierarchy that counts OOM kills,
    that file's name), or None without a usable hierarchy."""
    version = detect()
    if version == "v2":
        return str(CGROUP_FS / PARENT), _OOM_FILE[2]
    if version == "v1":
        memory = next((r for r in _v1_roots() if _mounts_memory(os.path.dirname(r))), None)
        return (memory, _OOM_FILE[1]) if memory is not None else None
    return None


def kill(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` (members of a sandbox's cgroup), those already gone skipped."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@functools.lru_cache(maxsize=16)
def _v1_mount(controller: str) -> Path | None:
    p = CGROUP_FS / controller
    return p if (p / "cgroup.procs").exists() else None


@functools.lru_cache(maxsize=1)
def detect() -> str | None:
    """``"v1"``, ``"v2"`` or None: which writable hierarchy we can put sandboxes in (looked
    at once per process: asked at every launch, exit and destroy)."""
    if (CGROUP_FS / "cgroup.controllers").exists():
        ctrl = (CGROUP_FS / "cgroup.controllers").read_text().split()
        if "memory" in ctrl and "pids" in ctrl and os.access(CGROUP_FS, os.W_OK):
            return "v2"
        return None
    mem, pids = _v1_mount("memory"), _v1_mount("pids")
    if mem and pids and os.access(mem, os.W_OK) and os.access(pids, os.W_OK):
        return "v1"
    return None


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def create(name: str, resources: Resources) -> Cgroup | None:
    """A cgroup named ``resoluto/<name>`` holding ``resources``, or None when unsupported."""
    version = detect()
    if version == "v1":
        return _create_v1(name, resources)
    if version == "v2":
        return _create_v2(name, resources)
    return None


#: A new v1 cgroup's ``cpu.cfs_period_us`` (the kernel's default, not the parent's).
CFS_PERIOD_US = 100_000


@functools.lru_cache(maxsize=4)
def _swap_accounted(memory_root: str) -> bool:
    """Whether the v1 memory controller at ``memory_root`` accounts swap (a boot option: it
    does not change under a running host)."""
    return os.path.exists(os.path.join(memory_root, "memory.memsw.limit_in_bytes"))


def _create_v1(name: str, r: Resources) -> Cgroup:
    dirs: list[str] = []
    # cpuacct too: a cgroup runsc creates itself is gone with the sandbox, ours stays until
    # destroy, so the CPU a finished sandbox used can still be read (benchmarks/cpu_node.py).
    for controller in ("memory", "pids", "cpu", "cpuacct"):
        root = _v1_mount(controller)
        if root is None:
            continue
        d = root / PARENT / name
        d.mkdir(parents=True, exist_ok=True)
        dirs.append(str(d))
        if controller == "memory" and r.memory_bytes:
            _write(d / "memory.limit_in_bytes", str(r.memory_bytes))
            if _swap_accounted(str(root)):
                _write(d / "memory.memsw.limit_in_bytes", str(r.memory_bytes))  # no swap on top
        elif controller == "pids" and r.pids:
            _write(d / "pids.max", str(r.pids))
        elif controller == "cpu" and r.cpus:
            # The period is a new cgroup's own default (100 ms), never inherited: the quota
            # alone sets the share.
            _write(d / "cpu.cfs_quota_us", str(int(r.cpus * CFS_PERIOD_US)))
    return Cgroup(dirs=dirs, version=1)


def _create_v2(name: str, r: Resources) -> Cgroup:
    parent = CGROUP_FS / PARENT
    parent.mkdir(exist_ok=True)
    # Delegate the controllers to our subtree; harmless when already enabled.
    for path in (CGROUP_FS / "cgroup.subtree_control", parent / "cgroup.subtree_control"):
        try:
            _write(path, "+memory +pids +cpu")
        except OSError:
            pass
    d = parent / name
    d.mkdir(exist_ok=True)
    if r.memory_bytes:
        _write(d / "memory.max", str(r.memory_bytes))
        if (d / "memory.swap.max").exists():
            _write(d / "memory.swap.max", "0")
    if r.pids:
        _write(d / "pids.max", str(r.pids))
    if r.cpus and (d / "cpu.max").exists():
        _write(d / "cpu.max", f"{int(r.cpus * 100_000)} 100000")
    return Cgroup(dirs=[str(d)], version=2)


@functools.lru_cache(maxsize=1)
def _v1_roots() -> tuple[str, ...]:
    """Each v1 controller's ``resoluto`` directory (looked at once: asked at every exit and
    destroy, and the mounts do not change under a running host)."""
    return tuple(str(root / PARENT) for root in sorted(CGROUP_FS.iterdir()))


def named(name: str) -> Cgroup | None:
    """Every directory the sandbox cgroup ``name`` may have, not looked up (None without a
    usable hierarchy): for a sandbox that has exited, whose cgroup is then removed by trying
    each (one ``rmdir`` a directory, which fails for one not there) rather than first
    looking for them all."""
    version = detect()
    if version == "v1":
        return Cgroup(dirs=[os.path.join(parent, name) for parent in _v1_roots()], version=1)
    if version == "v2":
        return Cgroup(dirs=[str(CGROUP_FS / PARENT / name)], version=2)
    return None


def existing(name: str) -> Cgroup | None:
    """The cgroup of an earlier sandbox (for destroy/sweep from another process)."""
    dirs = []
    version = detect()
    if version == "v1":
        # Every controller, not just ours: runsc creates freezer, blkio ... too, and leaves
        # them behind when it fails half-way through creating a sandbox.
        for parent in _v1_roots():
            d = os.path.join(parent, name)
            if os.path.isdir(d):
                dirs.append(d)
    elif version == "v2" and (CGROUP_FS / PARENT / name).is_dir():
        dirs.append(str(CGROUP_FS / PARENT / name))
    return Cgroup(dirs=dirs, version=1 if version == "v1" else 2) if dirs else None
