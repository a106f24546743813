"""Cheap guest-side stand-ins for ``prefect`` and ``prefect_resoluto``.

Importing ``prefect`` costs seconds (more under gVisor, where syscalls are dear), and a
task module usually needs nothing from it but ``@task``, ``@flow`` and
``get_run_logger``. Until the module touches anything else, those names come from
here; the first other attribute or submodule loads the real package transparently.

Whichever is in use, a task in the sandbox sees the run it belongs to (the host sends
it as JSON): ``prefect.runtime.task_run`` / ``flow_run`` / ``deployment``, the
current tags and the run context objects (:mod:`guest_runner.runctx`). Calling another task
(or a flow) from a task runs it inline, in this sandbox, as a plain call of its function:
there is no Prefect API in here to create runs with. A flow a script calls at import time,
unguarded, is not run again here (:mod:`guest_runner.importguard`).
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import types
from importlib.machinery import ModuleSpec, PathFinder
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, cast

from guest_runner import importguard, runctx
from guest_runner.wire import LOG_MARKER

if TYPE_CHECKING:
    from importlib.abc import Loader as _LoaderBase
    from importlib.abc import MetaPathFinder as _FinderBase
else:
    # importlib.abc pulls in importlib.resources (tempfile, shutil, bz2, lzma, random ...):
    # a cost on every call's start in gVisor, for two base classes the import system never needs.
    _LoaderBase = _FinderBase = object


class _MarkerHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
            stream = sys.__stdout__ or sys.stdout
            stream.write(
                LOG_MARKER
                + json.dumps(
                    {"level": record.levelname, "logger": record.name, "msg": msg}, ensure_ascii=False
                )
                + "\n"
            )
            stream.flush()
        except Exception:
            self.handleError(record)


_LOGGER: Optional[logging.Logger] = None


def get_run_logger(*args: Any, **kwargs: Any) -> logging.Logger:
    """What ``prefect.get_run_logger`` gives a task in the sandbox: records, with their
    levels, travel to the host and land in the task run's logs."""
    global _LOGGER
    if _LOGGER is None:
        logger = logging.getLogger("prefect.task_runs")
        logger.handlers[:] = [_MarkerHandler()]
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
        _LOGGER = logger
    return _LOGGER


def _debug(text: str) -> None:
    get_run_logger().debug(text)


importguard.note = _debug


# -- the run this sandbox works for ------------------------------------------------------
#: What the host sent in call.json's "context": tags, task_run, flow_run, deployment.
_CONTEXT: Dict[str, Any] = {}


def set_run_context(context: Optional[Dict[str, Any]]) -> None:
    """Record the run context (before install() / use_real_prefect())."""
    _CONTEXT.clear()
    if isinstance(context, dict):
        _CONTEXT.update(context)
    runctx.set_contexts(_CONTEXT.get("contexts"))


def _apply_run_context(prefect: types.ModuleType) -> None:
    """Make the real package answer from the host's context, not from an API it cannot reach."""
    runtime_modules = {
        "task_run": "prefect.runtime.task_run",
        "flow_run": "prefect.runtime.flow_run",
        "deployment": "prefect.runtime.deployment",
    }
    for key, modname in runtime_modules.items():
        values = _CONTEXT.get(key)
        if not isinstance(values, dict):
            continue
        module = importlib.import_module(modname)
        fields = getattr(module, "FIELDS", None)
        if isinstance(fields, dict):
            for name, value in values.items():
                fields[name] = lambda v=value: v
    tags = _CONTEXT.get("tags")
    if isinstance(tags, list) and tags:
        context = importlib.import_module("prefect.context")
        # Entered for the rest of this process, which is the task's whole life.
        context.TagsContext(current_tags=set(map(str, tags))).__enter__()
    runctx.enter_real()


# -- nested task calls ---------------------------------------------------------------------
_ANNOUNCED: "set[str]" = set()


def _announce(name: str, how: str) -> None:
    if name not in _ANNOUNCED:
        _ANNOUNCED.add(name)
        get_run_logger().info(
            "nested task %r (%s) runs inline in this sandbox as a plain call of its function: "
            "no separate task run, state, retries or cache",
            name,
            how,
        )


class InlineFuture:
    """What ``task.submit()`` returns inside the sandbox: the call already happened."""

    def __init__(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> None:
        self._value: Any = None
        self._error: Optional[BaseException] = None
        try:
            self._value = fn(*args, **kwargs)
        except Exception as e:  # raised again from result(), as a Prefect future would
            self._error = e
        if self._value is not None and _isawaitable(self._value):
            import asyncio

            async def _await(aw: Any) -> Any:
                return await aw

            try:
                self._value = asyncio.run(_await(self._value))
            except Exception as e:
                self._value, self._error = None, e

    def result(self, timeout: Optional[float] = None, raise_on_failure: bool = True) -> Any:
        if self._error is not None:
            if raise_on_failure:
                raise self._error
            return self._error
        return self._value

    def wait(self, timeout: Optional[float] = None) -> None:
        return None

    def done(self) -> bool:
        return True

    def add_done_callback(self, fn: Callable[["InlineFuture"], Any]) -> None:
        fn(self)


def _isawaitable(v: Any) -> bool:
    import inspect

    return inspect.isawaitable(v)


def _iscoroutinefunction(fn: Any) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)


def _plain(value: Any) -> Any:
    """Unwrap ``unmapped(x)`` / ``quote(x)`` / a future (Prefect's annotations) to the value."""
    if isinstance(value, InlineFuture):
        return value.result()
    inline = getattr(value, "_resoluto_inline", None)
    if isinstance(inline, InlineFuture):
        return inline.result()
    if type(value).__name__ in ("unmapped", "quote", "allow_failure") and hasattr(value, "value"):
        inner = value.value
        return inner() if callable(inner) and type(value).__name__ != "unmapped" else inner
    return value


def inline_submit(name: str, fn: Callable[..., Any], args: Any, kwargs: Any) -> InlineFuture:
    _announce(name, "submit")
    kwargs = {k: v for k, v in kwargs.items() if k not in ("wait_for", "return_state")}
    return InlineFuture(fn, [_plain(a) for a in args], {k: _plain(v) for k, v in kwargs.items()})


def inline_map(name: str, fn: Callable[..., Any], args: Any, kwargs: Any) -> List[InlineFuture]:
    """Prefect's map semantics: iterables are mapped element-wise, everything else (and
    ``unmapped(x)``) is passed whole to every call."""
    _announce(name, "map")
    kwargs = {k: v for k, v in kwargs.items() if k not in ("wait_for", "return_state")}

    def mapped(v: Any) -> bool:
        return type(v).__name__ != "unmapped" and isinstance(v, (list, tuple, set, frozenset, range))

    lengths = {len(list(v)) for v in list(args) + list(kwargs.values()) if mapped(v)}
    if len(lengths) > 1:
        raise ValueError(f"map of {name!r} got iterable arguments of different lengths {sorted(lengths)}")
    n = lengths.pop() if lengths else 0
    futures = []
    for i in range(n):
        a = [list(v)[i] if mapped(v) else _plain(v) for v in args]
        k = {key: (list(v)[i] if mapped(v) else _plain(v)) for key, v in kwargs.items()}
        futures.append(InlineFuture(fn, a, k))
    return futures


def inline_call(name: str, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    _announce(name, "call")
    kwargs = {k: v for k, v in kwargs.items() if k not in ("wait_for", "return_state")}
    result = fn(*args, **kwargs)
    if _isawaitable(result):
        import asyncio

        try:
            asyncio.get_running_loop()
        except RuntimeError:  # an async task called from sync code: Prefect runs it to the end

            async def _await(aw: Any) -> Any:
                return await aw

            return asyncio.run(_await(result))
    return result  # from async code the caller awaits it, as under Prefect


class StandInTask:
    """Enough of a Prefect Task to import a module that defines tasks, and to call,
    submit or map one task from another (inline, in this sandbox)."""

    def __init__(self, fn: Callable[..., Any], **options: Any) -> None:
        self.fn = fn
        self.name = cast(str, options.get("name") or getattr(fn, "__name__", "task"))  # a Prefect task name
        # As a real Task's: Prefect's sync/async dispatch asks it of the run context's task.
        self.isasync = _iscoroutinefunction(fn)
        self.__wrapped__ = fn
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return inline_call(self.name, self.fn, args, kwargs)

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        done = inline_submit(self.name, self.fn, args, kwargs)
        return _real_future(done) if _PATCHED else done  # a PrefectFuture once Prefect is loaded

    def map(self, *args: Any, **kwargs: Any) -> Any:
        done = inline_map(self.name, self.fn, args, kwargs)
        if not _PATCHED:
            return done
        futures = importlib.import_module("prefect.futures")
        return futures.PrefectFutureList([_real_future(f) for f in done])

    def with_options(self, **options: Any) -> "StandInTask":
        return self

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"{name!r} of a task is not available inside the sandbox: the sandbox runs the task's "
            "function, and nested calls of other tasks run inline"
        )


class StandInFlow(StandInTask):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        importguard.flow_called(self.name, "called")
        return self.fn(*args, **kwargs)

    def serve(self, *args: Any, **kwargs: Any) -> Any:
        return self._at_import("serve", "served")

    def deploy(self, *args: Any, **kwargs: Any) -> Any:
        return self._at_import("deploy", "deployed")

    def _at_import(self, attr: str, how: str) -> Any:
        """A script's unguarded ``flow.serve()``: nothing while its module is imported."""
        return None if importguard.flow_called(self.name, how) else StandInTask.__getattr__(self, attr)


def _decorator(kind: type) -> Callable[..., Any]:
    def decorate(__fn: Optional[Callable[..., Any]] = None, **options: Any) -> Any:
        if __fn is None:
            return lambda fn: kind(fn, **options)
        return kind(__fn, **options)

    return decorate


task = _decorator(StandInTask)
flow = _decorator(StandInFlow)


class _Inert:
    """Anything from ``prefect_resoluto`` used at import time (``ResolutoTaskRunner(...)``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> "_Inert":
        return self

    def __getattr__(self, name: str) -> "_Inert":
        return self

    def __enter__(self) -> "_Inert":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _LazyModule(types.ModuleType):
    """A stand-in package that becomes the real one on first unknown use."""

    def __init__(
        self, name: str, provided: "dict[str, Any]", fallback: Optional[Callable[[str], Any]]
    ) -> None:
        super().__init__(name)
        self.__dict__.update(provided)
        self.__dict__["_standin_fallback"] = fallback

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr not in ("__version__", "__all__"):
            raise AttributeError(attr)
        fallback = self.__dict__["_standin_fallback"]
        if fallback is not None:
            return fallback(attr)
        return getattr(_load_real(self.__name__), attr)


def _load_real(name: str) -> types.ModuleType:
    current = sys.modules.get(name)
    if isinstance(current, _LazyModule):
        del sys.modules[name]
    real = importlib.import_module(name)
    if name == "prefect":
        _patch_real_prefect(real)
    return real


_PATCHED = False


def _patch_real_prefect(prefect: types.ModuleType) -> None:
    global _PATCHED
    if _PATCHED:
        return
    _PATCHED = True
    # The real get_run_logger needs a run context that only exists on the host.
    prefect.get_run_logger = get_run_logger  # type: ignore[attr-defined]
    loggers = importlib.import_module("prefect.logging.loggers")
    loggers.get_run_logger = get_run_logger  # type: ignore[attr-defined]
    logging_pkg = importlib.import_module("prefect.logging")
    logging_pkg.get_run_logger = get_run_logger  # type: ignore[attr-defined]
    # Calling a real Task from a task would look for a task runner and an API: run inline,
    # and hand back real Prefect futures (code may check isinstance(f, PrefectFuture)).
    tasks = importlib.import_module("prefect.tasks")
    futures = importlib.import_module("prefect.futures")
    cls = tasks.Task
    cls.__call__ = lambda self, *a, **k: inline_call(self.name, self.fn, a, k)
    cls.submit = lambda self, *a, **k: _real_future(inline_submit(self.name, self.fn, a, k))
    cls.map = lambda self, *a, **k: futures.PrefectFutureList(
        [_real_future(f) for f in inline_map(self.name, self.fn, a, k)]
    )
    _guard_flows(importlib.import_module("prefect.flows").Flow)
    _apply_run_context(prefect)
    # No ephemeral server, no wait on an API; artifacts relayed to the host.
    from guest_runner import prefect_api

    prefect_api.patch()
    # What any task module's `from prefect import task` loads (Prefect's logging set-up
    # among it), here as in a warm sandbox's pre-import: then what is loaded now is the
    # same in a cold call and a warm one, and is not the task's to report (real_loaded).
    try:
        importlib.import_module("prefect.main")
    except Exception:  # noqa: BLE001 - the task's own `from prefect import ...` reports it
        pass
    _REAL_LOADED.update(sys.modules)


def _guard_flows(cls: type) -> None:
    """A real Flow as the stand-in's: called, served or deployed while the task's module is
    imported, as :mod:`guest_runner.importguard` says; called otherwise, its function runs
    inline (there is no API in here to make a flow run with)."""

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        importguard.flow_called(str(self.name), "called")
        return self.fn(*args, **{k: v for k, v in kwargs.items() if k not in ("wait_for", "return_state")})

    def at_import(attr: str, how: str) -> Callable[..., Any]:
        original = getattr(cls, attr)

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return None if importguard.flow_called(str(self.name), how) else original(self, *args, **kwargs)

        return method

    cls.__call__ = call  # type: ignore[method-assign]
    for attr, how in (("serve", "served"), ("deploy", "deployed")):
        if hasattr(cls, attr):
            setattr(cls, attr, at_import(attr, how))


#: Every module loaded once the real Prefect was: Prefect's own dependencies (pydantic,
#: httpx, ...) are not the task's imports. A call reporting them made its warm pool key
#: change after its first call, and a new image boot the real Prefect again (issue 41).
_REAL_LOADED: "set[str]" = set()


def real_loaded() -> "frozenset[str]":
    """The modules loaded by the time the real Prefect was (empty while it is not)."""
    return frozenset(_REAL_LOADED)


_REAL_FUTURE: Optional[type] = None


def _real_future(inline: InlineFuture) -> Any:
    """A ``prefect.futures.PrefectTaskRunFuture`` for a nested call that already ran inline:
    its state is final (Completed, or Failed with the exception) and no API is asked. Its
    ``task_run_id`` is a fresh id naming no task run: a nested call has none."""
    global _REAL_FUTURE
    if _REAL_FUTURE is None:
        import uuid

        futures = importlib.import_module("prefect.futures")
        states = importlib.import_module("prefect.states")

        class InlinePrefectFuture(futures.PrefectTaskRunFuture):  # type: ignore[misc,name-defined]
            def __init__(self, done: InlineFuture) -> None:
                super().__init__(uuid.uuid4())
                self._resoluto_inline = done
                if done._error is not None:
                    e = done._error
                    self._final_state = states.Failed(
                        data=e, message=f"Task run encountered an exception {type(e).__name__}: {e}"
                    )
                else:
                    self._final_state = states.Completed(data=done._value)

            def wait(self, timeout: Optional[float] = None) -> None:
                return None

            def result(self, timeout: Optional[float] = None, raise_on_failure: bool = True) -> Any:
                return self._resoluto_inline.result(timeout, raise_on_failure)

            def add_done_callback(self, fn: Callable[[Any], Any]) -> None:
                fn(self)

        _REAL_FUTURE = InlinePrefectFuture
    return _REAL_FUTURE(inline)


class _Loaded(_LoaderBase):
    """Hands the import system a module the real package's import already created."""

    def __init__(self, real_spec: Optional[ModuleSpec]) -> None:
        self.real_spec = real_spec

    def create_module(self, spec: ModuleSpec) -> types.ModuleType:
        return sys.modules[spec.name]

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system stamped our spec on the module: give it its own back.
        if self.real_spec is not None:
            module.__spec__ = self.real_spec
            module.__loader__ = self.real_spec.loader


class _Empty(_LoaderBase):
    """An empty module: what a submodule of a stand-in whose real package is absent holds."""

    def create_module(self, spec: ModuleSpec) -> None:
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _Finder(_FinderBase):
    """``import prefect.<anything>`` swaps the stand-in for the real package first."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Optional[ModuleSpec]:
        for pkg in ("prefect", "prefect_resoluto"):
            if fullname.startswith(pkg + ".") and isinstance(sys.modules.get(pkg), _LazyModule):
                if pkg == "prefect_resoluto" and getattr(sys.modules[pkg], "__path__", None) == []:
                    # The host's package is not in this image. The real Prefect still finds its
                    # collection entry point (prefect_resoluto.collection) and would print a
                    # warning into the task's output: its submodules are empty here.
                    return ModuleSpec(fullname, _Empty(), is_package=True)
                _load_real(pkg)
                module = sys.modules.get(fullname)
                if module is not None:
                    # Loading the real package imported ``fullname`` too. The import system,
                    # seeing it in sys.modules, would take the module's own spec and execute
                    # the module a second time (a fresh object, its submodules unbound from
                    # it). With no __spec__ for a moment, it takes ours, whose loader hands
                    # back the module as it is.
                    real_spec = getattr(module, "__spec__", None)
                    module.__spec__ = None
                    return ModuleSpec(fullname, _Loaded(real_spec))
                # Not imported yet: a module guest_runner.prefect_api patches is patched as
                # it loads (its own finder, inserted while this one was asked, is not).
                from guest_runner import prefect_api

                return prefect_api.find_spec(fullname, path)
        return None


def _stand_in(name: str, provided: "dict[str, Any]", fallback: Optional[Callable[[str], Any]]) -> None:
    module = _LazyModule(name, provided, fallback)
    # The real package's search path, found without importing it: ``from prefect import
    # task`` probes __path__, and ``import prefect.x`` needs it to find the submodule.
    spec = PathFinder.find_spec(name)
    if spec is not None and spec.submodule_search_locations is not None:
        module.__path__ = list(spec.submodule_search_locations)
    elif name == "prefect_resoluto":
        module.__path__ = []  # not in this image: its submodules are empty ones (_Finder)
    sys.modules[name] = module


class _TagsContext:
    """``prefect.context.TagsContext`` where Prefect is not installed: the run's tags."""

    def __init__(self, current_tags: "set[str]") -> None:
        self.current_tags = set(current_tags)

    _stack: "List[_TagsContext]" = []

    @classmethod
    def get(cls) -> "_TagsContext":
        return cls._stack[-1] if cls._stack else cls(set(map(str, _CONTEXT.get("tags") or [])))


class _tags:
    """``prefect.tags(...)`` where Prefect is not installed: adds to the current tags."""

    def __init__(self, *new_tags: str) -> None:
        self.new_tags = set(new_tags)

    def __enter__(self) -> "set[str]":
        ctx = _TagsContext(_TagsContext.get().current_tags | self.new_tags)
        _TagsContext._stack.append(ctx)
        return ctx.current_tags

    def __exit__(self, *exc: Any) -> None:
        _TagsContext._stack.pop()


_RUNTIME_EMPTY: Dict[str, Dict[str, Any]] = {
    "task_run": {"id": None, "name": None, "task_name": None, "run_count": 0, "parameters": {}, "tags": []},
    "flow_run": {"id": None, "name": None, "flow_name": None, "tags": [], "parameters": {}},
    "deployment": {"id": None, "name": None},
}


def _runtime_module(key: str) -> types.ModuleType:
    module = types.ModuleType(f"prefect.runtime.{key}")

    def __getattr__(name: str) -> Any:
        raw = _CONTEXT.get(key)
        values = raw if isinstance(raw, dict) else {}
        if name in values:
            return values[name]
        if name in _RUNTIME_EMPTY[key]:
            return _RUNTIME_EMPTY[key][name]
        raise AttributeError(f"prefect.runtime.{key} has no attribute {name!r} in the sandbox")

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


def _install_without_prefect() -> "dict[str, Any]":
    """Prefect is not installed in this image: what a task can still read of its run."""
    runtime = types.ModuleType("prefect.runtime")
    for key in _RUNTIME_EMPTY:
        sub = _runtime_module(key)
        setattr(runtime, key, sub)
        sys.modules[sub.__name__] = sub
    sys.modules["prefect.runtime"] = runtime
    context = types.ModuleType("prefect.context")
    context.TagsContext = _TagsContext  # type: ignore[attr-defined]
    context.tags = _tags  # type: ignore[attr-defined]
    context.__dict__.update(runctx.standin_module_names())
    sys.modules["prefect.context"] = context
    exceptions = runctx.standin_exceptions()
    sys.modules["prefect.exceptions"] = exceptions
    return {"runtime": runtime, "context": context, "exceptions": exceptions, "tags": _tags}


_installed = False


def install() -> None:
    """Put the stand-ins in place (idempotent). Modules already imported are left alone."""
    global _installed
    if _installed:
        return
    _installed = True
    if "prefect" not in sys.modules:
        provided: "dict[str, Any]" = {"task": task, "flow": flow, "get_run_logger": get_run_logger}
        if PathFinder.find_spec("prefect") is None:
            provided.update(_install_without_prefect())
        _stand_in("prefect", provided, None)
    if "prefect_resoluto" not in sys.modules:
        # On the guest, the task runner and its helpers are inert: the flow never runs here.
        _stand_in("prefect_resoluto", {}, lambda attr: _Inert())
    sys.meta_path.insert(0, _Finder())


def use_real_prefect() -> None:
    """Import the real prefect now (over the stand-in, if installed), with get_run_logger
    working outside a run context."""
    _load_real("prefect")


def apply_run_context() -> None:
    """The run context (set_run_context) onto the real package imported before it was known."""
    if _PATCHED:
        _apply_run_context(sys.modules["prefect"])
    else:
        _patch_real_prefect(sys.modules["prefect"])


def uses_real_prefect() -> bool:
    mod = sys.modules.get("prefect")
    return mod is not None and not isinstance(mod, _LazyModule)
