"""Shared helpers for the benchmarks: paths, statistics, interpreters, scratch space.

Nothing here talks to the network; every server a benchmark starts listens on 127.0.0.1.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
for _p in (str(ROOT), str(ROOT / "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

#: The trivial workload every per-node figure runs.
TRIVIAL = [sys.executable, "-c", "pass"]


def median(xs: Iterable[float]) -> float:
    s = sorted(xs)
    if not s:
        return math.nan
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def percentile(xs: Iterable[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100)."""
    s = sorted(xs)
    if not s:
        return math.nan
    k = max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))
    return s[k]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def r3(x: float) -> float:
    return round(x, 3)


@dataclass
class Target:
    figure: str
    what: str
    target: str
    measured: str
    met: bool | None  # None: not measured here

    def to_json(self) -> dict[str, Any]:
        return {
            "figure": self.figure,
            "what": self.what,
            "target": self.target,
            "measured": self.measured,
            "met": self.met,
        }


def log(msg: str) -> None:
    """Progress goes to stderr so stdout stays the table (+ the JSON line)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix=f"resoluto-bench-{prefix}-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def child_workspace(prefix: str, module: str, source: str) -> tuple[Path, Path]:
    """A benchmark child's scratch directory and, in it, ``ws``: the workspace its sandboxes
    see, holding the task module ``module`` (``source``: its text). ``ws`` goes first on
    sys.path, so the child imports the module by file, as the sandbox does."""
    work = Path(tempfile.mkdtemp(prefix=f"resoluto-bench-{prefix}-"))
    ws = work / "ws"
    ws.mkdir()
    (ws / f"{module}.py").write_text(source)
    sys.path.insert(0, str(ws))
    return work, ws


#: The body of each ``timed_map`` flow (its function's entry to its return), seconds, newest last.
BODIES: list[float] = []


def timed_map(runner: Any, task: Any, n: int) -> float:
    """Seconds a flow on ``runner`` takes to map ``task`` over ``range(n)`` and gather the
    results (the benchmarks' ``noop``: a wrong answer raises). The flow's body alone is
    appended to :data:`BODIES`: a flow's wall also holds Prefect's exit, whose join of its
    heartbeat thread (asleep in whole seconds since the flow began) rounds the wall up to
    that thread's next second, on any task runner."""
    from prefect import flow

    @flow(task_runner=runner, name="bench-mapped", persist_result=False)
    def bench_mapped() -> list[int]:
        b0 = time.perf_counter()
        out = [f.result() for f in task.map(range(n))]
        BODIES.append(time.perf_counter() - b0)
        return out

    t0 = time.perf_counter()
    res = bench_mapped()
    took = time.perf_counter() - t0
    if res != list(range(n)):
        raise RuntimeError(f"mapped flow returned {res!r}")
    return took


def find_python(version: str) -> str | None:
    """An interpreter for ``version`` (e.g. "3.12") that actually runs, or None.

    The pyenv shim on PATH fails unless PYENV_VERSION selects it, so the pyenv
    installs are tried directly too (same logic as tests/support/guest.py).
    """
    candidates = [shutil.which(f"python{version}") or ""]
    candidates += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}*/bin/python{version}")))
    for c in candidates:
        if c and subprocess.run([c, "-S", "-c", "pass"], capture_output=True).returncode == 0:
            return c
    return None


def reference_python() -> Path | None:
    """``.venv-ref/bin/python`` with resoluto-sandbox 0.1.0 importable, or None."""
    py = ROOT / ".venv-ref" / "bin" / "python"
    if not py.exists():
        return None
    res = subprocess.run([str(py), "-c", "import resoluto.sandbox.driver"], capture_output=True)
    return py if res.returncode == 0 else None


def loopback_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment minus anything that could send traffic off the machine."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.lower().endswith("_proxy") and not k.startswith(("AWS_", "PREFECT_API"))
    }
    env.update(
        {
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
            "AWS_EC2_METADATA_DISABLED": "true",
            # A child's ephemeral Prefect server migrates a fresh database first; Prefect's
            # 20 s default is its typical start on a quiet 2-core machine, so a loaded run
            # timed out before any figure (the flow figure, twice).
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        }
    )
    env.update(extra or {})
    return env


def prefect_child_env(work: Path) -> dict[str, str]:
    """The environment of a child on Prefect's ephemeral API: a scratch PREFECT_HOME in
    ``work``, no analytics, no UI, quiet logs, loopback only."""
    return loopback_env(
        {
            "PREFECT_HOME": str(work / "prefect-home"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false",
            "PREFECT_LOGGING_LEVEL": "WARNING",
        }
    )


def dump_json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), sort_keys=False, default=str)
