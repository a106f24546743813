"""A flow that runs long sandboxed tasks; tests interrupt it (Ctrl-C) from outside.

With ``RESOLUTO_TEST_SIGINT_ON_STDIN`` set, a line on stdin makes a thread other than the main
one take a SIGINT: CPython's C handler notes it there and leaves the ``KeyboardInterrupt`` to
the main thread, which at that moment sleeps in a wait. That is where a Ctrl-C is left when
it lands as the main thread is about to sleep (task_runner/interruptible.py), made certain."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import sample_flows as sf  # the workspace module, next to this file
from prefect import flow

from prefect_resoluto import ResolutoTaskRunner


def _warm_pool() -> int | None:
    value = os.environ.get("RESOLUTO_TEST_WARM_POOL")
    return int(value) if value else None


@flow(
    task_runner=ResolutoTaskRunner(
        runtime=os.environ.get("RESOLUTO_TEST_RUNTIME", "gvisor"),
        conduit=os.environ["RESOLUTO_TEST_CONDUIT"],
        workspace=Path(__file__).parent,
        warm_pool=_warm_pool(),
        min_isolation=os.environ.get("RESOLUTO_TEST_MIN_ISOLATION", "user-kernel"),
    )
)
def long_running() -> list[str]:
    # Longer than any test waits for the flow to end: only the interrupt can end it in time.
    nap = 3600
    return [f.result() for f in sf.sleeper.map([nap, nap])]


def _sigint_on_stdin() -> None:
    sys.stdin.readline()
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)


if __name__ == "__main__":
    if os.environ.get("RESOLUTO_TEST_SIGINT_ON_STDIN"):
        threading.Thread(target=_sigint_on_stdin, daemon=True).start()
    long_running()
