"""Work a task need not wait for: done in order on one daemon thread per runner, drained at exit.

The task runner hands two kinds of work here so a task's result is not held up by it:
publishing the node's table artifact (an API round trip) and reaping a sandbox
whose guest has already written a complete, successful manifest (its interpreter exit,
the runtime's teardown). Each item runs in the ``contextvars`` context of the thread that
queued it, so a Prefect call sees the same settings and task run as it would have there.

The thread is a daemon and :meth:`Background.close` waits at most a deadline: a Ctrl-C or
an unreachable API can never hang the process's exit. In the normal case ``close`` returns
once the queue is empty, so by the time the flow call returns every artifact is in the API
and every sandbox reaped (the runner's sweep by flow-run label backs the latter).
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
import time
from collections.abc import Callable

log = logging.getLogger("prefect_resoluto")

#: Items waiting at most; beyond it ``submit`` runs the item on the caller (back-pressure, nothing dropped).
MAX_PENDING = 256

_Item = tuple[contextvars.Context, Callable[[], None], str]


class Background:
    def __init__(self, name: str, max_pending: int = MAX_PENDING) -> None:
        self.name = name
        self._queue: queue.Queue[_Item | None] = queue.Queue(maxsize=max_pending)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._outstanding = 0  # queued or running, sentinel not counted

    def submit(self, fn: Callable[[], None], what: str = "") -> None:
        """Run ``fn`` soon, on the background thread; on the caller when closed or full."""
        item: _Item = (contextvars.copy_context(), fn, what)
        with self._lock:
            if not self._closed:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                    self._thread.start()
                try:
                    self._queue.put_nowait(item)
                    self._outstanding += 1
                    return
                except queue.Full:
                    pass
        _run(item)

    def pending(self) -> int:
        """Items queued or running."""
        with self._lock:
            return self._outstanding

    def close(self, timeout: float) -> int:
        """Finish what is queued, waiting at most ``timeout`` seconds; returns how many items
        were still unfinished at the deadline (0 normally)."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is None:
            return 0
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            try:
                self._queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    break
        thread.join(max(0.0, deadline - time.monotonic()))
        left = self.pending()
        if left:
            log.warning(
                "%s: %d item(s) unfinished after %.1f s at exit; left behind", self.name, left, timeout
            )
        return left

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                _run(item)
            finally:
                with self._lock:
                    self._outstanding -= 1


def _run(item: _Item) -> None:
    ctx, fn, what = item
    try:
        ctx.run(fn)
    except Exception as e:  # background work is best effort by nature; say what failed
        log.warning("background %s failed: %s", what or getattr(fn, "__name__", "work"), e)
