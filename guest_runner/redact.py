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
* base64 of the value, standard and URL-safe alphabets, padded or not; inside a longer
  base64 stream, where the value's characters depend on its offset modulo 3, so the
  characters determined by the value alone are matched for each of the three offsets;
  and wrapped at 64 or 76 columns (PEM, MIME, the ``base64`` tool), line by line.

The escapes are also applied to each line of a multi-line value. A shape (or a line)
shorter than :data:`MIN_SECRET_LEN` is not matched: it would mask ordinary text. A
*declared* secret that short cannot be redacted safely and is refused before anything
runs (:func:`too_short`); a value found only by its variable's name is not a declared
secret and is left alone when that short (see docs/security.md).
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, Iterable, List, Mapping, Optional, Set

from guest_runner.wire import ENV_NAME_PREFIX, ENV_SECRET_ENV

# base64 and urllib.parse are imported only to compute a secret's shapes: a node without
# secrets never needs them, and every import costs syscalls through gVisor.

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
    import base64

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


def _escapes(p: str) -> Set[str]:
    from urllib.parse import quote, quote_plus

    return {
        p,
        json.dumps(p)[1:-1],
        json.dumps(p, ensure_ascii=False)[1:-1],
        repr(p)[1:-1],
        quote(p, safe=""),
        quote(p),
        quote_plus(p),
        quote_plus(p, safe="/"),
    }


def shapes(secret: str) -> Set[str]:
    """Every string :class:`Redactor` masks for ``secret`` (each at least MIN_SECRET_LEN long):
    the value and each of its lines as is and escaped; the value's base64, alone, in a
    stream, and wrapped at 64 or 76 columns (PEM, MIME, ``base64``) one line per line."""
    if len(secret) < MIN_SECRET_LEN:
        return set()
    out = _escapes(secret)
    if "\n" in secret or "\r" in secret:
        for line in re.split(r"\r\n|\r|\n", secret):
            for p in (line, line.strip()):
                if len(p) >= MIN_SECRET_LEN:
                    out |= _escapes(p)
    import base64

    raw = secret.encode("utf-8", "surrogatepass")
    out |= _b64_cores(raw)
    for enc in (base64.b64encode(raw).decode("ascii"), base64.urlsafe_b64encode(raw).decode("ascii")):
        for width in (64, 76):
            if len(enc) > width:
                out |= {enc[i : i + width] for i in range(0, len(enc), width)}
    return {s for s in out if len(s) >= MIN_SECRET_LEN}


def _trie(words: Iterable[str]) -> str:
    """One regex matching any of ``words``, the longest where several start at one place.

    As a trie (common prefixes shared) rather than an alternation of every word: ``re``
    then tries one branch per character instead of every word at every position, which
    makes hundreds of shapes (a PEM key's lines in every encoding) cheap per log line."""
    root: Dict[str, Any] = {}
    for w in words:
        node = root
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = True  # a word ends here

    def emit(node: Dict[str, Any]) -> str:
        out = []
        while True:  # a chain of single characters is one literal (no recursion per char)
            kids = [k for k in node if k]
            if len(kids) != 1 or "" in node:
                break
            out.append(re.escape(kids[0]))
            node = node[kids[0]]
        kids = sorted(k for k in node if k)
        if not kids:
            return "".join(out)
        # Extending first: a longer word is preferred to one that ends here.
        alt = "(?:" + "|".join(re.escape(k) + emit(node[k]) for k in kids) + ")"
        return "".join(out) + (alt + "?" if "" in node else alt)

    return emit(root)


class Redactor:
    def __init__(self, secrets: Iterable[str] = ()) -> None:
        values = {s for s in secrets if isinstance(s, str) and len(s) >= MIN_SECRET_LEN}
        patterns: Set[str] = set()
        for v in values:
            patterns |= shapes(v)
        self._pattern: Optional["re.Pattern[str]"] = re.compile(_trie(patterns)) if patterns else None
        self.count = len(values)

    @classmethod
    def from_env(cls, env: Mapping[str, str], extra: Iterable[str] = ()) -> "Redactor":
        declared: "set[str]" = set()
        raw = env.get(ENV_SECRET_ENV, "")
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
            if k in declared or (name_looks_secret(k) and not k.startswith(ENV_NAME_PREFIX))
        ]
        return cls(list(values) + list(extra))

    def text(self, s: str) -> str:
        if self._pattern is None or not s:
            return s
        # The longest shape starting at a place is masked whole, even when a shorter one
        # also starts there.
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
