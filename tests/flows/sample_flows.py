"""Flows and tasks the task-runner tests run in sandboxes.

This module is the tests' workspace: the sandbox imports it by file, so it imports
nothing but prefect (and only what a task module would).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from pathlib import Path

from prefect import get_run_logger, task
from pydantic import BaseModel


class Point(BaseModel):
    x: int
    y: int


@dataclasses.dataclass
class Box:
    width: int
    height: int


@task
def square(x: int) -> int:
    print(f"squaring {x}")
    return x * x


@task
async def add_async(a: int, b: int = 10) -> int:
    await asyncio.sleep(0)
    return a + b


@task
def logs_with_levels() -> str:
    logger = get_run_logger()
    logger.info("info from the sandbox")
    logger.warning("warning from the sandbox")
    print("printed line 1")
    print("printed line 2")
    return "ok"


@task
def move(p: Point, dx: int) -> Point:
    return Point(x=p.x + dx, y=p.y)


@task
def grow(b: Box) -> Box:
    return Box(width=b.width * 2, height=b.height * 2)


@task
def fail_with(message: str) -> None:
    raise ValueError(message)


@task(retries=2, retry_delay_seconds=0)
def fail_on_first_attempt() -> str:
    node = os.environ["RESOLUTO_NODE_ID"]
    print(f"node id {node}")
    if "." not in node:
        raise RuntimeError("first attempt fails on purpose")
    return node


@task
def kill_runner_on_first_attempt() -> str:
    """An infrastructure failure: the guest runner dies without a result."""
    node = os.environ["RESOLUTO_NODE_ID"]
    if "." not in node:
        os.kill(os.getppid(), 9)
        time.sleep(30)
    return node


@task
def write_report(name: str) -> str:
    out = Path("out")
    out.mkdir(exist_ok=True)
    (out / f"{name}.txt").write_text(f"report for {name}\n")
    (out / "ignored.tmp").write_text("not declared")
    return f"out/{name}.txt"


@task
def sleeper(seconds: float) -> str:
    print("sleeping", flush=True)
    time.sleep(seconds)
    return "woke"


@task
async def sleeper_async(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "woke"


@task
def env_value(name: str) -> str | None:
    return os.environ.get(name)


@task
def echo_secret() -> str:
    print("the secret is " + os.environ.get("API_TOKEN", "unset"))
    return "done"


@task
def returns_unserialisable() -> object:
    return object()
