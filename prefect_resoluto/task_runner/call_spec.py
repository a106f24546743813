"""Host side of a Python task crossing into the sandbox, with nothing pickled.

The function travels by reference (a workspace-relative source file + qualname, or an
importable ``module:qualname``), the parameters as JSON. Anything that cannot make the
trip is refused here, before a sandbox starts, with what to do instead.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from guest_runner import archive, exc_values, values
from guest_runner import call as call  # re-exported: task_runner reads its file names
from guest_runner.redact import Redactor
from guest_runner.wire import WireError
from prefect_resoluto.node import result_files
from prefect_resoluto.task_runner import error_file, json_cost, remote_traceback, returned_state

CALL_ARCHIVE = "call"
RESULT_PATHS = [call.RETURN_FILE, call.ERROR_FILE, call.IMPORTS_FILE]
#: What the host only reads, taken from the outbox into memory (never a file on the host;
#: the outbox in the conduit keeps them as the node's evidence). error.json is written
#: to the node's outputs: redacted there, it is the failure's record on the host.
READ_IN_MEMORY = [call.RETURN_FILE, call.IMPORTS_FILE]


class NotSandboxable(TypeError):
    """A task, parameter or result that cannot cross the sandbox boundary."""


class RemoteError:
    """Mixed into every exception re-raised on the host for one raised in the sandbox.

    ``remote_type``, ``remote_message`` and ``remote_traceback`` are what the sandbox
    reported (secrets redacted). ``str()`` and ``repr()`` read as the original
    exception's (a state message says what a thread's says); the sandbox's frames are the
    exception's ``__traceback__`` (prefect_resoluto.task_runner.remote_traceback), so a logged
    traceback shows the task's own frames, as on threads.
    """

    remote_type: str
    remote_message: str
    remote_traceback: str

    def _remote_init(self, type_name: str, message: str, traceback: str, typed: bool = False) -> None:
        self.remote_type = type_name
        self.remote_message = message
        self.remote_traceback = traceback
        # An instance of the original class reads like one (Prefect prefixes the type
        # name itself); a RemoteTaskError names the remote type.
        text = message if typed else (f"{type_name}: {message}" if message else type_name)
        self._remote_text = text
        BaseException.__init__(self, text)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return self._remote_text

    def __repr__(self) -> str:
        return f"{self.remote_type}({self.remote_message!r})"

    def __reduce__(self) -> Any:
        # Classes made for one remote type are not importable: rebuild through this module.
        base = getattr(type(self), "_remote_base", None)
        ref = (base.__module__, base.__qualname__) if base is not None else None
        return (_rebuild_remote, (ref, self.remote_type, self.remote_message, self.remote_traceback))


class RemoteTaskError(RemoteError, RuntimeError):
    """The task's function raised inside the sandbox, and its exception's class could not
    be found on the host (else the raised exception is also an instance of that class)."""

    def __init__(self, type_name: str, message: str, traceback: str) -> None:
        self._remote_init(type_name, message, traceback)


_REMOTE_CLASSES: dict[type, type[BaseException]] = {}


def remote_exception(
    cls: type[BaseException] | None, type_name: str, message: str, traceback: str
) -> BaseException:
    """An exception to raise on the host for one the sandbox reported.

    With the original class ``cls``: an instance of ``cls`` that is also a
    :class:`RemoteError` (and a :class:`RemoteTaskError` when ``cls`` is an ``Exception``),
    so ``except ValueError`` and type-based retry conditions work. A ``BaseException``
    that is not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``) stays one, so
    Prefect's engine makes the task run Crashed, as it does for the same task on threads.
    """
    if cls is None or issubclass(cls, BaseExceptionGroup) or cls in (RemoteTaskError, RemoteError):
        if cls is not None and not issubclass(cls, Exception):
            return _remote_class(BaseException)(type_name, message, traceback)
        return RemoteTaskError(type_name, message, traceback)
    try:
        return _remote_class(cls)(type_name, message, traceback)
    except Exception:  # a class that refuses our attributes (a frozen attrs exception)
        return remote_exception(
            None if issubclass(cls, Exception) else BaseException, type_name, message, traceback
        )


def _remote_class(cls: type[BaseException]) -> type[BaseException]:
    made = _REMOTE_CLASSES.get(cls)
    if made is None:
        bases: tuple[type, ...] = (RemoteTaskError, cls) if issubclass(cls, Exception) else (RemoteError, cls)
        try:
            made = type(
                cls.__name__,
                bases,
                {
                    "__init__": lambda self, t, m, tb: self._remote_init(t, m, tb, typed=True),
                    "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__,
                    "__str__": RemoteError.__str__,
                    "__repr__": RemoteError.__repr__,
                    "__reduce__": RemoteError.__reduce__,
                    "_remote_base": cls,
                },
            )
        except Exception:  # a class that cannot be mixed (layout conflict, final, its __init_subclass__)
            made = RemoteTaskError if issubclass(cls, Exception) else _remote_class(BaseException)
        _REMOTE_CLASSES[cls] = made
    return made


def _rebuild_remote(
    ref: tuple[str, str] | None, type_name: str, message: str, traceback: str
) -> BaseException:
    cls = None
    if ref is not None:
        cls = _find_class(ref[0], ref[1])
    return remote_exception(cls, type_name, message, traceback)


def _find_class(module: str | None, qualname: str | None) -> type[BaseException] | None:
    """The exception class ``module.qualname`` on the host, looked up only in modules the
    host has already imported (``builtins``, the task's own module, what they imported):
    a name from the sandbox never makes the host import anything (importing runs code)."""
    if not module or not qualname or "<locals>" in qualname:
        return None
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        if obj is None or not part.isidentifier():
            return None
        obj = _own_attribute(obj, part)
    if isinstance(obj, type) and issubclass(obj, BaseException):
        return obj
    return None


def _own_attribute(obj: Any, name: str) -> Any:
    """``obj``'s attribute ``name`` from its own namespace only: never through a module's
    ``__getattr__`` (a package's lazy import: prefect's imports a submodule for a name) or
    a descriptor, so a name from the sandbox runs no code on the host."""
    namespace = getattr(obj, "__dict__", None)
    return namespace.get(name) if isinstance(namespace, Mapping) else None


def function_ref(fn: Callable[..., Any], workspace: Path | None) -> dict[str, str]:
    """How the guest finds ``fn``: by file in the workspace, else by importable module.
    Worked out once per function and workspace (every call of a task asks; finding its file
    is an ``inspect`` walk and two ``resolve`` calls of the file system)."""
    try:
        hash(fn)
    except TypeError:
        return _function_ref(fn, workspace)
    return dict(_function_ref_once(fn, None if workspace is None else str(workspace)))


@functools.lru_cache(maxsize=256)
def _function_ref_once(fn: Callable[..., Any], workspace: str | None) -> dict[str, str]:
    return _function_ref(fn, None if workspace is None else Path(workspace))


def _function_ref(fn: Callable[..., Any], workspace: Path | None) -> dict[str, str]:
    qualname = getattr(fn, "__qualname__", "")
    name = getattr(fn, "__name__", repr(fn))
    if name == "<lambda>" or "<lambda>" in qualname:
        raise NotSandboxable(
            f"task function {qualname or name!r} is a lambda; define it with def at module level"
        )
    if "<locals>" in qualname:
        raise NotSandboxable(
            f"task function {qualname!r} is defined inside another function; the sandbox imports task "
            "functions by name, so move it to module level"
        )
    src = _source_file(fn)
    if workspace is not None and src:
        try:
            rel = Path(src).resolve().relative_to(Path(workspace).resolve())
            return {"file": rel.as_posix(), "qualname": qualname}
        except ValueError:
            pass
    module = getattr(fn, "__module__", None)
    if module and module != "__main__" and module in sys.modules:
        spec = getattr(sys.modules[module], "__spec__", None)
        if spec is not None and spec.origin and "site-packages" in spec.origin:
            return {"module": module, "qualname": qualname}
    raise NotSandboxable(
        f"task function {qualname!r} lives in {src or module!r}, outside the workspace {str(workspace)!r}, "
        "and is not an installed module; set the runner's workspace to a directory that contains its file"
    )


def _source_file(fn: Callable[..., Any]) -> str | None:
    """The file defining ``fn``, also when Prefect loaded it from a deployment's entrypoint
    script (its code then reports "<dynamic-code>" instead of a path)."""
    import os

    try:
        src = inspect.getsourcefile(fn)
    except TypeError:
        src = None
    if src and os.path.isfile(src):
        return src
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    mod_file: str | None = getattr(module, "__file__", None)
    if mod_file and os.path.isfile(mod_file):
        return mod_file
    # A flow run started by a runner/worker: the function lives in the entrypoint's script.
    entrypoint = os.environ.get("PREFECT__FLOW_ENTRYPOINT", "")
    path = entrypoint.rsplit(":", 1)[0] if ":" in entrypoint else ""
    if path.endswith(".py") and os.path.isfile(path):
        return os.path.abspath(path)
    return src


def encode_parameters(
    task_name: str, parameters: dict[str, Any], task_module: str | None = None
) -> dict[str, Any]:
    from pydantic_core import PydanticSerializationError, to_jsonable_python

    def fallback(value: Any) -> Any:
        if isinstance(value, BaseException):  # a failed upstream's, through allow_failure
            return values.Tagged("exception", exception_record(value, task_module))
        # a model, dataclass or enum member: rebuilt as its class in the sandbox (guest_runner.from_host)
        return values.tagged_object(value, task_module, fallback) or to_jsonable_python(value)

    out: dict[str, Any] = {}
    for name, value in parameters.items():
        try:
            out[name] = values.encode(value, fallback)
            json.dumps(out[name], allow_nan=True)
        except (PydanticSerializationError, TypeError, ValueError, RecursionError):
            raise NotSandboxable(
                f"parameter {name!r} of task {task_name!r} is a {type(value).__module__}."
                f"{type(value).__qualname__}, which cannot cross into the sandbox as JSON. Write it to a "
                "file in the workspace and pass the file's path instead."
            ) from None
    return out


def exception_record(exc: BaseException, task_module: str | None) -> dict[str, Any]:
    """What crosses into the sandbox for an exception passed to a task
    (:mod:`guest_runner.exc_values` rebuilds it): one the host rebuilt from a sandbox's
    report goes as that report's class and message."""
    if not isinstance(exc, RemoteError):
        return exc_values.record(exc, task_module)
    base = getattr(type(exc), "_remote_base", None)
    if base is None:  # a RemoteTaskError: the class was the sandbox's alone
        return {"type": exc.remote_type, "qualname": exc.remote_type, "message": exc.remote_message}
    return {
        "type": base.__name__,
        "module": base.__module__,
        "qualname": base.__qualname__,
        "task_module": base.__module__ == task_module,
        "exception": issubclass(base, Exception),
        "message": exc.remote_message,
    }


def call_archive(
    ref: dict[str, str],
    parameters: dict[str, Any],
    *,
    real_prefect: bool = False,
    context: dict[str, Any] | None = None,
) -> bytes:
    body = json.dumps(
        {**ref, "parameters": parameters, "real_prefect": real_prefect, "context": context or {}}
    ).encode()
    return archive.pack_files([(call.CALL_FILE, body)])


def guest_argv(python: str = "python3") -> list[str]:
    return [python, "-m", "guest_runner.call", call.CALL_FILE]


def read_outcome(
    output_dir: Path | None,
    data: dict[str, bytes] | None = None,
    *,
    redactor: Redactor | None = None,
    task_module: str | None = None,
    memory_hint: str = "",
    limit: int | None = None,
    workspace: Path | None = None,
) -> tuple[bool, Any]:
    """(True, value) from return.json, or raises the task's exception from error.json.

    error.json is read from ``output_dir`` without following links and only as a regular
    file (prefect_resoluto.node.result_files), its first ``error_file.MAX_FILE`` bytes; it is
    redacted again here (the guest already did; this host does not take its word for it),
    and the redacted text replaces the file. return.json is in ``data`` (the node's
    :data:`READ_IN_MEMORY` files; without ``data``, read from ``output_dir`` as error.json
    is), parsed only within ``limit`` bytes and if parsing it costs a bounded multiple of
    its size (:mod:`.json_cost`). Its value is the task's data and is not altered; a state
    the task returned (:mod:`.returned_state`) has its name and message redacted.
    """
    if output_dir is not None:
        e = read_error(output_dir, redactor)
        if e is not None:
            raise error_from_record(e, task_module, memory_hint, workspace=workspace, redactor=redactor)
        raw = (
            data.get(call.RETURN_FILE)
            if data is not None
            else result_files.read(output_dir, call.RETURN_FILE, limit)
        )
        if raw is not None:
            if limit is not None and len(raw) > limit:
                raise WireError(f"{call.RETURN_FILE} from the sandbox is over {limit} bytes")
            try:
                json_cost.check(raw, call.RETURN_FILE)
            except json_cost.TooCostly as err:
                raise WireError(str(err)) from None
            try:
                doc = values.loads(
                    raw,
                    {
                        "exception": _returned_exception(task_module, redactor),
                        "object": _returned_object(task_module, workspace),
                    },
                )
                if not isinstance(doc, dict):
                    raise TypeError(f"it holds a {type(doc).__name__}, not an object")
                if "state" in doc:
                    return True, returned_state.build(doc["state"], redactor)
                return True, doc["value"]
            except (ValueError, KeyError, TypeError, RecursionError) as err:
                # the error may quote the sandbox's text (a tag's kind, a date it could not read)
                said = f"{call.RETURN_FILE} from the sandbox is malformed: {err!r}"
                raise WireError(redactor.text(said) if redactor is not None else said) from None
    return False, None


def _returned_object(task_module: str | None, workspace: Path | None) -> Callable[[Any], Any]:
    """How an object the task returned (a model, a dataclass, an enum member) is rebuilt
    when no annotation says what it is: as its class where that class is the user's own
    -- the task's module's, or a module of the workspace the host has already imported --
    else it stays its data. The sandbox names the class: no class but the user's own is
    ever built from what it sent, and nothing is imported for it."""

    def rebuild_object(rec: Any) -> Any:
        if not isinstance(rec, dict) or not isinstance(rec.get("class"), dict) or "v" not in rec:
            raise ValueError("a tagged object holds its class and its data")
        cls = _user_class(rec["class"], task_module, workspace)
        return rec["v"] if cls is None else _validated(cls, rec["v"])

    return rebuild_object


def _user_class(ref: dict[str, Any], task_module: str | None, workspace: Path | None) -> type | None:
    own = ref.get("task_module") is True
    name = task_module if own else ref.get("module")
    qualname = ref.get("qualname")
    module = sys.modules.get(name) if isinstance(name, str) else None
    if module is None or not isinstance(qualname, str) or "<locals>" in qualname:
        return None
    if not own and not _in_workspace(getattr(module, "__file__", None), str(workspace or "")):
        return None
    obj: Any = module
    for part in qualname.split("."):
        if obj is None or not part.isidentifier():
            return None
        obj = _own_attribute(obj, part)
    if not isinstance(obj, type):
        return None
    if issubclass(obj, enum.Enum) or dataclasses.is_dataclass(obj) or hasattr(obj, "model_fields"):
        return obj
    return None


@functools.lru_cache(maxsize=256)
def _in_workspace(module_file: str | None, workspace: str) -> bool:
    if not module_file or not workspace:
        return False
    return Path(module_file).resolve().is_relative_to(Path(workspace).resolve())


def _validated(cls: type, data: Any) -> Any:
    from pydantic import ValidationError

    try:
        return _adapter(cls).validate_python(data)
    except (ValidationError, TypeError, ValueError):
        return data  # not what the class describes: its data, as before


@functools.lru_cache(maxsize=128)
def _adapter(cls: type) -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(cls)


def _returned_exception(task_module: str | None, redactor: Redactor | None) -> Callable[[Any], BaseException]:
    """How an exception the task returned (or put in its state) is rebuilt: as one it
    raised is (its class where the host has it, else a RemoteTaskError), redacted."""

    def rebuild_exception(rec: Any) -> BaseException:
        if not isinstance(rec, dict):
            raise ValueError("a tagged exception holds an object")
        if redactor is not None and redactor.count:
            rec = redactor.data(error_file.as_text(rec))
        # A value, never a KeyboardInterrupt or SystemExit that reading a state would raise
        # on the host: a class that is not an Exception's becomes a RemoteTaskError.
        e = {**error_file.bounded(rec), "traceback": "", "exception": True}
        return _exception_from_record(e, task_module, "")

    return rebuild_exception


def read_error(output_dir: Path, redactor: Redactor | None) -> dict[str, Any] | None:
    """error.json as a record of bounded size (:mod:`.error_file`: at most its first
    ``error_file.MAX_FILE`` bytes are read, each text cut to its bound), redacted, and
    rewritten so in place (a new file renamed over it); None when there is none. One that
    cannot be read safely (a link, not a regular file) becomes a record that says so."""
    try:
        head = result_files.read_head(output_dir, call.ERROR_FILE, error_file.MAX_FILE)
    except result_files.ResultFileError as err:
        return {"type": "Exception", "message": f"refused: {err}"}
    if head is None:
        return None
    data, cut = head
    e = error_file.parse(data, cut, call.ERROR_FILE)
    del data
    if redactor is not None and redactor.count:
        clean: dict[str, Any] = error_file.bounded(redactor.data(error_file.as_text(e)))
        if cut or clean != e:
            result_files.replace(output_dir, call.ERROR_FILE, json.dumps(clean, ensure_ascii=False).encode())
        return clean
    return error_file.bounded(e)


def error_from_record(
    e: dict[str, Any],
    task_module: str | None = None,
    memory_hint: str = "",
    *,
    workspace: Path | None = None,
    redactor: Redactor | None = None,
    _depth: int = 0,
) -> BaseException:
    """The exception to raise on the host for error.json's record ``e``: its class where
    the host has it, the sandbox's frames as its traceback, and what it was raised from
    or during (``chained``) as its ``__cause__`` / ``__context__``."""
    exc = _exception_from_record(e, task_module, memory_hint)
    exc.__traceback__ = remote_traceback.build(exc, e.get("frames"), workspace=workspace, redactor=redactor)
    chained = e.get("chained")
    if isinstance(chained, dict) and _depth < remote_traceback.MAX_CHAIN:
        inner = error_from_record(
            chained, task_module, workspace=workspace, redactor=redactor, _depth=_depth + 1
        )
        if chained.get("how") == "cause":
            exc.__cause__ = inner
        else:
            exc.__context__ = inner
    if isinstance(exc, RemoteError) and exc.remote_type.endswith("ExceptionGroup"):
        # Not rebuilt as a group: its sub-exceptions are told by the sandbox's text.
        exc.add_note(exc.remote_traceback.rstrip())
    return exc


def _exception_from_record(e: dict[str, Any], task_module: str | None, memory_hint: str) -> BaseException:
    type_name = str(e.get("type") or "Exception")
    message, traceback = str(e.get("message") or ""), str(e.get("traceback") or "")
    if type_name == "MemoryError" and memory_hint:
        message = f"{message}: {memory_hint}" if message else memory_hint
    module = e.get("module")
    if e.get("task_module") is True and task_module:
        module = task_module  # the guest imported the task's file under another name, maybe
    cls = _find_class(str(module) if module else None, str(e.get("qualname") or type_name))
    if cls is not None and issubclass(cls, Exception) != bool(e.get("exception", True)):
        cls = None  # not the class the sandbox meant
    if cls is None and e.get("exception") is False:
        return _remote_class(BaseException)(type_name, message, traceback)
    return remote_exception(cls, type_name, message, traceback)


def rebuild(value: Any, annotation: Any) -> Any:
    """Turn the return value back into the task's annotated type, where it says one and the
    value is not already of it: what JSON cannot carry with its type (a dataclass, a pydantic
    model, an enum) comes as its JSON form."""
    if annotation in (inspect.Signature.empty, Any, None) or isinstance(annotation, str):
        return value
    if isinstance(annotation, type) and isinstance(value, annotation):
        return value  # as a thread's task returns it: not validated, not copied
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(annotation).validate_python(value)
    except (ValidationError, TypeError, NameError):
        return value  # the annotation does not describe what came back; hand over the JSON


def return_annotation(fn: Callable[..., Any]) -> Any:
    try:
        import typing

        return typing.get_type_hints(fn).get("return", inspect.Signature.empty)
    except Exception:
        return inspect.Signature.empty
