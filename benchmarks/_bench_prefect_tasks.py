"""A trivial task whose module needs the real Prefect in the sandbox (``pool real-prefect``)."""

from __future__ import annotations

import prefect.variables  # noqa: F401  (more than the guest's stand-ins give: the real package loads)
from prefect import task


@task
def noop_real(x: int) -> int:
    return x
