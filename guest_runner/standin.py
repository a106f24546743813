"""Cheap guest-side stand-ins for ``prefect`` and ``prefect_resoluto``.

Importing ``prefect`` costs seconds (more under gVisor, where syscalls are dear), and a
task module usually needs nothing from it but ``@task``, ``@flow`` and
``get_run_logger``. Until the module touches anything else, those names come from
here; the first other attribute or submodule loads the real package transparently.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import types
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec, PathFinder
from typing import Any, Callable, Optional

from guest_runner.wire import LOG_MARKER


class _MarkerHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
            stream = sys.__stdout__ or sys.stdout
            stream.write(LOG_MARKER + json.dumps(
                {"level": record.levelname, "logger": record.name, "msg": msg}, ensure_ascii=False) + "\n")
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


class StandInTask:
    """Enough of a Prefect Task to import a module that defines tasks."""

    def __init__(self, fn: Callable[..., Any], **options: Any) -> None:
        self.fn = fn
        self.name = options.get("name") or getattr(fn, "__name__", "task")
        self.__wrapped__ = fn
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def with_options(self, **options: Any) -> "StandInTask":
        return self

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"{name!r} of a task is not available inside the sandbox: the sandbox runs the task's "
            "function only (submit/map belong to the flow on the host)"
        )


def _decorator(kind: type) -> Callable[..., Any]:
    def decorate(__fn: Optional[Callable[..., Any]] = None, **options: Any) -> Any:
        if __fn is None:
            return lambda fn: kind(fn, **options)
        return kind(__fn, **options)

    return decorate


task = _decorator(StandInTask)
flow = _decorator(StandInTask)


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

    def __init__(self, name: str, provided: "dict[str, Any]", fallback: Optional[Callable[[str], Any]]) -> None:
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


def _patch_real_prefect(prefect: types.ModuleType) -> None:
    # The real get_run_logger needs a run context that only exists on the host.
    prefect.get_run_logger = get_run_logger  # type: ignore[attr-defined]
    try:
        loggers = importlib.import_module("prefect.logging.loggers")
        loggers.get_run_logger = get_run_logger  # type: ignore[attr-defined]
        logging_pkg = importlib.import_module("prefect.logging")
        logging_pkg.get_run_logger = get_run_logger  # type: ignore[attr-defined]
    except Exception:
        pass


class _Loaded(Loader):
    """Hands the import system a module the real package's import already created."""

    def create_module(self, spec: ModuleSpec) -> types.ModuleType:
        return sys.modules[spec.name]

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _Finder(MetaPathFinder):
    """``import prefect.<anything>`` swaps the stand-in for the real package first."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Optional[ModuleSpec]:
        for pkg in ("prefect", "prefect_resoluto"):
            if fullname.startswith(pkg + ".") and isinstance(sys.modules.get(pkg), _LazyModule):
                _load_real(pkg)
                if fullname in sys.modules:
                    return ModuleSpec(fullname, _Loaded())
        return None


def _stand_in(name: str, provided: "dict[str, Any]", fallback: Optional[Callable[[str], Any]]) -> None:
    module = _LazyModule(name, provided, fallback)
    # The real package's search path, found without importing it: ``from prefect import
    # task`` probes __path__, and ``import prefect.x`` needs it to find the submodule.
    spec = PathFinder.find_spec(name)
    if spec is not None and spec.submodule_search_locations is not None:
        module.__path__ = list(spec.submodule_search_locations)
    sys.modules[name] = module


_installed = False


def install() -> None:
    """Put the stand-ins in place (idempotent). Modules already imported are left alone."""
    global _installed
    if _installed:
        return
    _installed = True
    if "prefect" not in sys.modules:
        _stand_in("prefect", {"task": task, "flow": flow, "get_run_logger": get_run_logger}, None)
    if "prefect_resoluto" not in sys.modules:
        # On the guest, the task runner and its helpers are inert: the flow never runs here.
        _stand_in("prefect_resoluto", {}, lambda attr: _Inert())
    sys.meta_path.insert(0, _Finder())


def use_real_prefect() -> None:
    """Import the real prefect now, with get_run_logger working outside a run context."""
    _patch_real_prefect(importlib.import_module("prefect"))


def uses_real_prefect() -> bool:
    mod = sys.modules.get("prefect")
    return mod is not None and not isinstance(mod, _LazyModule)
