"""What a sandbox sends the egress proxy, parsed as attacker input: HTTP request heads
and their bodies' framing, the server name of a TLS ClientHello, DNS questions.

Each function returns validated values or raises :class:`Refused`, whose ``reason`` is
escaped and fit to log; nothing else escapes a parser (the property tests in
``tests/test_egress_parse.py`` hold them to that). Anything ambiguous is refused rather
than interpreted: a duplicated ``Host``, ``Content-Length`` with ``Transfer-Encoding``,
an obsolete folded header, a ClientHello split across records, two server names.

Pure functions; nothing here opens a socket.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from .names import BadName, escape, host_name, is_ip_literal

#: The most a request head may take; a bigger one is refused, not buffered.
HEAD_LIMIT = 64 * 1024
MAX_HEADERS = 200
#: The largest TLS record (2^14 plaintext plus what TLS 1.2 allows for expansion).
TLS_RECORD_LIMIT = 16384 + 2048
_CHUNK_LINE_LIMIT = 4096

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(r"HTTP/1\.[01]")
_PORT = re.compile(r"[0-9]{1,5}")
# A header value: visible ASCII, space, tab and obs-text; never a control character.
_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
# A request target as split from the request line; what is in it is judged by its form
# (an authority's host by :func:`host_name`, a path by _PATH), so a bad byte in a name is
# refused as a bad name.
_TARGET = re.compile(r"[^ \r\n]+")
_PATH = re.compile(r"[\x21-\x7e]*")
_HOP_BY_HOP = frozenset(
    {"connection", "proxy-connection", "proxy-authorization", "keep-alive", "upgrade", "te", "trailer"}
)


class Refused(Exception):
    """The proxy will not relay this; ``reason`` is escaped and fit to log."""

    def __init__(self, reason: str, address: str = "", host: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.address = address
        #: The (escaped) name the refused request named, when there was one.
        self.host = host


def name_or_address(raw: str) -> str:
    """A validated host name, or an IP literal (the allowlist names no address, so an
    address is refused by the policy, not here)."""
    if raw.startswith("[") and raw.endswith("]") and is_ip_literal(raw[1:-1]) and ":" in raw:
        return raw[1:-1].lower()
    if is_ip_literal(raw) and ":" not in raw:
        return raw
    try:
        return host_name(raw)
    except BadName as e:
        raise Refused(e.reason, host=escape(raw)) from None


def authority(text: str, default_port: int) -> tuple[str, int]:
    """``name``, ``name:port``, ``a.b.c.d:port`` or ``[v6]:port`` -> (host, port)."""
    if text.startswith("["):
        end = text.find("]")
        host, tail = text[: end + 1], text[end + 1 :]
        if end < 0 or (tail and not tail.startswith(":")):
            raise Refused(f"not a host[:port]: {escape(text)}", host=escape(text))
        port_text = tail[1:] if tail else None
    else:
        host, sep, after = text.rpartition(":")
        host, port_text = (host, after) if sep else (text, None)
    if "@" in host:
        raise Refused(f"user information in an authority is not relayed: {escape(text)}", host=escape(text))
    name = name_or_address(host)
    return name, default_port if port_text is None else port(port_text, text)


def port(text: str, context: str = "") -> int:
    if not _PORT.fullmatch(text) or not 1 <= int(text) <= 65535:
        raise Refused(f"not a port 1-65535: {escape(context or text)}", host=escape(context or text))
    return int(text)


# --------------------------------------------------------------------------- HTTP


@dataclass(frozen=True)
class RequestHead:
    method: str
    target: str
    version: str
    #: In order, names as sent; every value checked free of control characters.
    headers: tuple[tuple[str, str], ...]

    def get(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None


def head_end(buf: bytes | bytearray) -> int:
    """The length of the head at the start of ``buf`` including its blank line, or -1
    while incomplete; :class:`Refused` once it is over the limit without ending."""
    end = buf.find(b"\r\n\r\n", 0, HEAD_LIMIT + 4)
    if end < 0:
        if len(buf) > HEAD_LIMIT:
            raise Refused(f"a request head longer than {HEAD_LIMIT} bytes")
        return -1
    return end + 4


def parse_head(head: bytes) -> RequestHead:
    """A request head (without its blank line), strictly: ``METHOD SP target SP
    HTTP/1.x``, then ``Name: value`` lines; a bare CR or LF, an obsolete line fold, a
    space before the colon, a control character or a second Host, Content-Length or
    Transfer-Encoding is refused."""
    if len(head) > HEAD_LIMIT:
        raise Refused(f"a request head longer than {HEAD_LIMIT} bytes")
    text = head.decode("latin-1")
    lines = text.split("\r\n")
    bare = next((line for line in lines if "\r" in line or "\n" in line), None)
    if bare is not None:
        raise Refused(f"a bare CR or LF in the request head: {escape(bare)}")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not _TARGET.fullmatch(parts[1]):
        raise Refused(f"not an HTTP request line: {escape(lines[0])}")
    if not _VERSION.fullmatch(parts[2]):
        raise Refused(f"not HTTP/1.0 or HTTP/1.1: {escape(parts[2])}")
    if len(lines) - 1 > MAX_HEADERS:
        raise Refused(f"more than {MAX_HEADERS} header lines")
    headers: list[tuple[str, str]] = []
    seen: set[str] = set()
    for line in lines[1:]:
        if line[:1] in (" ", "\t"):
            raise Refused("an obsolete folded header line")
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name):
            raise Refused(f"not a header line: {escape(line)}")
        key = name.lower()
        if key == "host":
            authority(value.strip(" \t"), 80)  # a bad byte in it is a bad name, and says so
        elif not _VALUE.fullmatch(value):
            raise Refused(f"a control character in header {escape(name)}")
        if key in ("host", "content-length", "transfer-encoding") and key in seen:
            raise Refused(f"more than one {name} header")
        seen.add(key)
        headers.append((name, value.strip(" \t")))
    return RequestHead(parts[0], parts[1], parts[2], tuple(headers))


def absolute_target(target: str) -> tuple[str, int, str]:
    """``http://authority/path?query`` -> (host, port, origin-form path)."""
    if target[:7].lower() != "http://":
        raise Refused("only CONNECT and absolute-form http:// requests are proxied")
    rest = target[7:]
    cut = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    host, port_n = authority(rest[:cut], 80)
    path = _path(rest[cut:].partition("#")[0])
    if not path.startswith("/"):
        path = "/" + path
    return host, port_n, path


def _path(path: str) -> str:
    if not _PATH.fullmatch(path):
        raise Refused(f"a control or non-ASCII character in the request target: {escape(path)}")
    return path


def host_header(head: RequestHead, default_port: int) -> tuple[str, int] | None:
    value = head.get("host")
    return None if value is None else authority(value, default_port)


def admitted(head: RequestHead, host: str, port_n: int, default_port: int) -> None:
    """The request's Host header must name the host (and port) being dialled."""
    named = host_header(head, default_port)
    if named is not None and named != (host, port_n):
        raise Refused(
            f"the Host header names {_hp(*named)}, the request is for {_hp(host, port_n)}",
            host=escape(named[0]),
        )


def _hp(host: str, port_n: int) -> str:
    return f"[{host}]:{port_n}" if ":" in host else f"{host}:{port_n}"


def forwarded_head(head: RequestHead, target: str, host: str, port_n: int, default_port: int) -> bytes:
    """The head as relayed: origin-form, hop-by-hop headers dropped (they are about the
    connection to the proxy), the Host header kept or added, and ``Connection: close``:
    the connection carries this one request."""
    kept = [f"{k}: {v}" for k, v in head.headers if k.lower() not in _HOP_BY_HOP]
    if head.get("host") is None:
        kept.insert(0, f"Host: {host if port_n == default_port else _hp(host, port_n)}")
    lines = [f"{head.method} {target} {head.version}", *kept, "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


@dataclass(frozen=True)
class Request:
    """What one request head asks the proxy for: ``kind`` is ``"phase"`` (the guest's
    phase switch, ``host`` its target), ``"connect"`` (a tunnel to ``host:port``) or
    ``"http"`` (one request to ``host:port``, relayed as ``forwarded``)."""

    kind: str
    host: str
    port: int
    head: RequestHead
    forwarded: bytes = b""


def proxy_request(raw: bytes, phase_path: str) -> Request:
    """A head sent to the proxy's own port. The ``CONNECT`` authority is the admission
    (that head goes nowhere); an absolute-form URI is, and its Host header must agree."""
    head = parse_head(raw)
    if head.method == "POST" and head.target.startswith(phase_path):
        return Request("phase", head.target[len(phase_path) :], 0, head)
    if head.method == "CONNECT":
        host, port_n = authority(head.target, 443)
        return Request("connect", host, port_n, head)
    host, port_n, path = absolute_target(head.target)
    admitted(head, host, port_n, 80)
    Body(head)  # ambiguous framing is refused before anything is dialled
    return Request("http", host, port_n, head, forwarded_head(head, path, host, port_n, 80))


def transparent_request(raw: bytes, port_n: int) -> Request:
    """A plain HTTP head that arrived on a transparent port: its Host header is the
    admission, on the port it arrived on."""
    head = parse_head(raw)
    named = host_header(head, port_n)
    if named is None:
        raise Refused("neither TLS with SNI nor HTTP with a Host header")
    host, host_port = named
    if host_port != port_n:
        raise Refused(
            f"the Host header names port {host_port}, the connection is to port {port_n}", host=host
        )
    target = head.target
    if target[:7].lower() == "http://":
        a_host, a_port, target = absolute_target(target)
        admitted(head, a_host, a_port, port_n)
    elif not target.startswith("/") or not _PATH.fullmatch(target):
        raise Refused(f"not an origin-form request target: {escape(target)}", host=host)
    Body(head)
    return Request("http", host, port_n, head, forwarded_head(head, target, host, port_n, port_n))


class Body:
    """Where a request's body ends, fed the bytes after its head as they arrive: by
    ``Content-Length``, or by walking ``chunked`` framing, else empty. What comes after
    the body is not this request's."""

    def __init__(self, head: RequestHead) -> None:
        te = head.get("transfer-encoding")
        cl = head.get("content-length")
        self._chunked = False
        self._left = 0
        if te is not None:
            if cl is not None:
                raise Refused("both Transfer-Encoding and Content-Length")
            if te.lower() != "chunked" or head.version != "HTTP/1.1":
                raise Refused(f"Transfer-Encoding {escape(te)} is not relayed (only chunked, HTTP/1.1)")
            self._chunked = True
            self._state = "size"
            self._line = bytearray()
        elif cl is not None:
            if not cl.isdigit() or not cl.isascii() or len(cl) > 18:
                raise Refused(f"not a Content-Length: {escape(cl)}")
            self._left = int(cl)
        self.done = not self._chunked and self._left == 0

    def feed(self, data: bytes | bytearray | memoryview) -> int:
        """How many bytes at the start of ``data`` belong to the body."""
        if self.done:
            return 0
        if not self._chunked:
            n = min(self._left, len(data))
            self._left -= n
            self.done = self._left == 0
            return n
        i = 0
        view = memoryview(data)
        while i < len(view) and not self.done:
            if self._state == "data":
                n = min(self._left, len(view) - i)
                i += n
                self._left -= n
                if self._left == 0:
                    self._state = "crlf"
                continue
            j = bytes(view[i : i + _CHUNK_LINE_LIMIT + 2]).find(b"\n")
            if j < 0:
                self._line += view[i:]
                i = len(view)
                if len(self._line) > _CHUNK_LINE_LIMIT:
                    raise Refused("a chunk line longer than 4096 bytes")
                break
            self._line += view[i : i + j + 1]
            i += j + 1
            line = bytes(self._line)
            self._line = bytearray()
            if len(line) > _CHUNK_LINE_LIMIT or not line.endswith(b"\r\n"):
                raise Refused("a malformed chunk line")
            self._on_line(line[:-2])
        return i

    def _on_line(self, line: bytes) -> None:
        if self._state == "crlf":
            if line:
                raise Refused("a chunk not followed by CRLF")
            self._state = "size"
        elif self._state == "size":
            size = line.split(b";", 1)[0].strip(b" \t")
            if not size or len(size) > 15 or not all(c in b"0123456789abcdefABCDEF" for c in size):
                raise Refused(f"not a chunk size: {escape(line)}")
            self._left = int(size, 16)
            self._state = "data" if self._left else "trailer"
        elif not line:  # the blank line after the trailers ends the body
            self.done = True
        elif line[:1] in (b" ", b"\t") or b":" not in line or any(c < 0x20 and c != 9 for c in line):
            raise Refused("a malformed trailer line")


# --------------------------------------------------------------------------- TLS


def tls_record_length(header: bytes) -> int:
    """The payload length of the TLS handshake record whose 5-byte header this is."""
    if len(header) < 5 or header[0] != 0x16 or header[1] != 3:
        raise Refused("not a TLS handshake record")
    length = int(struct.unpack("!H", header[3:5])[0])
    if not 4 <= length <= TLS_RECORD_LIMIT:
        raise Refused(f"a TLS record of {length} bytes")
    return length


def client_hello_sni(record: bytes) -> str:
    """The validated server name of the ClientHello in one TLS record (header included).
    No server name, two of them, a ClientHello that does not fit its record, or any
    length that does not add up is refused."""
    length = tls_record_length(record[:5])
    payload = record[5:]
    if len(payload) != length:
        raise Refused("a truncated TLS record")
    r = _Reader(payload)
    if r.u8() != 1:
        raise Refused("the TLS record is not a ClientHello")
    body = r.sub(r.u24(), "the ClientHello does not fit in its record (split across records)")
    if not r.empty():
        raise Refused("more than one handshake message in the first TLS record")
    body.take(2 + 32)  # legacy_version, random
    body.sub(body.u8(), "")  # session id
    suites = body.u16()
    if suites % 2 or not suites:
        raise Refused("malformed cipher suites in the ClientHello")
    body.take(suites)
    body.sub(body.u8(), "")  # compression methods
    if body.empty():
        raise Refused("no server name (SNI) in the TLS handshake")
    exts = body.sub(body.u16(), "")
    if not body.empty():
        raise Refused("bytes after the ClientHello's extensions")
    seen: set[int] = set()
    sni: str | None = None
    while not exts.empty():
        etype = exts.u16()
        data = exts.sub(exts.u16(), "")
        if etype in seen:
            raise Refused(f"TLS extension {etype} twice in the ClientHello")
        seen.add(etype)
        if etype == 0:
            sni = _server_name(data)
    if sni is None:
        raise Refused("no server name (SNI) in the TLS handshake")
    return sni


def _server_name(data: _Reader) -> str:
    names = data.sub(data.u16(), "")
    if not data.empty():
        raise Refused("bytes after the server name list")
    found: list[bytes] = []
    while not names.empty():
        kind = names.u8()
        value = names.take(names.u16())
        if kind == 0:
            found.append(value)
    if len(found) != 1:
        raise Refused(f"{len(found)} host names in the TLS server name extension (one is required)")
    try:
        return host_name(found[0])
    except BadName as e:
        raise Refused(e.reason, host=escape(found[0])) from None


class _Reader:
    """Bounds-checked reads; running past the end is a :class:`Refused`."""

    def __init__(self, data: bytes, start: int = 0, end: int | None = None) -> None:
        self.data, self.i, self.end = data, start, len(data) if end is None else end

    def empty(self) -> bool:
        return self.i >= self.end

    def take(self, n: int) -> bytes:
        if n < 0 or self.i + n > self.end:
            raise Refused("a length in the TLS handshake runs past its end")
        out = self.data[self.i : self.i + n]
        self.i += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int(struct.unpack("!H", self.take(2))[0])

    def u24(self) -> int:
        return int.from_bytes(self.take(3), "big")

    def sub(self, n: int, why: str) -> _Reader:
        if n < 0 or self.i + n > self.end:
            raise Refused(why or "a length in the TLS handshake runs past its end")
        out = _Reader(self.data, self.i, self.i + n)
        self.i += n
        return out


# --------------------------------------------------------------------------- DNS


@dataclass(frozen=True)
class DnsQuery:
    qid: int
    flags: int
    #: The question's labels as sent; see :meth:`name`.
    labels: tuple[bytes, ...]
    qtype: int
    qclass: int
    #: The question section as sent, echoed in the answer.
    question: bytes

    def name(self) -> str:
        """The validated name asked for, else :class:`Refused` (a label holding a dot
        or any byte outside LDH is not a name, whatever joining the labels would say)."""
        raw = b".".join(self.labels)
        if any(b"." in label for label in self.labels):
            raise Refused(f"not a host name (a label holds a '.'): {escape(raw)}", host=escape(raw))
        try:
            return host_name(raw + b".")
        except BadName as e:
            raise Refused(e.reason, host=escape(raw)) from None


def dns_query(packet: bytes) -> DnsQuery:
    """One standard query with exactly one question, no compression in it."""
    if len(packet) < 12:
        raise Refused("a DNS packet shorter than its header")
    qid, flags, qd, an, ns, _ = struct.unpack("!HHHHHH", packet[:12])
    if flags & 0x8000 or (flags >> 11) & 0xF or qd != 1 or an or ns:
        raise Refused("not a standard DNS query with one question")
    i, labels = 12, []
    while True:
        if i >= len(packet):
            raise Refused("a DNS question that runs past the packet")
        n = packet[i]
        if n == 0:
            break
        if n > 63:
            raise Refused("a compressed or oversized label in a DNS question")
        labels.append(packet[i + 1 : i + 1 + n])
        i += 1 + n
        if i > len(packet) or i - 12 > 255:
            raise Refused("a DNS question that runs past the packet")
    if i + 5 > len(packet):
        raise Refused("a DNS question without its type and class")
    qtype, qclass = struct.unpack("!HH", packet[i + 1 : i + 5])
    return DnsQuery(qid, flags, tuple(labels), qtype, qclass, packet[12 : i + 5])


def dns_answer(query: DnsQuery, address: bytes | None, known: bool) -> bytes:
    """NXDOMAIN for a name the sandbox may not reach; else an authoritative answer, with
    ``address`` (4 bytes) for an A question and no records for any other type."""
    answers = b""
    if known and address is not None and query.qtype == 1 and query.qclass == 1:
        answers = struct.pack("!HHHIH", 0xC00C, 1, 1, 5, 4) + address
    rcode = 0 if known else 3
    flags = 0x8000 | 0x0400 * known | (query.flags & 0x0100) | 0x0080 | rcode
    return struct.pack("!HHHHHH", query.qid, flags, 1, 1 if answers else 0, 0, 0) + query.question + answers
