"""Secret redaction for everything the guest ships (and, with the same class, everything
the host logs: it re-redacts what it is given).

Two sources of secrets: environment variables whose *names* look secret, and the
variables the host declares secret (``RESOLUTO_SECRET_ENV``, a JSON list of names).
Their *values* are replaced by ``***`` wherever they appear in a log line or in span
data; span data keys that look secret have their value replaced outright.

A value is matched in the shapes a program commonly prints it in, not only as is:

* each line of a multi-line value (a PEM key): output is split into lines before it is
  matched, so the whole value never appears in one line;
* JSON-escaped (``json.dumps(v)[1:-1]``, ASCII-escaped or not) and ``repr``-escaped;
* URL-encoded (``quote`` with and without ``/`` safe, ``quote_plus``);
* base64, standard and URL-safe alphabets, padded or not, and inside a longer base64
  stream: there the value's characters depend on its offset modulo 3, so the
  characters determined by the value alone are matched for each of the three offsets.

The same shapes are applied to each line of a multi-line value. A shape (or a line)
shorter than :data:`MIN_SECRET_LEN` is not matched: it would mask ordinary text. A
*declared* secret that short cannot be redacted safely and is refused before anything
runs (:func:`too_short`); a value found only by its variable's name is not a declared
secret and is left alone when that short (see docs/security.md).
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any, Iterable, List, Mapping, Optional, Set
from urllib.parse import quote, quote_plus

MASK = "***"
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|CREDENTIAL|PRIVATE|API_?KEY|KEY", re.I)
_AWS_CREDENTIAL_NAMES = frozenset({"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"})
#: Shorter than this, a value (or a line or shape of one) would mask ordinary text ("1", "on").
MIN_SECRET_LEN = 4
_MIN_SECRET_LEN = MIN_SECRET_LEN  # the old private name


def name_looks_secret(name: str) -> bool:
    return name.upper() in _AWS_CREDENTIAL_NAMES or bool(_SECRET_NAME.search(name))


def too_short(secrets: Mapping[str, str]) -> List[str]:
    """Names of declared secrets that are non-empty but too short to redact safely."""
    return sorted(k for k, v in secrets.items() if isinstance(v, str) and 0 < len(v) < MIN_SECRET_LEN)


def too_short_message(names: Iterable[str], setting: str = "secret_env") -> str:
    listed = ", ".join(repr(n) for n in names)
    return (
        f"{setting} {listed}: a secret value shorter than {MIN_SECRET_LEN} characters cannot be "
        "redacted safely (masking it would mask ordinary text, not masking it would leak it); "
        "use a longer value, or pass it as a plain variable (env) if it is not a secret"
    )


def _b64_cores(raw: bytes) -> Set[str]:
    """The base64 characters determined by ``raw`` alone, at each offset mod 3 of a stream,
    in both alphabets; plus the standalone padded forms."""
    out: Set[str] = set()
    n = len(raw)
    for k in range(3):
        enc = base64.b64encode(b"\0" * k + raw + b"\0\0")
        # Character i carries bits [6i, 6i+6); the value holds bits [8k, 8k+8n).
        start = -(-8 * k // 6)
        stop = (8 * (k + n)) // 6
        core = enc[start:stop].decode("ascii")
        out.add(core)
        out.add(core.translate(_URLSAFE))
    for enc_fn in (base64.b64encode, base64.urlsafe_b64encode):
        out.add(enc_fn(raw).decode("ascii"))
    return out


_URLSAFE = str.maketrans("+/", "-_")


def shapes(secret: str) -> Set[str]:
    """Every string :class:`Redactor` masks for ``secret`` (each at least MIN_SECRET_LEN long)."""
    parts = [secret]
    if "\n" in secret or "\r" in secret:
        for line in re.split(r"\r\n|\r|\n", secret):
            parts += [line, line.strip()]
    out: Set[str] = set()
    for p in parts:
        if len(p) < MIN_SECRET_LEN:
            continue
        out.add(p)
        out.add(json.dumps(p)[1:-1])
        out.add(json.dumps(p, ensure_ascii=False)[1:-1])
        out.add(repr(p)[1:-1])
        out.add(quote(p, safe=""))
        out.add(quote(p))
        out.add(quote_plus(p))
        out.add(quote_plus(p, safe="/"))
        out |= _b64_cores(p.encode("utf-8", "surrogatepass"))
    return {s for s in out if len(s) >= MIN_SECRET_LEN}


class Redactor:
    def __init__(self, secrets: Iterable[str] = ()) -> None:
        values = {s for s in secrets if isinstance(s, str) and len(s) >= MIN_SECRET_LEN}
        patterns: Set[str] = set()
        for v in values:
            patterns |= shapes(v)
        # Longest first: a shape that contains another is masked whole.
        ordered = sorted(patterns, key=lambda s: (-len(s), s))
        self._pattern: Optional["re.Pattern[str]"] = (
            re.compile("|".join(re.escape(v) for v in ordered)) if ordered else None
        )
        self.count = len(values)

    @classmethod
    def from_env(cls, env: Mapping[str, str], extra: Iterable[str] = ()) -> "Redactor":
        declared: "set[str]" = set()
        raw = env.get("RESOLUTO_SECRET_ENV", "")
        if raw:
            try:
                names = json.loads(raw)
                if isinstance(names, list):
                    declared = {str(n) for n in names}
            except ValueError:
                pass
        # RESOLUTO_* are the runner's own settings (RESOLUTO_SECRET_ENV holds names, not secrets)
        values = [
            v
            for k, v in env.items()
            if k in declared or (name_looks_secret(k) and not k.startswith("RESOLUTO_"))
        ]
        return cls(list(values) + list(extra))

    def text(self, s: str) -> str:
        if self._pattern is None or not s:
            return s
        # Alternatives are tried longest first at each position, so a shape found where it
        # starts is masked whole even when another, shorter one also starts there.
        return self._pattern.sub(MASK, s)

    def data(self, obj: Any) -> Any:
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, Mapping):
            return {
                k: (
                    MASK
                    if isinstance(k, str) and name_looks_secret(k) and v not in ("", None)
                    else self.data(v)
                )
                for k, v in obj.items()
            }
        if isinstance(obj, (list, tuple)):
            return [self.data(v) for v in obj]
        return obj
