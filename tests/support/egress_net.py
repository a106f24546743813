"""A small "internet" made of network namespaces this process creates, for egress tests.

::

    proxy (dials from) --> uplink ns  rsl-tu-<id>   198.18.0.1/24, lo 127.0.0.1
                               | veth
                           internet ns rsl-tn-<id>  198.18.0.2/24, 198.18.0.3/24 (test hosts)
                                                    10.20.0.2 and 169.254.169.254 (refusal targets)

The proxy is pointed at the uplink namespace (RESOLUTO_EGRESS_UPLINK_NETNS), so even a
proxy bug could only reach these namespaces: nothing here touches the host's own routes.
Servers run in this process on sockets created inside the namespaces; each records the
address every connection reached, so a test can prove a refusal connected nowhere.
"""

from __future__ import annotations

import http.server
import os
import socket
import socketserver
import ssl
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from prefect_resoluto.egress import netns

HOST = "198.18.0.2"
HOST2 = "198.18.0.3"
PRIVATE = "10.20.0.2"
IMDS = "169.254.169.254"
NAMES = (
    "api.example.test",
    "other.example.test",
    "files.example.test",
    "setup.example.test",
    "private.example.test",
    "imds.example.test",
    "loop.example.test",
    "denied.example.test",
)


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")


@dataclass
class Hits:
    seen: list[tuple[str, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, addr: str, port: int) -> None:
        with self.lock:
            self.seen.append((addr, port))

    def to(self, addr: str) -> list[tuple[str, int]]:
        with self.lock:
            return [h for h in self.seen if h[0] == addr]


def make_cert(d: Path) -> tuple[Path, Path]:
    cert, key = d / "ca.pem", d / "key.pem"
    san = ",".join(f"DNS:{n}" for n in NAMES) + ",DNS:*.example.test"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=example.test",
            "-addext",
            f"subjectAltName={san}",
            "-days",
            "2",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


#: ``GET /wait/<key>`` blocks until the test sets GATES[key]: a task can hold a node open
#: at a known point (and the test knows it got there: ARRIVED) without any sleep.
GATES: dict[str, threading.Event] = {}
ARRIVED: list[str] = []
#: (address reached, Host header, path) of every request a test host answered.
REQUESTS: list[tuple[str, str, str]] = []


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def handle(self) -> None:
        try:
            super().handle()
        except OSError:
            pass  # a client killed mid-answer (the SIGKILL test) is not a server error

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        local = self.connection.getsockname()[0]
        REQUESTS.append((local, self.headers.get("Host", ""), self.path))
        if self.path.startswith("/wait/"):
            key = self.path.split("/")[2]
            ARRIVED.append(key)
            GATES.setdefault(key, threading.Event()).wait(120)
            self.close_connection = True
        if self.path.startswith("/bytes/"):
            n = int(self.path.split("/")[2])
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            chunk = b"x" * (1 << 20)
            try:
                while n > 0:
                    self.wfile.write(chunk[: min(n, len(chunk))])
                    n -= len(chunk)
            except OSError:
                pass  # the client went away
            return
        body = f"hello from {local} host={self.headers.get('Host', '')} path={self.path}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(body)


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def _server_in(ns: str, port: int, hits: Hits, tls: ssl.SSLContext | None = None) -> _Server:
    srv = _Server(("0.0.0.0", port), _Handler, bind_and_activate=False)
    srv.socket.close()
    s = netns.socket_in(ns)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(64)
    srv.socket = s
    orig = srv.get_request

    def get_request() -> tuple[socket.socket, object]:
        conn, peer = orig()
        hits.add(*conn.getsockname()[:2])
        if tls is not None:
            conn = tls.wrap_socket(conn, server_side=True)
        return conn, peer

    srv.get_request = get_request  # type: ignore[method-assign]
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
    return srv


def _echo_in(ns: str, port: int, hits: Hits, udp_hits: Hits) -> list[socket.socket]:
    tcp = netns.socket_in(ns)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("0.0.0.0", port))
    tcp.listen(16)
    udp = netns.socket_in(ns, socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", port))

    def serve_tcp() -> None:
        while True:
            try:
                c, _ = tcp.accept()
            except OSError:
                return
            hits.add(*c.getsockname()[:2])
            threading.Thread(target=_echo, args=(c,), daemon=True).start()

    def serve_udp() -> None:
        while True:
            try:
                data, peer = udp.recvfrom(2048)
            except OSError:
                return
            udp_hits.add(peer[0], port)
            udp.sendto(data, peer)

    threading.Thread(target=serve_tcp, daemon=True).start()
    threading.Thread(target=serve_udp, daemon=True).start()
    return [tcp, udp]


def _echo(c: socket.socket) -> None:
    with c:
        while True:
            data = c.recv(65536)
            if not data:
                return
            c.sendall(data)


@dataclass
class TestNet:
    uplink: str
    internet: str
    cert: Path
    hits: Hits
    udp_hits: Hits
    loop_hits: Hits
    _closers: list[object] = field(default_factory=list)

    @property
    def resolve(self) -> dict[str, str]:
        """egress_resolve for the test names."""
        return {
            "api.example.test": HOST,
            "other.example.test": HOST2,
            "files.example.test": HOST,
            "setup.example.test": HOST2,
            "private.example.test": PRIVATE,
            "imds.example.test": IMDS,
            "loop.example.test": "127.0.0.1",
            "denied.example.test": HOST,
        }

    def close(self) -> None:
        for c in self._closers:
            try:
                if isinstance(c, socketserver.BaseServer):
                    c.shutdown()
                    c.server_close()
                else:
                    c.close()  # type: ignore[attr-defined]
            except OSError:
                pass
        netns.delete(self.internet)
        netns.delete(self.uplink)


def build(tmp: Path, tag: str) -> TestNet:
    uid = f"{tag}-{os.getpid()}-{os.urandom(2).hex()}"
    up, inet = f"rsl-tu-{uid}", f"rsl-tn-{uid}"
    _ip("netns", "add", up)
    _ip("netns", "add", inet)
    try:
        _ip("link", "add", "up0", "netns", up, "type", "veth", "peer", "name", "net0", "netns", inet)
        for ns in (up, inet):
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", up, "addr", "add", "198.18.0.1/24", "dev", "up0")
        _ip("-n", up, "link", "set", "up0", "up")
        _ip("-n", inet, "addr", "add", f"{HOST}/24", "dev", "net0")
        _ip("-n", inet, "addr", "add", f"{HOST2}/24", "dev", "net0")
        _ip("-n", inet, "link", "set", "net0", "up")
        _ip("-n", inet, "addr", "add", f"{PRIVATE}/32", "dev", "lo")
        _ip("-n", inet, "addr", "add", f"{IMDS}/32", "dev", "lo")
        # Routes for the refusal targets exist only inside the test's uplink namespace.
        _ip("-n", up, "route", "add", f"{PRIVATE}/32", "via", HOST)
        _ip("-n", up, "route", "add", f"{IMDS}/32", "via", HOST)
        cert, key = make_cert(tmp)
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(cert, key)
        hits, udp_hits, loop_hits = Hits(), Hits(), Hits()
        net = TestNet(up, inet, cert, hits, udp_hits, loop_hits)
        net._closers += [
            _server_in(inet, 443, hits, tls),
            _server_in(inet, 80, hits),
            _server_in(inet, 8443, hits, tls),
            *_echo_in(inet, 7, hits, udp_hits),
            # Where a proxy that dialled "loopback" would land: the uplink's lo.
            _server_in(up, 443, loop_hits, tls),
            _server_in(up, 80, loop_hits),
        ]
        return net
    except Exception:
        netns.delete(inet)
        netns.delete(up)
        raise
