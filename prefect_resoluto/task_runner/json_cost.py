"""What parsing a JSON document from the sandbox may cost the host, checked before parsing.

A document's Python objects cost more than its bytes, and the most for containers: ``{}``
is three bytes of JSON (with its comma) and about ninety of Python, so a return.json of
empty objects within a node's output allowance would cost the flow process thirty times
the allowance. Scalars cost at most about twelve times their text (a two-character string
and its comma: five bytes, some sixty in Python), as they would for the same value
returned on threads. Nesting is bounded by ``json``'s recursion limit (a RecursionError).

So a document may hold at most one container per :data:`BYTES_PER_CONTAINER` bytes
beyond a first :data:`FREE_CONTAINERS`: its containers then cost at most a few times its
size, and the whole parse about sixteen times it. Containers are counted outside
strings (a text full of brackets is a string, not a structure).
"""

from __future__ import annotations

import re

#: Containers any document may hold (about 60 MiB of Python at their densest).
FREE_CONTAINERS = 640 * 1024
#: Beyond those, at least this many bytes of document per container.
BYTES_PER_CONTAINER = 24
#: A JSON string: a quote, anything but a quote or a backslash, or an escape, then a quote
#: or the end of the document. Matching an unclosed one to the end, without backtracking,
#: keeps the scan linear: one that had to close was sought again from every quote inside
#: it (a few MB of ``\"[`` took hours, holding the GIL).
_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)', re.DOTALL)


class TooCostly(ValueError):
    """A document whose parse would cost the host many times its size."""


def allowed_containers(size: int) -> int:
    return FREE_CONTAINERS + size // BYTES_PER_CONTAINER


def containers(raw: bytes) -> int:
    """How many arrays and objects ``raw`` opens, outside strings."""
    upper = raw.count(b"[") + raw.count(b"{")  # strings' brackets too: an upper bound
    if upper <= allowed_containers(len(raw)):
        return upper
    skeleton = _STRING.sub(b"", raw)
    return skeleton.count(b"[") + skeleton.count(b"{")


def check(raw: bytes, name: str) -> None:
    """Raises :class:`TooCostly` when ``raw`` holds more containers than its size allows."""
    n = containers(raw)
    if n > allowed_containers(len(raw)):
        raise TooCostly(
            f"{name} from the sandbox holds {n} arrays and objects in {len(raw)} bytes, more than "
            f"the host parses ({FREE_CONTAINERS} and one per {BYTES_PER_CONTAINER} bytes beyond): "
            "parsing it would cost the flow process many times its size. Return a value with fewer, "
            "larger parts, or write it to a file in the outputs and return the file's path."
        )
