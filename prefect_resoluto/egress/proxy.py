"""The per-run egress proxy: every connection a sandbox makes ends here, and is either
relayed to an allowlisted name or refused.

It listens only inside the run's proxy namespace (see :mod:`.netns`), on

* ``PROXY_PORT``: HTTP ``CONNECT name:port`` and absolute-form ``GET http://name/...``
  (the sandbox gets ``HTTPS_PROXY``/``HTTP_PROXY`` pointing here), plus the guest's
  one-way phase switch ``POST /.resoluto/egress/phase/workload``;
* every port of the run's allowlists and forwards, transparently: TLS routed by SNI,
  plain HTTP by its Host header (a forward alone on its port needs neither);
* UDP 53: DNS answers for allowlisted names only, pointing at the proxy itself.

A connection is identified with its node by source address (one /30 per sandbox,
reverse-path filtering on, so a sandbox cannot speak with another's address). Names are
resolved here (``egress_resolve`` first), and the address about to be dialled is checked
against :func:`.policy.refusal` — the name's allowlisting never exempts it. Only the
node's forwards (``name:port`` -> one host loopback ``addr:port``) skip that check, for
exactly that pair. Dialling happens from the host's namespace, or from
``RESOLUTO_EGRESS_UPLINK_NETNS`` when set (tests point it at a namespace of test hosts).

Every decision becomes an event (kind ``egress``) handed to the node's sink.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import netns
from .policy import NodePolicy, is_ip, normalize_name, refusal

log = logging.getLogger("prefect_resoluto.egress")

PROXY_PORT = 3128
DNS_PORT = 53
UPLINK_ENV = "RESOLUTO_EGRESS_UPLINK_NETNS"
PHASE_PATH = "/.resoluto/egress/phase/"
_HEAD_LIMIT = 64 * 1024
_BUF = 256 * 1024
_CLIENT_TIMEOUT = 30.0
_DIAL_TIMEOUT = 10.0
#: Open connections per sandbox (each costs the host two threads): beyond, refused.
MAX_CONNECTIONS = 256
#: Decision events per sandbox; beyond, only counted (a flood must not flood the logs).
MAX_EVENTS = 2000

Sink = Callable[[dict[str, Any]], None]


@dataclass
class Attachment:
    """One sandbox on the run's proxy."""

    sandbox_id: str
    node_id: str
    policy: NodePolicy
    sink: Sink | None
    slot: int
    netns: str
    gateway: str
    address: str
    phase: str = ""
    #: The guest canary's targets: refusing them is the expected outcome, logged at INFO.
    canary: frozenset[str] = frozenset()
    conns: set[socket.socket] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    slots: threading.BoundedSemaphore = field(
        default_factory=lambda: threading.BoundedSemaphore(MAX_CONNECTIONS)
    )
    events: int = 0
    dropped: int = 0

    @property
    def proxy_url(self) -> str:
        return f"http://{self.gateway}:{PROXY_PORT}"


class _Refused(Exception):
    def __init__(self, reason: str, address: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.address = address


class RunProxy:
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.netns = ""
        self.uplink = os.environ.get(UPLINK_ENV) or None
        self._own: set[str] = set()
        self._nodes: dict[str, Attachment] = {}  # by sandbox address
        self._by_sandbox: dict[str, Attachment] = {}
        self._listeners: dict[int, socket.socket] = {}
        self._reserved: set[int] = set()
        self._udp: socket.socket | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.connections = 0

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> RunProxy:
        if self.uplink and not netns.exists(self.uplink):
            raise netns.NetnsError(f"{UPLINK_ENV}={self.uplink}: no such network namespace")
        self.netns = netns.create_proxy_namespace(self.run_id)
        try:
            self._own = netns.addresses(None) | (netns.addresses(self.uplink) if self.uplink else set())
            self._listen(PROXY_PORT, self._serve_proxy)
            udp = netns.socket_in(self.netns, socket.AF_INET, socket.SOCK_DGRAM)
            udp.bind(("0.0.0.0", DNS_PORT))
            self._udp = udp
            threading.Thread(target=self._serve_dns, name=f"egress-dns-{self.netns}", daemon=True).start()
        except Exception:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:
            listeners, self._listeners = list(self._listeners.values()), {}
            attached = list(self._by_sandbox.values())
        for s in listeners + ([self._udp] if self._udp else []):
            _close(s)
        for att in attached:
            self.detach(att.sandbox_id)
        if self.netns:
            netns.delete(self.netns)

    def _listen(self, port: int, serve: Callable[[socket.socket, int], None]) -> None:
        with self._lock:
            if port in self._listeners:
                return
            s = netns.socket_in(self.netns)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", port))
            s.listen(512)
            self._listeners[port] = s
        threading.Thread(
            target=self._accept, args=(s, port, serve), name=f"egress-{port}", daemon=True
        ).start()

    def _accept(self, s: socket.socket, port: int, serve: Callable[[socket.socket, int], None]) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = s.accept()
            except OSError:
                return
            threading.Thread(
                target=self._guarded, args=(serve, client, port), daemon=True, name="egress-conn"
            ).start()

    def _guarded(self, serve: Callable[[socket.socket, int], None], client: socket.socket, port: int) -> None:
        att = self._node(client)
        if att is None or not att.slots.acquire(blocking=False):
            if att is not None:
                self._refuse(att, "", port, "any", f"more than {MAX_CONNECTIONS} connections open at once")
            _close(client)
            return
        try:
            serve(client, port)
        except Exception as e:  # one broken connection never takes the proxy down
            log.debug("egress connection failed: %s", e)
        finally:
            att.slots.release()
            _close(client)

    # ----------------------------------------------------------------- sandboxes

    def attach(
        self,
        sandbox_id: str,
        node_id: str,
        policy: NodePolicy,
        sink: Sink | None = None,
        canary: frozenset[str] = frozenset(),
    ) -> Attachment:
        with self._lock:  # the slot is taken at once: concurrent attaches get distinct ones
            used = {a.slot for a in self._by_sandbox.values()} | self._reserved
            slot = next(i for i in range(len(used) + 1) if i not in used)
            self._reserved.add(slot)
        try:
            name, gateway, address = netns.create_sandbox_namespace(self.run_id, sandbox_id, self.netns, slot)
        except Exception:
            with self._lock:
                self._reserved.discard(slot)
            raise
        att = Attachment(
            sandbox_id,
            node_id,
            policy,
            sink,
            slot,
            name,
            gateway,
            address,
            phase=policy.phases.first,
            canary=canary,
        )
        with self._lock:
            self._reserved.discard(slot)
            self._by_sandbox[sandbox_id] = att
            self._nodes[address] = att
        for port in sorted(policy.ports()):
            if port != PROXY_PORT:
                self._listen(port, self._serve_transparent)
        self._event(
            att,
            "phase",
            f"egress phase {att.phase}: allowlist {policy.describe(att.phase)}" + _forwards(policy),
            phase=att.phase,
        )
        return att

    def detach(self, sandbox_id: str) -> None:
        with self._lock:
            att = self._by_sandbox.pop(sandbox_id, None)
            if att is not None:
                self._nodes.pop(att.address, None)
        if att is None:
            return
        with att.lock:
            conns = list(att.conns)
        for c in conns:
            _shutdown(c)
        netns.delete(att.netns)
        if att.dropped:
            att.events = 0  # the summary itself must get through
            self._event(
                att,
                "summary",
                f"egress: {att.dropped} more decision(s) were not logged "
                f"(more than {MAX_EVENTS} for one sandbox)",
                level="WARNING",
                dropped=att.dropped,
            )

    def attached(self) -> list[Attachment]:
        with self._lock:
            return list(self._by_sandbox.values())

    def switch_phase(self, att: Attachment, phase: str) -> bool:
        """Setup -> workload only: a sandbox can narrow its own access, never widen it."""
        if phase != "workload" or att.phase != "setup":
            return att.phase == phase
        with att.lock:
            att.phase = "workload"
            conns = list(att.conns)
        for c in conns:  # what setup opened does not survive into the workload
            _shutdown(c)
        self._event(
            att,
            "phase",
            f"egress phase workload: allowlist {att.policy.describe('workload')}"
            + _forwards(att.policy)
            + f" ({len(conns)} setup connection(s) closed)",
            phase="workload",
        )
        return True

    def _node(self, client: socket.socket) -> Attachment | None:
        try:
            peer = client.getpeername()[0]
        except OSError:
            return None
        with self._lock:
            return self._nodes.get(peer)

    # ----------------------------------------------------------------- connections

    def _serve_proxy(self, client: socket.socket, port: int) -> None:
        att = self._node(client)
        if att is None:
            return
        client.settimeout(_CLIENT_TIMEOUT)
        head, rest = _read_head(client)
        if head is None:
            return
        line, headers = _parse_head(head)
        parts = line.split(" ")
        if len(parts) != 3:
            _reply(client, 400, "bad request line")
            return
        method, target, _ = parts
        if method == "POST" and target.startswith(PHASE_PATH):
            ok = self.switch_phase(att, target[len(PHASE_PATH) :])
            _reply(client, 200 if ok else 409, json.dumps({"phase": att.phase}), "application/json")
            return
        if method == "CONNECT":
            host, port_s = _split(target, 443)
            self._relay(
                att,
                client,
                host,
                port_s,
                b"",
                via="CONNECT",
                on_open=lambda: client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n"),
            )
            return
        if target.startswith("http://"):
            authority, _, path = target[len("http://") :].partition("/")
            host, port_n = _split(authority, 80)
            first = _rewrite(f"{method} /{path} {parts[2]}", headers) + rest
            self._relay(att, client, host, port_n, first, via="HTTP proxy")
            return
        _reply(client, 400, "only CONNECT and absolute-form http:// requests are proxied")

    def _serve_transparent(self, client: socket.socket, port: int) -> None:
        att = self._node(client)
        if att is None:
            return
        client.settimeout(_CLIENT_TIMEOUT)
        fwd = [k for k in att.policy.forward if k[1] == port]
        if len(fwd) == 1 and not any(
            port in r.ports for r in att.policy.phases.setup + att.policy.phases.workload
        ):
            self._relay(att, client, fwd[0][0], port, b"", via="transparent")
            return
        first = _recv_some(client, 5)
        if not first:
            return
        if first[0] == 0x16:  # a TLS handshake record: route by SNI
            length = struct.unpack("!H", first[3:5])[0]
            first += _recv_exact(client, length)
            name = _sni(first[5:])
            if not name:
                self._refuse(att, "", port, "transparent TLS", "no server name (SNI) in the TLS handshake")
                return
            self._relay(att, client, name, port, first, via="transparent TLS")
            return
        head, rest = _read_head(client, first)
        if head is None:
            return
        line, headers = _parse_head(head)
        host = headers.get("host", "")
        if not host:
            self._refuse(att, "", port, "transparent", "neither TLS with SNI nor HTTP with a Host header")
            return
        name, _ = _split(host, port)
        self._relay(att, client, name, port, _rewrite(line, headers) + rest, via="transparent HTTP")

    def _relay(
        self,
        att: Attachment,
        client: socket.socket,
        name: str,
        port: int,
        first: bytes,
        *,
        via: str,
        on_open: Callable[[], None] | None = None,
    ) -> None:
        t0 = time.monotonic()
        name = normalize_name(name)
        phase = att.phase
        try:
            upstream, address, forwarded = self._open(att, name, port, phase)
        except _Refused as r:
            self._refuse(att, name, port, via, r.reason, r.address)
            if on_open is not None:
                _reply(client, 403, f"egress refused: {r.reason}")
            return
        except OSError as e:
            self._event(
                att,
                "failed",
                f"egress {name}:{port} via {via}: cannot connect: {e}",
                level="WARNING",
                host=name,
                port=port,
                via=via,
                reason=str(e),
                decision="allowed",
            )
            if on_open is not None:
                _reply(client, 502, f"cannot connect to {name}:{port}: {e}")
            return
        with att.lock:
            if att.phase != phase:  # the phase switched while we dialled
                _close(upstream)
                return
            att.conns.update((client, upstream))
        self.connections += 1
        up = down = 0
        try:
            if on_open is not None:
                on_open()
            if first:
                upstream.sendall(first)
            client.settimeout(None)
            upstream.settimeout(None)
            counts = [len(first), 0]
            t = threading.Thread(target=_pump, args=(upstream, client, counts, 1), daemon=True)
            t.start()
            _pump(client, upstream, counts, 0, skip=len(first))
            t.join()
            up, down = counts
        finally:
            with att.lock:
                att.conns.discard(client)
                att.conns.discard(upstream)
            _close(upstream)
        took = time.monotonic() - t0
        target = f"{address[0]}:{address[1]}"
        self._event(
            att,
            "allowed",
            f"egress allowed {name}:{port} -> {target} via {via}"
            + (" (forward)" if forwarded else "")
            + f": {up} B up, {down} B down, {took:.2f} s",
            host=name,
            port=port,
            address=target,
            via=via,
            bytes_up=up,
            bytes_down=down,
            duration=round(took, 4),
            decision="allowed",
            phase=phase,
            forward=forwarded,
        )

    def _open(
        self, att: Attachment, name: str, port: int, phase: str
    ) -> tuple[socket.socket, tuple[str, int], bool]:
        fwd = att.policy.forward.get((name, port))
        if fwd is not None:
            # The one exemption from the loopback refusal: this name:port, to this address.
            s = netns.socket_in(None, socket.AF_INET6 if ":" in fwd[0] else socket.AF_INET)
            s.settimeout(_DIAL_TIMEOUT)
            try:
                s.connect(fwd)
            except OSError:
                _close(s)
                raise
            return s, fwd, True
        if is_ip(name) or not att.policy.allows(phase, name, port):
            raise _Refused(
                "not in the allowlist" + (f" of the {phase} phase" if att.policy.phases.has_setup else "")
            )
        candidates = self._resolve(att, name, port)
        why = ""
        for family, addr in candidates:
            bad = refusal(addr, self._own)
            if bad:
                why = why or f"resolves to a private address ({addr}: {bad})"
                continue
            s = netns.socket_in(self.uplink, family)
            s.settimeout(_DIAL_TIMEOUT)
            try:
                s.connect((addr, port))
            except OSError:
                _close(s)
                raise
            return s, (addr, port), False
        raise _Refused(why or f"{name} does not resolve", candidates[0][1] if candidates else "")

    def _resolve(self, att: Attachment, name: str, port: int) -> list[tuple[int, str]]:
        pinned = att.policy.resolve.get(name)
        if pinned:
            return [(socket.AF_INET6 if ":" in pinned else socket.AF_INET, pinned)]
        try:
            infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
        except OSError as e:
            raise _Refused(f"{name} does not resolve: {e}") from None
        seen: list[tuple[int, str]] = []
        for family, _, _, _, sa in infos:
            if (family, sa[0]) not in seen:
                seen.append((family, str(sa[0])))
        return seen

    def _refuse(
        self, att: Attachment, name: str, port: int, via: str, reason: str, address: str = ""
    ) -> None:
        what = f"{name}:{port}" if name else f"port {port}"
        probe = name in att.canary
        self._event(
            att,
            "refused",
            f"egress refused {what} via {via}: {reason}" + (" (canary probe, as required)" if probe else ""),
            level="INFO" if probe else "WARNING",
            host=name,
            port=port,
            address=address,
            via=via,
            reason=reason,
            decision="refused",
            phase=att.phase,
            bytes_up=0,
            bytes_down=0,
            canary=probe,
        )

    # ----------------------------------------------------------------- DNS

    def _serve_dns(self) -> None:
        udp = self._udp
        assert udp is not None
        while not self._stopped.is_set():
            try:
                data, peer = udp.recvfrom(2048)
            except OSError:
                return
            with self._lock:
                att = self._nodes.get(peer[0])
            if att is None:
                continue
            try:
                reply = self._dns_answer(att, data)
            except (ValueError, IndexError, struct.error):
                continue
            try:
                udp.sendto(reply, peer)
            except OSError:
                pass

    def _dns_answer(self, att: Attachment, query: bytes) -> bytes:
        qid, flags, qd = struct.unpack("!HHH", query[:6])
        if qd != 1 or flags & 0x8000:
            raise ValueError("not a single-question query")
        i, labels = 12, []
        while query[i]:
            n = query[i]
            labels.append(query[i + 1 : i + 1 + n].decode("ascii", "replace"))
            i += 1 + n
        qtype, _ = struct.unpack("!HH", query[i + 1 : i + 5])
        question = query[12 : i + 5]
        name = normalize_name(".".join(labels))
        known = att.policy.knows_name(att.phase, name)
        rd = flags & 0x0100
        rcode = 0 if known else 3  # NXDOMAIN for anything not allowlisted
        answers = b""
        if known and qtype == 1:
            answers = struct.pack("!HHHIH", 0xC00C, 1, 1, 5, 4) + socket.inet_aton(att.gateway)
        if not known:
            probe = name in att.canary
            self._event(
                att,
                "dns",
                f"egress DNS refused {name}: not in the allowlist"
                + (" (canary probe, as required)" if probe else ""),
                level="INFO" if probe else "WARNING",
                host=name,
                decision="refused",
                reason="not in the allowlist",
                via="DNS",
                phase=att.phase,
                canary=probe,
            )
        header = struct.pack(
            "!HHHHHH", qid, 0x8000 | 0x0400 * known | rd | 0x0080 | rcode, 1, 1 if answers else 0, 0, 0
        )
        return header + question + answers

    # ----------------------------------------------------------------- events

    def _event(self, att: Attachment, name: str, line: str, level: str = "INFO", **data: Any) -> None:
        with att.lock:
            att.events += 1
            if att.events > MAX_EVENTS:
                att.dropped += 1
                return
        ev = {
            "run_id": self.run_id,
            "span_id": uuid.uuid4().hex[:16],
            "parent_span_id": "",
            "kind": "egress",
            "name": name,
            "event": "log",
            "ts": time.time(),
            "status": "",
            "data": {
                "line": line,
                "level": level,
                "logger": "resoluto.egress",
                "node_id": att.node_id,
                **data,
            },
        }
        if att.sink is not None:
            try:
                att.sink(ev)
            except Exception as e:
                log.debug("egress event sink failed: %s", e)


def _forwards(policy: NodePolicy) -> str:
    if not policy.forward:
        return ""
    return "; forwards " + ", ".join(f"{n}:{p} -> {a}:{q}" for (n, p), (a, q) in policy.forward.items())


# --------------------------------------------------------------------------- bytes


def _pump(src: socket.socket, dst: socket.socket, counts: list[int], idx: int, skip: int = 0) -> None:
    buf = bytearray(_BUF)
    view = memoryview(buf)
    try:
        while True:
            n = src.recv_into(buf)
            if not n:
                break
            dst.sendall(view[:n])
            counts[idx] += n
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _recv_some(s: socket.socket, n: int) -> bytes:
    try:
        return _recv_exact(s, n)
    except OSError:
        return b""


def _recv_exact(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _read_head(s: socket.socket, first: bytes = b"") -> tuple[bytes | None, bytes]:
    buf = bytearray(first)
    while b"\r\n\r\n" not in buf:
        if len(buf) > _HEAD_LIMIT:
            return None, b""
        try:
            chunk = s.recv(65536)
        except OSError:
            return None, b""
        if not chunk:
            return None, b""
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    return head, rest


def _parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    order: list[tuple[str, str]] = []
    for h in lines[1:]:
        k, _, v = h.partition(":")
        headers[k.strip().lower()] = v.strip()
        order.append((k.strip(), v.strip()))
    headers["\x00order"] = json.dumps(order)
    return lines[0], headers


def _rewrite(line: str, headers: dict[str, str]) -> bytes:
    """One request per connection: a kept-alive connection could name another host next."""
    order = json.loads(headers["\x00order"])
    drop = {"connection", "proxy-connection", "proxy-authorization", "keep-alive"}
    kept = [f"{k}: {v}" for k, v in order if k.lower() not in drop]
    return ("\r\n".join([line, *kept, "Connection: close"]) + "\r\n\r\n").encode("latin-1")


def _split(authority: str, default: int) -> tuple[str, int]:
    authority = authority.strip()
    if authority.startswith("["):
        host, _, tail = authority[1:].partition("]")
        return host, int(tail[1:]) if tail.startswith(":") and tail[1:].isdigit() else default
    host, sep, port = authority.rpartition(":")
    if sep and port.isdigit() and ":" not in host:
        return host, int(port)
    return authority, default


def _sni(record: bytes) -> str:
    """The server_name of a TLS ClientHello (the handshake message after the record header)."""
    try:
        if record[0] != 1:
            return ""
        i = 4 + 2 + 32
        i += 1 + record[i]
        i += 2 + struct.unpack("!H", record[i : i + 2])[0]
        i += 1 + record[i]
        end = i + 2 + struct.unpack("!H", record[i : i + 2])[0]
        i += 2
        while i + 4 <= end:
            etype, elen = struct.unpack("!HH", record[i : i + 4])
            i += 4
            if etype == 0:
                j = i + 2
                while j + 3 <= i + elen:
                    ntype, nlen = record[j], struct.unpack("!H", record[j + 1 : j + 3])[0]
                    if ntype == 0:
                        return record[j + 3 : j + 3 + nlen].decode("ascii", "replace")
                    j += 3 + nlen
            i += elen
    except (IndexError, struct.error):
        pass
    return ""


def _reply(s: socket.socket, code: int, text: str, ctype: str = "text/plain") -> None:
    reasons = {200: "OK", 400: "Bad Request", 403: "Forbidden", 409: "Conflict", 502: "Bad Gateway"}
    body = (text + ("" if ctype != "text/plain" else "\n")).encode()
    head = (
        f"HTTP/1.1 {code} {reasons.get(code, 'Error')}\r\nContent-Type: {ctype}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    try:
        s.sendall(head + body)
    except OSError:
        pass


def _shutdown(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _close(s: socket.socket) -> None:
    try:
        s.close()
    except OSError:
        pass


# --------------------------------------------------------------------------- per run

_PROXIES: dict[str, tuple[RunProxy, int]] = {}
_REGISTRY = threading.Lock()


def acquire(run_id: str) -> RunProxy:
    """The run's proxy, started by its first sandbox; pair every call with :func:`release`."""
    with _REGISTRY:
        entry = _PROXIES.get(run_id)
        if entry is None:
            proxy = RunProxy(run_id).start()
            _PROXIES[run_id] = (proxy, 1)
            return proxy
        _PROXIES[run_id] = (entry[0], entry[1] + 1)
        return entry[0]


def release(run_id: str) -> None:
    """Stops the run's proxy when its last sandbox lets go."""
    with _REGISTRY:
        entry = _PROXIES.get(run_id)
        if entry is None:
            return
        proxy, count = entry
        if count > 1:
            _PROXIES[run_id] = (proxy, count - 1)
            return
        del _PROXIES[run_id]
    proxy.stop()


def proxy_for(run_id: str) -> RunProxy | None:
    """The live proxy of ``run_id`` in this process, if any (drivers, tests, the worker)."""
    with _REGISTRY:
        entry = _PROXIES.get(run_id)
        return entry[0] if entry else None
