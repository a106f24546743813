"""One Prefect server that requires an auth string, and one `resoluto` worker on it, per test
process: shared by every module that tests the worker's API gateway (``auth_server`` in
tests/test_api_gateway.py). support/scheduling.py sends those modules to one worker as one
unit, so the server and its worker start once, not once per module (~13 s of CPU each).

The server is not the current API here: each module makes it so for its own tests only
(``auth_server``), and every other module keeps the session's.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.prefect_cli import as_api, started_prefect_server

#: The worker's credential: this, then 32 hex digits (tests/test_api_gateway.py matches its
#: forms by shape; 15 bytes, a whole number of base64 groups).
AUTH_PREFIX = "resoluto-admin:"
#: The fixture that shares it; support/scheduling.py groups the tests that use it.
FIXTURE = "auth_server"


class AuthServer:
    def __init__(self, url: str, auth: str, tmp: Path, worker: Any) -> None:
        self.url, self.auth, self.tmp, self.worker = url, auth, tmp, worker


@pytest.fixture(scope="session")
def gateway_prefect(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthServer]:
    """The server with an auth string and one worker on it. The worker makes no engine
    snapshots (RESOLUTO_WARM_SNAPSHOTS=0): the gateway tests' gVisor runs start together, so
    an image (~6-10 s of CPU in the background) would never be used; restored runs are
    tests/test_worker_snapshots.py's."""
    from test_worker import create_pool, running_worker

    tmp = tmp_path_factory.mktemp("gateway")
    auth = AUTH_PREFIX + secrets.token_hex(16)
    with started_prefect_server(tmp, auth_string=auth) as url:
        with as_api(url, auth):
            pool = create_pool(cli=False)
            worker = running_worker(pool, tmp, RESOLUTO_WARM_SNAPSHOTS="0")
            started = worker.__enter__()
        try:
            yield AuthServer(url, auth, tmp, started)
        finally:
            worker.__exit__(None, None, None)
