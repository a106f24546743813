"""Tasks the flow and latency benchmarks run; copied into a scratch workspace, which the
sandbox imports by file. Imports nothing but prefect (the guest's stand-in answers it)."""

from __future__ import annotations

import time

from prefect import task


@task
def noop(x: int) -> int:
    return x


@task
def ticker(seconds: float, every: float = 0.01) -> int:
    """Print a line stamped with the wall clock every ``every`` seconds for ``seconds``."""
    n = 0
    start = time.time()
    next_at = start
    while True:
        now = time.time()
        if now - start >= seconds:
            return n
        if now >= next_at:
            print(f"tick {n} {time.time():.6f}", flush=True)
            n += 1
            next_at += every
        time.sleep(max(0.0, min(every, next_at - time.time())))
