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


@task(retries=1, retry_delay_seconds=0, tags=["reads-context"])
def reads_run_context(label: str) -> dict:
    """What Prefect's run context says of this run, read the three ways Prefect code reads it;
    the first attempt fails, so the second reads run_count 2. The real package loads here,
    lazily (or, without Prefect in the image, the stand-in answers)."""
    from prefect.context import FlowRunContext, TaskRunContext, get_run_context

    return run_context_probe(get_run_context(), TaskRunContext.get(), FlowRunContext.get())


def run_context_probe(run: object, task_ctx: object, flow_ctx: object) -> dict:
    tr = run.task_run  # type: ignore[attr-defined]
    probe = {
        "run_is_task_context": run is task_ctx,
        "task_run": {
            "id": str(tr.id),
            "id_type": type(tr.id).__name__,
            "name": tr.name,
            "run_count": tr.run_count,
            "tags": sorted(tr.tags),
            "flow_run_id": str(tr.flow_run_id),
        },
        "same_task_run": task_ctx.task_run.id == tr.id,  # type: ignore[attr-defined]
        "task_name": task_ctx.task.name,  # type: ignore[attr-defined]
        "parameters": task_ctx.parameters,  # type: ignore[attr-defined]
        "flow_run": {
            "id": str(flow_ctx.flow_run.id),  # type: ignore[attr-defined]
            "name": flow_ctx.flow_run.name,  # type: ignore[attr-defined]
            "parameters": flow_ctx.parameters,  # type: ignore[attr-defined]
        },
    }
    if tr.run_count < 2:
        raise ValueError(f"first attempt of {tr.name}")
    return probe


@task
def reads_what_a_sandbox_has_not() -> dict:
    """What a thread's run context has and a sandbox's cannot: each read's error, or what it gave."""
    from prefect.context import FlowRunContext, TaskRunContext, get_run_context

    reads = {
        "client": lambda: get_run_context().client,
        "result_store": lambda: TaskRunContext.get().result_store,
        "flow": lambda: FlowRunContext.get().flow,
        "task_runner": lambda: FlowRunContext.get().task_runner,
        "job_variables": lambda: FlowRunContext.get().flow_run.job_variables,
        "flow_run.context": lambda: FlowRunContext.get().flow_run.context,
    }
    out = {}
    for name, read in reads.items():
        try:
            out[name] = f"gave {read()!r}"
        except AttributeError as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out
