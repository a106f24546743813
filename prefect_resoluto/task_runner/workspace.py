"""The workspace archive each node's inbox gets, packed once while the tree is unchanged.

A map of N nodes over one workspace would pack the same tree N times (seconds each for a
large one). :class:`WorkspacePacker` keeps the last archive of each workspace with a
:func:`~guest_runner.archive.stamp` of the tree and hands it out again while the stamp
is the same, so every node still gets the workspace as it was when the node started.
A tree with an entry changed in the last :data:`RACY_NS` is never cached: a rewrite
within the clock's granularity could leave every stat field as it was (git's "racily
clean" problem).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from guest_runner import archive

RACY_NS = 2_000_000_000


class WorkspacePacker:
    def __init__(self) -> None:
        self._last: dict[tuple[str, tuple[str, ...]], tuple[str, bytes]] = {}
        self._locks: dict[tuple[str, tuple[str, ...]], threading.Lock] = {}
        self._lock = threading.Lock()
        self.packs = 0  # archives actually built (tests, benchmarks)

    def __call__(self, root: str | os.PathLike[str], skip: list[str]) -> bytes:
        key = (str(Path(root).resolve()), tuple(sorted(skip)))
        with self._lock:
            key_lock = self._locks.setdefault(key, threading.Lock())
        # One node of a map packs while the others wait, then they all take its archive.
        with key_lock:
            started = time.time_ns()
            digest, newest = archive.stamp(root, skip=skip)
            hit = self._last.get(key)
            if hit is not None and hit[0] == digest:
                return hit[1]
            data = archive.pack(root, skip=skip)
            self.packs += 1
            if newest < started - RACY_NS:
                self._last[key] = (digest, data)
            else:
                self._last.pop(key, None)
            return data
