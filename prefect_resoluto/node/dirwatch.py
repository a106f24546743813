"""Wakes a node's driver as soon as an object lands in its directory on a local conduit.

Every watch of this process shares one inotify instance, read by one thread. An instance
per node ran out at ``fs.inotify.max_user_instances`` (128 by default, for every process
of the user together): past it, nodes quietly fell back to polling (~35 polls a node of
20 s instead of ~6 at 200 in flight), and the host had left no instance to anything else
its user runs. Watches are counted apart (``max_user_watches``, ~190 000 here).

The reading thread hands each watch its own flag and an eventfd, written when the flag
goes up, so a driver still sleeps in ``poll(2)`` on its descriptors (the sandbox's exit, a
cancellation) plus this one. It wakes a driver only for a name its tail reads, an event
chunk's or the manifest's: not a writer's temporary file (a node's driver is woken once per
object, not twice), nor ``result.json`` (read once the manifest is there) or any other name
a sandbox writes (it cannot wake its driver at will).

What a sandbox makes its directory say reaches only its own watch, with two bounds on what
a flood of names costs the others: the reading thread paces its reads and parses none
that holds a flood's worth of names (``FLOOD_BYTES``: its work is bounded, and the
kernel's queue overflows instead); lost events (an overflow, a flood's unparsed read: any
watch's) wake every watch, at most once per ``OVERFLOW_GAP``: each then polls once, which
is all a lost event needs (the tail reads objects by name, the watch only says when to
look). A finalizer never takes the hub's lock (it may run in a thread holding it), and a
forked child never removes its parent's kernel watches.
"""

from __future__ import annotations

import ctypes
import math
import os
import select
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

from guest_runner import wire
from guest_runner.conduit.local import TEMP_PREFIX

#: Descriptors a wait also wakes for: one, several, or none.
Fds = int | Sequence[int] | None

# A directory watch wakes its driver at most this often: a sandbox that creates names in a
# loop would otherwise keep a host core busy with its driver's polls.
MIN_WAKE_GAP = 0.01
# What the reading thread takes of the shared queue at once.
READ_BYTES = 32 << 10
# A read holding more than this (~350 events of short names: a host's nodes land a few
# objects a second each) is a flood, which the thread does not parse name by name: it is
# taken as an overflow (every watch looks once, below). After a read of more than
# PACE_BYTES the thread waits MIN_WAKE_GAP. So a flood costs the thread a bounded share of
# a core (at most FLOOD_BYTES parsed and READ_BYTES dequeued a gap), what does not fit
# overflows the kernel's bounded queue, and another node's object is seen at the next
# broadcast at worst, never behind a queue of the flood's names.
FLOOD_BYTES = 16 << 10
PACE_BYTES = 4 << 10
# Events were lost (any watch's): every watch is woken to look (one poll each), at most
# this often, however long a flood lasts.
OVERFLOW_GAP = 0.25

_IN_CLOSE_WRITE = 0x00000008
_IN_MOVED_TO = 0x00000080
_IN_Q_OVERFLOW = 0x00004000
_IN_IGNORED = 0x00008000
_IN_ONLYDIR = 0x01000000
_IN_DONT_FOLLOW = 0x02000000
# A writer that publishes by rename shows IN_MOVED_TO; one writing in place, IN_CLOSE_WRITE.
_MASK = _IN_MOVED_TO | _IN_CLOSE_WRITE | _IN_ONLYDIR

_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then the name
_TEMP = TEMP_PREFIX.encode()
_MANIFEST = wire.MANIFEST.encode()


class _Watch:
    """One directory's share of the hub: what landed since its driver last looked."""

    __slots__ = ("chunks", "efd", "named", "pending", "wd")

    def __init__(self, wd: int) -> None:
        self.wd = wd
        self.efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self.named = False  # a name landed (not a temporary file's), or an overflow
        self.chunks = True  # ... and every such name was a chunk's
        self.pending = False  # the eventfd was written and not yet drained

    def signal(self, only_chunks: bool) -> None:
        """Hub lock held."""
        self.chunks = (self.chunks if self.named else True) and only_chunks
        self.named = True
        if not self.pending:
            self.pending = True
            os.eventfd_write(self.efd, 1)


class _Hub:
    """The process's inotify instance, its watches by descriptor, and the thread reading it."""

    def __init__(self, fd: int, libc: Any) -> None:
        self.fd, self.libc, self.pid = fd, libc, os.getpid()
        self.lock = threading.Lock()
        self.by_wd: dict[int, list[_Watch]] = {}
        #: Closed by a finalizer, which may run in a thread holding the lock (the cyclic
        #: collector runs them wherever it is triggered): released at the next add, remove
        #: or dispatch, under the lock, never from the finalizer itself.
        self.doomed: list[_Watch] = []
        self.overflowed = False
        self.next_broadcast = 0.0
        self.poller = select.poll()
        self.poller.register(fd, select.POLLIN)
        threading.Thread(target=self._loop, name="resoluto-dirwatch", daemon=True).start()

    def add(self, path: bytes, mask: int) -> _Watch | None:
        with self.lock:
            self._reap()
            wd = self.libc.inotify_add_watch(self.fd, path, mask)
            if wd < 0:
                return None
            w = _Watch(wd)
            # The same directory watched twice is one descriptor: each watch of it is told.
            self.by_wd.setdefault(wd, []).append(w)
            return w

    def remove(self, w: _Watch, *, later: bool = False) -> None:
        if self.pid != os.getpid():
            # A forked child's inherited watch: the kernel's watch is its parent's, still used.
            os.close(w.efd)
        elif later:
            self.doomed.append(w)  # one bytecode: safe in a finalizer
        else:
            with self.lock:
                self._reap()
                self._forget(w)
            os.close(w.efd)  # after the lock: the reading thread writes only to watches it holds

    def _reap(self) -> None:
        """Lock held."""
        while self.doomed:
            w = self.doomed.pop()
            self._forget(w)
            os.close(w.efd)

    def _forget(self, w: _Watch) -> None:
        """Lock held."""
        mine = self.by_wd.get(w.wd, [])
        if w in mine:
            mine.remove(w)
            if not mine:
                del self.by_wd[w.wd]
                self.libc.inotify_rm_watch(self.fd, w.wd)  # gone already: EINVAL, fine
        w.wd = -1

    def take(self, w: _Watch) -> tuple[bool, bool]:
        """(whether a name landed, whether every one was a chunk's) since the last take."""
        with self.lock:
            named, chunks = w.named, w.chunks and w.named
            w.named, w.chunks, w.pending = False, True, False
            try:
                os.eventfd_read(w.efd)
            except BlockingIOError:
                pass
        return named, chunks

    def _loop(self) -> None:
        while True:
            try:
                self._once()
            except Exception:  # never let the watches die with the thread: each falls back on its backstop
                time.sleep(MIN_WAKE_GAP)

    def _once(self) -> None:
        wait = (
            -1 if not self.overflowed else max(0, math.ceil((self.next_broadcast - time.monotonic()) * 1000))
        )
        try:
            buf = os.read(self.fd, READ_BYTES) if self.poller.poll(wait) else b""
        except BlockingIOError:
            buf = b""
        landed, ignored, overflow = parse(buf) if len(buf) <= FLOOD_BYTES else NOTHING_BUT_LOST
        if landed or ignored or overflow or self.overflowed or self.doomed:  # not for temporary files alone
            self._dispatch(landed, ignored, overflow)
        if len(buf) > PACE_BYTES:
            time.sleep(MIN_WAKE_GAP)  # the reading thread's share of a core stays bounded

    def _dispatch(self, landed: dict[int, bool], ignored: list[int], overflow: bool) -> None:
        with self.lock:
            self._reap()
            for wd, only_chunks in landed.items():
                for w in self.by_wd.get(wd, ()):
                    w.signal(only_chunks)
            for wd in ignored:  # its directory is gone: told once, then never again
                for w in self.by_wd.pop(wd, ()):
                    w.signal(False)
            self.overflowed = self.overflowed or overflow
            if self.overflowed and time.monotonic() >= self.next_broadcast:
                self.overflowed = False
                self.next_broadcast = time.monotonic() + OVERFLOW_GAP
                for watches in self.by_wd.values():
                    for w in watches:
                        w.signal(False)


#: What a flood's read says: no watch told by name, events lost.
NOTHING_BUT_LOST: tuple[dict[int, bool], list[int], bool] = ({}, [], True)


def parse(buf: bytes) -> tuple[dict[int, bool], list[int], bool]:
    """The events in ``buf``: for each watch a tail's name landed in (a chunk's or the
    manifest's; a writer's temporary file, which no listing shows, and any other name are
    not), whether every such name was a chunk's; the watches whose directory went; whether
    the queue overflowed."""
    landed: dict[int, bool] = {}
    ignored: list[int] = []
    at, overflow = 0, False
    while at + _EVENT.size <= len(buf):
        wd, mask, _cookie, n = _EVENT.unpack_from(buf, at)
        name = buf[at + _EVENT.size : at + _EVENT.size + n].rstrip(b"\0")
        at += _EVENT.size + n
        if mask & _IN_Q_OVERFLOW:
            overflow = True
        elif mask & _IN_IGNORED:
            ignored.append(wd)
        elif name == _MANIFEST:
            landed[wd] = False
        elif not name.startswith(_TEMP) and wire.chunk_index(name.decode("utf-8", "replace")) is not None:
            landed.setdefault(wd, True)
    return landed, ignored, overflow


_hub: _Hub | None = None
_hub_lock = threading.Lock()


def _the_hub() -> _Hub | None:
    """This process's hub (a forked child makes its own: the thread did not come with it)."""
    global _hub
    with _hub_lock:
        if _hub is None or _hub.pid != os.getpid():
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            except (OSError, AttributeError):
                return None
            if fd < 0:
                return None  # none left to the user: tried again at the next watch
            _hub = _Hub(fd, libc)
        return _hub


def _after_fork_in_child() -> None:
    global _hub_lock
    _hub_lock = threading.Lock()
    if _hub is not None:  # its watches stay the parent's; a thread of it may have held this
        _hub.lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class DirWatch:
    """A watch of one directory: :meth:`wait` returns True once an object lands in it."""

    def __init__(self, hub: _Hub, watch: _Watch) -> None:
        self._hub: _Hub | None = hub
        self._watch = watch
        self.wakes = 0
        self._woke_at = -MIN_WAKE_GAP
        #: Whether everything the last wake saw land was a chunk (events-NNNNNN): not the
        #: manifest, nor lost events or the directory's removal, which may hide it.
        self.only_chunks = False

    @property
    def fd(self) -> int:
        """The descriptor a wait polls (its eventfd), -1 once closed."""
        return self._watch.efd if self._hub is not None else -1

    @classmethod
    def open(cls, where: int | str) -> DirWatch | None:
        """A watch of a directory: one a descriptor holds (added through its ``/proc/self/fd``
        link, which names that very inode: the watch is on the directory the caller opened and
        reads from, never on whatever its path names by then, a link a guest put there), or
        a path whose last part is not followed if it is a link. None without inotify."""
        hub = _the_hub()
        if hub is None:
            return None
        if isinstance(where, int):
            path, mask = f"/proc/self/fd/{where}", _MASK
        else:
            path, mask = where, _MASK | _IN_DONT_FOLLOW
        watch = hub.add(os.fsencode(path), mask)
        return None if watch is None else cls(hub, watch)

    def wait(self, timeout: float, also: Fds = None) -> bool:
        """Block up to ``timeout`` seconds, or until one of ``also`` is readable; True when
        something landed."""
        hub = self._hub
        if hub is None:
            return wait_fds(also, timeout)
        if not self._watch.pending and self._watch.efd not in readable(
            [self._watch.efd, *_fds(also)], timeout
        ):
            return False
        early = self._woke_at + MIN_WAKE_GAP - time.monotonic()
        if early > 0:
            time.sleep(early)  # what lands meanwhile is read with it, in one wake
        self._woke_at = time.monotonic()
        self.wakes += 1
        landed, self.only_chunks = hub.take(self._watch)
        return landed

    def close(self, *, later: bool = False) -> None:
        """Release the watch; ``later`` from a finalizer (which never takes the hub's lock)."""
        hub, self._hub = self._hub, None
        if hub is not None:
            hub.remove(self._watch, later=later)

    def __del__(self) -> None:
        self.close(later=True)


def _fds(also: Fds) -> tuple[int, ...]:
    if also is None:
        return ()
    return (also,) if isinstance(also, int) else tuple(also)


def wait_fds(also: Fds, timeout: float) -> bool:
    """Sleep up to ``timeout`` seconds, or until one of ``also`` is readable; False."""
    fds = _fds(also)
    if not fds:
        time.sleep(max(0.0, timeout))
    else:
        readable(list(fds), timeout)
    return False


def readable(fds: list[int], timeout: float) -> list[int]:
    """Those of ``fds`` readable (or hung up) within ``timeout`` seconds: poll(2), not
    select(2), whose sets hold no descriptor numbered past 1 023 (a host driving a thousand
    nodes holds a watch's and an exit descriptor for each)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    ms = math.ceil(max(0.0, timeout) * 1000)
    return [fd for fd, _ in poller.poll(ms)]
