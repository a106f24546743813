"""A task module that needs the real Prefect in the sandbox (the stand-ins do not have it)."""

from __future__ import annotations

import sys

# Before this module's own imports: whether the warm call paid `prefect.main` ahead.
MAIN_PRELOADED = "prefect.main" in sys.modules

import prefect.variables  # noqa: E402
from prefect import task  # noqa: E402


@task
def has_variables(i: int = 0) -> str:
    return prefect.variables.Variable.__name__


@task
def main_was_preloaded() -> bool:
    return MAIN_PRELOADED
