"""``gvisor``: the guest under gVisor's user-space kernel, driven by ``runsc`` directly.

Each sandbox is an OCI bundle in its state directory: an empty read-only root holding
only mount points, the host's system directories and Python bound read-only at their
host paths, guest_runner at /opt/resoluto, tmpfs /tmp and /workspace, and the node's
conduit directory read-write at /conduit/<subdir>. ``--network=none`` leaves only ``lo``.
Memory, pids and CPU go into ``linux.resources`` (runsc puts the sandbox in a host
cgroup); labels become annotations, so ``runsc state`` shows them.

``runsc run`` is the child process we observe: its exit status is the guest's.
A warm sandbox may instead be *restored* from a checkpoint image of a template sandbox
(:meth:`GVisorRuntime.checkpoint`, :meth:`GVisorRuntime.restore`; prefect_resoluto/warm/snapshots.py):
``runsc restore`` takes the place of ``runsc run`` with a bundle of its own (same mounts,
its own slot directory as the conduit mount's source) and is then the child we observe.

Secrets never go into config.json: they are written to the container's stdin as
shell ``export`` lines, which a tiny ``/bin/sh`` prelude evaluates before exec'ing the
guest (so they exist only in the guest's memory).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, ClassVar

from prefect_resoluto.egress import SandboxNetwork

from . import _cgroup, _local
from ._guest_layout import (
    RUNNER_CAPS,
    WORKLOAD_USER_ENV,
    GuestLayout,
    SandboxRecord,
    add_network,
    guest_layout,
    labels_match,
    remove_tree,
    sandbox_dir,
)
from ._local import LocalChildRuntime, Prepared
from .base import (
    Availability,
    IsolationLevel,
    LaunchError,
    LaunchSpec,
    Resources,
    SandboxHandle,
    SandboxStatus,
)
from .capabilities import Capabilities

LABEL_PREFIX = "io.resoluto.label/"
#: Where the read-only roots shared by sandboxes of one layout live, in the runtime's state.
ROOTFS_DIR = "rootfs"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Reads `export K='v'` lines from stdin (the secrets), then becomes the guest.
# `runsc run`'s own exit status when it fails (any other status is the container's).
_RUNSC_FAILED = 128
_SECRET_PRELUDE = 'eval "$(cat)"; exec "$@"'
_RESTORE_REAPER = str(Path(__file__).with_name("_restore_reaper.py"))
# What _restore_reaper.py does, as a shell run by catatonit (podman's init, a child
# subreaper when it is not pid 1): ~2 ms of CPU where a Python interpreter's start is ~12 ms,
# at every restore. "$@" is runsc and its global flags; the four words before them the
# restore's. `runsc restore` runs in the background so a SIGTERM (which catatonit passes
# on) interrupts the wait: the container is killed and the wait goes on; a kill still
# running would re-create the container's lock file, and the trap's ends before the wait
# resumes. A TERM right after the wait returned restore's own status makes the next wait
# answer 127 (that child is reaped): the status already had is kept. The shell keeps no copy
# of the assignment pipe (catatonit keeps its own until it exits, as the Python reaper did).
# A background command of this shell starts with SIGINT and SIGQUIT ignored, and runsc's
# processes inherit that: harmless, the host sends neither and they run in their own session.
_REAP_SH = (
    "verb=$1 image=$2 bundle=$3 id=$4; shift 4\n"
    "exec 3<&0 0</dev/null\n"
    '"$@" "$verb" "$image" "$bundle" "$id" 0<&3 3<&- &\n'
    "child=$!\n"
    "exec 3<&-\n"
    'trap \'term=1; "$@" kill "$id" KILL >/dev/null 2>&1\' TERM\n'
    "code=\n"
    'while :; do term=; wait "$child"; c=$?\n'
    '  [ "$c" -eq 127 ] && [ -n "$code" ] && break; code=$c; [ -z "$term" ] && break\n'
    "done\n"
    "trap '' TERM\n"
    '"$@" delete --force "$id" >/dev/null 2>&1\n'
    'exit "$code"\n'
)


@functools.lru_cache(maxsize=1)
def _catatonit() -> str | None:
    """catatonit's path (a restored sandbox's subreaper), None where it is not installed:
    then the Python one (_restore_reaper.py) runs instead."""
    return shutil.which("catatonit")


@functools.lru_cache(maxsize=8)
def _probe(exe: str) -> tuple[str, tuple[str, ...]]:
    """(version line, platforms this runsc knows), from ``runsc --version`` and ``runsc flags``."""
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    flags = subprocess.run([exe, "flags"], capture_output=True, text=True, timeout=30)
    text = flags.stdout + flags.stderr
    # "-platform string\n\tspecifies which platform to use: systrap (default), ptrace, kvm."
    m = re.search(r"-platform string\s+specifies which platform to use: ([^\n]*)", text)
    platforms = (
        tuple(dict.fromkeys(re.findall(r"\b(systrap|ptrace|kvm)\b", m.group(1)))) if m else ("ptrace",)
    )
    return (version.stdout.splitlines() or ["runsc"])[0].strip(), platforms


@functools.lru_cache(maxsize=8)
def _probe_network(exe: str, flags: tuple[str, ...]) -> str:
    """Whether runsc's own network stack starts in a prepared namespace here: "" if so,
    else why not. Says whether the rmem_default workaround was needed."""
    name = f"rsl-s-probe-{os.getpid()}-{os.urandom(3).hex()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        needed = (
            subprocess.run(
                ["nsenter", f"--net=/run/netns/{name}", "test", "-e", "/proc/sys/net/core/rmem_default"],
                timeout=30,
            ).returncode
            == 0
        )
        failure = _probe_run(exe, (*flags, "--network=sandbox"), name)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    if failure:
        return f"runsc cannot start its network stack in a prepared namespace: {failure}"
    return "ok: " + (
        "needs the rmem_default workaround (google/gvisor#10704) and it works"
        if needed
        else "no workaround needed"
    )


@functools.lru_cache(maxsize=8)
def _probe_run(exe: str, flags: tuple[str, ...], netns: str | None = None) -> str:
    """Start one real sandbox running /usr/bin/true; "" on success, else runsc's complaint.

    Cached per process: a runsc that is installed but cannot start sandboxes here (no
    root, a platform the kernel refuses) must say so in availability(), not at launch.
    """
    with tempfile.TemporaryDirectory(prefix="resoluto-runsc-probe-") as tmp:
        rootfs = Path(tmp, "rootfs")
        for d in ("usr", "proc", "dev", "sys"):
            (rootfs / d).mkdir(parents=True)
        for link in ("bin", "lib", "lib64"):
            (rootfs / link).symlink_to(f"usr/{link}")
        cfg = {
            "ociVersion": "1.0.2",
            "process": {
                "args": ["/usr/bin/true"],
                "cwd": "/",
                "user": {"uid": 0, "gid": 0},
                "env": ["PATH=/usr/bin"],
            },
            "root": {"path": "rootfs", "readonly": True},
            "mounts": [
                {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]},
                {"destination": "/proc", "type": "proc", "source": "proc"},
            ],
            "linux": {
                "namespaces": [
                    {"type": t, **({"path": f"/run/netns/{netns}"} if netns and t == "network" else {})}
                    for t in ("pid", "network", "ipc", "uts", "mount")
                ]
            },
        }
        Path(tmp, "config.json").write_text(json.dumps(cfg))
        cid = f"probe-{os.getpid()}-{os.urandom(4).hex()}"
        base = [exe, f"--root={tmp}/root", "--ignore-cgroups", *flags]
        if "--network=sandbox" not in flags:
            base.insert(2, "--network=none")
        cmd = [*base, "run", f"--bundle={tmp}", cid]
        try:
            res = subprocess.run(
                netns_argv(netns, cmd) if netns else cmd,
                capture_output=True,
                text=True,
                timeout=20,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            res = None
        subprocess.run([*base, "delete", "--force", cid], capture_output=True, timeout=30)
        if res is None:
            return "a probe sandbox did not finish within 20 s"
        return "" if res.returncode == 0 else (res.stderr.strip() or f"exit code {res.returncode}")[-400:]


def _oci_mounts(lay: GuestLayout, r: Resources) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
        {
            "destination": "/sys",
            "type": "sysfs",
            "source": "sysfs",
            "options": ["nosuid", "noexec", "nodev", "ro"],
        },
    ]
    # /dev/shm: POSIX semaphores and shared memory (multiprocessing's locks and queues,
    # a ProcessPoolExecutor) live there; on a tmpfs like /tmp's, in the sandbox's memory.
    for dst in [*lay.tmpfs, "/dev/shm"]:
        opts = ["nosuid", "nodev", "mode=1777"]
        if r.tmpfs_bytes:  # gVisor's tmpfs is sandbox memory: never larger than the limit
            opts.append(f"size={r.tmpfs_bytes}")
        mounts.append({"destination": dst, "type": "tmpfs", "source": "tmpfs", "options": opts})
    for src, dst in lay.ro_binds:
        mounts.append({"destination": dst, "type": "bind", "source": src, "options": ["rbind", "ro"]})
    for src, dst in lay.rw_binds:
        mounts.append({"destination": dst, "type": "bind", "source": src, "options": ["rbind", "rw"]})
    return mounts


def _oci_resources(r: Resources) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if r.memory_bytes:
        resources["memory"] = {"limit": r.memory_bytes, "swap": r.memory_bytes}
    if r.pids:
        resources["pids"] = {"limit": r.pids}
    if r.cpus:
        resources["cpu"] = {"quota": int(r.cpus * 100_000), "period": 100_000}
    return resources


def _make_rootfs(rootfs: Path, lay: GuestLayout) -> None:
    """A read-only root for ``lay``: every mount point and symlink it needs, nothing else."""
    rootfs.mkdir()
    for dst, is_dir in lay.mount_points():
        target = rootfs / dst.lstrip("/")
        if is_dir:
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch(mode=0o644)  # never writable by others, whatever the umask
    for link, dst in lay.symlinks:
        target = rootfs / dst.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(link)
    for d in ("proc", "dev", "sys"):
        (rootfs / d).mkdir(exist_ok=True)
    # Whatever the host's umask: the workload's user must traverse to what is bound below.
    for dirpath, _dirs, _files in os.walk(rootfs):
        os.chmod(dirpath, 0o755)


class GVisorRuntime(LocalChildRuntime):
    name: ClassVar[str] = "gvisor"
    capabilities: ClassVar[Capabilities] = Capabilities(
        egress_allowlist=True,
        egress_by_name=True,
        warm=True,
        snapshots=True,
        options=frozenset(
            {
                "runsc",
                "platform",
                "python",
                "state_dir",
                "ignore_cgroups",
                "debug",
                "extra_ro_paths",
                "runsc_flags",
            }
        ),
    )
    #: runsc's own state and debug logs live next to the sandboxes' directories.
    own_entries: ClassVar[frozenset[str]] = LocalChildRuntime.own_entries | {
        "runsc-root",
        "debug",
        ROOTFS_DIR,
    }
    #: A task committing memory in bulk (MAP_POPULATE) past the limit had the host's OOM killer
    #: take the systrap stub holding it: runsc lived on, the task hung, the guest runner beat.
    oom_breaks_a_running_sandbox: ClassVar[bool] = True

    def __init__(
        self,
        *,
        runsc: str = "runsc",
        platform: str | None = None,
        python: str | None = None,
        state_dir: str | os.PathLike[str] | None = None,
        ignore_cgroups: bool | None = None,
        debug: bool = False,
        extra_ro_paths: list[str] | None = None,
        runsc_flags: list[str] | None = None,
    ) -> None:
        """``runsc``: binary name or path. ``platform``: ``systrap``/``ptrace``/``kvm``; default
        systrap when this runsc has it (several times cheaper per syscall), else ptrace.
        ``python``: interpreter for the guest (default ``sys.executable``, bound read-only with
        its prefix and virtualenv). ``ignore_cgroups``: skip host cgroups (no limits);
        default: only when no writable cgroup hierarchy exists. ``debug``: runsc debug logs
        into ``<state>/debug/<sandbox id>/`` (kept after destroy; never written otherwise).
        ``runsc_flags``: extra global runsc flags."""
        # gVisor enforces limits itself through runsc's cgroup, never a host-side wrapper.
        super().__init__(state_dir=state_dir, limits="none")
        self.runsc = runsc
        self.platform = platform
        self.python = python
        self.ignore_cgroups = ignore_cgroups
        self.debug = debug
        self.extra_ro_paths = list(extra_ro_paths or [])
        self.runsc_flags = list(runsc_flags or [])
        # Sandbox id -> checkpoint image, for launches that restore instead of boot.
        self._restore_from: dict[str, Path] = {}

    @property
    def isolation(self) -> IsolationLevel:
        return IsolationLevel.USER_KERNEL

    # ----------------------------------------------------------------- probing

    def _binary(self) -> str | None:
        return shutil.which(self.runsc)

    def _platform(self) -> str:
        if self.platform:
            return self.platform
        exe = self._binary()
        platforms = _probe(exe)[1] if exe else ()
        return "systrap" if "systrap" in platforms else "ptrace"

    def _ignore_cgroups(self) -> bool:
        if self.ignore_cgroups is not None:
            return self.ignore_cgroups
        return _cgroup.detect() is None

    def _check(self) -> Availability:
        exe = self._binary()
        if exe is None:
            return Availability(False, why=f"runsc binary {self.runsc!r} not found (apt-get install runsc)")
        if os.geteuid() != 0:
            return Availability(False, why="runsc needs root here (rootless gVisor is not wired up)")
        try:
            version, platforms = _probe(exe)
        except (OSError, subprocess.TimeoutExpired) as e:
            return Availability(False, why=f"cannot run {exe}: {e}")
        platform = self._platform()
        if platform not in platforms:
            return Availability(
                False,
                why=f"{version} does not support platform {platform!r} (supports: {', '.join(platforms)})",
            )
        failure = _probe_run(exe, (f"--platform={platform}", *self.runsc_flags))
        if failure:
            return Availability(False, why=f"runsc ({platform}) cannot start a sandbox here: {failure}")
        limits = "no limits (--ignore-cgroups)" if self._ignore_cgroups() else "limits: runsc cgroup"
        return Availability(
            True,
            detail=f"{version} at {exe}; platform {platform} (available: {', '.join(platforms)}); {limits}",
        )

    def _global_flags(self, sandbox: Path | None = None, network: bool = False) -> list[str]:
        flags = [
            f"--root={self.state / 'runsc-root'}",
            f"--platform={self._platform()}",
            "--network=sandbox" if network else "--network=none",
        ]
        if self._ignore_cgroups():
            flags.append("--ignore-cgroups")
        if self.debug and sandbox is not None:
            # Outside the sandbox's own directory, so the logs survive destroy for a post-mortem.
            flags += ["--debug", f"--debug-log={self.state / 'debug' / sandbox.name}/"]
        return flags + self.runsc_flags

    def _runsc(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        exe = self._binary() or self.runsc
        return subprocess.run(
            [exe, *self._global_flags(), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def egress_support(self) -> Availability:
        base = super().egress_support()
        if not base.ok:
            return base
        avail = self.availability()
        if not avail.ok:
            return Availability.refused(avail.why)
        exe = self._binary() or self.runsc
        verdict = _probe_network(exe, (f"--platform={self._platform()}", *self.runsc_flags))
        if not verdict.startswith("ok"):
            return Availability.refused(verdict)
        return Availability(True, detail=f"runsc netstack: {verdict.removeprefix('ok: ')}")

    # ----------------------------------------------------------------- the bundle

    def bundle_config(self, spec: LaunchSpec, lay: GuestLayout, netns: str | None = None) -> dict[str, Any]:
        """The OCI config.json for ``spec`` (public for tests). With ``netns`` the sandbox
        joins that prepared namespace; without, runsc makes an empty one."""
        mounts = _oci_mounts(lay, spec.resources)
        resources = _oci_resources(spec.resources)
        env = {k: v for k, v in lay.env.items() if k not in spec.secret_env}
        argv = lay.argv
        # The guest runner keeps the few capabilities it needs to start the workload as
        # another user (guest_runner/privsep.py), in gVisor's kernel only; any other
        # command, and the workload itself, has none.
        caps = list(RUNNER_CAPS) if WORKLOAD_USER_ENV in env else []
        if spec.secret_env:
            argv = ["/bin/sh", "-c", _SECRET_PRELUDE, "sh", *argv]
        return {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": 0, "gid": 0},
                "args": argv,
                "env": [f"{k}={v}" for k, v in env.items()],
                "cwd": lay.cwd,
                "capabilities": {"bounding": caps, "effective": caps, "inheritable": [], "permitted": caps},
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
                "noNewPrivileges": True,
            },
            "root": {"path": "rootfs", "readonly": True},
            "hostname": "sandbox",
            "mounts": mounts,
            "annotations": {LABEL_PREFIX + k: v for k, v in spec.labels.items()},
            "linux": {
                "namespaces": [
                    {"type": t, **({"path": f"/run/netns/{netns}"} if netns and t == "network" else {})}
                    for t in ("pid", "network", "ipc", "uts", "mount")
                ],
                "resources": resources,
                "cgroupsPath": f"/{_cgroup.PARENT}/{self._cgroup_name(spec.sandbox_id)}",
            },
        }

    def _prepare(self, spec: LaunchSpec, sandbox: Path, net: SandboxNetwork | None = None) -> Prepared:
        for k in spec.secret_env:
            if not _ENV_NAME.match(k):
                raise LaunchError(f"secret variable name {k!r} is not a valid environment name")
        lay = guest_layout(spec, python=self.python, extra_ro=self.extra_ro_paths)
        if net is not None:
            add_network(lay, net, sandbox)
        elif spec.network_layout:
            # A template restored later in a namespace of its own: the same mounts as the
            # sandbox it becomes (runsc restores into the mount points the image has); the
            # interfaces come from that namespace, the files from that sandbox's directory.
            add_network(lay, SandboxNetwork(netns="", gateway="", address=""), sandbox)
        bundle = sandbox / "bundle"
        bundle.mkdir()
        if spec.conduit_slot is not None or spec.conduit_root is None:
            # No mount point names the node: every sandbox of this layout (a warm pool's) links
            # to one root made once, not ~35 entries made and removed per sandbox.
            (bundle / "rootfs").symlink_to(self._shared_rootfs(lay))
        else:
            _make_rootfs(bundle / "rootfs", lay)
        cfg = bundle / "config.json"
        # Compact: json writes it with its C encoder (an indented dump is the pure-Python one,
        # ~1 ms a restore).
        cfg.write_text(json.dumps(self.bundle_config(spec, lay, netns=net.netns if net else None)))
        image = self._restore_from.pop(spec.sandbox_id, None)
        argv = self._runsc_argv(spec.sandbox_id, sandbox, bundle, image, network=net is not None)
        if net is not None:
            argv = netns_argv(net.netns, argv)
        # runsc donates its stdin to the container: a pipe the prelude reads to EOF.
        secrets = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in spec.secret_env.items())
        return Prepared(
            argv=argv,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            cwd=str(sandbox),
            extra={"bundle": str(bundle), **({"restored": True} if image is not None else {})},
            host_limits=False,
            stdin_data=secrets.encode() if secrets else None,
        )

    def _shared_rootfs(self, lay: GuestLayout) -> Path:
        """The read-only root of ``lay`` under this runtime's state (:data:`ROOTFS_DIR`): made
        aside and renamed into place once, found by the digest of its entries afterwards,
        never written again (runsc serves it read-only; a sandbox dir holds only a link)."""
        entries = [sorted(lay.mount_points()), sorted(lay.symlinks)]
        digest = hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:32]
        root = self.state / ROOTFS_DIR / digest
        if root.is_dir() and not root.is_symlink():
            return root
        root.parent.mkdir(mode=0o700, exist_ok=True)
        aside = root.with_name(f".{digest}.{os.getpid()}.{threading.get_ident()}")
        remove_tree(aside)  # a build this thread left half-made (a crash)
        _make_rootfs(aside, lay)
        try:
            os.rename(aside, root)
        except OSError:  # made meanwhile by another launch: theirs serves
            remove_tree(aside)
            if not (root.is_dir() and not root.is_symlink()):
                raise
        return root

    def _runsc_argv(
        self, sandbox_id: str, sandbox: Path, bundle: Path, image: Path | None, *, network: bool
    ) -> list[str]:
        """``runsc run`` of the bundle; with ``image``, ``runsc restore`` of it, deleted on exit
        as ``runsc run``'s container is, by a child subreaper (see _restore_reaper.py)."""
        exe = self._binary() or self.runsc
        verb = ["restore", f"--image-path={image}"] if image is not None else ["run"]
        own = [*verb, f"--bundle={bundle}", sandbox_id]
        runsc = [exe, *self._global_flags(sandbox, network=network)]
        if image is None:
            return [*runsc, *own]
        catatonit = _catatonit()
        if catatonit is not None:  # kill and delete with the restore's flags (debug logs beside its)
            return [catatonit, "--", "/bin/sh", "-c", _REAP_SH, "sh", *own, *runsc]
        delete = [exe, *self._global_flags(network=network), "delete", "--force", sandbox_id]
        return [sys.executable, "-I", "-S", _RESTORE_REAPER, *runsc, *own, "--", *delete]

    def _before_start(self, spec: LaunchSpec) -> None:
        if self._ignore_cgroups():
            return
        # Pre-create the cgroup runsc will join: runsc deletes only cgroups it created, so
        # this one outlives the sandbox and its oom_kill count can be read after exit (an
        # OOM under systrap otherwise looks like a plain exit code 1). destroy removes it.
        try:
            _cgroup.create(self._cgroup_name(spec.sandbox_id), spec.resources)
        except OSError as e:
            raise LaunchError(f"cannot create a cgroup for sandbox {spec.sandbox_id!r}: {e}") from e

    # ----------------------------------------------------------------- snapshots

    def snapshot_fingerprint(self) -> str:
        """What an image depends on besides the guest: this runsc, its platform, flags and mounts.

        A restored sandbox has its template's mount tree, whatever the bundle now says: the
        shape of the mounts this code gives every sandbox is part of it, so an image made
        before they changed (a /dev without /dev/shm) is not restored after."""
        exe = self._binary() or self.runsc
        version = _probe(exe)[0] if self._binary() else self.runsc
        shape = _oci_mounts(GuestLayout(argv=[], env={}), Resources())
        return json.dumps(
            [version, self._platform(), self._ignore_cgroups(), self.runsc_flags, self.extra_ro_paths, shape]
        )

    def checkpoint(self, handle: SandboxHandle, image: Path, timeout: float = 120) -> None:
        """Write ``handle``'s checkpoint into ``image`` (a directory that must not exist yet:
        runsc refuses to reuse one). The container stops; the caller destroys it. The image
        is uncompressed: restoring skips the inflate, and what it holds can be inspected."""
        res = self._runsc(
            "checkpoint", f"--image-path={image}", "--compression=none", handle.id, timeout=timeout
        )
        if res.returncode != 0:
            raise LaunchError(f"runsc checkpoint of {handle.id!r} failed: {res.stderr.strip()[-400:]}")

    def restore(self, spec: LaunchSpec, image: Path, wake: bytes = b"") -> SandboxHandle:
        """Start ``spec``'s sandbox from ``image`` instead of booting it. ``spec`` must have
        the template's mounts (sources may differ: each restored sandbox gets its own slot)
        and ``hold_stdin``; ``wake`` is written to the restored guest's stdin at once."""
        self._restore_from[spec.sandbox_id] = image
        try:
            handle = self.launch(spec)
        finally:
            self._restore_from.pop(spec.sandbox_id, None)
        if wake:
            with _local._LOCK:
                pipe = _local._STDIN.get((self.name, handle.id))
            try:
                if pipe is not None:
                    pipe.write(wake)
                    pipe.flush()
            except OSError:
                pass  # it already died: its status says why
        return handle

    def _destroy(self, sandbox_id: str) -> None:
        key = (self.name, sandbox_id)
        with _local._LOCK:
            proc = _local._CHILDREN.get(key)
        rec = SandboxRecord.load(sandbox_dir(self.state, sandbox_id)) if proc is not None else None
        if proc is not None and proc.poll() is None and rec is not None and rec.extra.get("restored"):
            # Its reaper deletes the container while it can still reap the gofer (killing
            # the reaper's group instead leaves the gofer to PID 1: seconds). A guest never
            # assigned exits at the end of its stdin, one still restoring too; an assigned
            # one is killed by the reaper on SIGTERM.
            with _local._LOCK:
                pipe = _local._STDIN.pop(key, None)
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass  # the group kill and `runsc delete` below still run
        super()._destroy(sandbox_id)

    # ----------------------------------------------------------------- observe & reap

    def _interpret(self, handle: SandboxHandle, code: int) -> SandboxStatus | None:
        if code == _RUNSC_FAILED and _runsc_failed(self.logs(handle, tail=20)):
            # runsc could not create the sandbox at all (bad mount, cgroup refused ...).
            return SandboxStatus(
                "failed",
                reason="runsc failed to start the sandbox: " + self.logs(handle, tail=5).strip(),
                exit_code=code,
                unstartable=True,
                infrastructure=True,
            )
        return None

    def _teardown(self, sandbox_id: str, record: SandboxRecord | None, exit_code: int | None) -> None:
        if self._binary() is None:
            return
        if exit_code is not None and exit_code >= 0 and exit_code != _RUNSC_FAILED:
            # `runsc run` exited by itself and deleted its container on the way out (a
            # restored sandbox's reaper did the same for `runsc restore`).
            return
        try:
            self._runsc("kill", sandbox_id, "KILL")
            self._runsc("delete", "--force", sandbox_id)
        except (OSError, subprocess.TimeoutExpired):
            pass  # the process-group kill and the cgroup drain below still run

    def _after_teardown(self, sandbox_id: str) -> None:
        # A container runsc never finished creating or restoring leaves its socket and lock
        # file in our root, which delete does not remove (it finds no container). Removed once
        # its processes are drained: a sandbox still starting made its socket after an earlier
        # look (a pool closed while its template booted left one).
        if self._binary() is None:
            return
        for leftover in (self.state / "runsc-root").glob(f"*{sandbox_id}*"):
            if leftover.is_file() or leftover.is_socket():
                leftover.unlink(missing_ok=True)

    def containers(self) -> list[dict[str, Any]]:
        """``runsc list`` of this runtime's root, with each container's OCI state."""
        if self._binary() is None or not (self.state / "runsc-root").is_dir():
            return []
        out = self._runsc("list", "--format=json")
        try:
            listing = json.loads(out.stdout or "[]") or []
        except ValueError:
            return []
        return [c for c in listing if isinstance(c, dict) and c.get("id")]

    def sweep(self, labels: dict[str, str]) -> int:
        n = super().sweep(labels)
        # Containers with no record left (state dir cleaned by hand, crash mid-launch).
        for c in self.containers():
            have = {
                k[len(LABEL_PREFIX) :]: v
                for k, v in (c.get("annotations") or {}).items()
                if k.startswith(LABEL_PREFIX)
            }
            if labels_match(have, labels):
                self._destroy(c["id"])
                n += 1
        return n


def netns_argv(netns: str, argv: list[str]) -> list[str]:
    """``argv`` (a ``runsc ... run``) started inside ``netns`` with gVisor's own network stack.

    runsc takes the sandbox's interfaces from the namespace it runs in, and refuses to
    start its netstack when ``/proc/sys/net/core/rmem_default`` exists, which it reads as
    "this is the root namespace" — on kernels >= 6.x the file exists in every namespace
    (google/gvisor#10704). So: a private mount namespace where that directory is an
    empty tmpfs (see docs/security.md)."""
    # nsenter, not `ip netns exec`: that one remounts /sys, hiding the cgroup tree runsc needs.
    return [
        "nsenter",
        f"--net=/run/netns/{netns}",
        "unshare",
        "--mount",
        "sh",
        "-c",
        'mount -t tmpfs none /proc/sys/net/core && exec "$@"',
        "sh",
        *argv,
    ]


def _runsc_failed(log: str) -> bool:
    return any(
        line.startswith(("running container:", "creating container:")) or "runsc" in line
        for line in log.splitlines()[-5:]
    )
