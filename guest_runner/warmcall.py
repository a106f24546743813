"""A Python task's call interpreter, started by a warm guest before its assignment.

It pays the interpreter start and the call's own imports (and, with
``RESOLUTO_WARM_IMPORTS=prefect.variables,numpy,...``, those installed modules: the real
Prefect when any is ``prefect.*``, else after the stand-ins, as a cold call would see them)
while the sandbox waits, then reads one JSON line from stdin: ``{"argv": [call.json
path], "cwd": ..., "env": {...}}`` and becomes ``python -m guest_runner.call`` with
exactly that environment and directory. It was started (forked or run) before any
credential reached the sandbox and never sees the runner's.
"""

from __future__ import annotations

import json
import os
import sys

from guest_runner import call, reseed, standin

IMPORTS_ENV = "RESOLUTO_WARM_IMPORTS"


def preimport(modules: "list[str]") -> None:
    """Import ``modules`` now; one that fails is left for the call to import (and report)."""
    import importlib

    try:
        if any(m == "prefect" or m.startswith("prefect.") for m in modules):
            standin.use_real_prefect()
            # `from prefect import task` loads prefect.main, whose import sets up Prefect's
            # logging from its settings: ~0.25 s on the host, ~4x that in gVisor, and the
            # largest part of a warm real-Prefect call that had not been paid ahead.
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


def main() -> int:
    modules = [m for m in os.environ.pop(IMPORTS_ENV, "").split(",") if m]
    if modules:
        preimport(modules)
    print("resoluto warm: ready", flush=True)
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
    sys.argv = [call.__file__, *spec["argv"]]
    return call.main(list(spec["argv"]))


if __name__ == "__main__":
    sys.exit(main())
