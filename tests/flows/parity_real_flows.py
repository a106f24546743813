"""A task whose module imports the real Prefect (prefect.futures), so the sandbox runs it
with the real package: a nested submit hands back a real PrefectFuture there."""

from __future__ import annotations

from prefect import task
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
