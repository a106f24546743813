"""A flow a script calls without ``if __name__ == "__main__":`` is not run again in the sandbox.

Such a script calls its flow when it is imported. The host made that call; the sandbox
imports the module only to find the task's function. Run again there, the flow would run
every one of its tasks inline, in every task's sandbox: N tasks, N² task bodies. Under
ThreadPoolTaskRunner the script is never imported a second time. So, while the guest
imports the task's module, a flow called (or served, or deployed) from the module's own
top level once the task is defined ends the import there: the module is then what it
was when the host called the flow (what follows the call had not run on the host either
when the task was submitted). A bare ``except:`` around the call that exits or raises
does not undo that.

A flow called during the import before the task is defined, or from another module's top
level, runs as it would have on the host (inline, as any flow in a sandbox): what the
module does next may need its value. Served or deployed there, it is not (``None``).
A flow that a task calls while it runs (a subflow) runs inline, as before.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any, Callable, Dict, Optional, Tuple

#: (module name, task qualname) while the guest imports the task's module.
_LOADING: Optional[Tuple[str, str]] = None
#: The task's module, once a flow call at its top level ended its import.
_ENDED: Optional[types.ModuleType] = None


class _EndImport(BaseException):
    """Ends the task module's import at its flow call. A BaseException, so that a script's
    ``except Exception`` around its flow call does not swallow it."""


def import_task_module(name: str, qualname: str) -> types.ModuleType:
    """``importlib.import_module(name)``, with a flow call at its top level ending it."""
    global _LOADING, _ENDED
    _LOADING, _ENDED = (name, qualname), None
    try:
        return importlib.import_module(name)
    except BaseException:
        ended = _ENDED
        if ended is None:
            raise
        # Ended at the flow call (whatever a bare `except:` made of it since): the module
        # stands as it was there. The import system forgot it when the exception left.
        sys.modules[name] = ended
        parent, _, leaf = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], leaf, ended)
        return ended
    finally:
        _LOADING, _ENDED = None, None


def flow_called(flow_name: str, how: str) -> bool:
    """Whether a flow served or deployed now is to be skipped (False: it runs). Raises to
    end the task module's import (see the module's docstring)."""
    global _ENDED
    if _LOADING is None:
        return False
    name, qualname = _LOADING
    module = sys.modules.get(name)
    caller = _calling_module()
    if module is not None and caller is module.__dict__ and _defines(module, qualname):
        _note(f"the flow {flow_name!r} {how} at the top level of {name!r}: its import ends there")
        _ENDED = module
        raise _EndImport()
    if how == "called":
        return False
    where = f"from {caller.get('__name__')!r} " if caller is not None else ""
    _note(f"the flow {flow_name!r} {how} {where}while {name!r} was imported: not in the sandbox")
    return True


def _calling_module() -> Optional[Dict[str, Any]]:
    """The globals of the nearest module-level code on the stack: the module whose top
    level made the call (directly, or through a function it defines)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            return frame.f_globals
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _defines(module: types.ModuleType, qualname: str) -> bool:
    obj: Any = module
    for part in qualname.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _note(text: str) -> None:
    if note is not None:
        note(f'{text} (the host runs the flow; put the call under `if __name__ == "__main__":`)')


#: Where the notes go: the task run's logs, at DEBUG (set by :mod:`guest_runner.standin`,
#: which owns the run logger and imports this module).
note: Optional[Callable[[str], None]] = None
