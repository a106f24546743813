"""Python-task entry in the sandbox: ``python -m guest_runner.call .resoluto/call.json``.

``call.json`` names the function (a source file relative to the workspace plus a
qualname, or an importable ``module``) and its parameters as JSON that keeps their
types (:mod:`guest_runner.values`). The function's
module is imported under its own name, so its ``if __name__ == "__main__":`` block
does not run, and a flow it calls at import without that guard is not run either
(:mod:`guest_runner.importguard`). The return value goes to ``.resoluto/return.json``, encoded the same way; an exception to
``.resoluto/error.json`` (type, message, traceback as text and as frames, from the task's
own frame down, and what it was raised from), redacted of secrets before it is written: the traceback and message are the runner's words about the task, and may quote
a secret. The return value is the task's data and is written as it is. Nothing is pickled.

``call.json`` may also carry the run's ``context`` (tags, task_run, flow_run,
deployment, the run context objects' fields), which :mod:`guest_runner.standin` and
:mod:`guest_runner.runctx` make visible through ``prefect``.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import traceback
from typing import Any, Dict

from guest_runner import exc_values, from_host, importguard, typed, values

CALL_DIR = ".resoluto"
CALL_FILE = CALL_DIR + "/call.json"
RETURN_FILE = CALL_DIR + "/return.json"
ERROR_FILE = CALL_DIR + "/error.json"
#: The installed packages the call imported (names only), so a warm pool can pre-import
#: them for the module's next node (prefect_resoluto.warm.pool.Learned).
IMPORTS_FILE = CALL_DIR + "/imports.json"
#: At most this many names are reported: a bound on what a pool pre-imports.
MAX_IMPORTS = 200
#: Loaded before any call (the interpreter's start, site's hooks): not the task's doing.
_AT_START = frozenset(sys.modules)


class CallError(Exception):
    """The call cannot even be attempted (bad call.json, import failure)."""


def _jsonable(value: Any) -> Any:
    """What JSON makes of a value :func:`values.tagged_object` does not tag (models,
    dataclasses and enum members are tagged before this is asked)."""
    if hasattr(value, "model_dump") and callable(value.model_dump):  # a model-like object
        return value.model_dump(mode="json")
    if isinstance(value, tuple):  # a namedtuple: its items (a plain tuple keeps its type)
        return list(value)
    if inspect.isgenerator(value) or inspect.isasyncgen(value):
        raise TypeError(
            "the task is a generator: a sandboxed task's values cross to the host once, when it "
            "returns. Return a list of what it would yield instead."
        )
    raise TypeError(
        f"the task returned a {type(value).__module__}.{type(value).__qualname__}, which cannot cross "
        "back to the host as JSON. Write it to a file in the workspace, declare the file in output_paths, "
        "and return its path instead."
    )


def module_name_for(rel_file: str) -> str:
    """Dotted module name for a workspace file: a package path when every parent
    directory is a package, else the bare file stem (its directory goes on sys.path)."""
    parts = rel_file[:-3].split("/") if rel_file.endswith(".py") else rel_file.split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    for i in range(1, len(parts)):
        if not os.path.isfile(os.path.join(*parts[:i], "__init__.py")):
            return parts[-1]
    return ".".join(parts)


def load_function(spec: Dict[str, Any]) -> Any:
    qualname = spec.get("qualname")
    if not isinstance(qualname, str) or not qualname:
        raise CallError("call.json has no 'qualname'")
    try:
        if spec.get("file"):
            rel = spec["file"]
            if os.path.isabs(rel) or ".." in rel.split("/"):
                raise CallError(f"call.json 'file' must be relative to the workspace, got {rel!r}")
            if not os.path.isfile(rel):
                raise CallError(f"the task's source file {rel!r} is not in the staged workspace")
            name = module_name_for(rel)
            root = os.getcwd()
            sys.path[:0] = [root] if "." in name else [os.path.join(root, os.path.dirname(rel)), root]
            module = importguard.import_task_module(name, qualname)
        elif spec.get("module"):
            module = importguard.import_task_module(spec["module"], qualname)
        else:
            raise CallError("call.json names neither a 'file' nor a 'module'")
    except CallError:
        raise
    except ImportError as e:
        raise CallError(
            f"importing the task's module failed in the sandbox: {type(e).__name__}: {e}. The sandbox "
            "can only import what its image (or the mounted environment) provides: install the "
            "package in the guest image, or ship the module inside the workspace."
        ) from e
    obj: Any = module
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CallError(f"{qualname!r} not found in module {module.__name__!r}") from None
    fn = getattr(obj, "fn", obj)  # a real prefect Task wraps the function
    if not callable(fn):
        raise CallError(f"{qualname!r} in {module.__name__!r} is not callable")
    from guest_runner import runctx

    runctx.set_task(obj)  # TaskRunContext.get().task: the task as its module defined it
    return fn


def call(fn: Any, params: Dict[str, Any]) -> Any:
    sig = inspect.signature(fn)
    try:
        import typing

        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    unknown = set(params) - set(sig.parameters)
    if unknown:
        raise CallError(f"parameters {sorted(unknown)} are not in the signature of {fn.__qualname__}")
    values = {
        name: typed.rebuild(hints.get(name, p.annotation), params[name])
        for name, p in sig.parameters.items()
        if name in params
    }
    args, kwargs = _arguments(sig, values)
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        import asyncio  # only for coroutine tasks: it pulls in ssl, socket, logging ...

        result = asyncio.run(_await(result))
    return result


def _arguments(sig: inspect.Signature, values: Dict[str, Any]) -> "tuple[list[Any], Dict[str, Any]]":
    """The call's positional and keyword arguments for the parameters Prefect bound by
    name, as Prefect's engine calls the function on a thread: positional-only ones by
    position, and every one before ``*args`` when ``*args`` holds something (those left
    out take their defaults), the rest by keyword."""
    kinds = inspect.Parameter
    params = list(sig.parameters.values())
    star = next((p for p in params if p.kind is kinds.VAR_POSITIONAL), None)
    star_values = list(values.get(star.name) or ()) if star is not None else []
    positional = [
        p
        for p in params
        if p.kind is kinds.POSITIONAL_ONLY or (star_values and p.kind is kinds.POSITIONAL_OR_KEYWORD)
    ]
    given = [i for i, p in enumerate(positional) if p.name in values]
    positional = positional if star_values else positional[: given[-1] + 1 if given else 0]
    args: "list[Any]" = []
    for p in positional:
        if p.name not in values and p.default is kinds.empty:
            raise CallError(f"{p.name!r} has no value and no default, and must be passed by position")
        args.append(values[p.name] if p.name in values else p.default)
    args.extend(star_values)
    by_position = {p.name for p in positional}
    kwargs: Dict[str, Any] = {}
    for p in params:
        if p.kind is kinds.VAR_KEYWORD:
            kwargs.update(values.get(p.name) or {})
        elif p.kind is not kinds.VAR_POSITIONAL and p.name in values and p.name not in by_position:
            kwargs[p.name] = values[p.name]
    return args, kwargs


async def _await(aw: Any) -> Any:
    return await aw


def _encoded(result: Any, task_module: "str | None", redact: Any) -> Any:
    """The return value as JSON that gives the host back its types (:mod:`guest_runner.values`)."""

    def fallback(value: Any) -> Any:
        if isinstance(value, BaseException):
            return values.Tagged("exception", exc_values.record(value, task_module, redact))
        # a model, dataclass or enum member: the host rebuilds it as its class where it has it
        return values.tagged_object(value, task_module, fallback) or _jsonable(value)

    try:
        return values.encode(result, fallback)
    except RecursionError:
        raise ValueError("the task's return value is nested too deeply (or holds itself)") from None


#: The states a task may end in by returning one, as Prefect's engine takes them.
_FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")


def _returned(result: Any, task_module: "str | None", redact: Any) -> Dict[str, Any]:
    """return.json's record: the value, or the Prefect state the task returned to end in
    (``return Failed(message=...)``): its type, name, message and data."""
    objects = sys.modules.get("prefect.client.schemas.objects")  # a State needs Prefect loaded
    state_cls = getattr(objects, "State", None)
    if state_cls is None or not isinstance(result, state_cls):
        return {"value": _encoded(result, task_module, redact)}
    kind = str(getattr(result.type, "value", result.type))
    if kind not in _FINAL_STATES:
        raise ValueError(
            f"the task returned a {kind} state; a task ends in a state it returns only when that "
            f"is one of {', '.join(s.title() for s in _FINAL_STATES)}"
        )
    data = result.data
    if hasattr(data, "metadata") and hasattr(data, "result"):  # a ResultRecord the task made
        data = data.result
    state: Dict[str, Any] = {"type": kind, "name": redact(str(result.name))}
    if result.message is not None:
        state["message"] = redact(str(result.message))
    if data is not None:
        state["value"] = _encoded(data, task_module, redact)
    return {"state": state}


def _write(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, default=_jsonable, ensure_ascii=False)
    os.replace(tmp, path)


def imported_packages(workspace: str) -> "list[str]":
    """Installed (non-standard-library) modules now loaded, at most two levels deep:
    every top-level package first, then ``pkg.sub`` names, each in the order sys.modules
    holds them; names only. Never the workspace's own modules, the guest runner's, the
    stand-ins, what the interpreter loaded at its start or what loading the real Prefect
    did (a warm sandbox for the module pre-imports that anyway): a pool must only
    pre-import what the image provides. Empty on Python < 3.10 (no list of the standard library)."""
    stdlib = getattr(sys, "stdlib_module_names", None)
    if stdlib is None:
        return []
    root = os.path.realpath(workspace) + os.sep
    standin = sys.modules.get("guest_runner.standin")
    with_prefect = standin.real_loaded() if standin is not None else frozenset()
    names: "list[str]" = []
    for name, module in list(sys.modules.items()):
        top = name.partition(".")[0]
        if (
            name.count(".") > 1
            or top in stdlib
            or top in ("guest_runner", "__main__")
            or module is None
            or name in _AT_START
            or name in with_prefect
        ):
            continue
        origin = getattr(getattr(module, "__spec__", None), "origin", None) or getattr(
            module, "__file__", None
        )
        if not isinstance(origin, str) or not os.path.isabs(origin):  # built-in, namespace, stand-in
            continue
        if os.path.realpath(origin).startswith(root):
            continue
        names.append(name)
    names.sort(key=lambda n: "." in n)  # stable: packages, then their submodules
    return names[:MAX_IMPORTS]


def _report_imports(workspace: str) -> None:
    try:
        _write(IMPORTS_FILE, {"modules": imported_packages(workspace)})
    except Exception:  # noqa: BLE001 - a hint for the pool, never the task's failure
        pass


#: This package's own directory: its frames (the call, the stand-ins' inline calls) are
#: plumbing, not the task's traceback.
_GUEST_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: Bounds on the structured traceback: frames per exception, chained exceptions.
MAX_FRAMES = 1000
MAX_CHAIN = 8


def _drop_guest_frames(te: Any, depth: int = 0) -> None:
    """The task's traceback from its own frame down: the guest runner's frames go, in this
    exception and every one chained to it."""
    if te is None or depth > MAX_CHAIN:
        return
    kept = [f for f in te.stack if not os.path.abspath(f.filename).startswith(_GUEST_DIR)]
    te.stack = traceback.StackSummary.from_list(kept)
    _drop_guest_frames(te.__cause__, depth + 1)
    _drop_guest_frames(te.__context__, depth + 1)
    for sub in getattr(te, "exceptions", None) or ():
        _drop_guest_frames(sub, depth + 1)


def _frames(te: Any, workspace: str, redact: Any) -> "list[Dict[str, Any]]":
    """Where each frame is (a workspace file by its relative path), for the host to show
    them as a thread's traceback would. No source text: the host reads its own copy of
    the workspace."""
    root = os.path.realpath(workspace) + os.sep
    out: "list[Dict[str, Any]]" = []
    for f in list(te.stack)[-MAX_FRAMES:]:
        path = os.path.realpath(f.filename) if os.path.isabs(f.filename) else f.filename
        inside = path.startswith(root)
        out.append(
            {
                "file": redact(path[len(root) :].replace(os.sep, "/") if inside else f.filename),
                "workspace": inside,
                "line": f.lineno or 0,
                "name": redact(f.name),
            }
        )
    return out


def _exception_fields(e: BaseException, task_module: "str | None", redact: Any) -> Dict[str, Any]:
    cls = type(e)
    return {
        "type": cls.__name__,
        "module": cls.__module__,
        "qualname": cls.__qualname__,
        # The class came from the task's own module: the host knows that module by the
        # task function's name for it.
        "task_module": task_module is not None and cls.__module__ == task_module,
        "exception": isinstance(e, Exception),
        "message": redact(str(e)),
    }


def _chained(
    e: BaseException, te: Any, task_module: "str | None", redact: Any, workspace: str, depth: int
) -> "Dict[str, Any] | None":
    """The exception ``e`` was raised from (``cause``) or during (``context``), as a record."""
    if depth >= MAX_CHAIN:
        return None
    for key in ("cause", "context"):
        inner = getattr(e, f"__{key}__")
        inner_te = getattr(te, f"__{key}__")
        if inner is None or inner_te is None or (key == "context" and e.__suppress_context__):
            continue
        rec = _exception_fields(inner, task_module, redact)
        rec["frames"] = _frames(inner_te, workspace, redact)
        rec["how"] = key
        nested = _chained(inner, inner_te, task_module, redact, workspace, depth + 1)
        if nested is not None:
            rec["chained"] = nested
        return rec
    return None


def _from_the_task_frame(te: Any, task_code: Any) -> None:
    """Frames before the task function's own go (asyncio.run's, for a coroutine task)."""
    if task_code is None:
        return
    stack = list(te.stack)
    for i, f in enumerate(stack):
        if f.filename == task_code.co_filename and f.name == task_code.co_name:
            te.stack = traceback.StackSummary.from_list(stack[i:])
            return


def _error_record(
    e: BaseException, task_module: "str | None", redact: Any, workspace: str = ".", task_code: Any = None
) -> Dict[str, Any]:
    te = traceback.TracebackException(type(e), e, e.__traceback__)
    _drop_guest_frames(te)
    _from_the_task_frame(te, task_code)
    record = _exception_fields(e, task_module, redact)
    record["traceback"] = redact("".join(te.format()))
    record["frames"] = _frames(te, workspace, redact)
    chained = _chained(e, te, task_module, redact, workspace, 0)
    if chained is not None:
        record["chained"] = chained
    return record


def main(argv: "list[str] | None" = None) -> int:
    from guest_runner.redact import Redactor

    argv = sys.argv[1:] if argv is None else argv
    call_path = argv[0] if argv else CALL_FILE
    # The sandbox and its workspace are thrown away after this call: a module's bytecode
    # written beside its source would never be read again (a directory, a file and a
    # rename per module, dear in gVisor), and would land in the task's own workspace.
    sys.dont_write_bytecode = True
    # Read before the task runs: it may change its own environment.
    redact = Redactor.from_env(os.environ).text
    task_module: "str | None" = None
    task_code: Any = None
    workspace = os.getcwd()
    received = from_host.FromHost()
    try:
        with open(call_path, encoding="utf-8") as f:
            # the parameters (and the context's) as the host's values
            spec = values.loads(f.read(), received.kinds())
        if not isinstance(spec, dict) or not isinstance(spec.get("parameters", {}), dict):
            raise CallError(f"{call_path} must hold an object with 'parameters' as an object")
        from guest_runner import standin

        standin.set_run_context(spec.get("context"))
        if standin.uses_real_prefect():  # a warm call pre-imported it, before this context existed
            standin.apply_run_context()
        elif spec.get("real_prefect"):  # opt-out of the stand-ins: pay for the real import up front
            standin.use_real_prefect()
        else:
            standin.install()
        fn = load_function(spec)
        task_module = getattr(fn, "__module__", None)
        task_code = getattr(fn, "__code__", None)
        if received.count:  # objects and exceptions from the host: now the task's module is loaded
            from_host.revive(spec, sys.modules.get(task_module or ""))
        params = spec.get("parameters", {})
        try:
            result = call(fn, params)
        finally:
            _report_imports(workspace)
        try:
            _write(RETURN_FILE, _returned(result, task_module, redact))
        except (TypeError, ValueError) as e:
            _write(
                ERROR_FILE,
                {
                    "type": "ResultNotSerializable",
                    "module": None,
                    "exception": True,
                    "message": redact(str(e)),
                    "traceback": "",
                },
            )
            return 1
        return 0
    except BaseException as e:  # report every failure, then fail
        # SystemExit and KeyboardInterrupt too, whatever the code: Prefect's engine makes
        # any BaseException in a task a crash, and the host does the same with this record.
        # The host logs the traceback as one record; it is not printed here line by line.
        try:
            record = _error_record(e, task_module, redact, workspace, task_code)
        except MemoryError:
            record = {
                "type": type(e).__name__,
                "module": type(e).__module__,
                "qualname": type(e).__qualname__,
                "exception": isinstance(e, Exception),
                "message": "",
                "traceback": "",
            }
        # Let go of the task's frames, and the memory they hold, before writing: after a
        # MemoryError there is otherwise none left to write the report with.
        traceback.clear_frames(e.__traceback__)
        e.__traceback__ = None
        del e
        import gc

        gc.collect()
        _write(ERROR_FILE, record)
        return 1


if __name__ == "__main__":
    sys.exit(main())
