"""Prefect's own processes (`prefect ...`, a worker, a served flow) pointed at the session's API."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    return str(PREFECT_API_URL.value())


def cli_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child, without pytest's variables, on the current API."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(PREFECT_API_URL=api_url(), PREFECT_SERVER_ANALYTICS_ENABLED="false", **extra)
    return env


def flow_child_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """For a test flow run as its own process (tests/flows/*.py) on the current API: its own
    sandbox state directory and local conduit under ``tmp_path``, the test flows importable."""
    return cli_env(
        RESOLUTO_STATE_DIR=str(tmp_path / "state"),
        RESOLUTO_TEST_CONDUIT=(tmp_path / "conduit").as_uri(),
        PYTHONPATH=str(Path(__file__).resolve().parent / "flows"),
        **extra,
    )


def prefect_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefect", *args], env=cli_env(), capture_output=True, text=True, timeout=180
    )
