"""A flow served as a deployment with a schedule; its tasks run in sandboxes.

Run by tests/test_deployments.py as a separate process (like `python served_flow.py`
on a real host): RESOLUTO_TEST_CONDUIT, RESOLUTO_TEST_INTERVAL, RESOLUTO_TEST_RUNTIME
(default gvisor) and RESOLUTO_TEST_WARM_POOL configure it.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

from prefect import flow, task

from prefect_resoluto import ResolutoTaskRunner


@task
def where_am_i(n: int, linger: float = 0.0) -> str:
    print(f"task {n} says hello from the sandbox", flush=True)
    time.sleep(linger)
    return os.environ.get("RESOLUTO_NODE_ID", "not in a sandbox")


def _warm_pool() -> int | None:
    value = os.environ.get("RESOLUTO_TEST_WARM_POOL")
    return int(value) if value else None


RUNTIME = os.environ.get("RESOLUTO_TEST_RUNTIME", "gvisor")


@flow(
    name="served-sandboxed",
    task_runner=ResolutoTaskRunner(
        runtime=RUNTIME,
        conduit=os.environ.get("RESOLUTO_TEST_CONDUIT"),
        workspace=Path(__file__).parent,
        warm_pool=_warm_pool(),
        # `process` isolates nothing: asked for by a test about Prefect glue, it is meant
        **({"min_isolation": "none"} if RUNTIME == "process" else {}),
    ),
)
def served_sandboxed(count: int = 2, linger: float = 0.0) -> list[str]:
    return [f.result() for f in where_am_i.map(range(count), linger=linger)]


if __name__ == "__main__":
    served_sandboxed.serve(
        name="every-few-seconds",
        interval=timedelta(seconds=float(os.environ.get("RESOLUTO_TEST_INTERVAL", "3600"))),
    )
