"""Shared fixtures. Servers (S3, Prefect) start once per session, on 127.0.0.1 only."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Nothing may leave this machine: Prefect's server would try to send usage telemetry, and
# every subprocess a test starts inherits this.
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
SCHEMAS = ROOT / "schemas"

from s3_fixtures import *  # noqa: E402,F401,F403


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runtimes record sandboxes under RESOLUTO_STATE_DIR; keep tests from seeing each other's."""
    if "RESOLUTO_STATE_DIR" not in os.environ:
        monkeypatch.setenv("RESOLUTO_STATE_DIR", str(tmp_path_factory.mktemp("state")))


@pytest.fixture(scope="session")
def schemas() -> dict[str, dict]:
    return {p.name.split(".")[0]: json.loads(p.read_text()) for p in SCHEMAS.glob("*.schema.json")}


@pytest.fixture(scope="session")
def validate(schemas):
    import jsonschema

    validators = {k: jsonschema.Draft202012Validator(v) for k, v in schemas.items()}

    def _validate(kind: str, obj: object) -> None:
        validators[kind].validate(obj)

    return _validate


@pytest.fixture
def gvisor():
    """The gVisor runtime, or a skip saying why this machine has none."""
    from prefect_resoluto.runtimes import get_runtime

    rt = get_runtime("gvisor")
    avail = rt.availability()
    if not avail.ok:
        pytest.skip(f"gVisor is not available here: {avail.why}")
    return rt


@pytest.fixture
def local_conduit(tmp_path: Path):
    from guest_runner.conduit import LocalConduit

    return LocalConduit(tmp_path / "conduit")


def guest_env(conduit_root: Path, run_id: str, node_id: str, argv: list[str], **extra: str) -> dict[str, str]:
    """Environment for `python -m guest_runner` on a local conduit."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(ROOT),
        "RESOLUTO_STORE_KIND": "localfs",
        "RESOLUTO_STORE_ROOT": str(conduit_root),
        "RESOLUTO_RUN_ID": run_id,
        "RESOLUTO_NODE_ID": node_id,
        "RESOLUTO_WORKLOAD_ARGV": json.dumps(argv),
    }
    env.update(extra)
    return env


PY = sys.executable


def find_python(version: str) -> str | None:
    """An interpreter for ``version`` (e.g. "3.9") that actually runs, or None."""
    import glob
    import shutil
    import subprocess

    candidates = [shutil.which(f"python{version}") or ""]
    candidates += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}*/bin/python{version}")))
    for c in candidates:
        if c and subprocess.run([c, "-S", "-c", "pass"], capture_output=True).returncode == 0:
            return c
    return None


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory: pytest.TempPathFactory):
    """A real Prefect API (SQLite), started once for the whole session."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def prefect(prefect_api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Per test: fresh result storage so cached states never leak between tests."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: tmp_path / "results"}):
        yield


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the strict type check in the background as soon as it is known to be wanted
    (its test only collects the result), so its minute of CPU overlaps tests that wait."""
    for item in session.items:
        if item.path.name == "test_code_checks.py" and item.name == "test_mypy_strict":
            module = item.module  # type: ignore[attr-defined]
            module.start(*module.MYPY_STRICT)
            return
