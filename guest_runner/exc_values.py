"""Exceptions as values: passed to a task, returned by one, held by a state it returns.

A task that takes a failed upstream through ``allow_failure(future)`` gets the upstream's
exception as its parameter, as under a thread. The host sends the exception's class (its
name, module and whether it is the task's own module's) and message; an exception object
itself cannot cross. While ``call.json`` is parsed the task's module is not imported yet
(the stand-ins come first), so each exception is first built as an instance of a class
of the same name made here (:func:`decode`), and once the module is loaded it becomes an
instance of the task's own class where the sandbox has one (:func:`revived`, through
:mod:`guest_runner.from_host`): a downstream
task's ``isinstance(x, MyError)`` holds as on a thread. Nothing is imported for it:
a class is found only in a module already loaded.

The other way, an exception a task returns (or puts in the state it returns) is sent as
the same record (:func:`record`); the host finds its class its own way.

Standard library only: the guest runner vendors it.
"""

from __future__ import annotations

import builtins
import sys
import types
from typing import Any, Dict, Optional, Tuple

#: The classes made for exceptions the host sent, by (module, qualname, is an Exception).
_MADE: Dict[Tuple[str, str, bool], type] = {}


def record(exc: BaseException, task_module: Optional[str], redact: Any = None) -> Dict[str, Any]:
    """What crosses for ``exc``: its class's name and module, whether it is the task's
    own module's, its message and its arguments where they are plain JSON."""
    cls = type(exc)
    message = str(exc)
    rec: Dict[str, Any] = {
        "type": cls.__name__,
        "module": cls.__module__,
        "qualname": cls.__qualname__,
        "task_module": cls.__module__ == task_module,
        "exception": isinstance(exc, Exception),
        "message": redact(message) if redact is not None else message,
    }
    if redact is None and all(type(a) in (str, int, float, bool, type(None)) for a in exc.args):
        rec["args"] = list(exc.args)
    return rec


def _text(rec: Dict[str, Any], key: str) -> str:
    v = rec.get(key)
    return v if isinstance(v, str) else ""


def decode(rec: Any) -> BaseException:
    """The exception the host described in ``rec`` (see ``prefect_resoluto``'s
    ``call_spec.exception_record``), as an instance of a class of its name."""
    if not isinstance(rec, dict):
        raise ValueError("a tagged exception holds an object")
    qualname = _text(rec, "qualname") or _text(rec, "type") or "Exception"
    module = _text(rec, "module")
    is_exception = rec.get("exception") is not False
    if module == "builtins":
        real = getattr(builtins, qualname, None) if qualname.isidentifier() else None
        if isinstance(real, type) and issubclass(real, BaseException):
            made = _instance(real, rec)
            if made is not None:  # else (an ExceptionGroup: it wants its exceptions) one of its name
                return made
    key = (module, qualname, is_exception)
    cls = _MADE.get(key)
    if cls is None:
        name = qualname.rpartition(".")[2] or "Exception"
        cls = types.new_class(name, (Exception if is_exception else BaseException,))
        cls.__module__, cls.__qualname__ = module or "builtins", qualname
        _MADE[key] = cls
    exc: Any = _instance(cls, rec) or cls()
    exc._resoluto_host = rec
    return exc  # type: ignore[no-any-return]


def _instance(cls: Any, rec: Dict[str, Any]) -> Optional[BaseException]:
    """An instance of ``cls`` with the record's arguments (or message); None if the class
    cannot be made without arguments of its own kind."""
    args = rec.get("args")
    if not isinstance(args, list):
        args = [_text(rec, "message")] if _text(rec, "message") else []
    try:
        exc = cls(*args)
        if isinstance(exc, BaseException):
            return exc
    except Exception:  # a class whose __init__ wants other arguments
        pass
    try:
        made: BaseException = cls.__new__(cls)
        made.args = tuple(args)
        return made
    except Exception:  # nor its __new__ (an ExceptionGroup's wants its exceptions)
        return None


def revived(exc: BaseException, task_module: Optional[types.ModuleType]) -> BaseException:
    """``exc`` as an instance of its own class if :func:`decode` made it and that class is
    in the task's module or a module already loaded; else ``exc``."""
    rec = getattr(exc, "_resoluto_host", None)
    cls = _find(rec, task_module) if isinstance(rec, dict) else None
    made = _instance(cls, rec) if cls is not None and rec is not None else None
    return exc if made is None else made


def _find(rec: Dict[str, Any], task_module: Optional[types.ModuleType]) -> Optional[type]:
    qualname = _text(rec, "qualname")
    if "<locals>" in qualname or not qualname:
        return None
    obj: Any = task_module if rec.get("task_module") is True else sys.modules.get(_text(rec, "module"))
    for part in qualname.split("."):
        if obj is None or not part.isidentifier():
            return None
        obj = getattr(obj, part, None)
    if isinstance(obj, type) and issubclass(obj, BaseException):
        return obj
    return None
