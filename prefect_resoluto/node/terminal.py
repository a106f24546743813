"""Text from a sandbox, made safe for a terminal (issue 30, finding 5).

A guest's log line reaches ``prefect-resoluto events``, the worker's stdout and the flow
process's stdout. Raw, its ESC/BEL/CR could set the terminal's title, erase or hide text,
and a newline could forge a line in the host's own format. Every C0 and C1 control
(newline and carriage return included), DEL, the Unicode line/paragraph separators and
the bidirectional overrides are escaped the way the egress audit log escapes names
(:func:`prefect_resoluto.egress.names.escape`); tab and other printable text, non-ASCII
letters included, stay as written. The Prefect API keeps the text as written: only what
is printed goes through here.
"""

from __future__ import annotations

import re

from prefect_resoluto.egress.names import escape

_UNSAFE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c]")


def safe(text: str) -> str:
    """``text`` as one terminal line that does nothing but show itself."""
    if not _UNSAFE.search(text):
        return text
    return _UNSAFE.sub(lambda m: escape(m.group()), text)
