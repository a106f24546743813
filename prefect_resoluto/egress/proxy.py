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
reverse-path filtering on, so a sandbox cannot speak with another's address). What the
sandbox sends is parsed by :mod:`.parse` (names validated by :mod:`.names`) before
anything is matched: the admission is the ``CONNECT`` authority, the absolute-form URI
(whose ``Host`` header must agree), the transparent connection's TLS server name or
``Host`` header. A plain HTTP connection carries exactly one request: its head and its
body (by ``Content-Length`` or chunked framing) are relayed, ``Connection: close`` is
sent upstream, and anything the client sends after that is refused, not relayed. Names
are resolved here (``egress_resolve`` first), and the address about to be dialled is
checked against :func:`.ranges.refusal` and, at that moment, against the dialling
namespace's own addresses (:func:`.netns.is_local`, then the connected socket) — the
name's allowlisting never exempts it. Only
the node's forwards (``name:port`` -> one host loopback ``addr:port``) skip that check,
for exactly that pair. Dialling happens from the host's namespace, or from
``RESOLUTO_EGRESS_UPLINK_NETNS`` when set (tests point it at a namespace of test hosts).

Every decision becomes an event (kind ``egress``) handed to the node's sink, with every
string made printable (a name cannot start a line of its own). Each kind of decision —
admitted, refused, failed — is logged one by one up to :data:`MAX_DECISIONS` per sandbox,
then counted (refusals and failures by reason, admissions by destination with their
bytes) and summarised at detach, one summary per kind: a flood of one kind neither floods
the logs nor hides the first decisions of another, and a sandbox's events are bounded
(:func:`events_bound`).
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from guest_runner import wire

from . import netns, parse, registry
from .names import printable
from .policy import NodePolicy, is_ip, refusal

log = logging.getLogger("prefect_resoluto.egress")

PROXY_PORT = 3128
DNS_PORT = 53
UPLINK_ENV = "RESOLUTO_EGRESS_UPLINK_NETNS"
PHASE_PATH = "/.resoluto/egress/phase/"
#: The most a relay reads at once. Taken only when data is there to read and dropped once
#: it is sent on: an idle tunnel holds no buffer (docs/performance.md, "Egress memory").
_BUF = 64 * 1024
#: A tunnel in which neither direction moved for this long is closed (seconds).
IDLE_TIMEOUT = 300.0
_CLIENT_TIMEOUT = 30.0
_DIAL_TIMEOUT = 10.0
_LOCAL = "an address of this host"
#: Open connections per sandbox (each costs the host two threads and, while data moves,
#: up to two relay buffers): beyond, refused.
MAX_CONNECTIONS = 128
#: Decisions of each kind (:data:`DECISIONS`) logged one by one per sandbox; beyond, counted
#: and summarised at detach (a flood must not flood the logs, nor the node's event list).
MAX_DECISIONS = 2000
DECISIONS = ("allowed", "refused", "failed")
#: Distinct reasons (destinations, for admissions) counted past the cap per kind; the rest
#: are counted as "other reasons".
_REASONS = 32
_NOUNS = {"allowed": "admitted connection(s)", "refused": "refusal(s)", "failed": "failed dial(s)"}


def events_bound() -> int:
    """The most events one sandbox's attachment hands its sink: each kind up to its cap,
    plus its phase switches and the summaries."""
    return len(DECISIONS) * MAX_DECISIONS + 8


Sink = Callable[[wire.SpanEvent], None]


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
    #: Decisions logged one by one, by kind.
    logged: dict[str, int] = field(default_factory=dict)
    #: Decisions past MAX_DECISIONS, by kind, then by reason (admissions: by destination).
    dropped: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Bytes (up, down) of the admitted connections that were not logged one by one.
    dropped_bytes: list[int] = field(default_factory=lambda: [0, 0])

    @property
    def proxy_url(self) -> str:
        return f"http://{self.gateway}:{PROXY_PORT}"


class RunProxy:
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.netns = ""
        self.uplink = os.environ.get(UPLINK_ENV) or None
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
            log.debug("egress connection failed: %s", printable(str(e)))
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
        self._summary(att)

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
        got: tuple[bytes, bytes] | None = None
        try:
            got = _read_head(client)
            if got is None:
                return
            req = parse.proxy_request(got[0], PHASE_PATH)
        except parse.Refused as r:
            via = "CONNECT" if got is not None and got[0].startswith(b"CONNECT ") else "HTTP proxy"
            self._refuse(att, r.host, 0, via, r.reason)
            _reply(client, 403, f"egress refused: {r.reason}")
            return
        if req.kind == "phase":
            ok = self.switch_phase(att, req.host)
            _reply(client, 200 if ok else 409, json.dumps({"phase": att.phase}), "application/json")
        elif req.kind == "connect":
            self._relay(
                att,
                client,
                req.host,
                req.port,
                got[1],
                via="CONNECT",
                on_open=lambda: client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n"),
            )
        else:
            self._relay(att, client, req.host, req.port, got[1], via="HTTP proxy", http=req, replies=True)

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
        if first[0] == 0x16:  # a TLS handshake record: its server name is the admission
            try:
                record = first + _recv_exact(client, parse.tls_record_length(first))
                name = parse.client_hello_sni(record)
            except parse.Refused as r:
                self._refuse(att, r.host, port, "transparent TLS", r.reason)
                return
            self._relay(att, client, name, port, record, via="transparent TLS")
            return
        try:
            got = _read_head(client, first)
            if got is None:
                return
            req = parse.transparent_request(got[0], port)
        except parse.Refused as r:
            self._refuse(att, r.host, port, "transparent HTTP", r.reason)
            return
        self._relay(att, client, req.host, port, got[1], via="transparent HTTP", http=req)

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
        http: parse.Request | None = None,
        replies: bool = False,
    ) -> None:
        """Dial ``name:port`` (validated) for the sandbox and relay both ways. With
        ``http``, the client's side carries that one request (``first``: what followed its
        head) and nothing else; without, ``first`` goes upstream before the rest."""
        t0 = time.monotonic()
        phase = att.phase
        replies = replies or on_open is not None
        try:
            upstream, address, forwarded = self._open(att, name, port, phase)
        except parse.Refused as r:
            self._refuse(att, name, port, via, r.reason, r.address)
            if replies:
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
                decision="failed",
                phase=phase,
            )
            if replies:
                _reply(client, 502, f"cannot connect to {name}:{port}: {e}")
            return
        with att.lock:
            if att.phase != phase:  # the phase switched while we dialled
                _close(upstream)
                return
            att.conns.update((client, upstream))
        self.connections += 1
        flow = _Flow()
        try:
            if on_open is not None:
                on_open()
            # A send the other side never reads gives up after the idle timeout too.
            client.settimeout(IDLE_TIMEOUT)
            upstream.settimeout(IDLE_TIMEOUT)
            t = threading.Thread(target=_pump, args=(upstream, client, flow, 1), daemon=True)
            if http is None:
                if first:
                    upstream.sendall(first)
                    flow.moved(0, len(first))
                t.start()
                _pump(client, upstream, flow, 0)
            else:
                t.start()
                self._pump_request(att, client, upstream, http, first, flow, port, via)
            t.join()
        finally:
            with att.lock:
                att.conns.discard(client)
                att.conns.discard(upstream)
            _close(upstream)
        up, down = flow.counts
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

    def _pump_request(
        self,
        att: Attachment,
        client: socket.socket,
        upstream: socket.socket,
        http: parse.Request,
        rest: bytes,
        flow: _Flow,
        port: int,
        via: str,
    ) -> None:
        """Client -> upstream for one HTTP request: its head, then exactly its body. A
        byte after that is a second request, which this connection does not carry."""
        try:
            body = parse.Body(http.head)
            n = body.feed(rest)
            data, extra = http.forwarded + rest[:n], rest[n:]
            upstream.sendall(data)
            flow.moved(0, len(data))
            while not body.done and not extra:
                if not _readable(client, upstream, flow):
                    break
                chunk = client.recv(_BUF)
                if not chunk:
                    break
                n = body.feed(chunk)
                upstream.sendall(chunk[:n])
                flow.moved(0, n)
                extra = chunk[n:]
            if body.done and not extra and _readable(client, upstream, flow):
                extra = client.recv(_BUF)  # more, or the client's end of the connection
            if extra:
                self._refuse_second(att, extra, port, via)
        except parse.Refused as r:
            self._refuse(att, r.host, port, via, r.reason)
        except OSError:
            pass
        finally:
            _shutdown_write(upstream)

    def _refuse_second(self, att: Attachment, extra: bytes, port: int, via: str) -> None:
        name = ""
        try:  # name what the second request was for, when its head is already here
            end = parse.head_end(extra)
            if end > 0:
                head = parse.parse_head(extra[: end - 4])
                if head.target[:7].lower() == "http://":
                    name = parse.absolute_target(head.target)[0]
                else:
                    named = parse.host_header(head, port)
                    name = named[0] if named else ""
        except parse.Refused as r:
            name = r.host
        self._refuse(
            att,
            name,
            port,
            via,
            "a second request on one connection (the proxy relays one request per connection)",
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
            raise parse.Refused(
                "not in the allowlist" + (f" of the {phase} phase" if att.policy.phases.has_setup else "")
            )
        candidates = self._resolve(att, name, port)
        why = ""
        for family, addr, pinned in candidates:
            # Whether the address is the dialling namespace's own is asked of its kernel
            # now, not of a list taken at start: addresses come and go during a run.
            bad = refusal(addr, pinned=pinned) or (_LOCAL if netns.is_local(self.uplink, addr) else None)
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
            if netns.connected_to_self(s):  # it became local between the check and the dial
                _close(s)
                why = why or f"resolves to a private address ({addr}: {_LOCAL})"
                continue
            return s, (addr, port), False
        raise parse.Refused(why or f"{name} does not resolve", candidates[0][1] if candidates else "")

    def _resolve(self, att: Attachment, name: str, port: int) -> list[tuple[int, str, bool]]:
        """(family, address, pinned by egress_resolve) for a validated name."""
        pinned = att.policy.resolve.get(name)
        if pinned:
            return [(socket.AF_INET6 if ":" in pinned else socket.AF_INET, pinned, True)]
        try:
            infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
        except OSError as e:
            raise parse.Refused(f"{name} does not resolve: {e}") from None
        seen: list[tuple[int, str, bool]] = []
        for family, _, _, _, sa in infos:
            if (family, str(sa[0]), False) not in seen:
                seen.append((family, str(sa[0]), False))
        return seen

    def _refuse(
        self, att: Attachment, name: str, port: int, via: str, reason: str, address: str = ""
    ) -> None:
        """``name``: validated, or already escaped by the parser that refused it."""
        what = (f"{name}:{port}" if port else name) if name else f"port {port}" if port else "a request"
        probe = bool(name) and name in att.canary
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
            except parse.Refused as r:  # not a query we can answer: refused, unanswered
                self._dns_refused(att, "", r.reason)
                continue
            try:
                udp.sendto(reply, peer)
            except OSError:
                pass

    def _dns_answer(self, att: Attachment, packet: bytes) -> bytes:
        query = parse.dns_query(packet)
        try:
            name = query.name()
        except parse.Refused as r:
            self._dns_refused(att, r.host, r.reason)
            return parse.dns_answer(query, None, known=False)
        known = att.policy.knows_name(att.phase, name)
        if not known:
            self._dns_refused(att, name, "not in the allowlist")
        return parse.dns_answer(query, socket.inet_aton(att.gateway), known)

    def _dns_refused(self, att: Attachment, name: str, reason: str) -> None:
        probe = bool(name) and name in att.canary
        self._event(
            att,
            "dns",
            f"egress DNS refused {name or 'a query'}: {reason}"
            + (" (canary probe, as required)" if probe else ""),
            level="INFO" if probe else "WARNING",
            host=name,
            decision="refused",
            reason=reason,
            via="DNS",
            phase=att.phase,
            canary=probe,
        )

    # ----------------------------------------------------------------- events

    def _event(self, att: Attachment, name: str, line: str, level: str = "INFO", **data: Any) -> None:
        """Phase switches and summaries are always delivered; decisions up to
        ``MAX_DECISIONS`` per sandbox and kind, then counted for the summary at detach."""
        kind = data.get("decision")
        if kind in DECISIONS:
            with att.lock:
                n = att.logged.get(kind, 0)
                if n >= MAX_DECISIONS:
                    self._count(att, kind, data)
                    return
                att.logged[kind] = n + 1
        ev: wire.SpanEvent = {
            "run_id": self.run_id,
            "span_id": uuid.uuid4().hex[:16],
            "parent_span_id": "",
            "kind": "egress",
            "name": name,
            "event": "log",
            "ts": time.time(),
            "status": "",
            "data": {
                "line": printable(line),
                "level": level,
                "logger": "resoluto.egress",
                "node_id": att.node_id,
                **{k: printable(v) if isinstance(v, str) else v for k, v in data.items()},
            },
        }
        if att.sink is not None:
            try:
                att.sink(ev)
            except Exception as e:
                log.debug("egress event sink failed: %s", printable(str(e)))

    @staticmethod
    def _count(att: Attachment, kind: str, data: dict[str, Any]) -> None:
        """One decision past the cap (``att.lock`` held): counted by reason, an admission
        by its destination and its bytes."""
        if kind == "allowed":
            key = f"{data.get('host', '')}:{data.get('port', '')}"
            att.dropped_bytes[0] += int(data.get("bytes_up") or 0)
            att.dropped_bytes[1] += int(data.get("bytes_down") or 0)
        else:
            key = str(data.get("reason", ""))
        counts = att.dropped.setdefault(kind, {})
        key = key if key in counts or len(counts) < _REASONS else "other reasons"
        counts[key] = counts.get(key, 0) + 1

    def _summary(self, att: Attachment) -> None:
        with att.lock:
            dropped = {kind: {printable(k): n for k, n in c.items()} for kind, c in att.dropped.items()}
            up, down = att.dropped_bytes
        for kind in DECISIONS:
            counts = dropped.get(kind)
            if not counts:
                continue
            total = sum(counts.values())
            by_reason = "; ".join(f"{n} x {why}" for why, n in sorted(counts.items(), key=lambda kv: -kv[1]))
            extra = {"bytes_up": up, "bytes_down": down} if kind == "allowed" else {}
            self._event(
                att,
                "summary",
                f"egress: {total} more {_NOUNS[kind]} were not logged one by one (more than "
                f"{MAX_DECISIONS} for one sandbox)"
                + (f", {up} B up, {down} B down in all" if extra else "")
                + f": {by_reason}",
                level="INFO" if kind == "allowed" else "WARNING",
                summary_of=kind,
                dropped=total,
                dropped_by_reason=counts,
                **extra,
            )


def _forwards(policy: NodePolicy) -> str:
    if not policy.forward:
        return ""
    return "; forwards " + ", ".join(f"{n}:{p} -> {a}:{q}" for (n, p), (a, q) in policy.forward.items())


# --------------------------------------------------------------------------- bytes


@dataclass
class _Flow:
    """One relayed connection: bytes each way, and when either way last moved."""

    counts: list[int] = field(default_factory=lambda: [0, 0])
    last: float = field(default_factory=time.monotonic)

    def moved(self, idx: int, n: int) -> None:
        self.counts[idx] += n
        self.last = time.monotonic()


def _readable(src: socket.socket, dst: socket.socket, flow: _Flow) -> bool:
    """Wait, holding no buffer, until ``src`` has data or its end. False when neither
    direction moved for ``IDLE_TIMEOUT``: then both sockets are shut down, which ends the
    other direction's wait too."""
    poller = select.poll()
    poller.register(src, select.POLLIN)
    while True:
        left = flow.last + IDLE_TIMEOUT - time.monotonic()
        if left <= 0:
            _shutdown(src)
            _shutdown(dst)
            return False
        if poller.poll(max(1, int(left * 1000))):
            return True


def _pump(src: socket.socket, dst: socket.socket, flow: _Flow, idx: int) -> None:
    try:
        while _readable(src, dst, flow):
            data = src.recv(_BUF)
            if not data:
                break
            dst.sendall(data)
            flow.moved(idx, len(data))
    except OSError:
        pass
    finally:
        _shutdown_write(dst)


def _shutdown_write(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_WR)
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


def _read_head(s: socket.socket, first: bytes = b"") -> tuple[bytes, bytes] | None:
    """(head without its blank line, what followed it), or None if the client went away
    first; a head over the limit is :class:`parse.Refused`."""
    buf = bytearray(first)
    while (end := parse.head_end(buf)) < 0:
        try:
            chunk = s.recv(65536)
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
    return bytes(buf[: end - 4]), bytes(buf[end:])


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


def acquire(run_id: str) -> RunProxy:
    """The run's proxy, started by its first sandbox; pair every call with :func:`release`."""
    return registry.acquire(run_id, lambda run: RunProxy(run).start())


def release(run_id: str) -> None:
    """Stops the run's proxy when its last sandbox lets go."""
    registry.release(run_id)


def proxy_for(run_id: str) -> RunProxy | None:
    """The live proxy of ``run_id`` in this process, if any (drivers, tests, the worker)."""
    found: RunProxy | None = registry.proxy_of(run_id)
    return found
