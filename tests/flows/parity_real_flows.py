"""A task whose module imports the real Prefect (prefect.futures), so the sandbox runs it
with the real package: a nested submit hands back a real PrefectFuture there."""

from __future__ import annotations

from prefect import task
from prefect.context import FlowRunContext, TaskRunContext, get_run_context
from prefect.futures import PrefectFuture, PrefectFutureList


@task
def inc(x: int) -> int:
    return x + 1


@task
def nests(x: int) -> dict:
    one = inc.submit(x)
    many = inc.map([x, x + 1])
    return {
        "future": isinstance(one, PrefectFuture),
        "list": isinstance(many, PrefectFutureList) and all(isinstance(f, PrefectFuture) for f in many),
        "value": one.result(),
        "completed": one.state.is_completed(),
        "mapped": many.result(),
        "chained": inc.submit(one).result(),
    }


@task(retries=1, retry_delay_seconds=0, tags=["reads-context"])
def reads_run_context_real(label: str) -> dict:
    """As parity_flows.reads_run_context, in a module that loaded the real package on import
    (before the sandbox knew which task it runs)."""
    try:
        from flows.parity_flows import run_context_probe  # on the host
    except ImportError:
        from parity_flows import run_context_probe  # in the sandbox: the workspace is tests/flows

    return run_context_probe(get_run_context(), TaskRunContext.get(), FlowRunContext.get())
