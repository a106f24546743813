"""``container``: the guest in an OCI container, via the ``podman`` or ``nerdctl`` CLI.

The isolation level follows the OCI runtime underneath: Kata → ``vm``, runsc (gVisor)
→ ``user-kernel``, anything else (runc, crun) → ``namespace``.

* nerdctl talks to a dedicated containerd (``--address``, ``--namespace``), never
  Docker's or k3s's; its runtimes are containerd shims (``io.containerd.kata.v2``).
* podman runs rootful here; 4.3 with runsc needs lower ulimits than its defaults
  (``nofile=1024``, ``nproc=4096``), and crun fails on a cgroup-v1 layout (use runc/runsc).

The container gets ``--network none`` (and ``--runtime-flag network=none`` under runsc),
a read-only root, tmpfs /tmp and /workspace, guest_runner read-only at /opt/resoluto,
the node's conduit directory at /conduit/<subdir>, memory (swap equal, so none extra),
CPU and pids limits, one ``--label`` per label plus a marker for ``sweep``. Secrets go
through an ``--env-file`` (0600, deleted once the engine has read it), never argv.

Offline images: with no image configured, the runtime builds a ~10 kB *skeleton* image
(empty directories and merged-/usr symlinks, ``podman import`` of a tarball made here)
and binds the host's /usr, minimal /etc and Python read-only into it, exactly like the
bubblewrap and gVisor runtimes. With a real image (``image=`` or ``spec.image``) the
image's own ``python3`` runs guest_runner.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
import threading
from pathlib import Path
from typing import Any, ClassVar

from prefect_resoluto import egress
from prefect_resoluto.runtimes import slot

from ._guest_layout import (
    RUNNER_CAPS,
    WORKLOAD_USER_ENV,
    GuestLayout,
    add_network,
    guest_layout,
    remove_tree,
    sandbox_dir,
    state_dir,
)
from ._local import network_request_of
from .base import (
    Availability,
    IsolationLevel,
    LaunchError,
    LaunchSpec,
    Resources,
    SandboxHandle,
    SandboxRuntime,
    SandboxStatus,
)
from .capabilities import Capabilities

MARKER_LABEL = "io.resoluto.sandbox"
SKELETON_IMAGE = "localhost/resoluto-skeleton:1"
ENGINES = ("podman", "nerdctl")
# containerd shim names for nerdctl's --runtime.
# podman's --runtime takes a binary; Kata's is not called "kata".
_PODMAN_BINARIES = {"kata": "kata-runtime"}
# `<engine> wait` children by (engine, sandbox id), shared by every instance in this process.
_WAITERS: dict[tuple[str, str], subprocess.Popen[bytes]] = {}
_LOCK = threading.Lock()
_SHIMS = {"kata": "io.containerd.kata.v2", "runsc": "io.containerd.runsc.v1", "runc": "io.containerd.runc.v2"}
# Containers with an egress network: (engine, sandbox id) -> run id.
_NETWORKS: dict[tuple[str, str], str] = {}
# podman hands runsc the namespace by path; runsc's "root namespace" test must not see
# /proc/sys/net/core/rmem_default there (google/gvisor#10704): the same cure as the gvisor
# runtime, as a per-container OCI runtime wrapper (podman calls it for every verb).
_RUNSC_WRAPPER = """#!/bin/sh
if [ -e {ns} ]; then
  exec nsenter --net={ns} unshare --mount sh -c 'mount -t tmpfs none /proc/sys/net/core && exec "$0" "$@"' {runsc} "$@"
fi
exec {runsc} "$@"
"""


def isolation_of(oci_runtime: str) -> IsolationLevel:
    name = os.path.basename(oci_runtime).lower()
    if "kata" in name:
        return IsolationLevel.VM
    if "runsc" in name or "gvisor" in name:
        return IsolationLevel.USER_KERNEL
    return IsolationLevel.NAMESPACE


def skeleton_tar() -> bytes:
    """A rootfs of mount points only: the host's system directories are bound over it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("usr", "etc", "tmp", "proc", "dev", "sys", "run", "opt", "workspace", "conduit", "root"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        for link in ("bin", "sbin", "lib", "lib64"):
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, f"usr/{link}"
            tar.addfile(info)
    return buf.getvalue()


class ContainerRuntime(SandboxRuntime):
    name: ClassVar[str] = "container"
    capabilities: ClassVar[Capabilities] = Capabilities(
        egress_allowlist=True,
        egress_by_name=True,
        options=frozenset(
            {
                "engine",
                "engine_path",
                "oci_runtime",
                "image",
                "host_python",
                "python",
                "address",
                "namespace",
                "read_only",
                "runtime_flags",
                "extra_run_args",
                "state_dir",
            }
        ),
    )

    def __init__(
        self,
        *,
        engine: str = "podman",
        engine_path: str | None = None,
        oci_runtime: str = "runsc",
        image: str | None = None,
        host_python: bool | None = None,
        python: str | None = None,
        address: str | None = None,
        namespace: str = "resoluto",
        read_only: bool = True,
        runtime_flags: list[str] | None = None,
        extra_run_args: list[str] | None = None,
        state_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        """``engine``: ``podman`` or ``nerdctl``; ``engine_path``: its binary (default: found on
        PATH). ``oci_runtime``: ``runsc``, ``kata``, ``runc`` or a path/shim name.
        ``image``: default image (``spec.image`` wins); None → the offline skeleton image.
        ``host_python``: bind the host's /usr + interpreter + virtualenv and run
        ``python`` (default ``sys.executable``); default True only for the skeleton image.
        ``address``/``namespace``: nerdctl's dedicated containerd socket and namespace.
        ``runtime_flags``: extra ``--runtime-flag`` values (podman).
        ``extra_run_args``: appended to ``run`` before the image."""
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        if engine == "nerdctl" and not address:
            raise ValueError("nerdctl needs address= (the dedicated containerd socket), never a shared one")
        self.engine = engine
        self.engine_path = engine_path
        self.oci_runtime = oci_runtime
        self.image = image
        self.host_python = host_python
        self.python = python
        self.address = address
        self.namespace = namespace
        self.read_only = read_only
        self.runtime_flags = list(runtime_flags or [])
        self.extra_run_args = list(extra_run_args or [])
        self._state_override = state_dir
        self._availability: Availability | None = None

    @property
    def isolation(self) -> IsolationLevel:
        return isolation_of(self.oci_runtime)

    # ----------------------------------------------------------------- engine plumbing

    def _exe(self) -> str | None:
        return shutil.which(self.engine_path or self.engine)

    def _base(self) -> list[str]:
        base = [self._exe() or self.engine_path or self.engine]
        if self.engine == "nerdctl":
            base += ["--address", str(self.address), "--namespace", self.namespace]
        return base

    def _run_engine(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self._base(), *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )

    def _runtime_arg(self) -> str:
        if self.engine == "nerdctl":
            return _SHIMS.get(self.oci_runtime, self.oci_runtime)
        binary = _PODMAN_BINARIES.get(self.oci_runtime, self.oci_runtime)
        return shutil.which(binary) or binary

    def _is_runsc(self) -> bool:
        return isolation_of(self.oci_runtime) == IsolationLevel.USER_KERNEL

    @property
    def display_name(self) -> str:
        # The OCI runtime decides the isolation: container(runsc), container(kata).
        return f"{self.name}({self.oci_runtime})" if self.oci_runtime else self.name

    def availability(self) -> Availability:
        if self._availability is None:
            self._availability = self._check()
        return self._availability

    def _check(self) -> Availability:
        exe = self._exe()
        if exe is None:
            return Availability(
                False, why=f"{self.engine} binary {self.engine_path or self.engine!r} not found"
            )
        if self.engine == "podman" and shutil.which(self._runtime_arg()) is None:
            return Availability(
                False, why=f"OCI runtime {self.oci_runtime!r} not found (looked for {self._runtime_arg()!r})"
            )
        if self.engine == "nerdctl" and not Path(str(self.address)).exists():
            return Availability(False, why=f"containerd socket {self.address} does not exist")
        try:
            ver = self._run_engine("version", "--format", "{{.Client.Version}}", timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return Availability(False, why=f"cannot run {exe}: {e}")
        if ver.returncode != 0:
            return Availability(False, why=f"{self.engine} version failed: {ver.stderr.strip()[:300]}")
        return Availability(
            True,
            detail=f"{self.engine} {ver.stdout.strip()} at {exe}; OCI runtime "
            f"{self._runtime_arg()} → isolation {self.isolation.label}; "
            f"image {self.image or SKELETON_IMAGE}",
        )

    def ensure_skeleton_image(self) -> str:
        """Import the skeleton image unless the engine already has it (offline: no registry)."""
        if self._run_engine("image", "inspect", SKELETON_IMAGE, timeout=60).returncode == 0:
            return SKELETON_IMAGE
        tar = self.state / "skeleton.tar"
        tar.write_bytes(skeleton_tar())
        res = self._run_engine("import", str(tar), SKELETON_IMAGE, timeout=120)
        tar.unlink(missing_ok=True)
        if res.returncode != 0:
            raise LaunchError(f"cannot import the skeleton image: {res.stderr.strip()[:500]}")
        return SKELETON_IMAGE

    @property
    def state(self) -> Path:
        return state_dir(self.name, self._state_override)

    # ----------------------------------------------------------------- launch

    def _image_for(self, spec: LaunchSpec) -> tuple[str | None, bool]:
        """(image or None for the skeleton, whether to bind the host's Python)."""
        image = spec.image or self.image
        host_python = self.host_python if self.host_python is not None else image is None
        return image, host_python

    def build_run_argv(
        self,
        spec: LaunchSpec,
        image: str,
        env_file: str | None = None,
        host_python: bool = False,
        net: egress.SandboxNetwork | None = None,
    ) -> list[str]:
        """The full ``<engine> run`` command for ``spec`` (public for unit tests).

        With ``net`` the container joins that prepared namespace (``--network ns:PATH``:
        podman's own option, and nerdctl's CNI-free one), so it reaches only the run's
        proxy, whatever the OCI runtime (runsc's netstack, a Kata VM's tap)."""
        lay = guest_layout(
            spec, python=self.python if host_python else (self.python or "python3"), host_python=host_python
        )
        runtime_arg = self._runtime_arg()
        network = "none"
        if net is not None:
            add_network(lay, net, self._net_dir(spec.sandbox_id))
            network = f"ns:/run/netns/{net.netns}"
            if self.engine == "podman" and self._is_runsc():
                runtime_arg = self._runsc_wrapper(spec.sandbox_id, net.netns)
        argv = [*self._base()]
        runsc = self._is_runsc()
        if self.engine == "podman":
            # Global flags handed to the OCI runtime: gVisor's own network stack off too.
            flags = (["network=none"] if runsc and net is None else []) + self.runtime_flags
            argv += [f"--runtime-flag={f}" for f in flags]
        argv += [
            "run",
            "-d",
            "--name",
            spec.sandbox_id,
            "--runtime",
            runtime_arg,
            "--network",
            network,
            "--workdir",
            lay.cwd,
        ]
        if self.engine == "podman":
            argv += ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096", "--pull", "never"]
        argv += self._privilege_args(lay)
        argv += _resource_args(spec.resources)
        argv += ["--label", f"{MARKER_LABEL}=true"]
        for k, v in spec.labels.items():
            argv += ["--label", f"{k}={v}"]
        for k, v in lay.env.items():
            if k not in spec.secret_env:
                argv += ["-e", f"{k}={v}"]
        if env_file:
            argv += ["--env-file", env_file]
        argv += _mount_args(lay, spec.resources)
        argv += [*self.extra_run_args, image, *lay.argv]
        return argv

    def _privilege_args(self, lay: GuestLayout) -> list[str]:
        argv: list[str] = []
        if WORKLOAD_USER_ENV in lay.env:
            # The guest runner keeps only what it needs to start the workload as another
            # user (guest_runner/privsep.py); nothing started in here gains a privilege.
            argv += ["--cap-drop", "all", "--cap-add", ",".join(RUNNER_CAPS)]
            argv += ["--security-opt", "no-new-privileges"]
        if self.read_only:
            argv.append("--read-only")
        return argv

    def _net_dir(self, sandbox_id: str) -> Path:
        d = sandbox_dir(self.state, sandbox_id).with_suffix(".net")
        d.mkdir(mode=0o700, exist_ok=True)
        return d

    def _runsc_wrapper(self, sandbox_id: str, netns: str) -> str:
        path = self._net_dir(sandbox_id) / "runsc"
        path.write_text(_RUNSC_WRAPPER.format(ns=f"/run/netns/{netns}", runsc=self._runtime_arg()))
        path.chmod(0o755)
        return str(path)

    def _detach(self, name: str) -> None:
        with _LOCK:
            run_id = _NETWORKS.pop((self.engine, name), None)
        d = sandbox_dir(self.state, name).with_suffix(".net")
        if run_id is not None:
            egress.detach(run_id, name)
        if d.exists():
            remove_tree(d)

    def launch(self, spec: LaunchSpec) -> SandboxHandle:
        self.check_spec(spec)
        self.require_available()
        request = network_request_of(spec)
        net = None
        if request is not None:
            try:
                net = egress.attach(request, spec.sandbox_id)
            except (egress.netns.NetnsError, OSError) as e:
                raise LaunchError(
                    f"container: cannot give sandbox {spec.sandbox_id!r} its egress network: {e}"
                ) from e
            with _LOCK:
                _NETWORKS[(self.engine, spec.sandbox_id)] = request.run_id
        try:
            return self._launch(spec, net)
        except BaseException:
            self._detach(spec.sandbox_id)
            raise

    def _launch(self, spec: LaunchSpec, net: egress.SandboxNetwork | None) -> SandboxHandle:
        chosen, host_python = self._image_for(spec)
        image = chosen or self.ensure_skeleton_image()
        env_file = None
        # The engine writes the new container's id here once it exists: on failure we remove
        # exactly that container, never a live one that already had the name.
        cidfile = sandbox_dir(self.state, spec.sandbox_id).with_suffix(".cid")
        cidfile.unlink(missing_ok=True)
        if spec.secret_env:
            env_file = sandbox_dir(self.state, spec.sandbox_id).with_suffix(".env")
            fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                for k, v in spec.secret_env.items():
                    if "\n" in v:
                        raise LaunchError(f"secret {k!r} contains a newline, which an env-file cannot carry")
                    f.write(f"{k}={v}\n")
        try:
            argv = self.build_run_argv(spec, image, str(env_file) if env_file else None, host_python, net)
            i = argv.index("run") + 2  # after "run -d"
            argv[i:i] = ["--cidfile", str(cidfile)]
            try:
                res = subprocess.run(
                    argv, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
                )
                error = (
                    "" if res.returncode == 0 else f"(exit {res.returncode}): {res.stderr.strip()[-1000:]}"
                )
            except (OSError, subprocess.TimeoutExpired) as e:
                error = str(e)
            if error:
                # The engine may have created the container before the OCI runtime refused it.
                created = cidfile.read_text().strip() if cidfile.exists() else ""
                if created:
                    self._remove(created)
                raise LaunchError(f"{self.engine} could not start sandbox {spec.sandbox_id!r} {error}")
        finally:
            if env_file:
                env_file.unlink(missing_ok=True)
            cidfile.unlink(missing_ok=True)
        cid = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else spec.sandbox_id
        self._start_waiter(spec.sandbox_id)
        return SandboxHandle(
            id=spec.sandbox_id,
            runtime=self.name,
            labels=dict(spec.labels),
            data={"container_id": cid, "engine": self.engine, "image": image},
        )

    # ----------------------------------------------------------------- observe & reap

    def inspect(self, sandbox_id: str) -> dict[str, Any] | None:
        res = (
            self._run_engine("inspect", "--type", "container", sandbox_id, timeout=60)
            if self.engine == "podman"
            else self._run_engine("inspect", sandbox_id, timeout=60)
        )
        if res.returncode != 0:
            return None
        try:
            data = json.loads(res.stdout)
        except ValueError:
            return None
        return data[0] if isinstance(data, list) and data else None

    def _start_waiter(self, name: str) -> None:
        # One `<engine> wait` per sandbox: while it runs, the container does too, and
        # status() answers without spawning a full `inspect` (an engine process) every poll.
        # podman's wait polls (default every 250 ms, which would be the exit latency);
        # nerdctl's listens for containerd's exit event.
        interval = ["--interval", "50ms"] if self.engine == "podman" else []
        try:
            waiter = subprocess.Popen(
                [*self._base(), "wait", *interval, name],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError:
            return  # status() falls back to inspect
        with _LOCK:
            old = _WAITERS.pop((self.engine, name), None)
            _WAITERS[(self.engine, name)] = waiter
        if old is not None:
            _stop(old)

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        with _LOCK:
            waiter = _WAITERS.get((self.engine, handle.id))
        if waiter is not None and waiter.poll() is None:
            return SandboxStatus("running")
        info = self.inspect(handle.id)
        if info is None:
            return SandboxStatus("failed", reason=f"container {handle.id!r} no longer exists", gone=True)
        return status_from_state(info.get("State") or {})

    def destroy(self, handle: SandboxHandle) -> None:
        self._remove(handle.id)

    def _remove(self, name: str) -> None:
        with _LOCK:
            waiter = _WAITERS.pop((self.engine, name), None)
        if waiter is not None:
            _stop(waiter)
        args = ["rm", "-f", "-t", "0", name] if self.engine == "podman" else ["rm", "-f", name]
        try:
            self._run_engine(*args, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self._detach(name)

    def list_ids(self, labels: dict[str, str] | None = None) -> list[str]:
        """Names of this runtime's containers carrying all ``labels``."""
        args = ["ps", "-a", "--filter", f"label={MARKER_LABEL}=true"]
        for k, v in (labels or {}).items():
            args += ["--filter", f"label={k}={v}"]
        res = self._run_engine(*args, "--format", "{{.Names}}", timeout=60)
        if res.returncode != 0:
            return []
        return [n.strip() for n in res.stdout.splitlines() if n.strip()]

    def sweep(self, labels: dict[str, str]) -> int:
        names = self.list_ids(labels)
        for name in names:
            self._remove(name)
        egress.sweep()  # namespaces of hosts that died before they could destroy
        slot.sweep_orphans()  # conduit slots of hosts that died mid-node
        return len(names)

    def logs(self, handle: SandboxHandle, tail: int = 200) -> str:
        try:
            res = subprocess.run(
                [*self._base(), "logs", "--tail", str(tail), handle.id],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=60,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return res.stdout if res.returncode == 0 else ""


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def status_from_state(state: dict[str, Any]) -> SandboxStatus:
    """A SandboxStatus from podman/nerdctl ``inspect`` ``State`` (docker-compatible)."""
    phase = str(state.get("Status", "")).lower()
    code = state.get("ExitCode")
    error = str(state.get("Error") or "")
    if phase in ("created", "configured", "initialized"):
        return SandboxStatus("pending")
    if phase in ("running", "paused", "restarting"):
        return SandboxStatus("running")
    if phase in ("exited", "stopped", "dead"):
        code = int(code) if code is not None else None
        if state.get("OOMKilled"):
            return SandboxStatus(
                "failed",
                reason="OOM-killed: the container exceeded its memory limit",
                exit_code=code,
                infrastructure=True,
            )
        if error:
            return SandboxStatus(
                "failed",
                reason=f"container error: {error}",
                exit_code=code,
                infrastructure=True,
                unstartable=code in (None, 125, 126, 127),
            )
        if code == 0:
            return SandboxStatus("succeeded", exit_code=0)
        if code == 137:
            return SandboxStatus(
                "failed",
                reason="container killed by SIGKILL (out of memory or killed from outside)",
                exit_code=code,
                infrastructure=True,
            )
        return SandboxStatus("failed", reason=f"exit code {code}", exit_code=code)
    if phase == "removing":
        return SandboxStatus("failed", reason="container is being removed", gone=True)
    return SandboxStatus("unknown", reason=f"container state {phase!r}")


def _resource_args(r: Resources) -> list[str]:
    argv: list[str] = []
    if r.memory_bytes:
        argv += ["--memory", str(r.memory_bytes), "--memory-swap", str(r.memory_bytes)]
    if r.cpus:
        argv += ["--cpus", f"{r.cpus:g}"]
    if r.pids:
        argv += ["--pids-limit", str(r.pids)]
    return argv


def _mount_args(lay: GuestLayout, r: Resources) -> list[str]:
    """The layout's binds and scratch mounts as ``run`` options."""
    argv: list[str] = []
    for src, dst in lay.ro_binds:
        argv += ["-v", f"{src}:{dst}:ro"]
    for src, dst in lay.rw_binds:
        argv += ["-v", f"{src}:{dst}:rw"]
    for _link, dst in lay.symlinks:
        if dst.startswith("/etc/"):
            # The skeleton has no /etc entries; bind what the link points at instead.
            target = os.path.realpath(dst)
            if os.path.exists(target):
                argv += ["-v", f"{target}:{dst}:ro"]
    for dst in lay.tmpfs:
        size = f",size={r.tmpfs_bytes}" if r.tmpfs_bytes else ""
        argv += ["--tmpfs", f"{dst}:rw,mode=1777{size}"]
    return argv
