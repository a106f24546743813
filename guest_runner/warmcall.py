"""A Python task's call interpreter, started by a warm guest before its assignment.

It pays the interpreter start and the call's own imports (and, with
``RESOLUTO_WARM_IMPORTS=prefect.variables,numpy,...``, those installed modules: the real
Prefect when any is ``prefect.*``, else after the stand-ins, as a cold call would see them)
while the sandbox waits, then reads one JSON line from stdin: ``{"argv": [call.json
path], "cwd": ..., "env": {...}}`` and becomes ``python -m guest_runner.call`` with
exactly that environment and directory. It was started (forked or run) before any
credential reached the sandbox and never sees the runner's.

With ``RESOLUTO_WARM_ENGINE=1`` it is a worker's flow run instead: it imports Prefect's
flow-run engine ahead (what ``python -m prefect.engine`` loads before it asks the API for
its flow run: ~2-4 s of CPU in gVisor), and its assignment makes it that command. Prefect
reads its settings from the environment when it is imported, so they are read again from
the assigned one (:func:`run_engine`) before the engine runs.
"""

from __future__ import annotations

import json
import os
import sys

from guest_runner import call, reseed, standin, wire

IMPORTS_ENV = wire.ENV_WARM_IMPORTS
ENGINE_ENV = wire.ENV_WARM_ENGINE
#: What ``python -m prefect.engine`` imports on its way to a flow run's first request, beyond
#: ``prefect.main`` (measured from its ``sys.modules``): the flow engine, the client, the
#: deployment pull steps and runner storage, the task runners and results, the events client.
ENGINE_IMPORTS = (
    "prefect.main",
    "prefect.engine",
    "prefect.flow_engine",
    "prefect.flows",
    "prefect.client.orchestration",
    "prefect.deployments.steps.core",
    "prefect.deployments.steps.pull",
    "prefect.runner.storage",
    "prefect.task_runners",
    "prefect.task_engine",
    "prefect.results",
    "prefect.events.clients",
    "prefect.events.worker",
    "prefect.logging.handlers",
    "prefect._internal.metrics",
    "prefect.concurrency.v1.context",
)


def preimport(modules: "list[str]") -> None:
    """Import ``modules`` now; one that fails is left for the call to import (and report)."""
    import importlib

    try:
        if any(m == "prefect" or m.startswith("prefect.") for m in modules):
            # The stand-ins first, as a cold call has them: where the host's package is not in
            # the image, its stand-in answers the collection entry point the real Prefect loads
            # with its blocks (else "Failed to load collection" lands in the task's output).
            standin.install()
            standin.use_real_prefect()
            # `from prefect import task` loads prefect.main, whose import sets up Prefect's
            # logging from its settings: the largest part of a warm real-Prefect call that
            # had not been paid ahead.
            importlib.import_module("prefect.main")
        else:
            standin.install()  # what a cold call's imports find: the stand-ins for `from prefect import task`
    except Exception:  # noqa: BLE001
        return
    for name in modules:
        try:
            importlib.import_module(name)
        except (Exception, SystemExit):  # noqa: BLE001 - exiting at import: not this process's verdict
            sys.modules.pop(name, None)


def preimport_engine() -> None:
    """Import the flow-run engine's modules now (before any flow run or credential exists);
    one that fails is left for the engine to import, and report, itself."""
    import importlib

    for name in ENGINE_IMPORTS:
        try:
            importlib.import_module(name)
        except (Exception, SystemExit):  # noqa: BLE001 - the engine's own import reports it
            sys.modules.pop(name, None)


def run_engine(argv: "list[str]") -> int:
    """Become ``python -m guest_runner.engine <argv>`` (Prefect's ``prefect.engine``) in the
    environment and directory already set: ``sys.path`` as ``-m`` and PYTHONPATH would have
    made it, Prefect's settings and logging read again from this environment (they were read
    from the template's when imported), then Prefect's engine run as ``__main__``."""
    from guest_runner import engine  # a flow run's only: a task's call never loads it

    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[0:1] = [os.getcwd(), *extra]
    prefect = sys.modules.get("prefect")
    if prefect is not None:
        import importlib

        # By name: the guest runner itself needs nothing but the standard library.
        importlib.import_module("prefect.context").refresh_global_settings_context()
        importlib.import_module("prefect.logging.configuration").setup_logging(incremental=False)
        plugins = getattr(prefect, "_initialize_plugins", None)
        if plugins is not None:  # what importing prefect runs when the settings enable plugins
            plugins()
    # runpy warns that prefect.engine "found in sys.modules ... may result in unpredictable
    # behaviour": the engine's own dependencies imported it ahead (preimport_engine). Harmless:
    # a cold `python -m prefect.engine` ends with the same two copies (``__main__`` and the one
    # those dependencies import while it runs), only without the warning. Silenced exactly.
    import warnings

    warnings.filterwarnings(
        "ignore",
        message=r"'prefect\.engine' found in sys\.modules after import of package 'prefect'",
        category=RuntimeWarning,
        module="runpy",
    )
    engine.run(argv)
    return 0


def main() -> int:
    engine = os.environ.pop(ENGINE_ENV, "") == "1"
    modules = [m for m in os.environ.pop(IMPORTS_ENV, "").split(",") if m]
    if engine:
        preimport_engine()
    elif modules:
        preimport(modules)
    print(wire.WARM_READY, flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    spec = json.loads(line)
    reseed.reseed()  # this process may be one of many restored from one snapshot
    # What `python -m guest_runner.call` would have had: /dev/null on stdin, its own env.
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in spec["env"].items()})
    if spec.get("cwd"):
        os.chdir(spec["cwd"])
    if engine:
        return run_engine(list(spec["argv"]))
    sys.argv = [call.__file__, *spec["argv"]]
    return call.main(list(spec["argv"]))


def exit_now(code: "int | None") -> None:
    """Exit as the interpreter would, minus its finalization: the task's non-daemon threads
    are joined and its atexit handlers run, then stdio is flushed and the process ends.
    Tearing down every module and object of a pre-imported Prefect would cost the sandbox
    CPU after the call's result is already written (docs/performance.md)."""
    import atexit
    import threading

    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream has nothing left to flush
            pass
    os._exit(code if isinstance(code, int) else 1)


if __name__ == "__main__":
    try:
        rc = main()
    except SystemExit as e:  # as the interpreter reports it
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    exit_now(rc)
