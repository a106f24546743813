"""error.json from the sandbox as a record of bounded size, whatever the file holds.

An exception's report is small; the host reads at most :data:`MAX_FILE` bytes of it, so
what a sandbox writes there costs the flow process a bounded amount however large the
file. A record cut at that bound still yields the fields that came before the cut (the
guest writes the type first, then the message), so the task fails with its own
exception type and the start of its message. Every text is then cut to its own bound
with a visible marker: the host's exception, its state message and its logs carry at
most that much of the sandbox's text.
"""

from __future__ import annotations

import json
from typing import Any

from prefect_resoluto.task_runner import remote_traceback

#: Most bytes of error.json the host reads.
MAX_FILE = 1024 * 1024
#: Most characters of an exception's message the host keeps.
MAX_MESSAGE = 64 * 1024
#: Most characters of the sandbox's formatted traceback the host keeps.
MAX_TRACEBACK = 256 * 1024
#: Most characters of a type, module or class name.
MAX_NAME = 1000
#: The end of a string the read cut through is dropped: a secret cut in two there would
#: not be recognised by the redactor.
_CUT_GUARD = 64 * 1024
_WS = " \t\n\r"


def parse(data: bytes, cut: bool, name: str) -> dict[str, Any]:
    """error.json's record from ``data`` (its first :data:`MAX_FILE` bytes; ``cut``: there
    was more). Not yet redacted or bounded: see :func:`bounded`."""
    text = data.decode("utf-8", errors="replace")
    if cut:
        e = _salvage(text)
        # The marker stays within the message's own bound.
        message = str(e.get("message") or "")[: MAX_MESSAGE - 256]
        e["message"] = (message + " … " if message else "") + (
            f"[cut by the host: {name} from the sandbox is over {MAX_FILE} bytes]"
        )
        return e
    try:
        loaded: object = json.loads(text)
    except (ValueError, RecursionError):
        return {
            "type": "Exception",
            "message": f"{name} from the sandbox is malformed",
            "traceback": text[:4000],
        }
    if not isinstance(loaded, dict):
        return {"type": "Exception", "message": str(loaded)}
    return loaded


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _salvage(text: str) -> dict[str, Any]:
    """The top-level fields of a JSON object that ``text`` is the start of, up to where it
    was cut; a message or traceback cut through is kept as far as it goes."""
    decoder = json.JSONDecoder(strict=False)
    out: dict[str, Any] = {}
    i = _skip(text, 0)
    if not text.startswith("{", i):
        return out
    i += 1
    while True:
        i = _skip(text, i)
        if not text.startswith('"', i):
            return out
        try:
            key, i = decoder.raw_decode(text, i)
        except ValueError:
            return out
        i = _skip(text, i)
        if not text.startswith(":", i):
            return out
        i = _skip(text, i + 1)
        try:
            value, i = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            if key in ("message", "traceback") and text.startswith('"', i):
                out[key] = _string_head(text, i + 1)
            return out
        out[key] = value
        i = _skip(text, i)
        if not text.startswith(",", i):
            return out
        i += 1


def _string_head(text: str, start: int) -> str:
    """The decoded start of a JSON string that begins at ``start`` and is cut before its
    end, less :data:`_CUT_GUARD` characters where it was cut."""
    body = text[start : max(start, len(text) - _CUT_GUARD)]
    for back in range(7):  # an escape (at most ``\\uXXXX``) cut in half is left out
        try:
            head = json.loads('"' + body[: len(body) - back] + '"', strict=False)
            return str(head)
        except ValueError:
            continue
    return ""


def _cut(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]} … [{len(text) - limit} more characters cut by the host]"


def as_text(e: dict[str, Any], depth: int = 0) -> dict[str, Any]:
    """``e`` with its message and traceback as text, uncut, for the redactor to read
    whole: a message that is a number, a list or an object with the secret as a key
    would pass it untouched (it masks text) and :func:`bounded` makes it text after."""
    out = dict(e)
    for key in ("message", "traceback"):
        if out.get(key) is not None and not isinstance(out[key], str):
            out[key] = str(out[key])
    chained = e.get("chained")
    if isinstance(chained, dict) and depth < remote_traceback.MAX_CHAIN:
        out["chained"] = as_text(chained, depth + 1)
    return out


def bounded(e: dict[str, Any], depth: int = 0) -> dict[str, Any]:
    """The fields of record ``e`` the host uses, each within its bound (texts cut with a
    marker, at most :data:`remote_traceback.MAX_FRAMES` frames, a chain of at most
    :data:`remote_traceback.MAX_CHAIN`); anything else in it goes."""
    out: dict[str, Any] = {}
    for key in ("type", "module", "qualname"):
        v = e.get(key)
        if isinstance(v, str):
            out[key] = v[:MAX_NAME]
        elif key == "module" and key in e and v is None:
            out[key] = None
    for key in ("task_module", "exception"):
        if isinstance(e.get(key), bool):
            out[key] = e[key]
    if e.get("how") in ("cause", "context"):
        out["how"] = e["how"]
    if e.get("message") is not None:
        out["message"] = _cut(e["message"], MAX_MESSAGE)
    if e.get("traceback") is not None:
        out["traceback"] = _cut(e["traceback"], MAX_TRACEBACK)
    frames = e.get("frames")
    if isinstance(frames, list):
        out["frames"] = frames[-remote_traceback.MAX_FRAMES :]
    chained = e.get("chained")
    if isinstance(chained, dict) and depth < remote_traceback.MAX_CHAIN:
        out["chained"] = bounded(chained, depth + 1)
    return out
