"""A loopback HTTP proxy in front of the real kube-apiserver that injects faults.

::

    KubernetesRuntime --HTTP--> FaultProxy (127.0.0.1:p) --HTTPS--> kube-apiserver (127.0.0.1:a)

Every request is forwarded verbatim (the bearer token included) unless a queued
:class:`Fault` matches its verb and resource: then the proxy answers with an HTTP status
(a Kubernetes ``Status`` body, optional ``Retry-After``) instead of forwarding, forwards
first and *then* answers with the error (the request landed, the client never hears of it),
resets the connection, or delays the real answer. The proxy records each request as
``(verb, resource, status)`` so a test can count attempts.

A watch (``GET ...?watch=true``, verb ``watch``) is streamed through line by line, and the
stream itself can be harmed while it is open (:meth:`FaultProxy.expire_watch`: an ``ERROR``
event with a 410 Status, then the end of the stream, as the apiserver says it;
:meth:`FaultProxy.cut_watch`: the connection reset mid-stream;
:meth:`FaultProxy.garble_watch`: a line that is not an event). ``fail("watch", ...)``
refuses new watches like any other request (a 429 storm with ``Retry-After``).
"""

from __future__ import annotations

import http.client
import json
import queue
import re
import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

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


@dataclass
class StreamFault:
    """Done to the next open watch stream of ``resource``: ``line`` written to it, then the
    stream ended (``end``) or the connection reset (``cut``)."""

    resource: str
    line: bytes = b""
    end: bool = False
    cut: bool = False


EXPIRED = {
    "type": "ERROR",
    "object": {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": "too old resource version: 1 (2) (injected by the test proxy)",
        "reason": "Expired",
        "code": 410,
    },
}


def _verb(method: str, name: str | None, query: str = "") -> str:
    if method == "POST":
        return "create"
    if method == "GET":
        if not name and parse_qs(query).get("watch", [""])[0] in ("true", "1"):
            return "watch"
        return "get" if name else "list"
    return {"DELETE": "delete", "PATCH": "patch", "PUT": "update"}.get(method, method.lower())


class FaultProxy:
    def __init__(self, upstream: str, ca_file: str) -> None:
        u = urlsplit(upstream)
        self.upstream_host = u.hostname or "127.0.0.1"
        self.upstream_port = u.port or 443
        self._ctx = ssl.create_default_context(cafile=ca_file)
        self._faults: list[Fault] = []
        self._stream_faults: list[StreamFault] = []
        self.open_watches = 0
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

    def expire_watch(self, resource: str = "pods") -> None:
        """The next open watch of ``resource`` gets a 410 ERROR event, then its stream ends."""
        self._harm(StreamFault(resource, json.dumps(EXPIRED).encode() + b"\n", end=True))

    def cut_watch(self, resource: str = "pods") -> None:
        """The next open watch of ``resource`` has its connection reset mid-stream."""
        self._harm(StreamFault(resource, cut=True))

    def garble_watch(self, line: bytes = b"{this is not an event\n", resource: str = "pods") -> None:
        """The next open watch of ``resource`` gets ``line`` and goes on streaming."""
        self._harm(StreamFault(resource, line))

    def _harm(self, f: StreamFault) -> None:
        with self._lock:
            self._stream_faults.append(f)

    def pending_stream_faults(self) -> int:
        with self._lock:
            return len(self._stream_faults)

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
        verb = _verb(h.command, name, urlsplit(h.path).query)
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
        if verb == "watch":
            self._stream(h, res)
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

    def _take_stream_fault(self, resource: str) -> StreamFault | None:
        with self._lock:
            for f in self._stream_faults:
                if f.resource == resource:
                    self._stream_faults.remove(f)
                    return f
        return None

    def _stream(self, h: BaseHTTPRequestHandler, res: str) -> None:
        """Relay a watch line by line (chunked), harming it when a stream fault is queued."""
        conn = http.client.HTTPSConnection(
            self.upstream_host, self.upstream_port, context=self._ctx, timeout=600
        )
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
            conn.request("GET", h.path, headers=headers)
            r = conn.getresponse()
            self._record("watch", res, r.status)
            if r.status != 200:
                data = r.read()
                h.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in _HOP:
                        h.send_header(k, v)
                h.send_header("Content-Length", str(len(data)))
                h.end_headers()
                h.wfile.write(data)
                return
            h.send_response(200)
            h.send_header("Content-Type", r.getheader("Content-Type") or "application/json")
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            h.wfile.flush()
            with self._lock:
                self.open_watches += 1
            try:
                self._relay(h, r, res)
            finally:
                with self._lock:
                    self.open_watches -= 1
        except OSError:
            pass  # the client went away
        finally:
            conn.close()
        h.close_connection = True

    def _relay(self, h: BaseHTTPRequestHandler, r: http.client.HTTPResponse, res: str) -> None:
        lines: queue.Queue[bytes] = queue.Queue()

        def pump() -> None:
            try:
                while line := r.readline():
                    lines.put(line)
            except (OSError, ValueError, AttributeError, http.client.HTTPException):
                pass  # the connection was closed under the reader
            lines.put(b"")  # the upstream stream ended

        threading.Thread(target=pump, daemon=True, name="k8s-fault-proxy-watch").start()

        def chunk(data: bytes) -> None:
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            h.wfile.flush()

        while True:
            f = self._take_stream_fault(res)
            if f is not None:
                if f.cut:
                    h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    h.connection.close()
                    return
                chunk(f.line)
                if f.end:
                    break
                continue
            try:
                line = lines.get(timeout=0.05)
            except queue.Empty:
                continue
            if not line:
                break
            chunk(line)
        h.wfile.write(b"0\r\n\r\n")
        h.wfile.flush()

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
