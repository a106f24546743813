"""``process``: the guest runner as a plain child process. No isolation at all.

For development and for trusted code only: the task runner refuses it unless the
minimum isolation level is lowered to ``none`` explicitly. It still gets a clean
environment, its own session (destroy kills the whole tree), a scratch working
directory, and the cgroup limits the other local runtimes get.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import ClassVar

from ._host import conduit_host_dir, guest_runner_dir, sandbox_env
from ._local import LocalChildRuntime, Prepared
from .base import Availability, IsolationLevel, LaunchSpec


class ProcessRuntime(LocalChildRuntime):
    name: ClassVar[str] = "process"
    mounts_conduit: ClassVar[bool] = False

    def __init__(
        self,
        *,
        python: str | None = None,
        state_dir: str | os.PathLike[str] | None = None,
        limits: str = "auto",
    ) -> None:
        """``python``: interpreter for the guest (default: this one, ``sys.executable``).
        ``limits``: ``auto`` (cgroup if writable, else RLIMIT_DATA), ``cgroup``, ``rlimit``, ``none``."""
        super().__init__(state_dir=state_dir, limits=limits)
        self.python = python or sys.executable

    @property
    def isolation(self) -> IsolationLevel:
        return IsolationLevel.NONE

    def _check(self) -> Availability:
        if not os.access(self.python, os.X_OK):
            return Availability(False, why=f"python interpreter {self.python!r} is not executable")
        return Availability(True, detail=f"python {self.python}; {self.limits_detail()}")

    def _prepare(self, spec: LaunchSpec, sandbox: Path, net: object = None) -> Prepared:
        workspace = sandbox / "workspace"
        home = sandbox / "home"
        workspace.mkdir()
        home.mkdir()
        conduit_host_dir(spec)  # create the node directory; the guest sees host paths as they are
        env = sandbox_env(
            spec,
            home=str(home),
            path=f"{os.path.dirname(self.python)}:/usr/local/bin:/usr/bin:/bin",
            pythonpath=str(guest_runner_dir().parent),
            overrides={"RESOLUTO_WORKSPACE_DIR": str(workspace)},
        )
        argv = list(spec.command) if spec.command else [self.python, "-m", "guest_runner"]
        # An explicit cwd: a stray timeit.py in the caller's cwd would shadow the stdlib.
        return Prepared(argv=argv, env=env, cwd=str(workspace))
