"""The small flow of issue 41's browser pass, for the runner-artifact tests: a mapped task,
a task that fails once and then completes, one that makes the user's own markdown artifact
and one that always fails. Imports nothing but prefect (it is the sandbox's workspace)."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.context import TaskRunContext


@task
def double(x: int) -> int:
    return 2 * x


@task(retries=1, retry_delay_seconds=0)
def flaky() -> str:
    ctx = TaskRunContext.get()
    assert ctx is not None
    if ctx.task_run.run_count <= 1:
        raise RuntimeError("first attempt fails on purpose")
    return "second attempt"


@task
def report(values: list[int]) -> int:
    create_markdown_artifact(f"# Totals\n\nsum: {sum(values)}", key="totals", description="the user's report")
    return sum(values)


@task
def broken(message: str) -> None:
    raise ValueError(message)
