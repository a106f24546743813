"""Prefect's own processes (`prefect ...`, a worker, a served flow) pointed at the session's API."""

from __future__ import annotations

import os
import subprocess
import sys


def api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    return str(PREFECT_API_URL.value())


def cli_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child, without pytest's variables, on the current API."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(PREFECT_API_URL=api_url(), PREFECT_SERVER_ANALYTICS_ENABLED="false", **extra)
    return env


def prefect_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefect", *args], env=cli_env(), capture_output=True, text=True, timeout=180
    )
