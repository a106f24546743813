"""A task that writes a stream of log lines at several levels (the log-forwarding tests)."""

from __future__ import annotations

import sys
import time

from prefect import get_run_logger, task

# line i's level by i % 4: what the host must store for it
LEVELS = (20, 30, 40, 20)


@task
def burst(n: int, per_second: float) -> int:
    """``n`` lines numbered 0..n-1 at about ``per_second`` lines a second (by the clock, so
    a slow moment is caught up): INFO, WARNING, ERROR through the run logger, and a print."""
    logger = get_run_logger()
    start = time.time()
    for i in range(n):
        kind = i % 4
        if kind == 0:
            logger.info("burst %d", i)
        elif kind == 1:
            logger.warning("burst %d", i)
        elif kind == 2:
            logger.error("burst %d", i)
        else:
            print(f"burst {i}", flush=True)
        ahead = start + (i + 1) / per_second - time.time()
        if ahead > 0:
            time.sleep(ahead)
    sys.stdout.flush()
    return n
