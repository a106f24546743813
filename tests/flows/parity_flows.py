"""Tasks run under ResolutoTaskRunner and ThreadPoolTaskRunner alike, whose records and
results are compared (test_thread_parity.py). Whole-statement lines only where a frame
is shown: Python underlines part of a line with carets, which a sandbox's frame does not
reproduce."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prefect import get_run_logger, task


@task(retries=1, retry_delay_seconds=0)
def fails_twice(x: int) -> int:
    check(x)
    return x


@task
async def fails_async(x: int) -> int:
    await asyncio.sleep(0)
    check(x)
    return x


def check(x: int) -> None:
    raise ValueError(f"bad input {x}\nsee the second line")


@task
def talks(x: int) -> int:
    get_run_logger().info("squaring %d", x)
    print(f"printed {x}")
    return x * x


@task
def writes_report(name: str) -> str:
    Path("out").mkdir(exist_ok=True)
    Path("out", f"{name}.txt").write_text(f"report for {name}\n")
    return f"out/{name}.txt"
