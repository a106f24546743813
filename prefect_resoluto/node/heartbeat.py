"""The host's heartbeat: what lets a sandbox end by itself once its host stopped driving it.

One writer per host process and conduit (not per node, nor per run): a daemon thread that
rewrites ``[<base>/]hosts/<writer>/beat`` (``wire.host_beat_key``) every ``interval``
seconds with a counter and its monotonic tick. Every node this process drives is told the
key and the bound (``RESOLUTO_HOST_BEAT_KEY``, ``RESOLUTO_HOST_LOST_AFTER``); its guest
(:mod:`guest_runner.hostwatch`) kills its work and exits when the object stayed the same
for the bound, by the guest's own clock. A host that dies (SIGKILL, a lost machine) stops
writing, and each of its sandboxes is gone within the bound plus one poll plus the
runtime's teardown; ``sweep`` stays the backstop for what never started a guest.

A node takes a :class:`Lease` for its life; the writer starts with the first (its first
beat is written before the lease is returned, so before anything is launched) and stops
``linger`` seconds after the last is released, deleting its object. Local runtimes bind
the writer's directory read-only into each sandbox (:attr:`Lease.local_dir`), the only
part of the conduit outside the node's own directory a local sandbox sees.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from guest_runner import wire
from guest_runner.conduit import Conduit, ConduitError
from guest_runner.conduit.local import make_dirs

log = logging.getLogger("prefect_resoluto.node.heartbeat")

#: Seconds between two beats, and after which a sandbox takes its host for gone.
DEFAULT_INTERVAL = 5.0
DEFAULT_LOST_AFTER = 60.0
#: At least this many beats fit in the bound (a host may be late by all but one of them).
MIN_BEATS_PER_BOUND = 3


def check(interval: float, lost_after: float) -> None:
    if not interval > 0:
        raise ValueError("host_heartbeat_interval must be positive (seconds)")
    if lost_after and lost_after < MIN_BEATS_PER_BOUND * interval:
        raise ValueError(
            f"host_lost_after ({lost_after:g}s) must be 0 (no heartbeat) or at least "
            f"{MIN_BEATS_PER_BOUND}x host_heartbeat_interval ({interval:g}s): a host a little late "
            "must not look dead"
        )


@dataclass
class Lease:
    """One node's hold on its host's heartbeat."""

    writer: _Writer
    lost_after: float
    released: bool = False

    @property
    def env(self) -> dict[str, str]:
        """What the node's guest is told."""
        return {
            wire.ENV_HOST_BEAT_KEY: self.writer.store_key,
            wire.ENV_HOST_LOST_AFTER: f"{self.lost_after:g}",
        }

    @property
    def local_dir(self) -> Path | None:
        """The heartbeat's directory on a local conduit (made), else None."""
        return self.writer.local_dir()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.writer.release()


class _Writer:
    def __init__(self, conduit: Conduit, writer_id: str, interval: float) -> None:
        self.conduit = conduit
        self.writer_id = writer_id
        self.key = wire.host_beat_key(writer_id)
        self.store_key = wire.host_beat_key(writer_id, conduit.base_prefix)
        self.interval = interval
        self.linger = 0.0
        self.leases = 0
        self.beats = 0
        self._last_beat = 0.0
        self._idle_since: float | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        #: Called with each beat's count after it is written (a warm pool seals its pods' beats).
        self._hooks: list[Callable[[int], None]] = []

    def also(self, hook: Callable[[int], None]) -> None:
        """Call ``hook(count)`` at every beat, so it stops when this host's beat stops."""
        with self._cond:
            self._hooks.append(hook)

    def drop(self, hook: Callable[[int], None]) -> None:
        with self._cond:
            if hook in self._hooks:
                self._hooks.remove(hook)

    def local_dir(self) -> Path | None:
        root = self.conduit.local_root
        if root is None:
            return None
        path = root / wire.host_beat_dir(self.writer_id)
        make_dirs(path)
        return path

    def acquire(self, conduit: Conduit, interval: float, lost_after: float) -> None:
        with self._cond:
            self.conduit = conduit  # the newest of the conduits of this URL: one still open
            self.leases += 1
            self._idle_since = None
            self.interval = min(self.interval, interval)
            self.linger = max(self.linger, lost_after)
            running = self._thread is not None and self._thread.is_alive()
            if running:
                self._cond.notify_all()
                return
            self._beat()  # the first beat is there before any guest looks for it
            self._thread = threading.Thread(target=self._run, name="resoluto-host-heartbeat", daemon=True)
            self._thread.start()

    def release(self) -> None:
        with self._cond:
            self.leases -= 1
            if self.leases == 0:
                self._idle_since = time.monotonic()
                self._cond.notify_all()

    def _beat(self) -> None:
        self._last_beat = time.monotonic()
        self.beats += 1
        body = f"{self.beats} {time.monotonic_ns()}\n".encode()
        try:
            self.conduit.put_transient(self.key, body)
        except ConduitError as e:  # late is fine, within the bound: the next beat retries
            log.warning("host heartbeat %s not written: %s", self.key, e)
        for hook in list(self._hooks):
            try:
                hook(self.beats)
            except Exception as e:  # a hook's store write: the next beat retries
                log.warning("host heartbeat hook failed: %s", e)

    def _run(self) -> None:
        while self._wait_for_beat():
            self._beat()  # outside the lock: a slow store never holds up a node's start

    def _wait_for_beat(self) -> bool:
        """Wait until the next beat is due (True) or the writer is done (False). A lease
        taken or released only wakes this to look again: a beat is written by the clock,
        never by a node's start or end (which would cost a store write per node)."""
        with self._cond:
            while True:
                if self._thread is not threading.current_thread():
                    return False  # closed: the object is deleted already
                now, idle = time.monotonic(), self._idle_since
                if idle is not None and now - idle >= self.linger:
                    self._thread = None
                    self._stop_beating()  # under the lock: a new first beat comes after it
                    return False
                wait = self._last_beat + self.interval - now
                if wait <= 0:
                    return True
                if idle is not None:
                    wait = min(wait, idle + self.linger - now)
                self._cond.wait(wait)

    def close(self) -> None:
        """Stop beating and delete the object at once (this process is ending)."""
        with self._cond:
            if self._thread is None:
                return
            self._thread = None
            self._idle_since, self.linger = 0.0, 0.0
            self._cond.notify_all()
            self._stop_beating()

    def _stop_beating(self) -> None:
        try:
            self.conduit.delete_prefix(wire.host_beat_dir(self.writer_id) + "/")
        except ConduitError as e:
            log.debug("host heartbeat %s not deleted: %s", self.key, e)


_LOCK = threading.Lock()
_WRITERS: dict[str, _Writer] = {}
_IDS: dict[int, str] = {}


def _writer_id() -> str:
    """This process's writer id: one per process (a fork gets its own), for every conduit."""
    pid = os.getpid()
    with _LOCK:
        return _IDS.setdefault(pid, f"h{pid}-{os.urandom(6).hex()}")


def lease(conduit: Conduit, interval: float, lost_after: float) -> Lease:
    """Hold this process's heartbeat in ``conduit`` (started, its first beat written)."""
    check(interval, lost_after)
    writer = writer_for(conduit)
    writer.acquire(conduit, interval, lost_after)
    return Lease(writer, lost_after)


def writer_for(conduit: Conduit) -> _Writer:
    """The writer of ``conduit`` (made, not started): a warm pool binds its directory ahead."""
    wid = _writer_id()
    with _LOCK:
        writer = _WRITERS.get(f"{wid} {conduit.url}")
        if writer is None:
            writer = _WRITERS[f"{wid} {conduit.url}"] = _Writer(conduit, wid, DEFAULT_INTERVAL)
        return writer


@atexit.register
def _close_all() -> None:
    """A process that ends cleanly leaves no heartbeat behind (its sandboxes are swept or done)."""
    with _LOCK:
        writers = list(_WRITERS.values())
    for writer in writers:
        writer.close()
