"""Removing a tree a sandbox wrote: at any depth, of any size, without leaving it.

A stdlib-only leaf. The tree is hostile (the sandbox is dead, but what it made is not
trusted): directories nested thousands deep (``shutil.rmtree`` recurses, and stopped at
Python's recursion limit, leaving the rest on disk), links to anywhere, FIFOs, modes of
000, names of 255 bytes, millions of entries. So:

* no recursion and no paths: an explicit stack of directory descriptors, each directory
  opened relative to its parent with ``O_DIRECTORY | O_NOFOLLOW``, each entry removed by
  name relative to its directory (``unlink``/``rmdir`` with ``dir_fd``); a link is
  removed, never followed, and no path is ever longer than one name;
* bounded descriptors: at most :data:`OPEN_DEPTH` directories are held open; one deeper is
  renamed to the top of the tree (the same filesystem, inside the tree) and taken apart
  from there, so depth costs neither descriptors nor stack;
* another filesystem inside the tree (a mount: a warm sandbox's slot) is left whole, never
  emptied: the caller unmounts, and the removal reports that something is left;
* a directory its owner cannot enter or write (mode 000, a host not running as root) is
  made 0700 through a descriptor of that very entry, never by a path a link could redirect.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

#: Directories held open at once (each with a listing's descriptor too).
OPEN_DEPTH = 32
#: Names of directories lifted to the top of the tree (a number follows).
LIFTED = ".resoluto-lifted-"
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: str | os.PathLike[str]) -> bool:
    """Remove ``path`` and everything under it (a file or a link: just that entry). True
    when nothing is left there; False when something could not be removed (logged by the
    caller; what could be removed was)."""
    parent, name = os.path.split(os.path.abspath(path))
    try:
        pfd = os.open(parent, _O_DIR)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        return remove_at(pfd, name)
    finally:
        os.close(pfd)


def remove_at(dir_fd: int, name: str) -> bool:
    """:func:`remove_tree` of the entry ``name`` in the directory ``dir_fd``."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return True
    except (IsADirectoryError, PermissionError):
        pass  # a directory (EISDIR on Linux; EPERM elsewhere)
    except OSError:
        return False
    try:
        top = _open_dir(dir_fd, name)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        if os.fstat(top).st_dev != os.fstat(dir_fd).st_dev:
            return False  # a mount point: not ours to empty
        _empty(top)
    finally:
        os.close(top)
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


class _Listing(Protocol):  # what os.scandir returns
    def __iter__(self) -> Iterator[os.DirEntry[str]]: ...
    def close(self) -> None: ...


@dataclass
class _Frame:
    fd: int
    name: str  # in the frame below
    listing: _Listing | None = None
    did: bool = False  # removed, entered or lifted something in this listing
    stuck: set[str] = field(default_factory=set)  # names that would not go

    def close(self) -> None:
        if self.listing is not None:
            self.listing.close()
        os.close(self.fd)


def _empty(top: int) -> None:
    """Remove everything in the directory ``top`` (its descriptor stays the caller's)."""
    dev = os.fstat(top).st_dev
    stack = [_Frame(top, "")]
    lifted = 0
    try:
        while stack:
            f = stack[-1]
            if f.listing is None:
                f.listing, f.did = os.scandir(f.fd), False
            child = _next_directory(f)
            if child is None:
                f.listing.close()
                f.listing = None
                if f.did:  # a listing need not show what changed while it ran: look again
                    continue
                stack.pop()
                if stack:
                    os.close(f.fd)
                    _rmdir(stack[-1], f.name)
                continue
            f.did = True
            try:
                cfd = _open_dir(f.fd, child)
            except FileNotFoundError:
                continue
            except OSError:
                f.stuck.add(child)
                continue
            if os.fstat(cfd).st_dev != dev:  # a mount inside the tree: leave it whole
                os.close(cfd)
                f.stuck.add(child)
                continue
            if len(stack) < OPEN_DEPTH:
                stack.append(_Frame(cfd, child))
                continue
            os.close(cfd)
            lifted = _lift(f, child, top, lifted)
    finally:
        for f in stack[1:]:
            f.close()
        if stack and stack[0].listing is not None:
            stack[0].listing.close()


def _next_directory(f: _Frame) -> str | None:
    """Unlink the frame's next entries up to a directory, whose name is returned."""
    assert f.listing is not None
    for entry in f.listing:
        name: str = entry.name
        if name in f.stuck:
            continue
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            is_dir = False
        if is_dir:
            return name
        try:
            os.unlink(name, dir_fd=f.fd)
            f.did = True
        except FileNotFoundError:
            pass
        except IsADirectoryError:  # became one since the listing
            return name
        except OSError:
            f.stuck.add(name)
    return None


def _rmdir(parent: _Frame, name: str) -> None:
    try:
        os.rmdir(name, dir_fd=parent.fd)
        parent.did = True
    except FileNotFoundError:
        pass
    except OSError:
        parent.stuck.add(name)


def _lift(f: _Frame, child: str, top: int, lifted: int) -> int:
    """Rename ``child`` of ``f`` to the top of the tree under a fresh name; returns the
    counter of lifted names used so far."""
    for _ in range(8):
        lifted += 1
        try:
            os.rename(child, f"{LIFTED}{lifted}", src_dir_fd=f.fd, dst_dir_fd=top)
            return lifted
        except OSError as e:
            if isinstance(e, FileNotFoundError) and _gone(f.fd, child):
                return lifted
            # a name of the tree's own (not empty, not a directory): take the next number
    f.stuck.add(child)
    return lifted


def _gone(fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return True
    return False


def _open_dir(dir_fd: int, name: str) -> int:
    """The directory ``name`` in ``dir_fd``, opened without following a link, and made
    0700 when its owner could not enter, list or empty it."""
    try:
        fd = os.open(name, _O_DIR, dir_fd=dir_fd)
    except PermissionError:
        # Mode 000 for a host that is not root: change the mode of this very entry (an
        # O_PATH descriptor opened without following), then open it.
        pin = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            if not stat.S_ISDIR(os.fstat(pin).st_mode):
                raise
            os.chmod(f"/proc/self/fd/{pin}", 0o700)
        finally:
            os.close(pin)
        fd = os.open(name, _O_DIR, dir_fd=dir_fd)
    st = os.fstat(fd)
    if st.st_mode & 0o700 != 0o700 and st.st_uid == os.geteuid():
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o700)
    return fd
