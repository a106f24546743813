"""Host-side helpers shared by the local runtimes.

* which host paths a Python guest needs inside a sandbox (:func:`guest_layout`),
* the environment a sandbox gets (:func:`sandbox_env`): never the host's,
* (re-exported from :mod:`prefect_resoluto.host.state`, a leaf shared with egress) a
  per-runtime state directory with one JSON record per sandbox, so ``sweep`` can find
  sandboxes launched by an earlier (crashed) process, and so a recorded pid is only ever
  signalled while it still belongs to the process we started.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from guest_runner import wire
from guest_runner.conduit.local import make_dirs
from prefect_resoluto.host.state import RECORD_NAME as RECORD_NAME
from prefect_resoluto.host.state import STATE_ENV as STATE_ENV
from prefect_resoluto.host.state import SandboxRecord as SandboxRecord
from prefect_resoluto.host.state import kill_group as kill_group
from prefect_resoluto.host.state import labels_match as labels_match
from prefect_resoluto.host.state import process_start_time as process_start_time
from prefect_resoluto.host.state import records as records
from prefect_resoluto.host.state import remove_tree as remove_tree
from prefect_resoluto.host.state import same_process as same_process
from prefect_resoluto.host.state import sandbox_dir as sandbox_dir
from prefect_resoluto.host.state import state_dir as state_dir

from .base import LaunchSpec

if TYPE_CHECKING:
    from prefect_resoluto.egress import SandboxNetwork

#: Where the conduit root appears inside a sandbox (RESOLUTO_STORE_ROOT is rewritten to it).
GUEST_CONDUIT_ROOT = "/conduit"
#: The host's heartbeat directory inside a sandbox, under GUEST_CONDUIT_ROOT: one fixed
#: path whatever process writes it (a sandbox restored from a snapshot keeps its mounts'
#: destinations), RESOLUTO_HOST_BEAT_KEY rewritten to it.
GUEST_HOST_BEAT_WRITER = "host"
GUEST_HOST_BEAT_DIR = wire.host_beat_dir(GUEST_HOST_BEAT_WRITER)
#: The guest's working directory and default RESOLUTO_WORKSPACE_DIR inside a sandbox.
GUEST_WORKSPACE = "/workspace"
#: Where the guest_runner package is mounted inside a sandbox (PYTHONPATH points here).
GUEST_RUNNER_ROOT = "/opt/resoluto"

LOG_NAME = "output.log"

# System directories a dynamically linked interpreter needs. On merged-/usr systems the
# top-level ones are symlinks into /usr and are recreated as symlinks, not bound.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# The few /etc entries a Python program expects: the loader cache, user/group names,
# the time zone, TLS roots. Nothing else of /etc (no resolv.conf: there is no network).
_ETC_ENTRIES = (
    "/etc/ld.so.cache",
    "/etc/passwd",
    "/etc/group",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/mime.types",
)
_BASE_PATH = "/usr/local/bin:/usr/bin:/bin"

# The workload as another user than the runner (guest_runner/privsep.py): the uid/gid it
# runs as inside a sandbox, and the capabilities the runner keeps to get it there (in
# the sandbox's own kernel or user namespace, never over the host's resources).
WORKLOAD_USER = "65534:65534"
WORKLOAD_USER_ENV = wire.ENV_WORKLOAD_USER
WORKLOAD_PIDNS_ENV = wire.ENV_WORKLOAD_PIDNS
RUNNER_CAPS = ("CAP_CHOWN", "CAP_DAC_READ_SEARCH", "CAP_KILL", "CAP_SETGID", "CAP_SETPCAP", "CAP_SETUID")
_RUNNER_MODULES = ("guest_runner", "guest_runner.warm")


def runs_guest_runner(argv: list[str]) -> bool:
    """Whether ``argv`` starts the guest runner (cold or warm), not an arbitrary command."""
    return len(argv) >= 3 and argv[1] == "-m" and argv[2] in _RUNNER_MODULES


# --------------------------------------------------------------------------- layout


@dataclass
class GuestLayout:
    """A runtime-neutral description of a sandbox's filesystem and process.

    Each runtime translates it into its own syntax (bwrap flags, OCI mounts, ``-v``).
    Destinations are absolute paths inside the sandbox.
    """

    argv: list[str]
    env: dict[str, str]
    cwd: str = GUEST_WORKSPACE
    #: (host path, guest path), mounted read-only.
    ro_binds: list[tuple[str, str]] = field(default_factory=list)
    #: (host path, guest path), mounted read-write.
    rw_binds: list[tuple[str, str]] = field(default_factory=list)
    #: (link target, guest path): merged-/usr symlinks, /etc/localtime ...
    symlinks: list[tuple[str, str]] = field(default_factory=list)
    #: Guest paths that get a fresh writable tmpfs.
    tmpfs: list[str] = field(default_factory=lambda: ["/tmp"])

    def mount_points(self) -> Iterator[tuple[str, bool]]:
        """Every guest mount destination with whether the host side is a directory."""
        for src, dst in self.ro_binds + self.rw_binds:
            yield dst, os.path.isdir(src)
        for dst in self.tmpfs:
            yield dst, True


def _covered(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def system_binds() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Read-only binds and symlinks for the host's system directories and minimal /etc."""
    binds: list[tuple[str, str]] = []
    links: list[tuple[str, str]] = []
    for d in _SYSTEM_DIRS + _ETC_ENTRIES:
        if os.path.islink(d):
            target = os.readlink(d)
            # A relative link into a bound tree (bin -> usr/bin) is recreated as is; an
            # absolute one (/etc/localtime -> /usr/share/zoneinfo/..) too, since /usr is bound.
            links.append((target, d))
        elif os.path.exists(d):
            binds.append((d, d))
    return binds, links


@functools.lru_cache(maxsize=1)
def guest_runner_dir() -> Path:
    """The host directory of the ``guest_runner`` package (stdlib only, so it runs anywhere).
    Looked up once per process: the package is imported from one place for the process's
    life, and every launch asks (a ``find_spec`` and a ``resolve``, one lstat per component)."""
    spec = importlib.util.find_spec("guest_runner")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the guest_runner package is not importable on the host")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def python_paths(executable: str | None = None) -> list[str]:
    """Host directories a guest started with the host's interpreter must see read-only.

    The interpreter prefix and the virtualenv (``pyvenv.cfg`` lives at ``sys.prefix``), the
    directory the executable symlink resolves into, and every ``sys.path`` entry holding
    installed distributions (``site-packages``/``dist-packages`` directories and zipped
    paths outside the prefixes, e.g. a user site), so a sandboxed task imports what the
    flow imports. Source directories on ``sys.path`` (the cwd ``python -m`` inserts, a
    script's directory, pytest's rootdir, old-style editable installs) are *not* bound:
    they are the user's project tree, which reaches a sandbox through the workspace or,
    deliberately, through a runtime's ``extra_ro_paths``. Paths under the system
    directories are skipped: those are bound anyway.
    """
    exe = executable or sys.executable
    candidates = [
        sys.base_prefix,
        sys.base_exec_prefix,
        sys.prefix,
        sys.exec_prefix,
        os.path.dirname(os.path.realpath(exe)),
    ]
    candidates += [p for p in sys.path if p and os.path.isabs(p) and _holds_distributions(p)]
    roots: list[str] = []
    system = [d for d in _SYSTEM_DIRS if os.path.exists(d)]
    # Shortest first, so a prefix swallows the entries below it.
    for p in sorted({os.path.normpath(c) for c in candidates}, key=len):
        if p == "/" or not os.path.exists(p) or _covered(p, system) or _covered(p, roots):
            continue
        roots.append(p)
    return roots


def _holds_distributions(entry: str) -> bool:
    name = os.path.basename(os.path.normpath(entry))
    return name in ("site-packages", "dist-packages") or entry.endswith((".zip", ".egg", ".whl"))


def host_interpreter(python: str | None = None) -> str:
    """The interpreter a sandbox runs at its host path (default: this one), without ``..``:
    a flow started as ``../.venv/bin/python flow.py`` has such an ``sys.executable``, and in
    a sandbox the directories it climbs out of are not there to climb."""
    return os.path.normpath(python or sys.executable)


def guest_layout(
    spec: LaunchSpec,
    *,
    python: str | None = None,
    host_python: bool = True,
    extra_ro: list[str] | None = None,
) -> GuestLayout:
    """The filesystem, argv and environment of a sandboxed Python guest.

    ``host_python`` binds the host's system directories and interpreter at their host
    paths (the guest runs ``python``, default ``sys.executable``); without it the image
    is expected to bring ``python3`` and only guest_runner is bound.
    """
    ro: list[tuple[str, str]] = []
    links: list[tuple[str, str]] = []
    path = _BASE_PATH
    if host_python:
        python = host_interpreter(python)
        ro, links = system_binds()
        ro += [(p, p) for p in python_paths(python)]
        # `python` in a workload argv should be the flow's interpreter.
        path = f"{os.path.dirname(python)}:{_BASE_PATH}"
    else:
        python = python or "python3"
    for p in extra_ro or []:
        if not os.path.exists(p):
            raise ValueError(f"extra read-only path {p!r} does not exist on the host")
        ro.append((p, p))
    ro.append((str(guest_runner_dir()), f"{GUEST_RUNNER_ROOT}/guest_runner"))

    rw: list[tuple[str, str]] = []
    tmpfs = ["/tmp", GUEST_WORKSPACE]

    overrides = {wire.ENV_WORKSPACE_DIR: GUEST_WORKSPACE}
    argv = list(spec.command) if spec.command else [python, "-m", "guest_runner"]
    if runs_guest_runner(argv):
        # Every sandbox built from this layout is its own PID namespace.
        overrides |= {WORKLOAD_USER_ENV: WORKLOAD_USER, WORKLOAD_PIDNS_ENV: "1"}
    conduit = conduit_host_dir(spec)
    if conduit is not None:
        rw.append((str(conduit), guest_conduit_dir(spec)))
        overrides[wire.ENV_STORE_ROOT] = GUEST_CONDUIT_ROOT
        if spec.host_beat_dir is not None:  # the host's heartbeat: read, never written, in here
            ro.append((str(spec.host_beat_dir), f"{GUEST_CONDUIT_ROOT}/{GUEST_HOST_BEAT_DIR}"))
            overrides[wire.ENV_HOST_BEAT_KEY] = wire.host_beat_key(GUEST_HOST_BEAT_WRITER)
    env = sandbox_env(spec, home="/tmp", path=path, pythonpath=GUEST_RUNNER_ROOT, overrides=overrides)
    return GuestLayout(argv=argv, env=env, ro_binds=ro, rw_binds=rw, symlinks=links, tmpfs=tmpfs)


# --------------------------------------------------------------------------- conduit & env


def conduit_host_dir(spec: LaunchSpec) -> Path | None:
    """The node's conduit directory on the host (created), or None without a local conduit."""
    if spec.conduit_root is None:
        return None
    sub = spec.conduit_subdir.strip("/")
    if any(part in ("", ".", "..") for part in sub.split("/")) and sub:
        raise ValueError(f"conduit_subdir {spec.conduit_subdir!r} must be a plain relative path")
    host = Path(spec.conduit_root).resolve() / sub if sub else Path(spec.conduit_root).resolve()
    make_dirs(host)
    if spec.conduit_slot is not None:
        from prefect_resoluto.runtimes import slot

        slot.mount(host, spec.conduit_slot)
    if sub:
        # The runner's alone: the workload (another user, guest_runner/privsep.py) can
        # neither forge nor read the node's events, result and manifest.
        host.chmod(0o700)
    return host


def guest_conduit_dir(spec: LaunchSpec) -> str:
    sub = spec.conduit_subdir.strip("/")
    return f"{GUEST_CONDUIT_ROOT}/{sub}" if sub else GUEST_CONDUIT_ROOT


def sandbox_env(
    spec: LaunchSpec,
    *,
    home: str,
    path: str = _BASE_PATH,
    pythonpath: str | None = None,
    overrides: dict[str, str] | None = None,
) -> dict[str, str]:
    """spec.env + spec.secret_env + a minimal PATH/HOME/LANG; nothing of the host's environment.

    ``overrides`` win over spec.env: they are what the runtime owns, i.e. where the conduit
    and the workspace appear inside (a caller's RESOLUTO_WORKSPACE_DIR=/workspace would
    be the host's /workspace for the process runtime).
    """
    env = {"PATH": path, "HOME": home, "LANG": "C.UTF-8"}
    env.update(spec.env)
    env.update(overrides or {})
    if pythonpath:
        extra = env.get("PYTHONPATH")
        env["PYTHONPATH"] = f"{pythonpath}:{extra}" if extra else pythonpath
    env.update(spec.secret_env)
    return env


# --------------------------------------------------------------------------- logs


def open_log(path: Path) -> IO[bytes]:
    """The sandbox's stdout+stderr file. Append mode matters: gVisor writes a regular
    non-append stdout in place (pwrite at offset 0), clobbering earlier output."""
    return open(path, "ab", buffering=0)


def tail_file(path: Path, lines: int, max_bytes: int = 1 << 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", "replace")
    if lines <= 0:
        return ""
    return "\n".join(text.splitlines()[-lines:]) + ("\n" if text.endswith("\n") else "")


# --------------------------------------------------------------------------- network


def add_network(lay: GuestLayout, net: SandboxNetwork, sandbox: Path) -> None:
    """Give a guest its egress network's view: /etc/resolv.conf pointing at the run's
    proxy, a minimal /etc/hosts, and the proxy variables (the guest's own env wins for
    nothing here: these are the runtime's)."""
    etc = sandbox / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "resolv.conf").write_text(net.resolv_conf)
    (etc / "hosts").write_text("127.0.0.1\tlocalhost\n::1\tlocalhost\n")
    lay.ro_binds += [(str(etc / "resolv.conf"), "/etc/resolv.conf"), (str(etc / "hosts"), "/etc/hosts")]
    lay.env.update(net.env)
