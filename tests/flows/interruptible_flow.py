"""A flow that runs long sandboxed tasks; tests interrupt it (Ctrl-C) from outside."""

from __future__ import annotations

import os
from pathlib import Path

import sample_flows as sf  # the workspace module, next to this file
from prefect import flow

from prefect_resoluto import ResolutoTaskRunner


def _warm_pool() -> int | None:
    value = os.environ.get("RESOLUTO_TEST_WARM_POOL")
    return int(value) if value else None


@flow(
    task_runner=ResolutoTaskRunner(
        runtime=os.environ.get("RESOLUTO_TEST_RUNTIME", "gvisor"),
        conduit=os.environ["RESOLUTO_TEST_CONDUIT"],
        workspace=Path(__file__).parent,
        warm_pool=_warm_pool(),
    )
)
def long_running() -> list[str]:
    return [f.result() for f in sf.sleeper.map([300, 300])]


if __name__ == "__main__":
    long_running()
