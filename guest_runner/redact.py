"""Secret redaction for everything the guest ships.

Two sources of secrets: environment variables whose *names* look secret, and the
variables the host declares secret (``RESOLUTO_SECRET_ENV``, a JSON list of names).
Their *values* are replaced by ``***`` wherever they appear in a log line or in span
data; span data keys that look secret have their value replaced outright.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Mapping, Optional

MASK = "***"
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|CREDENTIAL|PRIVATE|API_?KEY|KEY", re.I)
_AWS_CREDENTIAL_NAMES = frozenset({"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"})
# Values shorter than this would mask ordinary text ("1", "on"); such secrets are no secret.
_MIN_SECRET_LEN = 4


def name_looks_secret(name: str) -> bool:
    return name.upper() in _AWS_CREDENTIAL_NAMES or bool(_SECRET_NAME.search(name))


class Redactor:
    def __init__(self, secrets: Iterable[str] = ()) -> None:
        values = sorted(
            {s for s in secrets if isinstance(s, str) and len(s) >= _MIN_SECRET_LEN}, key=len, reverse=True
        )
        self._pattern: Optional["re.Pattern[str]"] = (
            re.compile("|".join(re.escape(v) for v in values)) if values else None
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
