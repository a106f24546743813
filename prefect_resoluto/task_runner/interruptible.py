"""Ctrl-C reaches a flow that waits on its tasks, every time.

CPython runs a signal's Python handler (``KeyboardInterrupt`` for SIGINT) in the main thread,
between bytecodes, or when a blocking lock acquisition there is interrupted. A SIGINT that
lands after the main thread's last look at its pending signals and before it sleeps in the
lock's futex (while it hands the GIL to another thread, which takes longer the busier the
runner's threads are) is noted and never acted on: an untimed ``Future.result()`` or
``Thread.join()`` then sleeps until the task ends, which for a sandboxed task may be never.
Measured here: a flow with two running tasks and a warm pool ignored 2 of ~40 SIGINTs.

So the main thread's waits on this runner's futures and threads are timed, :data:`SLICE` at a
time: between two slices it runs bytecode, and a noted signal is acted on within one slice.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import CancelledError, Future, TimeoutError
from typing import Any

#: The longest a noted Ctrl-C waits to be acted on.
SLICE = 0.25


class InterruptibleFuture(Future[Any]):
    """A ``concurrent.futures.Future`` whose untimed waits are taken in timed slices."""

    def result(self, timeout: float | None = None) -> Any:
        if timeout is None:
            _wait_done(self)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if timeout is None:
            _wait_done(self)
        return super().exception(timeout)


def _wait_done(future: Future[Any]) -> None:
    while True:
        try:
            Future.exception(future, SLICE)
            return
        except TimeoutError:
            continue
        except CancelledError:  # ``result``/``exception`` raise it themselves
            return


def interruptible(future: Future[Any]) -> Future[Any]:
    """``future`` (made by a ``ThreadPoolExecutor``, not yet waited on) with timed waits: its
    class only changes; its worker sets its result through the base class as before."""
    if type(future) is Future:
        future.__class__ = InterruptibleFuture
    return future


def join_all(threads: Iterable[threading.Thread]) -> None:
    """``join()`` every thread, :data:`SLICE` at a time."""
    for thread in list(threads):
        while thread.is_alive():
            thread.join(SLICE)
