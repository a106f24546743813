"""A task that floods its logs (issue 39, finding 3): long lines, each with one emoji first,
so the host holds 4 bytes a character of them, however they are cut; then a burst of short
lines, landing together in the node's chunks."""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger


@task
def flood(lines: int, chars: int, burst: int = 0) -> int:
    logger = get_run_logger()
    for i in range(lines):
        logger.info("\U0001f600" + f"{i:06d} " + "x" * chars)
    for i in range(burst):
        logger.info(f"burst {i:06d} " + "y" * 100)
    return lines + burst
