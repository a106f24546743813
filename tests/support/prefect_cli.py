"""Prefect's own processes (`prefect ...`, a worker, a served flow) pointed at the session's API."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefect.client.base import PrefectHttpxSyncClient


def api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    return str(PREFECT_API_URL.value())


def api_http() -> PrefectHttpxSyncClient:
    """An HTTP client for raw API requests that, like Prefect's own client, retries what the
    server answers 503 (SQLite busy under a loaded suite: "Service Unavailable", retryable)
    and 429/502. A raw ``httpx`` call failed a CI run on one such 503."""
    from prefect.client.base import PrefectHttpxSyncClient

    return PrefectHttpxSyncClient(timeout=30, trust_env=False, raise_on_all_errors=False)


def cli_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child, without pytest's variables, on the current API
    (with its auth string, when the current API has one)."""
    from prefect.settings import PREFECT_API_AUTH_STRING

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(PREFECT_API_URL=api_url(), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    auth = PREFECT_API_AUTH_STRING.value()
    if auth:
        env["PREFECT_API_AUTH_STRING"] = (
            auth.get_secret_value() if hasattr(auth, "get_secret_value") else str(auth)
        )
    env.update(extra)
    return env


def flow_child_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """For a test flow run as its own process (tests/flows/*.py) on the current API: its own
    sandbox state directory and local conduit under ``tmp_path``, the test flows importable."""
    return cli_env(
        RESOLUTO_STATE_DIR=str(tmp_path / "state"),
        RESOLUTO_TEST_CONDUIT=(tmp_path / "conduit").as_uri(),
        PYTHONPATH=str(Path(__file__).resolve().parents[1] / "flows"),
        **extra,
    )


def prefect_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefect", *args], env=cli_env(), capture_output=True, text=True, timeout=180
    )


@contextlib.contextmanager
def prefect_server(tmp_path: Path, auth_string: str | None = None, **settings: str) -> Iterator[str]:
    """A `prefect server start` of its own on 127.0.0.1 (``settings``: its environment, e.g. a
    scheduler loop), as the current API while it runs; with ``auth_string`` the server
    requires it (PREFECT_SERVER_API_AUTH_STRING) and this process's client sends it."""
    with started_prefect_server(tmp_path, auth_string, **settings) as url, as_api(url, auth_string):
        yield url


@contextlib.contextmanager
def as_api(url: str, auth_string: str | None = None) -> Iterator[None]:
    """``url`` (and its auth string) as this process's current Prefect API, while it runs."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    updates: dict[Any, Any] = {PREFECT_API_URL: url}
    if auth_string:
        updates[PREFECT_API_AUTH_STRING] = auth_string
    with temporary_settings(updates):
        yield


@contextlib.contextmanager
def started_prefect_server(tmp_path: Path, auth_string: str | None = None, **settings: str) -> Iterator[str]:
    """A `prefect server start` of its own on 127.0.0.1, healthy, and its API URL; the current
    API is left as it is (:func:`as_api` makes it the current one)."""
    import urllib.request

    from support.polling import wait_for

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/api"
    env = {
        **cli_env(PREFECT_HOME=str(tmp_path / "server-home"), PREFECT_UI_ENABLED="false", **settings),
        "PREFECT_API_URL": url,
    }
    env.pop("PREFECT_API_AUTH_STRING", None)
    if auth_string:
        env["PREFECT_SERVER_API_AUTH_STRING"] = auth_string
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def healthy() -> bool:
        assert server.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:  # /health needs no auth
                return r.status == 200
        except OSError:
            return False

    try:
        wait_for(healthy, timeout=180, what="a Prefect server of its own", max_delay=0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
