"""``bubblewrap``: the guest in fresh Linux namespaces (``bwrap --unshare-all``).

Shares the host kernel, so it is only ``namespace`` isolation, but it starts in a few
milliseconds. The sandbox sees: the host's system directories and Python read-only,
a minimal /etc, guest_runner at /opt/resoluto, a private /proc and /dev, a tmpfs /tmp,
a per-sandbox scratch /workspace and the node's conduit directory read-write. Nothing
else of the host. The network namespace is new and empty except for ``lo``, so no
traffic leaves (and the host's loopback is not the sandbox's).

Bubblewrap has no resource limits of its own: the base class puts the process tree in a
cgroup (memory, pids, cpu) when one is writable, else applies RLIMIT_DATA via prlimit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ._host import add_network, guest_layout
from ._local import LocalChildRuntime, Prepared
from .base import Availability, IsolationLevel, LaunchSpec

if TYPE_CHECKING:
    from prefect_resoluto.egress import SandboxNetwork

_NAMESPACE_FLAGS = (
    "--unshare-all",  # ipc, pid, net (only lo), uts, cgroup; user only if possible ...
    "--unshare-user",  # ... so insist: --disable-userns below needs it
    "--disable-userns",  # no nested user namespaces from inside
    "--cap-drop",
    "ALL",  # run as root, bwrap would otherwise keep capabilities inside
    "--die-with-parent",  # killing the bwrap process kills the sandbox
    "--new-session",  # no TIOCSTI into a controlling terminal
)


class BubblewrapRuntime(LocalChildRuntime):
    name: ClassVar[str] = "bubblewrap"
    supports_egress_allowlist: ClassVar[bool] = True
    egress_by_name: ClassVar[bool] = True

    def __init__(
        self,
        *,
        bwrap: str = "bwrap",
        python: str | None = None,
        state_dir: str | os.PathLike[str] | None = None,
        limits: str = "auto",
        extra_ro_paths: list[str] | None = None,
    ) -> None:
        """``bwrap``: the bubblewrap binary (name or path). ``python``: interpreter for the guest
        (default ``sys.executable``; its prefix and virtualenv are bound read-only).
        ``extra_ro_paths``: more host paths to bind read-only at the same place.
        ``limits``: ``auto`` | ``cgroup`` | ``rlimit`` | ``none`` (see ``_local``)."""
        super().__init__(state_dir=state_dir, limits=limits)
        self.bwrap = bwrap
        self.python = python
        self.extra_ro_paths = list(extra_ro_paths or [])

    @property
    def isolation(self) -> IsolationLevel:
        return IsolationLevel.NAMESPACE

    def _binary(self) -> str | None:
        return shutil.which(self.bwrap)

    def _check(self) -> Availability:
        exe = self._binary()
        if exe is None:
            return Availability(
                False, why=f"bubblewrap binary {self.bwrap!r} not found (apt-get install bubblewrap)"
            )
        # A real start proves user namespaces are allowed here, not just that bwrap exists.
        probe = [
            exe,
            *_NAMESPACE_FLAGS,
            "--ro-bind",
            "/usr",
            "/usr",
            "--symlink",
            "usr/bin",
            "/bin",
            "--symlink",
            "usr/lib",
            "/lib",
            "--symlink",
            "usr/lib64",
            "/lib64",
            "--",
            "/usr/bin/true",
        ]
        try:
            res = subprocess.run(probe, capture_output=True, text=True, timeout=30)
            version = subprocess.run(
                [exe, "--version"], capture_output=True, text=True, timeout=30
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            return Availability(False, why=f"cannot run {exe}: {e}")
        if res.returncode != 0:
            return Availability(False, why=f"bwrap cannot create namespaces here: {res.stderr.strip()}")
        return Availability(True, detail=f"{version or 'bwrap'} at {exe}; {self.limits_detail()}")

    def build_argv(
        self, spec: LaunchSpec, workspace: Path, net: SandboxNetwork | None = None
    ) -> tuple[list[str], dict[str, str]]:
        """The bwrap command line and the sandbox env (public for tests and benchmarks).

        With an egress network bwrap starts inside its namespace and keeps it
        (``--share-net``): the sandbox's root holds no capability over a namespace owned
        by the host's user namespace, so it cannot change its routes or addresses."""
        lay = guest_layout(
            spec, python=self.python, workspace_host_dir=str(workspace), extra_ro=self.extra_ro_paths
        )
        prefix: list[str] = []
        flags: tuple[str, ...] = _NAMESPACE_FLAGS
        if net is not None:
            add_network(lay, net, workspace.parent)
            prefix = ["nsenter", f"--net=/run/netns/{net.netns}"]
            flags = (*_NAMESPACE_FLAGS, "--share-net")
        argv = [
            *prefix,
            self._binary() or self.bwrap,
            *flags,
            "--hostname",
            "sandbox",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
        ]
        # tmpfs first: bwrap mounts in order, and a later tmpfs /tmp would hide a bind of a
        # host tree that lives under /tmp (a checkout or virtualenv there).
        for dst in lay.tmpfs:
            if spec.resources.tmpfs_bytes:
                argv += ["--size", str(spec.resources.tmpfs_bytes)]
            argv += ["--tmpfs", dst]
        for src, dst in lay.ro_binds:
            argv += ["--ro-bind", src, dst]
        for target, dst in lay.symlinks:
            argv += ["--symlink", target, dst]
        for src, dst in lay.rw_binds:
            argv += ["--bind", src, dst]
        # The environment is bwrap's own (set exactly by Popen), not --clearenv/--setenv:
        # secrets on an argv would be readable by every host user in /proc/<pid>/cmdline.
        # PWD is pinned because the cgroup wrapper's shell exports its own.
        argv += ["--chdir", lay.cwd, "--setenv", "PWD", lay.cwd]
        return argv + ["--", *lay.argv], lay.env

    def _prepare(self, spec: LaunchSpec, sandbox: Path, net: SandboxNetwork | None = None) -> Prepared:
        workspace = sandbox / "workspace"
        workspace.mkdir()
        argv, env = self.build_argv(spec, workspace, net)
        return Prepared(argv=argv, env=env, cwd=str(sandbox))
