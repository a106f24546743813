"""Running the guest runner as a program from a test: the repository, the interpreter, the
environment of ``python -m guest_runner`` on a local conduit, and other Pythons it must run on."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def guest_env(conduit_root: Path, run_id: str, node_id: str, argv: list[str], **extra: str) -> dict[str, str]:
    """Environment for `python -m guest_runner` on a local conduit."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(ROOT),
        "RESOLUTO_STORE_KIND": "localfs",
        "RESOLUTO_STORE_ROOT": str(conduit_root),
        "RESOLUTO_RUN_ID": run_id,
        "RESOLUTO_NODE_ID": node_id,
        "RESOLUTO_WORKLOAD_ARGV": json.dumps(argv),
    }
    env.update(extra)
    return env


def find_python(version: str) -> str | None:
    """An interpreter for ``version`` (e.g. "3.9") that actually runs, or None."""
    candidates = [shutil.which(f"python{version}") or ""]
    candidates += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}*/bin/python{version}")))
    for c in candidates:
        if c and subprocess.run([c, "-S", "-c", "pass"], capture_output=True).returncode == 0:
            return c
    return None


#: The host's own code as a traceback names it: a task's traceback shows none of these
#: (its frames are the task's, as on a thread), whatever the modules are called.
HOST_PLUMBING = (
    str(ROOT / "prefect_resoluto") + os.sep,
    str(ROOT / "guest_runner") + os.sep,
    "guest_runner",
    "<sandbox",
)


def plumbing_in(traceback_text: str) -> list[str]:
    """The host-plumbing marks ``traceback_text`` holds (empty: none)."""
    return [mark for mark in HOST_PLUMBING if mark in traceback_text]
