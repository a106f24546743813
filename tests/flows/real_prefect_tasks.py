"""A task module that needs the real Prefect in the sandbox (the stand-ins do not have it)."""

from __future__ import annotations

import prefect.variables
from prefect import task


@task
def has_variables() -> str:
    return prefect.variables.Variable.__name__
