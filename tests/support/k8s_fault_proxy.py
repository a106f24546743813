"""A loopback HTTP proxy in front of the real kube-apiserver that injects faults.

::

    KubernetesRuntime --HTTP--> FaultProxy (127.0.0.1:p) --HTTPS--> kube-apiserver (127.0.0.1:a)

Every request is forwarded verbatim (the bearer token included) unless a queued
:class:`Fault` matches its verb and resource: then the proxy answers with an HTTP status
(a Kubernetes ``Status`` body, optional ``Retry-After``) instead of forwarding, forwards
first and *then* answers with the error (the request landed, the client never hears of it),
resets the connection, or delays the real answer. The proxy records each request as
``(verb, resource, status)`` so a test can count attempts.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
    }
)
_PATH = re.compile(
    r"^/(?:api/v1|apis/[^/]+/v1)(?:/namespaces/[^/]+)?/(?P<res>[a-z]+)(?:/(?P<name>[^/?]+))?"
    r"(?:/(?P<sub>[a-z]+))?"
)


@dataclass
class Fault:
    verb: str  # create / get / list / delete / patch
    resource: str  # pods, secrets, networkpolicies, pods/log
    status: int = 503
    times: int = 1
    after: bool = False  # forward first, then answer with the error
    reset: bool = False  # close the connection without an answer
    delay_s: float = 0.0  # forward, but only answer after this long
    retry_after: int | None = None


def _verb(method: str, name: str | None) -> str:
    if method == "POST":
        return "create"
    if method == "GET":
        return "get" if name else "list"
    return {"DELETE": "delete", "PATCH": "patch", "PUT": "update"}.get(method, method.lower())


class FaultProxy:
    def __init__(self, upstream: str, ca_file: str) -> None:
        u = urlsplit(upstream)
        self.upstream_host = u.hostname or "127.0.0.1"
        self.upstream_port = u.port or 443
        self._ctx = ssl.create_default_context(cafile=ca_file)
        self._faults: list[Fault] = []
        self._hooks: list[tuple[str, str, Any]] = []
        self._lock = threading.Lock()
        self.requests: list[tuple[str, str, int]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                pass

            def _serve(self) -> None:
                proxy._handle(self)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve  # noqa: N815

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, daemon=True, name="k8s-fault-proxy"
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def fail(self, verb: str, resource: str, status: int = 503, **kw: Any) -> None:
        with self._lock:
            self._faults.append(Fault(verb, resource, status, **kw))

    def before(self, verb: str, resource: str, hook: Any) -> None:
        """Run ``hook(verb, resource, path)`` once, just before forwarding a matching request."""
        with self._lock:
            self._hooks.append((verb, resource, hook))

    def rewrite(self, verb: str, resource: str, fn: Any) -> None:
        """Forward matching requests with their JSON body replaced by ``fn(body)`` (once)."""
        self.before(verb, resource, None)
        with self._lock:
            self._hooks[-1] = (verb, resource, ("rewrite", fn))

    def calls(self, verb: str, resource: str) -> list[int]:
        """Statuses the client saw for each matching request, in order (0 for a reset)."""
        with self._lock:
            return [s for v, r, s in self.requests if v == verb and r == resource]

    def _take(self, verb: str, resource: str) -> Fault | None:
        with self._lock:
            for f in self._faults:
                if f.verb == verb and f.resource == resource and f.times > 0:
                    f.times -= 1
                    return f
        return None

    def _record(self, verb: str, resource: str, status: int) -> None:
        with self._lock:
            self.requests.append((verb, resource, status))

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        m = _PATH.match(urlsplit(h.path).path)
        res = m.group("res") if m else ""
        name = m.group("name") if m else None
        if m and m.group("sub"):
            res = f"{res}/{m.group('sub')}"
        verb = _verb(h.command, name)
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        fault = self._take(verb, res)
        with self._lock:
            hooks = [x for x in self._hooks if x[0] == verb and x[1] == res]
            self._hooks = [x for x in self._hooks if x not in hooks]
        for _, _, hook in hooks:
            if isinstance(hook, tuple):
                body = json.dumps(hook[1](json.loads(body))).encode()
            else:
                hook(verb, res, urlsplit(h.path).path)
        if fault is not None and fault.reset:
            self._record(verb, res, 0)
            # RST, not FIN: the client sees "connection reset by peer" mid-request.
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            h.connection.close()
            h.close_connection = True
            return
        if fault is not None and not fault.after and not fault.delay_s:
            self._answer_error(h, fault, verb, res, name)
            return
        status, headers, data = self._forward(h, body)
        if fault is not None and fault.after:
            self._answer_error(h, fault, verb, res, name)
            return
        self._record(verb, res, status)  # what the server said, whether or not the client waits for it
        if fault is not None and fault.delay_s:
            time.sleep(fault.delay_s)  # the slow answer itself is the fault
        h.send_response(status)
        for k, v in headers:
            if k.lower() not in _HOP:
                h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _forward(self, h: BaseHTTPRequestHandler, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPSConnection(
            self.upstream_host, self.upstream_port, context=self._ctx, timeout=60
        )
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
            conn.request(h.command, h.path, body=body or None, headers=headers)
            r = conn.getresponse()
            return r.status, r.getheaders(), r.read()
        finally:
            conn.close()

    def _answer_error(
        self, h: BaseHTTPRequestHandler, f: Fault, verb: str, res: str, name: str | None
    ) -> None:
        self._record(verb, res, f.status)
        reason = {
            429: "TooManyRequests",
            500: "InternalError",
            502: "BadGateway",
            503: "ServiceUnavailable",
            504: "Timeout",
        }.get(f.status, "InternalError")
        data = json.dumps(
            {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": f"injected by the test proxy: {f.status}",
                "reason": reason,
                "code": f.status,
            }
        ).encode()
        h.send_response(f.status)
        h.send_header("Content-Type", "application/json")
        if f.retry_after is not None:
            h.send_header("Retry-After", str(f.retry_after))
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
