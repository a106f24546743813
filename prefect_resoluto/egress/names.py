"""Host names as the egress proxy accepts them, and names made safe to log.

Every name a sandbox sends (a ``CONNECT`` authority, an absolute-form URI, a ``Host``
header, a TLS server name, a DNS question) is hostile. It is validated here *before* it
is matched against an allowlist or handed to the resolver: a name is LDH (letters,
digits, hyphen) labels of 1-63 characters, none starting or ending with a hyphen, at most
253 characters, ASCII only (an internationalised name must arrive as its A-label,
``xn--...``, as every IDNA-aware client sends it), and not an IPv4 address in any of the
forms ``inet_aton`` reads. Anything else is refused with :class:`BadName`, whose reason
is already escaped. Matching, resolution and logging only ever see a validated name, so a
NUL byte cannot cut a name short in ``getaddrinfo`` and a newline cannot start a forged
log line.

Pure functions; nothing here opens a socket.
"""

from __future__ import annotations

import ipaddress
import re
import socket

MAX_NAME = 253
MAX_LABEL = 63
#: Bytes of a hostile value shown in a reason (the rest is elided).
SHOWN = 80

_LDH = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")


class BadName(ValueError):
    """A name that is not a host name; ``reason`` says why (it does not repeat the name,
    which the caller shows escaped) and is fit to log."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def escape(value: str | bytes, limit: int = SHOWN) -> str:
    """``value`` as printable ASCII: a backslash, any control, non-ASCII or separator
    character becomes an escape (``\\n``, ``\\x00``, ``\\u2028``), so what is logged is
    one line and reads back as exactly what was sent. Long values are cut at ``limit``."""
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    cut = len(text) > limit
    out = []
    for ch in text[:limit]:
        if ch == "\\":
            out.append("\\\\")
        elif " " <= ch <= "~":
            out.append(ch)
        elif ch in "\n\r\t":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[ch])
        elif ord(ch) <= 0xFF:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return "".join(out) + (f"...({len(text)} characters)" if cut else "")


def printable(text: str) -> str:
    """``text`` with every character outside printable ASCII escaped, backslashes left as
    they are: the last guard on a log line whose names were escaped with :func:`escape`."""
    if all(" " <= ch <= "~" for ch in text):
        return text
    return "".join(ch if " " <= ch <= "~" else escape(ch) for ch in text)


def is_ip_literal(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def host_name(raw: str | bytes, *, wildcard: bool = False) -> str:
    """The validated, case-folded host name in ``raw`` (one trailing dot, the root, is
    dropped), else :class:`BadName`. With ``wildcard`` a leading ``*.`` is kept (allowlist
    entries only; a sandbox never gets to send one)."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            raise BadName(_bad("not ASCII (send an internationalised name as its xn-- A-label)")) from None
    else:
        text = raw
    if text.endswith(".") and not text.endswith(".."):
        text = text[:-1]
    if not text:
        raise BadName("not a host name: empty")
    for ch in text:
        if ord(ch) > 0x7F:
            raise BadName(_bad("not ASCII (send an internationalised name as its xn-- A-label)"))
        if not ("!" <= ch <= "~"):
            raise BadName(_bad(f"the character {escape(ch)} is not allowed in a host name"))
    name = text.lower()
    if len(name) > MAX_NAME:
        raise BadName(_bad(f"longer than {MAX_NAME} characters"))
    labels = name.split(".")
    if wildcard and labels[0] == "*":
        labels = labels[1:]
        if not labels:
            raise BadName(_bad("a wildcard needs a name after '*.'"))
    for label in labels:
        if not label:
            raise BadName(_bad("an empty label"))
        if len(label) > MAX_LABEL:
            raise BadName(_bad(f"a label longer than {MAX_LABEL} characters"))
        if not _LDH.fullmatch(label):
            bad = next((c for c in label if not (c.isascii() and (c.isalnum() or c == "-"))), "")
            why = (
                f"the character {escape(bad)} is not allowed in a host name"
                if bad
                else "a label starts or ends with '-'"
            )
            raise BadName(_bad(why))
        if label.startswith("xn--") and not _punycode_ok(label[4:]):
            raise BadName(_bad(f"{label} is not a valid A-label (punycode)"))
    if labels[-1].isdigit() or _inet_aton(name):
        raise BadName(_bad("an IPv4 address in a numeric form, not a name"))
    return name


def _bad(why: str) -> str:
    return f"not a host name ({why})"


def _punycode_ok(body: str) -> bool:
    try:
        decoded = body.encode("ascii").decode("punycode")
    except (UnicodeError, ValueError):
        return False
    return bool(decoded) and not decoded.isascii()


def _inet_aton(name: str) -> bool:
    # glibc's getaddrinfo takes "0x7f.1" or "2130706433" for 127.0.0.1: never a name.
    try:
        socket.inet_aton(name)
    except OSError:
        return False
    return True
