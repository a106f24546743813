"""A task's parameters rebuilt from their annotations in the sandbox.

What JSON cannot carry with its type (a pydantic model, a dataclass, an enum member)
crosses as its JSON form (:mod:`guest_runner.values` keeps the standard library's types);
under a thread the task gets the objects themselves. So each parameter is rebuilt from
its annotation, all the way down the annotation's own structure: ``list[Row]``,
``Optional[Point]``, ``dict[str, Mode]``, ``tuple[Point, ...]``, a dataclass whose fields
are dataclasses. Nothing is imported for it (pydantic is used only through a model's own
``model_validate``), nothing is validated that needs no rebuilding, and a value the
annotation does not describe is handed over as it came.

Standard library only: the guest runner vendors it.
"""

from __future__ import annotations

import sys
import typing
from typing import Any, Dict

#: How deep an annotation's structure is followed (a recursive one ends here).
MAX_DEPTH = 32


def rebuild(annotation: Any, value: Any, depth: int = 0) -> Any:
    """``value`` (decoded JSON) as the type ``annotation`` describes, where it can be."""
    if value is None or depth > MAX_DEPTH or annotation in (Any, object) or isinstance(annotation, str):
        return value
    try:
        if isinstance(annotation, type):
            return _instance(annotation, value, depth)
        return _generic(annotation, value, depth)
    except Exception:  # the annotation does not describe what came: hand it over as it is
        return value


def _instance(cls: Any, value: Any, depth: int) -> Any:
    if isinstance(value, cls):
        return value
    if isinstance(value, dict) and callable(getattr(cls, "model_validate", None)):
        return cls.model_validate(value)
    if isinstance(value, dict) and hasattr(cls, "__dataclass_fields__"):
        hints = _hints(cls)
        fields = cls.__dataclass_fields__
        return cls(
            **{k: rebuild(hints.get(k, Any), v, depth + 1) if k in fields else v for k, v in value.items()}
        )
    enum = sys.modules.get("enum")
    if enum is not None and issubclass(cls, enum.Enum):
        return cls(value)
    return value


def _generic(annotation: Any, value: Any, depth: int) -> Any:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is None or not args:
        return value
    if origin is typing.Union or type(annotation).__name__ == "UnionType":
        options = [a for a in args if a is not type(None)]
        for option in options:
            made = rebuild(option, value, depth + 1)
            if made is not value or len(options) == 1:
                return made
        return value
    if origin is typing.Annotated:
        return rebuild(args[0], value, depth + 1)
    if origin in (list, set, frozenset) and isinstance(value, (list, set, frozenset, tuple)):
        made = [rebuild(args[0], v, depth + 1) for v in value]
        return made if origin is list and isinstance(value, list) else type(value)(made)
    if origin is tuple and isinstance(value, (list, tuple)):
        if len(args) == 2 and args[1] is Ellipsis:
            items = [rebuild(args[0], v, depth + 1) for v in value]
        else:
            items = [rebuild(a, v, depth + 1) for a, v in zip(args, value)] + list(value[len(args) :])
        return type(value)(items)
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        return {rebuild(args[0], k, depth + 1): rebuild(args[1], v, depth + 1) for k, v in value.items()}
    return value


_HINTS: Dict[type, Dict[str, Any]] = {}


def _hints(cls: type) -> Dict[str, Any]:
    if cls not in _HINTS:
        try:
            _HINTS[cls] = typing.get_type_hints(cls)
        except Exception:
            _HINTS[cls] = {}
    return _HINTS[cls]
