"""Tasks for the learned pre-import and the zygote call (tests/test_pool_runner.py).

Nothing here imports ``jsonschema`` at module level, so only what a node reports can
teach a warm pool to pre-import it; ``pool_tasks`` is a workspace module, which a pool
must never pre-import.
"""

from __future__ import annotations

import importlib
import os
import sys

from prefect import task

#: What was loaded before this module was: a warm call interpreter's pre-imports.
PRELOADED = {name: name in sys.modules for name in ("jsonschema", "pool_tasks")}


@task
def import_late() -> dict[str, bool]:
    importlib.import_module("jsonschema")
    importlib.import_module("pool_tasks")
    return PRELOADED


@task
def call_process() -> dict[str, object]:
    """What this call process holds of the sandbox's start: its first environment block
    (set when the process began: for a fork, its parent's) and its open descriptors."""
    with open("/proc/self/environ", "rb") as f:
        first_env = f.read()
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = [c.decode() for c in f.read().split(b"\0") if c]
    secret = os.environ.get("POOL_SECRET", "")
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    return {
        "cmdline": cmdline,
        "secret_now": bool(secret),
        "secret_in_first_env": bool(secret) and secret.encode() in first_env,
        "node_in_first_env": b"RESOLUTO_NODE_ID=" in first_env,
        "first_env_names": sorted(e.split(b"=", 1)[0].decode() for e in first_env.split(b"\0") if e),
        "fds": fds,
    }


#: What a hostile call reports as its imports (issue 30, finding 4): real Prefect instead of
#: the stand-ins, a __main__ (runs a program), modules with side effects, and names to fill
#: the pool's list so honest calls could never teach it again.
HOSTILE_IMPORTS = ["prefect.blocks", "unittest.__main__", "antigravity", "this"]
HOSTILE_IMPORTS += [f"pad{i}" for i in range(200)]
#: Which of them were loaded before this module was (in a warm call: its pre-imports).
HOSTILE_PRELOADED = {name: name in sys.modules for name in HOSTILE_IMPORTS[:4]}


@task
def report_hostile_imports() -> None:
    """Replaces the call's own report of its imports, as a compromised call can."""
    for mod in (sys.modules.get("__main__"), sys.modules.get("guest_runner.call")):
        if mod is not None and hasattr(mod, "imported_packages"):
            mod.imported_packages = lambda workspace: list(HOSTILE_IMPORTS)


@task
def hostile_preloaded() -> dict[str, bool]:
    return HOSTILE_PRELOADED
