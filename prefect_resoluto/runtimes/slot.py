"""A node's conduit slot: the only part of the host's disk a local sandbox can write.

Each node's directory is its own ``tmpfs``, mounted by the host ``nosuid,nodev,noexec``
with ``size`` = the node's allowance (its ``disk``, else its memory limit), so:

* nothing a sandbox writes there can take effect on the host as privilege: a set-uid
  file, a device node or a program is inert on that mount, and the mount is the only
  path to those inodes (they never reach the conduit's own filesystem as written);
* what a sandbox makes the host store is bounded by the filesystem itself, sparse files
  included (the tmpfs counts pages, and :func:`settle` copies at most ``size`` bytes);
* the guest's ``chmod`` of its bind's root changes the tmpfs root only: the node's
  directory on the conduit (under it, the host's, 0700) is never bound into the sandbox.

A tmpfs lives in memory, so at the node's end :func:`settle` moves the slot's regular
files into the durable node directory under it (host-owned, modes 0600/0700), reports
anything else -- a special mode, a FIFO, a device, a link, a file bigger than the slot,
a full slot -- as a protocol failure naming it, and unmounts. A mount point cannot be
renamed, so a warm sandbox's slot (mounted in its state directory before it boots) is
bound onto the node's directory at assignment (:func:`bind`) instead of renamed.

Every slot this host mounts or binds is written in a ledger (``$RESOLUTO_STATE_DIR/slots``)
with the process that made it: a host killed mid-node leaves its slots mounted, and
:func:`sweep_orphans` (run by every local runtime's ``sweep``) settles the slots whose
process is gone, so their ordinary files stay on the conduit and the mount goes.

Without the right to mount (a host not running as root) a slot is a plain directory:
:func:`settle` still removes and reports every special file, but nothing bounds the size
(docs/security.md states this weaker mode).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import os
import stat
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from guest_runner.conduit.local import make_dirs
from prefect_resoluto.host.remove import remove_at, remove_tree
from prefect_resoluto.host.state import process_start_time, same_process, state_dir

log = logging.getLogger("prefect_resoluto.runtimes.slot")

_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x2, 0x4, 0x8
_MS_REMOUNT, _MS_BIND = 0x20, 0x1000
_MNT_DETACH = 0x2
_FLAGS = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
#: The mount's source name, which tells a slot from any other mount (sweeps, tests).
SOURCE = "resoluto-slot"
#: Free space below which a slot counts as filled (tmpfs keeps no reserve of its own).
FULL_MARGIN = 64 * 1024
#: Modes a file or directory left in a slot must not have.
SPECIAL_BITS = stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | stat.S_IWOTH
_COPY_CHUNK = 1 << 20
#: Directories deeper than this in a slot are refused (the walk is recursive); in a plain
#: directory (no mount) they are removed.
MAX_DEPTH = 64
#: The slot's name in a warm sandbox's state directory.
SLOT_NAME = "slot"
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

_libc: ctypes.CDLL | None = None
_warned = False


class SlotError(OSError):
    """A slot could not be mounted, bound or settled."""


def _call(fn: str, *args: object) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if getattr(_libc, fn)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _b(p: Path | str | None) -> bytes | None:
    return os.fsencode(str(p)) if p is not None else None


def capacity_of(disk_bytes: int | None, memory_bytes: int | None) -> tuple[int, str]:
    """The slot's size and the setting it comes from: the node's ``disk``, else its memory
    limit, else the default memory limit (a sandbox with no limit still gets a bounded slot)."""
    from prefect_resoluto.runtimes.base import DEFAULT_MEMORY, parse_quantity

    if disk_bytes:
        return disk_bytes, "disk"
    return memory_bytes or parse_quantity(DEFAULT_MEMORY), "memory"


def mounted(path: Path) -> bool:
    return os.path.ismount(path)


def _options(size: int) -> str:
    # One inode per 8 KiB of allowance: empty files cost memory the size does not count.
    return f"size={size},nr_inodes={max(4096, size // 8192)},mode=0700"


def mount(path: Path, size: int | None) -> bool:
    """Make ``path`` (created 0700 if missing) a slot of ``size`` bytes. False when this host
    may not mount (the weaker plain-directory mode, warned about once)."""
    global _warned
    make_dirs(path, 0o700)
    if size is None or mounted(path):
        return mounted(path)
    try:
        _call("mount", _b(SOURCE), _b(path), b"tmpfs", _FLAGS, _options(size).encode())
    except OSError as e:
        if e.errno in (errno.EPERM, errno.EACCES):
            if not _warned:
                _warned = True
                log.warning(
                    "cannot mount a node's conduit slot (%s): not running as root? Slots are plain "
                    "directories: special files are still removed after each node, but nothing "
                    "bounds what a sandbox writes to this host's disk",
                    e.strerror,
                )
            return False
        raise SlotError(e.errno, f"cannot mount the conduit slot {path}: {e.strerror}") from None
    _enter(path)
    return True


def bind(src: Path, dst: Path) -> None:
    """Show the slot mounted at ``src`` at ``dst`` too (created 0700), with the same guards."""
    dst.mkdir(mode=0o700)
    try:
        _call("mount", _b(src), _b(dst), None, _MS_BIND, None)
        _call("mount", None, _b(dst), None, _MS_REMOUNT | _MS_BIND | _FLAGS, None)
    except OSError as e:
        release(dst)
        with contextlib.suppress(OSError):
            dst.rmdir()
        raise SlotError(e.errno, f"cannot bind the conduit slot {src} at {dst}: {e.strerror}") from None
    _enter(dst)


def grow(path: Path, size: int) -> None:
    """Resize the slot at ``path`` (after the host's own inbox went in: it is not the guest's)."""
    if not mounted(path):
        return
    try:
        _call("mount", None, _b(path), None, _MS_REMOUNT | _FLAGS, f"size={size}".encode())
    except OSError as e:
        raise SlotError(e.errno, f"cannot resize the conduit slot {path}: {e.strerror}") from None


def used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def release(path: Path) -> None:
    """Unmount the slot at ``path`` if it is one (lazily: a reader's descriptor may linger)."""
    if mounted(path):
        with contextlib.suppress(OSError):
            _call("umount2", _b(path), _MNT_DETACH)
    with contextlib.suppress(FileNotFoundError):
        _entry(path).unlink()


# --------------------------------------------------------------------------- the ledger


def _entry(path: Path) -> Path:
    key = hashlib.sha256(os.fsencode(os.path.abspath(path))).hexdigest()[:32]
    return state_dir("slots") / f"{key}.json"


def _enter(path: Path) -> None:
    pid = os.getpid()
    entry = _entry(path)
    tmp = entry.with_suffix(f".{pid}.tmp")
    tmp.write_text(
        json.dumps({"path": os.path.abspath(path), "pid": pid, "start_time": process_start_time(pid)})
    )
    os.replace(tmp, entry)


def sweep_orphans() -> int:
    """Settle every slot in the ledger whose mounting process is gone (a host killed
    mid-node): its ordinary files stay in the node's directory, the rest is reported in the
    log, the mount goes. Slots of live processes are left alone. Returns how many went."""
    n = 0
    for entry in sorted(state_dir("slots").glob("*.json")):
        try:
            rec = json.loads(entry.read_text())
            path, pid, start = Path(rec["path"]), rec.get("pid"), rec.get("start_time")
        except (OSError, ValueError, KeyError, TypeError):
            entry.unlink(missing_ok=True)
            continue
        if same_process(pid, start):
            continue
        if mounted(path):
            try:
                problems = settle(path, None, "sweep").reason()
            except OSError as e:
                log.warning("cannot settle the orphaned conduit slot %s: %s", path, e)
                release(path)
            else:
                if problems:
                    log.warning("an orphaned conduit slot %s: %s", path, problems)
            n += 1
        entry.unlink(missing_ok=True)
    return n


@dataclass
class Settled:
    """What :func:`settle` found: problems (each naming a file or the setting), bytes kept."""

    problems: list[str] = field(default_factory=list)
    kept: int = 0

    def reason(self) -> str:
        if not self.problems:
            return ""
        more = f" (and {len(self.problems) - 10} more)" if len(self.problems) > 10 else ""
        return "the sandbox left in its conduit slot " + "; ".join(self.problems[:10]) + more


def settle(path: Path, size: int | None, setting: str, *, host_bytes: int = 0) -> Settled:
    """After the node: keep the slot's ordinary files in the durable directory under it,
    report and drop everything else, and unmount it. ``size``/``setting``: the node's
    allowance and the setting that raises it, for the "filled" failure; ``host_bytes``:
    what the host itself put there (the inbox), kept on top of it. Never follows a link."""
    out = Settled()
    is_mount = mounted(path)
    if is_mount and size is not None:
        st = os.statvfs(path)
        if st.f_bavail * st.f_frsize < FULL_MARGIN or st.f_favail == 0:
            hint = (
                "raise the node's `disk`"
                if setting == "disk"
                else "set the node's `disk` (or raise `memory`)"
            )
            out.problems.append(f"a full slot: it holds at most {size} bytes ({setting}); {hint}")
    if not is_mount:
        _clean_in_place(path, out)
        return out
    staging = path.parent / f".{path.name}.settle-{uuid.uuid4().hex[:8]}"
    staging.mkdir(mode=0o700)
    try:
        src = os.open(path, _O_DIR)
        dst = os.open(staging, _O_DIR)
        budget = _Budget(size + host_bytes if size is not None else 1 << 62, os.fstatvfs(dst).f_frsize)
        try:
            _copy_tree(src, dst, "", out, budget)
        finally:
            os.close(src)
            os.close(dst)
    finally:
        release(path)
    # The node's durable directory (the host's, under the mount) is empty: replace it whole.
    try:
        try:
            os.replace(staging, path)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            # An earlier run of the same node id left files under the mount: this run's win.
            old = path.parent / f".{path.name}.replaced-{uuid.uuid4().hex[:8]}"
            os.rename(path, old)
            os.rename(staging, path)
            remove_tree(old)
    except OSError as e:
        raise SlotError(e.errno, f"cannot keep the conduit slot's files in {path}: {e.strerror}") from None
    return out


def _entries(fd: int) -> Iterator[tuple[str, os.stat_result]]:
    with os.scandir(fd) as it:
        names = [e.name for e in it]
    for name in sorted(names):
        try:
            yield name, os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue


@dataclass
class _Budget:
    """What the durable copy may still take of the host's disk, counted as that filesystem
    stores it: whole blocks, and a block for each directory (a tmpfs directory costs its
    slot nothing, so thousands of empty ones must not become megabytes on the host)."""

    left: int
    block: int

    def cost(self, size: int) -> int:
        block = self.block or 4096
        return max(block, -(-size // block) * block) if size else 0

    def take(self, size: int, directory: bool = False) -> bool:
        need = self.cost(size) if not directory else self.cost(1)
        if need > self.left:
            return False
        self.left -= need
        return True


def _copy_tree(src: int, dst: int, rel: str, out: Settled, budget: _Budget) -> None:
    if rel.count("/") > MAX_DEPTH:
        out.problems.append(f"{rel!r}, directories nested deeper than {MAX_DEPTH}")
        return
    for name, st in _entries(src):
        where = f"{rel}{name}"
        bad = _why_bad(where, st)
        if bad:
            out.problems.append(bad)
            continue
        if stat.S_ISDIR(st.st_mode):
            if not budget.take(0, directory=True):
                out.problems.append(f"{where!r}, a directory past the slot's capacity")
                continue
            os.mkdir(name, 0o700, dir_fd=dst)
            s = os.open(name, _O_DIR, dir_fd=src)
            d = os.open(name, _O_DIR, dir_fd=dst)
            try:
                _copy_tree(s, d, where + "/", out, budget)
            finally:
                os.close(s)
                os.close(d)
            continue
        if not budget.take(st.st_size):
            out.problems.append(f"{where!r}, {st.st_size} bytes, more than the slot's capacity left")
            continue
        _copy_file(src, dst, name, where, st.st_size, out)


def _copy_file(src: int, dst: int, name: str, where: str, size: int, out: Settled) -> None:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=src)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped since the listing
            out.problems.append(f"{where!r}, not a regular file")
            return
        wfd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600, dir_fd=dst)
        try:
            left = size
            while left > 0:
                data = os.read(fd, min(_COPY_CHUNK, left))
                if not data:
                    break
                os.write(wfd, data)
                left -= len(data)
        finally:
            os.close(wfd)
        out.kept += size
    finally:
        os.close(fd)


def _why_bad(where: str, st: os.stat_result) -> str:
    mode = st.st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return f"{where!r}, a {_kind(mode)}"
    if mode & SPECIAL_BITS:
        return f"{where!r} with mode {stat.S_IMODE(mode):04o} (set-uid, set-gid, sticky or world-writable)"
    return ""


def _kind(mode: int) -> str:
    for test, word in (
        (stat.S_ISLNK, "symbolic link"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return word
    return "special file"


def _clean_in_place(path: Path, out: Settled) -> None:
    """The plain-directory mode: remove what :func:`_why_bad` refuses, reset the modes."""
    try:
        fd = os.open(path, _O_DIR)
    except OSError:
        return
    try:
        os.fchmod(fd, 0o700)
        _clean(fd, "", out)
    finally:
        os.close(fd)


def _clean(fd: int, rel: str, out: Settled) -> None:
    for name, st in _entries(fd):
        where = f"{rel}{name}"
        bad = _why_bad(where, st)
        if stat.S_ISDIR(st.st_mode) and rel.count("/") >= MAX_DEPTH:
            # Nothing there is kept: removed whole, by descriptors and without recursion.
            out.problems.append(f"{where!r}, directories nested deeper than {MAX_DEPTH}")
            remove_at(fd, name)
            continue
        if stat.S_ISDIR(st.st_mode):
            sub = os.open(name, _O_DIR, dir_fd=fd)
            try:
                os.fchmod(sub, 0o700)
                _clean(sub, where + "/", out)
            finally:
                os.close(sub)
            if bad:
                out.problems.append(bad)
                with contextlib.suppress(OSError):
                    os.rmdir(name, dir_fd=fd)
            continue
        if bad:
            out.problems.append(bad)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=fd)
        elif stat.S_ISREG(st.st_mode):
            f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
            try:
                os.fchmod(f, 0o600)
            finally:
                os.close(f)
