"""The Kubernetes control plane's build, started by the test session instead of by set-up.

``scripts/setup.sh`` no longer builds it (the demo does not need it, and a cold build is
5-15 minutes on 2 cores). When the session has collected a test that needs the genuine
apiserver and the build is not cached, ``support.scheduling`` starts ``k8s-local-cluster.sh build`` here,
at the lowest CPU priority, and moves those tests to the end of the run: a fresh machine
pays max(build, the rest of the suite), not the sum. The ``k8s_cluster`` fixture then waits
for that process to exit -- an event, not a timer. The script itself is cached and
``flock``'ed, so a build that another session (another worktree) already runs is waited on
through the lock, and a cached build makes the process exit at once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "k8s-local-cluster.sh"

_build: subprocess.Popen[bytes] | None = None
_log: Path | None = None


def cached() -> bool:
    return subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True).returncode == 0


def wanted_here() -> str:
    """Why this session should not build (empty: it should). Mirrors what the tests need."""
    if os.environ.get("RESOLUTO_SKIP_K8S_BUILD") == "1":
        return "RESOLUTO_SKIP_K8S_BUILD=1"
    if not Path("/etc/os-release").exists() or "bookworm" not in Path("/etc/os-release").read_text():
        return "the build needs Debian bookworm's kubernetes source package"
    if shutil.which("runsc") is None:
        return "runsc (gVisor) is not installed, so no node agent could run pods"
    if os.geteuid() != 0:
        return "the node agent runs gVisor sandboxes, which needs root here"
    return ""


def start(log_dir: Path, worker: str = "") -> subprocess.Popen[bytes] | None:
    """Start the build in the background unless it is cached (idempotent within a session).
    Each xdist worker starts its own: the script's flock makes all but one a wait, and the
    worker that runs the cluster tests waits on its own process either way."""
    global _build, _log
    if _build is not None or cached() or wanted_here():
        return _build
    log_dir.mkdir(parents=True, exist_ok=True)
    _log = log_dir / (f"k8s-build-{worker}.log" if worker else "k8s-build.log")
    # nice 19: the build eats only CPU the tests leave idle. Its own session, so a Ctrl-C of
    # pytest does not kill it half-way (the cache is filled for the next run; the flock keeps
    # a second build out meanwhile).
    with _log.open("wb") as out:
        _build = subprocess.Popen(
            ["nice", "-n", "19", "bash", str(SCRIPT), "build"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return _build


def running() -> subprocess.Popen[bytes] | None:
    return _build if _build is not None and _build.poll() is None else None


def wait() -> str:
    """Block until the build this session started has exited; '' if it succeeded, else why not."""
    if _build is None:
        return ""
    rc = _build.wait()
    if rc == 0:
        return ""
    tail = _log.read_text(errors="replace")[-3000:] if _log is not None and _log.exists() else ""
    return f"'k8s-local-cluster.sh build' exited {rc} (log {_log}):\n{tail}"
