"""An event a node's driver can sleep on: set, it wakes every driver polling its descriptor.

A node's driver sleeps in ``poll(2)`` on what tells it of the node (a local conduit's
directory watch, the sandbox's exit descriptor); a cancellation held only in a
:class:`threading.Event` is seen when it next wakes, so without a descriptor each driver
wakes on a timer to look (every node, every few seconds, for nothing). A :class:`WakeEvent`
is an Event whose :meth:`fileno` (an eventfd) turns readable when it is set and stays so:
the drivers of all nodes it cancels share it and sleep until something happens.
"""

from __future__ import annotations

import os
import threading


class WakeEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        # Never read: once set, readable for good (level-triggered), whoever polls it and when.
        self._fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)

    def fileno(self) -> int:
        return self._fd

    def set(self) -> None:
        super().set()
        try:
            os.eventfd_write(self._fd, 1)
        except BlockingIOError:  # the counter is full: readable already
            pass

    def __del__(self) -> None:
        # Only when nothing holds it any more (no driver can be polling the descriptor).
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
