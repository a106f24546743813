"""Property tests of what the egress proxy reads from a sandbox: host names, request
heads and their bodies' framing, TLS ClientHellos, DNS queries — generated hostile input.

Invariants: a parser returns validated values or raises its own refusal, never anything
else; nothing is admitted that the allowlist does not name (the name matched is the name
the resolver gets, whole); what is logged is printable and reads back as what was sent.
The same parsers run inside the real proxy in tests/test_egress.py.
"""

from __future__ import annotations

import re
import struct

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from prefect_resoluto.egress import parse
from prefect_resoluto.egress.names import BadName, escape, host_name, printable
from prefect_resoluto.egress.policy import build_policy

PROPS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
POLICY = build_policy(["api.example.test", "*.wild.example.test", "git.example.test:8443"])
assert POLICY is not None
_LDH = re.compile(r"(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*")

# Pieces an attacker mixes into names: allowlisted suffixes, separators, NUL, CR/LF, bytes
# resolvers and loggers treat specially, non-ASCII look-alikes.
_HOSTILE = st.sampled_from(
    [
        "api.example.test",
        ".wild.example.test",
        "evil.example",
        "\x00",
        "\n",
        "\r\n",
        "%00",
        "%2e",
        "@",
        ":",
        ":443",
        "[",
        "]",
        "..",
        ".",
        "*",
        "-",
        "_",
        " ",
        "\t",
        "\\",
        "xn--",
        "\u2028",
        "\u0430pi",  # Cyrillic a
        "127.0.0.1",
        "0x7f.1",
        "::1",
        "A" * 64,
    ]
)
_LABELS = st.lists(
    st.text(alphabet="abcxyz019", min_size=1, max_size=8)
    | st.text(alphabet="abz09-", min_size=1, max_size=8),
    min_size=1,
    max_size=3,
)
NAMES = st.one_of(
    st.lists(_HOSTILE, min_size=1, max_size=6).map("".join),
    st.text(max_size=40),
    # Names that look valid, often under the allowlisted wildcard.
    st.tuples(_LABELS, st.sampled_from(["", ".wild.example.test", ".example.test", "."])).map(
        lambda t: ".".join(t[0]) + t[1]
    ),
)


def _admitted_by_allowlist(name: str, port: int) -> bool:
    assert POLICY is not None
    return POLICY.allows("workload", name, port)


def _assert_clean_admission(name: str, port: int) -> None:
    """What may be matched and resolved: a whole, validated LDH name (or an address,
    which no allowlist names), and when the allowlist admits it, a name it spells."""
    assert "\x00" not in name and name == name.strip() and name.isascii()
    if _admitted_by_allowlist(name, port):
        assert _LDH.fullmatch(name), name
        assert (
            name == "api.example.test"
            or name.endswith(".wild.example.test")
            or (name == "git.example.test" and port == 8443)
        )
        assert host_name(name) == name


# --------------------------------------------------------------------------- names


@PROPS
@given(st.one_of(NAMES, st.binary(max_size=60)))
@example("evil.example\x00.wild.example.test")
@example(b"evil\n[WARNING resoluto.egress] egress allowed x.wild.example.test")
def test_a_name_is_validated_whole_or_refused(raw: str | bytes) -> None:
    try:
        name = host_name(raw)
    except BadName as e:
        assert printable(e.reason) == e.reason
        return
    assert _LDH.fullmatch(name), name
    text = raw.decode("ascii") if isinstance(raw, bytes) else raw
    assert name == text.lower().removesuffix(".")  # nothing cut off, nothing added


@PROPS
@given(st.one_of(st.text(max_size=60), st.binary(max_size=60).map(lambda b: b.decode("latin-1"))))
def test_escaped_names_are_printable_one_line_and_read_back(text: str) -> None:
    shown = escape(text, limit=1000)
    assert all(" " <= ch <= "~" for ch in shown)
    assert shown.encode("ascii").decode("unicode_escape") == text
    assert all(" " <= ch <= "~" for ch in printable(text))


# --------------------------------------------------------------------------- HTTP heads


def _head(method: str, target: str, headers: list[tuple[str, str]], version: str = "HTTP/1.1") -> bytes:
    lines = [f"{method} {target} {version}", *(f"{k}: {v}" for k, v in headers)]
    return "\r\n".join(lines).encode("utf-8", "surrogateescape")


@st.composite
def _heads(draw: st.DrawFn) -> bytes:
    """Mostly well-formed heads whose names and headers an attacker chose."""
    name = draw(NAMES)
    method = draw(st.sampled_from(["GET", "GET", "GET", "POST", "CONNECT", "CONNECT", "G\x00ET", "get"]))
    target = draw(
        st.sampled_from(
            [
                f"http://{name}/x",
                f"http://{name}:80/x",
                f"HTTP://{name}",
                f"{name}:443",
                name,
                "/",
                f"/{name}",
            ]
        )
    )
    host = draw(st.one_of(st.sampled_from([name, f"{name}:80", f"{name}:443"]), NAMES))
    headers = [("Host", host)] if draw(st.integers(0, 3)) else []
    headers += draw(
        st.lists(
            st.tuples(
                st.sampled_from(["Host", "HOST ", "Content-Length", "Transfer-Encoding", "Connection", "X"]),
                st.one_of(NAMES, st.sampled_from(["chunked", "5", "-1", "0x10", "5, 5", "keep-alive"])),
            ),
            max_size=2,
        )
    )
    version = draw(st.sampled_from(["HTTP/1.1"] * 6 + ["HTTP/1.0", "HTTP/2", "HTTP/1.1\x00"]))
    return _head(method, target, headers, version)


HEADS = st.one_of(_heads(), _heads(), st.binary(max_size=300))


@PROPS
@given(HEADS)
@example(_head("GET", "http://api.example.test/front", [("Host", "other.example.test")]))
@example(_head("GET", "http://api.example.test/", [("Host", "api.example.test"), ("Host", "other.test")]))
@example(_head("CONNECT", "evil.example\x00.wild.example.test:443", []))
@example(_head("GET", "http://user@api.example.test@evil.example/", []))
def test_proxy_requests_admit_only_what_the_allowlist_names(raw: bytes) -> None:
    try:
        req = parse.proxy_request(raw, "/.resoluto/egress/phase/")
    except parse.Refused as e:
        assert printable(e.reason) == e.reason and printable(e.host) == e.host
        return
    if req.kind == "phase":
        return
    _assert_clean_admission(req.host, req.port)
    if req.kind == "http":
        # What goes upstream names the admitted host once, and carries one request.
        sent = parse.parse_head(req.forwarded[:-4])
        hosts = [v for k, v in sent.headers if k.lower() == "host"]
        assert len(hosts) == 1 and parse.authority(hosts[0], 80) == (req.host, req.port)
        assert [v for k, v in sent.headers if k.lower() == "connection"] == ["close"]
        assert sent.target.startswith("/")


@PROPS
@given(HEADS, st.sampled_from([80, 443, 8443]))
@example(_head("GET", "/", [("Host", "a.wild.example.test\x00.evil")]), 80)
@example(_head("GET", "/", [("Host", "api.example.test:8443")]), 80)
def test_transparent_requests_admit_only_what_the_allowlist_names(raw: bytes, port: int) -> None:
    try:
        req = parse.transparent_request(raw, port)
    except parse.Refused as e:
        assert printable(e.reason) == e.reason
        return
    assert req.port == port
    _assert_clean_admission(req.host, req.port)
    sent = parse.parse_head(req.forwarded[:-4])
    assert [parse.authority(v, port) for k, v in sent.headers if k.lower() == "host"] == [(req.host, port)]


@PROPS
@given(st.binary(max_size=400), st.lists(st.integers(1, 50), max_size=20))
def test_body_framing_on_hostile_bytes_refuses_or_counts(data: bytes, cuts: list[int]) -> None:
    for te in ("chunked", None):
        head = parse.RequestHead("POST", "/", "HTTP/1.1", (("Transfer-Encoding", te),) if te else ())
        body = parse.Body(head)
        try:
            taken = _feed(body, data, cuts)
        except parse.Refused as e:
            assert printable(e.reason) == e.reason
            continue
        assert 0 <= taken <= len(data)


@PROPS
@given(
    st.lists(st.binary(min_size=1, max_size=40), max_size=5),
    st.binary(max_size=60),
    st.lists(st.integers(1, 30), max_size=30),
)
def test_a_chunked_body_ends_where_it_ends_however_it_arrives(
    chunks: list[bytes], after: bytes, cuts: list[int]
) -> None:
    """What follows a request's body (a pipelined second request) is never part of it."""
    body_bytes = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\nTrailer: x\r\n\r\n"
    head = parse.RequestHead("POST", "/", "HTTP/1.1", (("Transfer-Encoding", "chunked"),))
    body = parse.Body(head)
    assert _feed(body, body_bytes + after, cuts) == len(body_bytes) and body.done
    sized = parse.Body(parse.RequestHead("POST", "/", "HTTP/1.1", (("Content-Length", str(len(after))),)))
    assert _feed(sized, after + b"GET http://other/ HTTP/1.1\r\n\r\n", cuts) == len(after)


def _feed(body: parse.Body, data: bytes, cuts: list[int]) -> int:
    taken, i = 0, 0
    for n in [*cuts, len(data)]:
        piece = data[i : i + n]
        i += len(piece)
        got = body.feed(piece)
        taken += got
        if got < len(piece) or body.done:
            break
    return taken


# --------------------------------------------------------------------------- TLS


def client_hello(names: list[bytes], *, extra_ext: bytes = b"") -> bytes:
    entries = b"".join(b"\x00" + struct.pack("!H", len(n)) + n for n in names)
    sni = struct.pack("!H", len(entries)) + entries
    exts = struct.pack("!HH", 0, len(sni)) + sni + extra_ext
    body = (
        b"\x03\x03"
        + b"\x11" * 32
        + b"\x00"
        + struct.pack("!H", 2)
        + b"\x13\x01"
        + b"\x01\x00"
        + struct.pack("!H", len(exts))
        + exts
    )
    hs = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + struct.pack("!H", len(hs)) + hs


@PROPS
@given(
    st.lists(
        st.one_of(NAMES.map(lambda n: n.encode("utf-8", "surrogateescape")), st.binary(max_size=30)),
        max_size=3,
    )
)
@example([b"evil.example\x00.wild.example.test"])
@example([b"api.example.test", b"evil.example"])
def test_a_client_hello_yields_one_validated_name_or_a_refusal(names: list[bytes]) -> None:
    try:
        name = parse.client_hello_sni(client_hello(names))
    except parse.Refused as e:
        assert printable(e.reason) == e.reason and printable(e.host) == e.host
        return
    assert len(names) == 1 and name == names[0].decode("ascii").lower().removesuffix(".")
    _assert_clean_admission(name, 443)


@PROPS
@given(st.binary(max_size=300), st.integers(0, 299), st.binary(max_size=8))
def test_a_mangled_client_hello_never_breaks_the_parser(data: bytes, at: int, patch: bytes) -> None:
    hello = bytearray(client_hello([b"api.example.test"]))
    hello[at : at + len(patch)] = patch
    for record in (bytes(hello), data, b"\x16\x03\x01" + data):
        try:
            name = parse.client_hello_sni(record)
        except parse.Refused:
            continue
        _assert_clean_admission(name, 443)


# --------------------------------------------------------------------------- DNS


def dns(labels: list[bytes], qid: int = 7, qtype: int = 1) -> bytes:
    q = b"".join(bytes([len(label)]) + label for label in labels) + b"\x00"
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + q + struct.pack("!HH", qtype, 1)


@PROPS
@given(st.lists(st.binary(min_size=1, max_size=63), max_size=5))
@example([b"evil\x00", b"wild", b"example", b"test"])
@example([b"x.wild.example", b"test"])
@example([b"a\nforged", b"wild", b"example", b"test"])
def test_a_dns_question_is_a_validated_name_or_refused(labels: list[bytes]) -> None:
    query = parse.dns_query(dns(labels))
    assert query.labels == tuple(labels)
    try:
        name = query.name()
    except parse.Refused as e:
        assert printable(e.reason) == e.reason and printable(e.host) == e.host
        answer = parse.dns_answer(query, None, known=False)
        assert answer[3] & 0x0F == 3  # NXDOMAIN
        return
    assert name.encode() == b".".join(labels).lower()
    _assert_clean_admission(name, 443)


@PROPS
@given(st.binary(max_size=300))
@example(dns([b"a"])[:-3])
@example(b"\x00\x07\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\xc0\x0c\x00\x01\x00\x01")
def test_any_packet_is_a_query_or_refused(packet: bytes) -> None:
    try:
        query = parse.dns_query(packet)
    except parse.Refused as e:
        assert printable(e.reason) == e.reason
        return
    try:
        query.name()
    except parse.Refused:
        pass
    assert parse.dns_answer(query, b"\xc6\x12\x00\x02", known=True)[:2] == packet[:2]
