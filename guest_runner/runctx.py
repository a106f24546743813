"""Prefect's run context in the sandbox: ``get_run_context()``, ``TaskRunContext.get()`` and
``FlowRunContext.get()`` give the task what a thread's would.

The host sends them as JSON in call.json's ``context["contexts"]``
(``prefect_resoluto.task_runner.python_calls.run_contexts``): its own TaskRun, the allowed
fields of its FlowRun, the parameters, ``log_prints``, ``persist_result``. With the real
package loaded, real ``TaskRunContext`` / ``FlowRunContext`` objects holding real
``TaskRun`` / ``FlowRun`` models are entered (:func:`enter_real`); without Prefect in the
image, :func:`standin_module_names` gives ``prefect.context`` classes of the same shape.

What cannot work in here (a client, a result store, the task runner, the flow object, a
flow run field the host does not send) raises :class:`NotInSandbox` naming it, never
answers ``None`` or a default. Standard library only: Prefect is reached by module name.
"""

from __future__ import annotations

import importlib
import types
from typing import Any, Dict, List, Optional, Tuple, Type, TypeVar

WHY = (
    "a sandboxed task's run context holds its task run and flow run as the host sent them "
    "(ResolutoTaskRunner); the engine, its clients and stores stay on the host"
)

#: What each context holds in the sandbox; every other field raises NotInSandbox.
TASK_FIELDS = ("task", "task_run", "parameters", "log_prints", "persist_result", "start_time")
FLOW_FIELDS = ("flow_run", "parameters", "log_prints", "persist_result", "start_time")


class NotInSandbox(AttributeError):
    """A run context field a sandboxed task cannot have. An AttributeError, so ``getattr(ctx,
    name, default)`` and ``hasattr`` still work as for any absent attribute."""


def not_in_sandbox(owner: str, name: str) -> NotInSandbox:
    return NotInSandbox(f"{owner}.{name} is not available inside a sandboxed task: {WHY}")


# -- what the host sent -----------------------------------------------------------------------
_SENT: Dict[str, Any] = {}
_TASK: List[Any] = []  # TaskRunContext.task: the host's words, then the task object itself


def set_contexts(sent: Any) -> None:
    _SENT.clear()
    _TASK.clear()
    if isinstance(sent, dict):
        _SENT.update({k: v for k, v in sent.items() if k in ("task", "flow") and isinstance(v, dict)})
    about = _SENT.get("task", {}).get("task")
    if isinstance(about, dict):
        # Until the task's module is imported (the real package may load first): its name,
        # and whether it is async, which Prefect's sync/async dispatch asks of the context.
        _TASK.append(
            Record("TaskRunContext.task", {"name": about.get("name"), "isasync": about.get("isasync")})
        )


def set_task(task: Any) -> None:
    """The task object the call runs, as its module defined it: ``TaskRunContext.task``. A
    plain function (a task made elsewhere with ``task(fn)``) is not one: the host's words stay."""
    if not (hasattr(task, "fn") and isinstance(getattr(task, "name", None), str)):
        return
    _TASK[:] = [task]
    for ctx in _ENTERED:
        ctx.__dict__["task"] = task


# -- with the real package ----------------------------------------------------------------------
_ENTERED: List[Any] = []
_CLASSES: Dict[str, type] = {}


def _restricted(base: type, owner: str) -> type:
    """A subclass of the pydantic model ``base`` whose fields left out raise NotInSandbox."""
    made = _CLASSES.get(owner)
    if made is None:

        def __getattr__(self: Any, name: str) -> Any:
            if name in type(self).model_fields:
                raise not_in_sandbox(owner, name)
            return base.__getattr__(self, name)  # type: ignore[attr-defined]

        made = type(base.__name__, (base,), {"__getattr__": __getattr__, "__module__": base.__module__})
        made.__qualname__ = base.__qualname__
        _CLASSES[owner] = made
    return made


def _keep_only(obj: Any, names: "Tuple[str, ...]") -> Any:
    for name in list(type(obj).model_fields):
        if name not in names:
            obj.__dict__.pop(name, None)
    return obj


def enter_real() -> None:
    """Enter the real TaskRunContext (and FlowRunContext) for the rest of this process, which
    is the task's whole life. Nothing is entered for a context the host did not send."""
    if _ENTERED or not _SENT:
        return
    context = importlib.import_module("prefect.context")
    objects = importlib.import_module("prefect.client.schemas.objects")
    flow = _SENT.get("flow")
    if isinstance(flow, dict) and isinstance(flow.get("flow_run"), dict):
        sent_run = flow["flow_run"]
        run_cls = _restricted(objects.FlowRun, "FlowRunContext.flow_run")
        flow_run = _keep_only(run_cls.model_validate(sent_run), tuple(sent_run))  # type: ignore[attr-defined]
        ctx_cls = _restricted(context.FlowRunContext, "FlowRunContext")
        _enter(ctx_cls, FLOW_FIELDS, flow, flow_run=flow_run)
    task = _SENT.get("task")
    if isinstance(task, dict) and isinstance(task.get("task_run"), dict):
        task_run = objects.TaskRun.model_validate(task["task_run"])
        ctx_cls = _restricted(context.TaskRunContext, "TaskRunContext")
        extra = {"task": _TASK[0]} if _TASK else {}
        _enter(ctx_cls, TASK_FIELDS, task, task_run=task_run, **extra)


def _enter(cls: type, fields: "Tuple[str, ...]", sent: Dict[str, Any], **models: Any) -> None:
    values = {k: sent[k] for k in ("parameters", "log_prints", "persist_result") if k in sent}
    if isinstance(sent.get("start_time"), str):
        values["start_time"] = _value("start_time", sent["start_time"])
    values.update(models)
    # Built, not validated: the fields an engine would fill (client, stores) are not there
    # to validate, and `task` is whatever the task's module defined.
    ctx = _keep_only(cls.model_construct(**values), tuple(f for f in fields if f in values))  # type: ignore[attr-defined]
    ctx.__enter__()
    _ENTERED.append(ctx)


# -- without Prefect in the image --------------------------------------------------------------
class MissingContextError(RuntimeError):
    """``prefect.exceptions.MissingContextError`` where Prefect is not installed."""


_DATETIMES = frozenset(
    "created updated expected_start_time next_scheduled_start_time start_time end_time timestamp "
    "cache_expiration scheduled_time".split()
)


def _value(name: str, value: Any) -> Any:
    """A model field's JSON as its Python type: ids are UUIDs, times datetimes, objects records."""
    if isinstance(value, dict):
        return Record(name, value)
    if isinstance(value, str) and (name == "id" or name.endswith("_id")):
        import uuid

        try:
            return uuid.UUID(value)
        except ValueError:
            return value
    if isinstance(value, str) and name in _DATETIMES:
        import datetime

        try:  # 3.9's fromisoformat knows no "Z"
            return datetime.datetime.fromisoformat(value[:-1] + "+00:00" if value.endswith("Z") else value)
        except ValueError:
            return value
    return value


class Record:
    """A TaskRun / FlowRun (or a nested model of one) as attributes, from the host's JSON."""

    def __init__(self, owner: str, values: Dict[str, Any]) -> None:
        self.__dict__["_owner"] = owner
        self.__dict__.update({str(k): _value(str(k), v) for k, v in values.items() if str(k) != "_owner"})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise not_in_sandbox(self.__dict__["_owner"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{self.__dict__['_owner']} is read-only inside a sandboxed task")

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if k in ("id", "name"))
        return f"{self.__dict__['_owner']}({shown})"


class _StandInContext:
    _kind = "context"
    _fields: "Tuple[str, ...]" = ()
    _sent_key, _run_key = "", ""

    def __init__(self, sent: Dict[str, Any], run_key: str) -> None:
        for name in self._fields:
            if name == "task":  # the task object (set_task), looked up on use
                continue
            if name == run_key:
                self.__dict__[name] = Record(f"{self._kind}.{name}", sent[name])
            elif name == "start_time" and isinstance(sent.get(name), str):
                self.__dict__[name] = _value(name, sent[name])
            elif name in sent:
                self.__dict__[name] = sent[name]

    def __getattr__(self, name: str) -> Any:
        if name == "task" and _TASK:
            return _TASK[0]
        if name.startswith("__"):
            raise AttributeError(name)
        raise not_in_sandbox(self._kind, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{self._kind} is read-only inside a sandboxed task")


class TaskRunContext(_StandInContext):
    """``prefect.context.TaskRunContext`` where Prefect is not installed."""

    _kind = "TaskRunContext"
    _fields = TASK_FIELDS
    _sent_key, _run_key = "task", "task_run"
    _current: "List[TaskRunContext]" = []

    @classmethod
    def get(cls) -> "Optional[TaskRunContext]":
        return _current(cls)


class FlowRunContext(_StandInContext):
    """``prefect.context.FlowRunContext`` where Prefect is not installed."""

    _kind = "FlowRunContext"
    _fields = FLOW_FIELDS
    _sent_key, _run_key = "flow", "flow_run"
    _current: "List[FlowRunContext]" = []

    @classmethod
    def get(cls) -> "Optional[FlowRunContext]":
        return _current(cls)


_C = TypeVar("_C", TaskRunContext, FlowRunContext)


def _current(cls: "Type[_C]") -> "Optional[_C]":
    """The one context of its kind the host sent (made on first use), or None."""
    sent = _SENT.get(cls._sent_key)
    if not cls._current and isinstance(sent, dict) and isinstance(sent.get(cls._run_key), dict):
        cls._current.append(cls(sent, cls._run_key))
    return cls._current[0] if cls._current else None


def get_run_context() -> Any:
    """``prefect.context.get_run_context`` where Prefect is not installed."""
    ctx = TaskRunContext.get() or FlowRunContext.get()
    if ctx is None:
        raise MissingContextError("No run context available. You are not in a flow or task run context.")
    return ctx


def standin_module_names() -> Dict[str, Any]:
    """What the stand-in ``prefect.context`` holds of the run context."""
    return {
        "TaskRunContext": TaskRunContext,
        "FlowRunContext": FlowRunContext,
        "EngineContext": FlowRunContext,
        "get_run_context": get_run_context,
        "MissingContextError": MissingContextError,
    }


def standin_exceptions() -> types.ModuleType:
    module = types.ModuleType("prefect.exceptions")
    module.MissingContextError = MissingContextError  # type: ignore[attr-defined]
    return module
