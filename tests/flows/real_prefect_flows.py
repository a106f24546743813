# ruff: noqa: I001 - the import order is what this module tests
"""Tasks for the drop-in tests whose module loads the real prefect package at import.

The first prefect import is ``prefect.logging`` on purpose: the order that used to leave
``from prefect import task`` failing in the sandbox.
"""

from __future__ import annotations

import sys

from prefect.logging import get_run_logger  # noqa: F401
from prefect.context import TagsContext
from prefect import runtime, task


@task
def context_probe_real() -> dict:
    return {
        "tags": sorted(TagsContext.get().current_tags),
        "task_run": {
            k: getattr(runtime.task_run, k)
            for k in ("id", "name", "task_name", "run_count", "parameters", "tags")
        },
        "flow_run": {
            k: getattr(runtime.flow_run, k) for k in ("id", "name", "flow_name", "tags", "parameters")
        },
        "deployment": {k: getattr(runtime.deployment, k) for k in ("id", "name")},
        "real_prefect_loaded": type(sys.modules["prefect"]).__name__ == "module",
    }


@task
def triple(x: int) -> int:
    return 3 * x


@task
def nested_calls_real(x: int) -> dict:
    direct = triple(x)
    submitted = triple.submit(x + 1).result()
    mapped = [f.result() for f in triple.map([x, x + 1])]
    return {"direct": direct, "submitted": submitted, "mapped": mapped}
