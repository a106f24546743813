"""The suite's general fixtures (a plugin, loaded by tests/conftest.py). Servers start once
per session, on 127.0.0.1 only; the S3 endpoint's fixtures are in ``support.s3_fixtures``,
the Kubernetes cluster's in ``support.k8s_cluster``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from support.guest import ROOT

SCHEMAS = ROOT / "schemas"


#: Modules about the images' own life (made, checked, discarded, swept): theirs are the test's.
OWN_IMAGES = {"test_snapshots", "test_worker_snapshots"}


@pytest.fixture(scope="session")
def _session_images(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("warm-images"))


@pytest.fixture(autouse=True)
def _isolated_state(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    _session_images: str,
) -> None:
    """Runtimes record sandboxes under RESOLUTO_STATE_DIR; keep tests from seeing each other's.
    Warm-sandbox images (which hold no sandbox of a test, only a template's checkpoint) are the
    session's, as a host's are its own: each test would otherwise boot and checkpoint a template
    per pool key before its first warm sandbox (seconds of CPU each)."""
    if "RESOLUTO_STATE_DIR" not in os.environ:
        monkeypatch.setenv("RESOLUTO_STATE_DIR", str(tmp_path_factory.mktemp("state")))
    if request.node.path.stem in OWN_IMAGES:
        monkeypatch.delenv("RESOLUTO_WARM_IMAGES", raising=False)
    elif "RESOLUTO_WARM_IMAGES" not in os.environ:
        monkeypatch.setenv("RESOLUTO_WARM_IMAGES", _session_images)


@pytest.fixture(scope="session")
def schemas() -> dict[str, dict]:
    return {p.name.split(".")[0]: json.loads(p.read_text()) for p in SCHEMAS.glob("*.schema.json")}


@pytest.fixture(scope="session")
def validate(schemas: dict[str, dict]) -> Callable[[str, object], None]:
    import jsonschema

    validators = {k: jsonschema.Draft202012Validator(v) for k, v in schemas.items()}

    def _validate(kind: str, obj: object) -> None:
        validators[kind].validate(obj)

    return _validate


@pytest.fixture
def gvisor() -> Any:
    """The gVisor runtime, or a skip saying why this machine has none."""
    from prefect_resoluto.runtimes import get_runtime

    rt = get_runtime("gvisor")
    avail = rt.availability()
    if not avail.ok:
        pytest.skip(f"gVisor is not available here: {avail.why}")
    return rt


@pytest.fixture
def local_conduit(tmp_path: Path) -> Any:
    from guest_runner.conduit import LocalConduit

    return LocalConduit(tmp_path / "conduit")


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A real Prefect API (SQLite), started once for the whole session."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))
    from prefect.testing.utilities import prefect_test_harness

    from support.polling import scaled

    # A hang bound, scaled: in a loaded full run the harness took 130 s to come up (its first
    # start migrates a fresh database), next to a fixed 120 s bound.
    with prefect_test_harness(server_startup_timeout=int(scaled(120))):
        yield


@pytest.fixture
def prefect(prefect_api: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Per test: fresh result storage so cached states never leak between tests."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: tmp_path / "results"}):
        yield
