"""``bubblewrap``: the guest in fresh Linux namespaces (``bwrap --unshare-all``).

Shares the host kernel, so it is only ``namespace`` isolation, but it starts in a few
milliseconds. The sandbox sees: the host's system directories and Python read-only,
a minimal /etc, guest_runner at /opt/resoluto, a private /proc and /dev, tmpfs /tmp and
/workspace (each sized like the node's conduit slot: its ``disk``, else its memory limit)
and the node's conduit directory read-write. Nothing else of the host: what the guest
writes outside its conduit slot never reaches the host's disk, and goes with the
sandbox's mount namespace, however deep it nests. The network namespace is new and empty
except for ``lo``, so no traffic leaves (and the host's loopback is not the sandbox's).

Bubblewrap has no resource limits of its own: the base class puts the process tree in a
cgroup (memory, pids, cpu) when one is writable, else applies RLIMIT_DATA via prlimit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from prefect_resoluto.runtimes import slot

from ._guest_layout import (
    RUNNER_CAPS,
    WORKLOAD_PIDNS_ENV,
    WORKLOAD_USER,
    WORKLOAD_USER_ENV,
    GuestLayout,
    add_network,
    guest_layout,
    runs_guest_runner,
)
from ._local import LocalChildRuntime, Prepared
from .base import Availability, IsolationLevel, LaunchError, LaunchSpec, Resources
from .capabilities import Capabilities

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


# With a user namespace of our own making (two uids: the runner's and the workload's):
# bwrap joins it instead of creating one (which would map one uid only).
_USERNS_FLAGS = (
    "--unshare-ipc",
    "--unshare-pid",
    "--unshare-uts",
    "--unshare-cgroup",
    "--cap-drop",
    "ALL",
    *(a for cap in RUNNER_CAPS for a in ("--cap-add", cap)),  # the runner's few, in that namespace only
    "--die-with-parent",
    "--new-session",
)


def workload_userns() -> int:
    """A user namespace mapping uid/gid 0 and the workload's to themselves, in which no
    further user namespace can be created (what ``--disable-userns`` does for bwrap's own);
    returns an fd that holds it. The host must be root (it writes the maps itself)."""
    uid, _, gid = WORKLOAD_USER.partition(":")
    holder = subprocess.Popen(
        ["unshare", "--user", "--", "sh", "-c", "echo in; read _"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        if holder.stdout.readline() != b"in\n":  # it has unshared: its namespace exists
            raise LaunchError("bubblewrap: cannot create a user namespace for the workload's user")
        ns = f"/proc/{holder.pid}/ns/user"
        Path(f"/proc/{holder.pid}/uid_map").write_text(f"0 0 1\n{uid} {uid} 1\n")
        Path(f"/proc/{holder.pid}/gid_map").write_text(f"0 0 1\n{gid} {gid} 1\n")
        capped = subprocess.run(
            ["nsenter", f"--user={ns}", "sh", "-c", "echo 0 > /proc/sys/user/max_user_namespaces"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if capped.returncode != 0:
            raise LaunchError(f"bubblewrap: cannot forbid nested user namespaces: {capped.stderr.strip()}")
        return os.open(ns, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise LaunchError(f"bubblewrap: cannot create a user namespace for the workload's user: {e}") from e
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        holder.wait()


def scratch_bytes(r: Resources) -> int:
    """The size of each of a sandbox's tmpfs (/tmp, /workspace): its conduit slot's
    (``disk``, else the memory limit, else the default memory limit), never unbounded."""
    return slot.capacity_of(r.disk_bytes, r.memory_bytes)[0]


def _mount_args(lay: GuestLayout, tmpfs_bytes: int) -> list[str]:
    """The layout's scratch mounts, binds and links as bwrap options, in the order they must go."""
    argv: list[str] = []
    # tmpfs first: bwrap mounts in order, and a later tmpfs /tmp would hide a bind of a
    # host tree that lives under /tmp (a checkout or virtualenv there).
    # /dev/shm (bwrap's --dev leaves it root's): POSIX semaphores and shared memory, which
    # multiprocessing's locks and queues need, for the workload's user too.
    for dst in [*lay.tmpfs, "/dev/shm"]:
        argv += ["--perms", "1777"]  # as /tmp is anywhere: the workload's user writes it too
        argv += ["--size", str(tmpfs_bytes), "--tmpfs", dst]
    # bwrap makes a bind's missing parents 0700: traversable by root only, and the
    # workload's user must reach the interpreter bound below them.
    parents = {str(p) for _, dst in lay.ro_binds + lay.rw_binds for p in Path(dst).parents}
    for d in sorted(parents - {"/"}, key=lambda p: (p.count("/"), p)):
        argv += ["--perms", "0755", "--dir", d]
    for src, dst in lay.ro_binds:
        argv += ["--ro-bind", src, dst]
    for target, dst in lay.symlinks:
        argv += ["--symlink", target, dst]
    for src, dst in lay.rw_binds:
        argv += ["--bind", src, dst]
    return argv


class BubblewrapRuntime(LocalChildRuntime):
    name: ClassVar[str] = "bubblewrap"
    capabilities: ClassVar[Capabilities] = Capabilities(
        egress_allowlist=True,
        egress_by_name=True,
        warm=True,
        options=frozenset({"bwrap", "python", "state_dir", "limits", "extra_ro_paths"}),
    )

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
        self,
        spec: LaunchSpec,
        sandbox: Path,
        net: SandboxNetwork | None = None,
        userns_fd: int | None = None,
    ) -> tuple[list[str], dict[str, str]]:
        """The bwrap command line and the sandbox env (public for tests and benchmarks).
        ``sandbox``: the sandbox's state directory (its network's files go there).

        ``userns_fd`` (:func:`workload_userns`): the sandbox joins that user namespace,
        where the guest runner can start the workload as another user; without it the
        guest runs as one user (bwrap's own namespace maps one uid).

        With an egress network bwrap starts inside its namespace and keeps it
        (``--share-net``): the sandbox's root holds no capability over a namespace owned
        by the host's user namespace, so it cannot change its routes or addresses."""
        lay = guest_layout(spec, python=self.python, extra_ro=self.extra_ro_paths)
        prefix: list[str] = []
        flags: tuple[str, ...] = _NAMESPACE_FLAGS
        if userns_fd is not None:
            flags = ("--userns", str(userns_fd), *_USERNS_FLAGS, "--unshare-net")
        else:
            lay.env.pop(WORKLOAD_USER_ENV, None)
            lay.env.pop(WORKLOAD_PIDNS_ENV, None)
        if net is not None:
            add_network(lay, net, sandbox)
            prefix = ["nsenter", f"--net=/run/netns/{net.netns}"]
            flags = (*(f for f in flags if f != "--unshare-net"), "--share-net")
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
        argv += _mount_args(lay, scratch_bytes(spec.resources))
        # The environment is bwrap's own (set exactly by Popen), not --clearenv/--setenv:
        # secrets on an argv would be readable by every host user in /proc/<pid>/cmdline.
        # PWD is pinned because the cgroup wrapper's shell exports its own.
        argv += ["--chdir", lay.cwd, "--setenv", "PWD", lay.cwd]
        return argv + ["--", *lay.argv], lay.env

    def _prepare(self, spec: LaunchSpec, sandbox: Path, net: SandboxNetwork | None = None) -> Prepared:
        runner = runs_guest_runner(list(spec.command) if spec.command else ["python", "-m", "guest_runner"])
        fd = workload_userns() if runner and os.geteuid() == 0 else None
        try:
            argv, env = self.build_argv(spec, sandbox, net, userns_fd=fd)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        return Prepared(argv=argv, env=env, cwd=str(sandbox), pass_fds=(fd,) if fd is not None else ())
