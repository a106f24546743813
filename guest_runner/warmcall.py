"""A Python task's call interpreter, started by a warm guest before its assignment.

It pays the interpreter start and the call's own imports (and, with
``RESOLUTO_WARM_PREFECT=prefect.variables,...``, those modules of the real Prefect) while the sandbox waits, then reads one
JSON line from stdin: ``{"argv": [call.json path], "cwd": ..., "env": {...}}`` and
becomes ``python -m guest_runner.call`` with exactly that environment and directory.
It was started before any credential reached the sandbox and never sees the runner's.
"""

from __future__ import annotations

import json
import os
import sys

from guest_runner import call, standin


def main() -> int:
    modules = [m for m in os.environ.pop("RESOLUTO_WARM_PREFECT", "").split(",") if m]
    if modules:
        import importlib

        try:
            standin.use_real_prefect()
            for name in modules:
                importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the call then imports (and reports) what it can itself
            pass
    print("resoluto warm: ready", flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    spec = json.loads(line)
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
