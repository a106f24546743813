"""Values the host sent that only the task's module can rebuild: objects and exceptions.

A pydantic model, a dataclass or an enum member passed to a task with no annotation to
rebuild it from, and an exception passed on by ``allow_failure``, cross with their class's
name and module (``{"$resoluto": "object" | "exception", "v": ...}``). ``call.json`` is
parsed before the task's module is imported (the stand-ins come first), so each is first
a stand-in: an object a :class:`Pending` holding its class's reference and data, an
exception one of a class of its name (:mod:`guest_runner.exc_values`). Once the module is
loaded, :func:`revive` makes each an instance of its own class, found in the task's module
or a module already loaded (never imported for it), in place, so the run context's copy
of the parameters (``prefect.runtime.task_run.parameters``) sees them too; one whose class
the sandbox does not have stays its data.

Standard library only: the guest runner vendors it.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable, Dict, Optional

from guest_runner import exc_values, typed


class Pending:
    """An object the host sent, until its class is found."""

    __slots__ = ("ref", "data")

    def __init__(self, ref: Dict[str, Any], data: Any) -> None:
        self.ref, self.data = ref, data


class FromHost:
    """The kinds ``values.loads`` leaves to this side for ``call.json``, counted."""

    def __init__(self) -> None:
        self.count = 0

    def kinds(self) -> Dict[str, Callable[[Any], Any]]:
        return {"exception": self._exception, "object": self._object}

    def _exception(self, rec: Any) -> BaseException:
        self.count += 1
        return exc_values.decode(rec)

    def _object(self, rec: Any) -> Pending:
        if not isinstance(rec, dict) or not isinstance(rec.get("class"), dict):
            raise ValueError("a tagged object holds its class and its data")
        self.count += 1
        return Pending(rec["class"], rec.get("v"))


def revive(value: Any, task_module: Optional[types.ModuleType]) -> Any:
    """``value`` with every stand-in made an instance of its own class where the sandbox has
    it; lists and dicts are changed in place."""
    if isinstance(value, Pending):
        data = revive(value.data, task_module)
        cls = find_class(value.ref, task_module)
        return data if cls is None else typed.rebuild(cls, data)
    if isinstance(value, BaseException):
        return exc_values.revived(value, task_module)
    if type(value) is list:
        for i, v in enumerate(value):
            value[i] = revive(v, task_module)
    elif type(value) is dict:
        for k, v in value.items():
            value[k] = revive(v, task_module)
    elif type(value) is tuple:
        return tuple(revive(v, task_module) for v in value)
    elif type(value) in (set, frozenset):
        try:
            return type(value)(revive(v, task_module) for v in value)
        except TypeError:  # an object of its that is not hashable: as it came
            return value
    return value


def find_class(ref: Dict[str, Any], task_module: Optional[types.ModuleType]) -> Optional[type]:
    """The class ``ref`` names, in the task's module (``task_module: true``) or a module
    already loaded; None where there is none."""
    qualname = ref.get("qualname")
    if not isinstance(qualname, str) or not qualname or "<locals>" in qualname:
        return None
    module = ref.get("module")
    obj: Any = task_module if ref.get("task_module") is True else sys.modules.get(str(module))
    for part in qualname.split("."):
        if obj is None or not part.isidentifier():
            return None
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None
