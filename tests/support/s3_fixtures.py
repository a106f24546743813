"""A real S3 HTTP endpoint for tests: moto's server behind a counting, fault-injecting proxy.

Everything listens on and connects to 127.0.0.1 only.

::

    client (S3Conduit / boto3) --HTTP--> CountingProxy (127.0.0.1:p) --HTTP--> moto (127.0.0.1:m)

The proxy is a stdlib ``ThreadingHTTPServer`` that forwards each request verbatim
(including the signed ``Host`` header) to moto, counts it by kind at the endpoint
(``LIST``/``GET``/``PUT``/``DELETE``/``HEAD``/...), and can inject faults on the real
HTTP path: error statuses, dropped connections, hung requests, or a refused port.

Fixtures (a plugin: tests/conftest.py lists it in ``pytest_plugins``):

- ``moto_server`` (session): an :class:`S3Endpoint` with ``.endpoint_url`` (the proxy,
  counted), ``.moto_endpoint_url`` (moto directly, uncounted), ``.counter``, ``.faults``,
  ``.raw_client()`` (a boto3 client straight to moto). Fake credentials and a fenced-off
  AWS environment are set for the session.
- ``s3_counter`` / ``s3_faults``: the endpoint's counter (reset) and faults (cleared and
  the endpoint brought back up after the test).
- ``s3_bucket``: a fresh, uniquely named, empty bucket (removed afterwards).
- ``s3_conduit``: an ``S3Conduit`` on that bucket with ``base_prefix="base"``.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest

__all__ = [
    "CountingProxy",
    "Faults",
    "RequestCounter",
    "S3Endpoint",
    "moto_server",
    "s3_bucket",
    "s3_conduit",
    "s3_counter",
    "s3_faults",
]

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
        "content-length",
    }
)

#: Query parameters of a ListObjects(V2) request; anything else on a bucket GET is a
#: bucket sub-resource (?location, ?versioning ...).
_LIST_PARAMS = frozenset(
    {
        "list-type",
        "prefix",
        "start-after",
        "continuation-token",
        "max-keys",
        "delimiter",
        "encoding-type",
        "fetch-owner",
        "marker",
    }
)

_DEFAULT_CODES = {500: "InternalError", 503: "ServiceUnavailable", 403: "AccessDenied", 404: "NoSuchKey"}

#: Upper bound on how long a hung request waits for ``faults.clear()`` (a safety net so
#: a broken test cannot wedge the session; tests release hangs explicitly).
_HANG_LIMIT_S = 120.0


def classify(method: str, target: str) -> tuple[str, str]:
    """(kind, bucket) of a path-style S3 request."""
    parts = urlsplit(target)
    bucket, _, key = parts.path.lstrip("/").partition("/")
    query = {k for k, _ in parse_qsl(parts.query, keep_blank_values=True)}
    if method == "GET":
        if key:
            return "GET", bucket
        return ("LIST" if query <= _LIST_PARAMS else "GET_BUCKET"), bucket
    if method == "PUT":
        return ("PUT" if key else "CREATE_BUCKET"), bucket
    if method == "POST":
        return ("DELETE" if "delete" in query else "POST"), bucket
    if method == "DELETE":
        return ("DELETE" if key else "DELETE_BUCKET"), bucket
    return method, bucket


def client_of(authorization: str) -> str:
    """The access key id a SigV4 ``Authorization`` header was signed with ('' if unsigned)."""
    _, sep, rest = authorization.partition("Credential=")
    return rest.split("/", 1)[0].strip() if sep else ""


class RequestCounter:
    """Requests that reached the endpoint, by kind (and by bucket, and by client: the
    access key id that signed the request). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total: Counter[str] = Counter()
        self._by_bucket: dict[str, Counter[str]] = {}
        self._by_client: dict[str, Counter[str]] = {}

    def record(self, kind: str, bucket: str, client: str = "") -> None:
        with self._lock:
            self._total[kind] += 1
            self._by_bucket.setdefault(bucket, Counter())[kind] += 1
            self._by_client.setdefault(client, Counter())[kind] += 1

    def snapshot(self, bucket: str | None = None, client: str | None = None) -> dict[str, int]:
        """``{"LIST": n, "GET": n, "PUT": n, ...}`` since the last reset (kinds seen only),
        of one bucket or of one client (access key id) when given."""
        with self._lock:
            if client is not None:
                return dict(self._by_client.get(client, Counter()))
            c = self._total if bucket is None else self._by_bucket.get(bucket, Counter())
            return dict(c)

    def total(self, bucket: str | None = None) -> int:
        return sum(self.snapshot(bucket).values())

    def reset(self) -> None:
        with self._lock:
            self._total.clear()
            self._by_bucket.clear()
            self._by_client.clear()


@dataclass
class _Fault:
    remaining: int
    mode: str  # "status" | "drop" | "hang"
    status: int = 503
    code: str = ""
    kinds: frozenset[str] | None = None
    release: threading.Event = field(default_factory=threading.Event)


class Faults:
    """Fault injection on the proxy's real HTTP path.

    - ``fail_next(n, status=503, code=None, kinds=None)``: the next ``n`` requests (of the
      given kinds, e.g. ``{"PUT"}``) get an S3-style XML error with that status.
    - ``drop_next(n, kinds=None)``: the next ``n`` requests are read and the connection is
      closed without a response.
    - ``hang_next(n, kinds=None)``: the next ``n`` requests get no answer until
      :meth:`clear` (exercises read timeouts).
    - ``down(mode="refuse")``: stop listening, so connections are refused (keep-alive
      connections already open are closed on their next request); ``mode="reset"`` keeps
      listening but closes every connection without answering. ``up()`` undoes it.
    - ``clear()``: drop pending faults, release hung requests, bring the endpoint up.
    """

    def __init__(self, proxy: CountingProxy) -> None:
        self._proxy = proxy
        self._lock = threading.Lock()
        self._pending: list[_Fault] = []
        self._down: str | None = None
        self.injected = 0

    def fail_next(self, n: int = 1, status: int = 503, code: str | None = None, kinds: Any = None) -> None:
        self._add(
            _Fault(
                n, "status", status, code or _DEFAULT_CODES.get(status, f"Injected{status}"), _kinds(kinds)
            )
        )

    def drop_next(self, n: int = 1, kinds: Any = None) -> None:
        self._add(_Fault(n, "drop", kinds=_kinds(kinds)))

    def hang_next(self, n: int = 1, kinds: Any = None) -> None:
        self._add(_Fault(n, "hang", kinds=_kinds(kinds)))

    def down(self, mode: str = "refuse") -> None:
        if mode not in ("refuse", "reset"):
            raise ValueError("mode must be 'refuse' or 'reset'")
        with self._lock:
            if self._down is not None:
                return
            self._down = mode
        if mode == "refuse":
            self._proxy._stop_listening()

    def up(self) -> None:
        with self._lock:
            was, self._down = self._down, None
        if was == "refuse":
            self._proxy._start_listening()

    @property
    def is_down(self) -> bool:
        return self._down is not None

    @property
    def pending(self) -> int:
        with self._lock:
            return sum(f.remaining for f in self._pending)

    def clear(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for f in pending:
            f.release.set()
        self.up()

    def _add(self, fault: _Fault) -> None:
        if fault.remaining < 1:
            raise ValueError("n must be at least 1")
        with self._lock:
            self._pending.append(fault)

    def _take(self, kind: str) -> _Fault | None:
        with self._lock:
            if self._down is not None:
                self.injected += 1
                return _Fault(1, "drop")
            for f in self._pending:
                if f.remaining > 0 and (f.kinds is None or kind in f.kinds):
                    f.remaining -= 1
                    if f.remaining == 0 and f.mode != "hang":
                        self._pending.remove(f)
                    self.injected += 1
                    return f
        return None


def _kinds(kinds: Any) -> frozenset[str] | None:
    if kinds is None:
        return None
    if isinstance(kinds, str):
        return frozenset({kinds})
    return frozenset(kinds)


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; with Nagle on, the body would wait for
    # the client's delayed ACK (~40 ms per response).
    disable_nagle_algorithm = True
    proxy: CountingProxy  # set on the per-proxy subclass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def do_GET(self) -> None:
        self._handle()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline().strip():  # trailers
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _handle(self) -> None:
        body = self._read_body()
        kind, bucket = classify(self.command, self.path)
        proxy = self.proxy
        proxy.counter.record(kind, bucket, client_of(self.headers.get("Authorization", "")))
        fault = proxy.faults._take(kind)
        if fault is not None:
            if fault.mode == "status":
                self._send_error_xml(fault.status, fault.code)
                return
            if fault.mode == "hang":
                fault.release.wait(_HANG_LIMIT_S)
            self.close_connection = True  # "drop" and released "hang": no answer at all
            return
        self._forward(body)

    def _send_error_xml(self, status: int, code: str) -> None:
        payload = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>injected by the test proxy</Message>"
            f"<RequestId>resoluto-fault</RequestId></Error>"
        ).encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _forward(self, body: bytes) -> None:
        host, port = self.proxy.upstream
        conn = http.client.HTTPConnection(host, port, timeout=60)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    conn.putheader(name, value)
            if body or self.command in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            resp = conn.getresponse()
            data = resp.read()
            headers = resp.getheaders()
            status, reason = resp.status, resp.reason
        except OSError:
            self.close_connection = True  # upstream broke: the client sees a closed connection
            return
        finally:
            conn.close()
        self.send_response_only(status, reason)
        upstream_length = None
        for name, value in headers:
            low = name.lower()
            if low == "content-length":
                upstream_length = value
            elif low not in _HOP_BY_HOP:
                self.send_header(name, value)
        if self.command == "HEAD":
            self.send_header("Content-Length", upstream_length or "0")
        else:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD" and data:
            self.wfile.write(data)


class CountingProxy:
    """Loopback HTTP proxy in front of an S3 endpoint: counts requests, injects faults."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.counter = RequestCounter()
        self.faults = Faults(self)
        self._handler = type("_BoundProxyHandler", (_ProxyHandler,), {"proxy": self})
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.port = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._start_listening()

    def stop(self) -> None:
        self.faults.clear()
        self._stop_listening()

    def _start_listening(self) -> None:
        with self._lock:
            if self._server is not None:
                return
            server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler)
            server.daemon_threads = True
            self.port = server.server_address[1]
            self._server = server
            self._thread = threading.Thread(
                target=server.serve_forever,
                kwargs={"poll_interval": 0.05},
                daemon=True,
                name=f"s3-proxy-{self.port}",
            )
            self._thread.start()

    def _stop_listening(self) -> None:
        with self._lock:
            server, thread = self._server, self._thread
            self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join()


@dataclass
class S3Endpoint:
    endpoint_url: str
    moto_endpoint_url: str
    proxy: CountingProxy
    region: str = "us-east-1"

    @property
    def counter(self) -> RequestCounter:
        return self.proxy.counter

    @property
    def faults(self) -> Faults:
        return self.proxy.faults

    def raw_client(self) -> Any:
        """A boto3 S3 client straight to moto: not counted, not subject to faults."""
        from botocore.config import Config

        from guest_runner.conduit.s3 import _session

        return _session(region_name=self.region).client(
            "s3",
            endpoint_url=self.moto_endpoint_url,
            config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "max_attempts": 2}),
        )


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_s3() -> Iterator[tuple[CountingProxy, str]]:
    """moto's S3 server on 127.0.0.1 behind the counting, fault-injecting proxy:
    yields (proxy, moto's own URL). Shared by the fixtures and the benchmarks."""
    from moto.server import ThreadedMotoServer

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    assert host == "127.0.0.1", host
    proxy = CountingProxy("127.0.0.1", port)
    proxy.start()
    try:
        yield proxy, f"http://127.0.0.1:{port}"
    finally:
        proxy.stop()
        moto.stop()


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    pytest.importorskip("boto3")
    pytest.importorskip(
        "moto.server", reason="moto[s3] with flask and flask-cors (the dev extra) is needed for S3 tests"
    )
    nowhere = tmp_path_factory.mktemp("aws") / "absent"
    with pytest.MonkeyPatch.context() as mp:
        # Fake credentials, and nothing that could send a request anywhere but 127.0.0.1.
        for var in (
            "AWS_PROFILE",
            "AWS_DEFAULT_PROFILE",
            "AWS_REGION",
            "AWS_ENDPOINT_URL",
            "AWS_ENDPOINT_URL_S3",
            "AWS_ROLE_ARN",
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
            "HTTP_PROXY",
            "HTTPS_PROXY",
            "ALL_PROXY",
            "http_proxy",
            "https_proxy",
            "all_proxy",
        ):
            mp.delenv(var, raising=False)
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_SESSION_TOKEN", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_CONFIG_FILE", str(nowhere))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(nowhere))
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        mp.setenv("NO_PROXY", "127.0.0.1,localhost")
        mp.setenv("no_proxy", "127.0.0.1,localhost")

        with serve_s3() as (proxy, moto_url):
            yield S3Endpoint(endpoint_url=proxy.endpoint_url, moto_endpoint_url=moto_url, proxy=proxy)


@pytest.fixture
def s3_faults(moto_server: S3Endpoint) -> Iterator[Faults]:
    moto_server.faults.clear()
    yield moto_server.faults
    moto_server.faults.clear()


@pytest.fixture
def s3_counter(moto_server: S3Endpoint) -> RequestCounter:
    moto_server.counter.reset()
    return moto_server.counter


def _stop_heartbeats(bucket: str) -> None:
    """This process's host heartbeats in ``bucket`` stop with it: a writer lingers after its
    last node (heartbeat.py), and its beats would land in the next test's counts, then fail
    on a bucket that is gone."""
    from prefect_resoluto.node import heartbeat

    with heartbeat._LOCK:
        writers = list(heartbeat._WRITERS.values())
    for writer in writers:
        if writer.conduit.url.split("?", 1)[0].split("/")[2] == bucket:
            writer.close()


@pytest.fixture
def s3_bucket(moto_server: S3Endpoint) -> Iterator[str]:
    name = f"resoluto-test-{uuid.uuid4().hex[:16]}"
    raw = moto_server.raw_client()
    raw.create_bucket(Bucket=name)
    moto_server.counter.reset()
    try:
        yield name
    finally:
        moto_server.faults.clear()
        _stop_heartbeats(name)
        try:
            for page in raw.get_paginator("list_objects_v2").paginate(Bucket=name):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
                if keys:
                    raw.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
            raw.delete_bucket(Bucket=name)
        finally:
            raw.close()


@pytest.fixture
def s3_conduit(moto_server: S3Endpoint, s3_bucket: str) -> Iterator[Any]:
    from guest_runner.conduit.s3 import S3Conduit

    conduit = S3Conduit(s3_bucket, base_prefix="base", endpoint_url=moto_server.endpoint_url)
    try:
        yield conduit
    finally:
        conduit.close()
