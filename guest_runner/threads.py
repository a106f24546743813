"""The runner's background threads, started ahead by a warm guest.

A thread started in a sandbox restored from a snapshot costs 2-15 ms of the node's time (the
first the most: measured in gVisor after a restore, against microseconds on a host), and a
node starts two (the shipper's and the host watch's). A warm guest starts them before its
checkpoint instead (:func:`prestart`, after the runner's hardening and the call's fork, so
they carry the hardened credentials and no fork sees them): they are restored waiting, and
:func:`start` hands each its work. Without spare threads (a cold guest), a thread is started
as before. Standard library only; Python 3.9+.
"""

from __future__ import annotations

import threading
from typing import Callable, List, Optional, Union


class _Spare:
    """A daemon thread waiting for the one function it will run."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._work: Optional[Callable[[], None]] = None
        self._done = threading.Event()
        self.thread = threading.Thread(target=self._wait, name="resoluto-spare", daemon=True)

    def _wait(self) -> None:
        with self._cond:
            while self._work is None:
                self._cond.wait()
            work = self._work
        try:
            work()
        finally:
            self._done.set()

    def give(self, work: Callable[[], None], name: str) -> None:
        self.thread.name = name
        with self._cond:
            self._work = work
            self._cond.notify()

    def join(self, timeout: Optional[float] = None) -> None:
        self._done.wait(timeout)


Started = Union[threading.Thread, _Spare]

_SPARES: List[_Spare] = []
_LOCK = threading.Lock()


def prestart(n: int) -> None:
    """Start ``n`` spare threads now (a warm guest, before its ready line)."""
    for _ in range(n):
        spare = _Spare()
        spare.thread.start()
        with _LOCK:
            _SPARES.append(spare)


def drop() -> None:
    """Let every spare thread end unused: they were started before a hardening of this
    process that happened since (per-thread state they would not carry)."""
    with _LOCK:
        spares = list(_SPARES)
        del _SPARES[:]
    for spare in spares:
        spare.give(lambda: None, "resoluto-spare")


def start(target: Callable[[], None], name: str) -> Started:
    """Run ``target`` on a daemon thread called ``name``: a spare one if any is left."""
    with _LOCK:
        spare = _SPARES.pop() if _SPARES else None
    if spare is not None:
        spare.give(target, name)
        return spare
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread
