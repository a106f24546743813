"""``process``: the guest runner as a plain child process. No isolation at all.

For development and for trusted code only: the task runner refuses it unless the
minimum isolation level is lowered to ``none`` explicitly. It still gets a clean
environment, its own session (destroy kills the whole tree), a scratch working
directory, and the cgroup limits the other local runtimes get.

With ``workload_user="uid:gid"`` on a host running as root, the workload runs as that
user (guest_runner/privsep.py): it cannot read the runner's environment or memory nor
write the node's conduit directory. Off by default: the flow's interpreter often lives
where another user cannot reach it (under /root), and nothing else of the host is
hidden from that user either (docs/security.md).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import ClassVar

from guest_runner import wire

from ._guest_layout import WORKLOAD_USER_ENV, conduit_host_dir, guest_runner_dir, sandbox_env
from ._local import LocalChildRuntime, Prepared
from .base import Availability, IsolationLevel, LaunchSpec
from .capabilities import Capabilities


class ProcessRuntime(LocalChildRuntime):
    name: ClassVar[str] = "process"
    capabilities: ClassVar[Capabilities] = Capabilities(
        mounts_conduit=False, warm=True, options=frozenset({"python", "state_dir", "limits", "workload_user"})
    )

    def __init__(
        self,
        *,
        python: str | None = None,
        state_dir: str | os.PathLike[str] | None = None,
        limits: str = "auto",
        workload_user: str | None = None,
    ) -> None:
        """``python``: interpreter for the guest (default: this one, ``sys.executable``).
        ``limits``: ``auto`` (cgroup if writable, else RLIMIT_DATA), ``cgroup``, ``rlimit``, ``none``.
        ``workload_user``: ``"uid:gid"`` the workload runs as (the host must be root)."""
        super().__init__(state_dir=state_dir, limits=limits)
        self.python: str = python or sys.executable
        self.workload_user = _parse_user(workload_user) if workload_user else None

    @property
    def isolation(self) -> IsolationLevel:
        return IsolationLevel.NONE

    def _check(self) -> Availability:
        if not os.access(self.python, os.X_OK):
            return Availability(False, why=f"python interpreter {self.python!r} is not executable")
        if self.workload_user and os.geteuid() != 0:
            return Availability(False, why="workload_user needs the host to run as root")
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
            overrides={wire.ENV_WORKSPACE_DIR: str(workspace)},
        )
        if self.workload_user is not None:
            uid, gid = self.workload_user
            env[WORKLOAD_USER_ENV] = f"{uid}:{gid}"  # no PID namespace: leftovers are not hunted down
            os.chown(home, uid, gid)
            # The user reaches its workspace and home, and lists nothing on the way (the
            # state directory's own parents must let it through: RESOLUTO_STATE_DIR).
            for d in (sandbox.parent, sandbox):
                d.chmod(0o711)
        argv = list(spec.command) if spec.command else [self.python, "-m", "guest_runner"]
        # An explicit cwd: a stray timeit.py in the caller's cwd would shadow the stdlib.
        return Prepared(argv=argv, env=env, cwd=str(workspace))


def _parse_user(value: str) -> tuple[int, int]:
    uid, _, gid = value.partition(":")
    try:
        parsed = int(uid), int(gid or uid)
    except ValueError:
        raise ValueError(f"workload_user must be 'uid:gid', got {value!r}") from None
    if min(parsed) <= 0:
        raise ValueError(f"workload_user must name an unprivileged uid and gid (> 0), got {value!r}")
    return parsed
