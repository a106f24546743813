"""A task's parameters and return value as JSON that gives back the same Python values.

Plain JSON turns a tuple into a list, a datetime into text, a dict's int keys into
strings, and has no bytes at all: a task under ThreadPoolTaskRunner gets and returns the
objects themselves. So values of a fixed set of standard-library types travel as a tagged
object, ``{"$resoluto": <kind>, "v": <JSON>}``, and come back as the same type:

========= =========================================== =====================================
kind      Python                                      ``v``
========= =========================================== =====================================
tuple     ``tuple``                                   the items
set       ``set``                                     the items
frozenset ``frozenset``                               the items
dict      a dict with a key that is not a ``str``,    ``[[key, value], ...]``
          or with the key ``"$resoluto"``
bytes     ``bytes`` (``bytearray`` too)               base64 text
datetime  ``datetime.datetime``                       ISO 8601 text
date      ``datetime.date``                           ISO 8601 text
time      ``datetime.time``                           ISO 8601 text
timedelta ``datetime.timedelta``                      ``[days, seconds, microseconds]``
decimal   ``decimal.Decimal``                         its text
uuid      ``uuid.UUID``                               its text
path      ``pathlib.PurePath`` (a ``Path`` back)      its text
exception an exception (a failed upstream's, passed   its class's name, module and message
          on by ``allow_failure``)                    (a record: see the callers)
object    a pydantic model, dataclass or enum member  its class's name and module, its data
          with no annotation to rebuild it from       (see the callers)
========= =========================================== =====================================

Any other object goes to ``fallback`` (a dataclass or a pydantic model becomes a dict,
rebuilt from the annotation where there is one); a fallback may answer a :class:`Tagged`
value of its own kind (an exception, an object). Decoding builds only these types, by a
fixed table, never a class named by the data; an ``exception`` or ``object`` only through
the function its caller gives :func:`loads` (each side finds classes its own way). What the sandbox
sends through it is hostile, and a malformed tag is a :class:`ValueError`.

Standard library only: the guest runner vendors it.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Dict, List

TAG = "$resoluto"

_PLAIN = frozenset((str, int, float, bool, type(None)))
_PLAIN_TYPES = (str, int, float, bool, type(None))


class Tagged:
    """What a ``fallback`` answers for a value of a kind it encodes itself: written as
    ``{"$resoluto": kind, "v": v}``, ``v`` as it is (already JSON)."""

    __slots__ = ("kind", "v")

    def __init__(self, kind: str, v: Any) -> None:
        self.kind, self.v = kind, v


def tagged_object(value: Any, task_module: "str | None", fallback: Callable[[Any], Any]) -> "Tagged | None":
    """A pydantic model (its JSON form), a dataclass (the fields its constructor takes) or
    an enum member (its value) as an ``object`` with its class's reference, for the other
    side to rebuild as that class where it has it; None for anything else. Nothing is
    imported: such a value's module is loaded already."""
    enum, dataclasses = sys.modules.get("enum"), sys.modules.get("dataclasses")
    fields: Any
    if enum is not None and isinstance(value, enum.Enum):
        fields = value.value
    elif isinstance(value, type):
        return None
    elif callable(getattr(value, "model_dump", None)) and callable(
        getattr(type(value), "model_validate", None)
    ):
        fields = value.model_dump(mode="json")
    elif dataclasses is not None and dataclasses.is_dataclass(value):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}
    else:
        return None
    cls = type(value)
    ref = {
        "module": cls.__module__,
        "qualname": cls.__qualname__,
        "task_module": cls.__module__ == task_module,
    }
    return Tagged("object", {"class": ref, "v": encode(fields, fallback)})


def encode(value: Any, fallback: Callable[[Any], Any]) -> Any:
    """``value`` as JSON-able data with its tagged types kept; ``fallback(obj)`` makes
    anything else JSON-able (it may raise TypeError). A list or dict of plain values is
    returned as it is, not copied."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is list:
        if all(type(v) in _PLAIN for v in value):
            return value
        return [encode(v, fallback) for v in value]
    if kind is dict:
        if TAG not in value and all(type(k) is str for k in value):
            if all(type(v) in _PLAIN for v in value.values()):
                return value
            return {k: encode(v, fallback) for k, v in value.items()}
        return _tagged("dict", [[encode(k, fallback), encode(v, fallback)] for k, v in value.items()])
    if isinstance(value, (tuple, set, frozenset)) and not hasattr(value, "_fields"):
        name = "tuple" if isinstance(value, tuple) else "frozenset" if isinstance(value, frozenset) else "set"
        return _tagged(name, [encode(v, fallback) for v in value])
    if isinstance(value, (bytes, bytearray)):
        import base64  # not for every call: an import is dear in gVisor

        return _tagged("bytes", base64.b64encode(bytes(value)).decode("ascii"))
    named = _stdlib_kind(value)
    if named is not None:
        return _tagged(named[0], named[1])
    if isinstance(value, _PLAIN_TYPES) and not _is_enum(value):
        return value  # a str or int subclass: JSON writes its value
    if isinstance(value, list):
        return [encode(v, fallback) for v in value]
    if isinstance(value, dict):  # an OrderedDict, a defaultdict: as a dict
        return encode(dict(value), fallback)
    made = fallback(value)
    if type(made) is Tagged:
        return _tagged(made.kind, made.v)
    return encode(made, fallback)


def _is_enum(value: Any) -> bool:
    enum = sys.modules.get("enum")
    return enum is not None and isinstance(value, enum.Enum)


def _tagged(kind: str, v: Any) -> Dict[str, Any]:
    return {TAG: kind, "v": v}


def _stdlib_kind(value: Any) -> "tuple[str, Any] | None":
    """The tag of a datetime, Decimal, UUID or path: only once its module is loaded (a
    value cannot be an instance of a class whose module nobody imported)."""
    datetime = sys.modules.get("datetime")
    if datetime is not None:
        if isinstance(value, datetime.datetime):
            return "datetime", value.isoformat()
        if isinstance(value, datetime.date):
            return "date", value.isoformat()
        if isinstance(value, datetime.time):
            return "time", value.isoformat()
        if isinstance(value, datetime.timedelta):
            return "timedelta", [value.days, value.seconds, value.microseconds]
    decimal, uuid, pathlib = (sys.modules.get(m) for m in ("decimal", "uuid", "pathlib"))
    if decimal is not None and isinstance(value, decimal.Decimal):
        return "decimal", str(value)
    if uuid is not None and isinstance(value, uuid.UUID):
        return "uuid", str(value)
    if pathlib is not None and isinstance(value, pathlib.PurePath):
        return "path", str(value)
    return None


def loads(text: "str | bytes", kinds: "Dict[str, Callable[[Any], Any]] | None" = None) -> Any:
    """Parsed JSON with the values :func:`encode` made; ValueError for a malformed tag.
    ``kinds``: tags its caller decodes itself (``exception``, ``object``), each side its
    own way; any other kind outside the fixed table is refused."""
    if not kinds:
        return json.loads(text, object_hook=hook)

    def hook_with_kinds(obj: Dict[str, Any]) -> Any:
        own = kinds.get(obj.get(TAG)) if type(obj.get(TAG)) is str else None  # type: ignore[arg-type]
        if own is not None and len(obj) == 2 and "v" in obj:
            return own(obj["v"])
        return hook(obj)

    return json.loads(text, object_hook=hook_with_kinds)


def hook(obj: Dict[str, Any]) -> Any:
    """``json``'s object_hook: each object is seen once, innermost first, so a tagged
    value's items are already decoded when its own tag is read."""
    return _untag(obj) if TAG in obj else obj


def _items(v: Any, kind: str) -> List[Any]:
    if type(v) is not list:
        raise ValueError(f"a tagged {kind} holds a list, not {type(v).__name__}")
    return v


def _text(v: Any, kind: str) -> str:
    if type(v) is not str:
        raise ValueError(f"a tagged {kind} holds text, not {type(v).__name__}")
    return v


def _untag(data: Dict[str, Any]) -> Any:
    kind, v = data.get(TAG), data.get("v")
    if set(data) != {TAG, "v"} or type(kind) is not str:
        raise ValueError(f"a {TAG!r} object must be {{{TAG!r}: kind, 'v': value}}")
    maker = _MAKERS.get(kind)
    if maker is None:
        raise ValueError(f"unknown {TAG!r} kind {kind[:40]!r}")
    try:
        return maker(v)
    except (TypeError, ValueError, ArithmeticError) as e:  # unhashable, bad text ...
        raise ValueError(f"a tagged {kind}: {type(e).__name__}: {e}"[:300]) from None


#: Members of one tagged set (or keys of one dict) that may share a hash. The hashes of
#: ints, floats, Decimals and tuples of them are not randomised: distinct values sharing
#: one are easy to make, and each insertion walks all those before it. Past this bound,
#: decoding would cost the square of the file's size: refused.
MAX_SAME_HASH = 16

#: A Decimal's text, and its exponent, at most this long / large: ``int()`` of
#: ``Decimal("1e99999999")`` (a few bytes) takes minutes and gigabytes, and a task
#: annotated ``-> int`` makes one. 4300 is what Python allows an int's text.
MAX_DECIMAL_DIGITS = 4300


def _hashable(members: List[Any]) -> List[Any]:
    """``members``, unless too many of them share one hash (see :data:`MAX_SAME_HASH`)."""
    if len(members) > MAX_SAME_HASH:
        counts: Dict[int, int] = {}
        for m in members:
            h = hash(m)  # a hash is an int equal to itself: this dict never floods
            n = counts[h] = counts.get(h, 0) + 1
            if n > MAX_SAME_HASH:
                raise ValueError(f"more than {MAX_SAME_HASH} of its members share one hash (a hash flood)")
    return members


def _dict(v: Any) -> Dict[Any, Any]:
    pairs = _items(v, "dict")
    for pair in pairs:
        if type(pair) is not list or len(pair) != 2:
            raise ValueError("a tagged dict holds [key, value] pairs")
    _hashable([p[0] for p in pairs])
    return {p[0]: p[1] for p in pairs}


def _bytes(v: Any) -> bytes:
    import base64

    return base64.b64decode(_text(v, "bytes"), validate=True)


def _timedelta(v: Any) -> Any:
    import datetime

    parts = _items(v, "timedelta")
    if len(parts) != 3 or any(type(p) is not int for p in parts):
        raise ValueError("a tagged timedelta holds [days, seconds, microseconds]")
    return datetime.timedelta(days=parts[0], seconds=parts[1], microseconds=parts[2])


def _iso(kind: str) -> Callable[[Any], Any]:
    def make(v: Any) -> Any:
        import datetime

        return getattr(datetime, kind).fromisoformat(_text(v, kind))

    return make


def _decimal(v: Any) -> Any:
    import decimal

    text = _text(v, "decimal")
    if len(text) > MAX_DECIMAL_DIGITS:
        raise ValueError(f"its text is over {MAX_DECIMAL_DIGITS} characters")
    d = decimal.Decimal(text)
    if d.is_finite() and abs(int(d.as_tuple().exponent)) > MAX_DECIMAL_DIGITS:
        raise ValueError(f"its exponent is beyond ±{MAX_DECIMAL_DIGITS}")
    return d


def _uuid(v: Any) -> Any:
    import uuid

    return uuid.UUID(_text(v, "uuid"))


def _path(v: Any) -> Any:
    import pathlib

    return pathlib.Path(_text(v, "path"))


_MAKERS: Dict[str, Callable[[Any], Any]] = {
    "tuple": lambda v: tuple(_items(v, "tuple")),
    "set": lambda v: set(_hashable(_items(v, "set"))),
    "frozenset": lambda v: frozenset(_hashable(_items(v, "frozenset"))),
    "dict": _dict,
    "bytes": _bytes,
    "datetime": _iso("datetime"),
    "date": _iso("date"),
    "time": _iso("time"),
    "timedelta": _timedelta,
    "decimal": _decimal,
    "uuid": _uuid,
    "path": _path,
}
