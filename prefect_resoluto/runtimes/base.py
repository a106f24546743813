"""The runtime seam: launch / status / destroy / sweep / logs, plus an isolation level.

A runtime knows how to start the guest runner inside one kind of sandbox and how to
observe it from outside. It knows nothing of Prefect, and nothing of the conduit
beyond "bind this host directory" (local conduits) or "pass these variables".
"""

from __future__ import annotations

import enum
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from guest_runner import wire
from prefect_resoluto.host.availability import Availability as Availability
from prefect_resoluto.runtimes.capabilities import LEGACY_FLAGS, Capabilities, fold_legacy, legacy_flags

if TYPE_CHECKING:
    from collections.abc import Mapping

    from guest_runner.conduit import Conduit
    from prefect_resoluto.egress import NetworkRequest


class IsolationLevel(enum.IntEnum):
    """How strongly a runtime separates the workload from the host, weakest first."""

    NONE = 0  # a plain process
    NAMESPACE = 1  # Linux namespaces (bubblewrap): shared host kernel
    USER_KERNEL = 2  # gVisor: a user-space kernel between the workload and the host
    VM = 3  # Kata: a hardware-virtualised microVM

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")

    @classmethod
    def parse(cls, value: str | IsolationLevel) -> IsolationLevel:
        if isinstance(value, IsolationLevel):
            return value
        key = str(value).strip().lower().replace("-", "_")
        for level in cls:
            if level.name.lower() == key:
                return level
        raise ValueError(
            f"unknown isolation level {value!r}; choose one of: {', '.join(lv.label for lv in cls)}"
        )


DEFAULT_MIN_ISOLATION = IsolationLevel.USER_KERNEL

_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(Ki|Mi|Gi|Ti|K|M|G|T|k)?\s*$")
_FACTORS = {
    None: 1,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
    "K": 1000,
    "k": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
}


def parse_quantity(value: str | int) -> int:
    """Bytes from a Kubernetes-style quantity: ``512Mi``, ``2Gi``, ``1G``, ``1048576``."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"memory quantity must be positive, got {value}")
        return value
    m = _QUANTITY.match(str(value))
    if not m:
        raise ValueError(
            f"cannot parse quantity {value!r}: use a number with an optional unit "
            "Ki/Mi/Gi/Ti (binary) or K/M/G/T (decimal), e.g. 512Mi"
        )
    n = int(float(m.group(1)) * _FACTORS[m.group(2)])
    if n <= 0:
        raise ValueError(f"quantity must be positive, got {value!r}")
    return n


def parse_cpus(value: str | float | int) -> float:
    """Cores from ``"2"``, ``"0.5"`` or ``"500m"``."""
    s = str(value).strip()
    try:
        cpus = float(s[:-1]) / 1000 if s.endswith("m") else float(s)
    except ValueError:
        raise ValueError(f"cannot parse CPU quantity {value!r}: use e.g. 1, 0.5 or 500m") from None
    if cpus <= 0:
        raise ValueError(f"CPU quantity must be positive, got {value!r}")
    return cpus


#: What every sandbox gets unless its settings say otherwise (as the reference backends).
DEFAULT_MEMORY = "4Gi"
DEFAULT_CPUS = 2.0
DEFAULT_PIDS = 4096


def format_bytes(n: int) -> str:
    for unit, factor in (("Ti", 1024**4), ("Gi", 1024**3), ("Mi", 1024**2), ("Ki", 1024)):
        if n >= factor and n % factor == 0:
            return f"{n // factor}{unit}"
    for unit, factor in (("Gi", 1024**3), ("Mi", 1024**2)):
        if n >= factor:
            return f"{n / factor:.1f}{unit}"
    return str(n)


@dataclass(frozen=True)
class Resources:
    """What one sandbox may use. ``None`` leaves the runtime's default (unlimited);
    :meth:`from_quantities`, which every configured sandbox goes through, fills in
    :data:`DEFAULT_MEMORY` / :data:`DEFAULT_CPUS` / :data:`DEFAULT_PIDS`."""

    memory_bytes: int | None = None
    cpus: float | None = None
    pids: int | None = DEFAULT_PIDS
    disk_bytes: int | None = None

    @classmethod
    def from_quantities(
        cls,
        memory: str | int | None = None,
        cpus: str | float | None = None,
        disk: str | int | None = None,
        pids: int | None = DEFAULT_PIDS,
    ) -> Resources:
        if pids is not None and (isinstance(pids, bool) or int(pids) <= 0):
            raise ValueError(f"pids must be a positive number of processes, got {pids!r}")
        return cls(
            memory_bytes=parse_quantity(memory or DEFAULT_MEMORY),
            cpus=parse_cpus(cpus) if cpus else DEFAULT_CPUS,
            disk_bytes=parse_quantity(disk) if disk else None,
            pids=int(pids) if pids is not None else None,
        )

    @property
    def tmpfs_bytes(self) -> int | None:
        """The size of each in-memory scratch mount (/tmp, /workspace): the disk quantity
        if one is set, else the memory limit (what is written there is memory)."""
        return self.disk_bytes or self.memory_bytes

    def describe(self) -> str:
        parts = [
            f"memory {format_bytes(self.memory_bytes)}" if self.memory_bytes else "memory unlimited",
            f"{self.cpus:g} CPU(s)" if self.cpus else "CPUs unlimited",
            f"pids {self.pids}" if self.pids else "pids unlimited",
        ]
        if self.tmpfs_bytes:
            parts.append(f"scratch (/tmp, /workspace) {format_bytes(self.tmpfs_bytes)} each")
        return ", ".join(parts)


def memory_hint(resources: Resources) -> str:
    """What to tell a user whose task hit the sandbox's memory limit."""
    if not resources.memory_bytes:
        return ""
    default = " (the default)" if resources.memory_bytes == parse_quantity(DEFAULT_MEMORY) else ""
    return (
        f"the sandbox's memory limit is {format_bytes(resources.memory_bytes)}{default}, set by the "
        "`memory` setting: raise it with ResolutoTaskRunner(memory=...), sandbox_options(memory=...) "
        "around one submission, the sandbox block's memory, the work pool's `memory` job variable, "
        "or --memory on the command line"
    )


@dataclass(frozen=True)
class StoreLocation:
    """Where a node's objects live, as its guest is told (the ``RESOLUTO_STORE_*`` variables):
    what a remote runtime needs to mint credentials, open a policy or stage a bundle."""

    #: ``localfs`` or ``s3`` ("" when the spec names no store: a runtime used directly).
    kind: str = ""
    bucket: str = ""
    #: The node's own key prefix in the store, the conduit's base prefix included.
    prefix: str = ""
    endpoint: str = ""
    region: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> StoreLocation:
        return cls(
            kind=env.get(wire.ENV_STORE_KIND, ""),
            bucket=env.get(wire.ENV_STORE_BUCKET, ""),
            prefix=env.get(wire.ENV_STORE_PREFIX, ""),
            endpoint=env.get(wire.ENV_STORE_ENDPOINT, ""),
            region=env.get(wire.ENV_STORE_REGION, ""),
        )


@dataclass(frozen=True)
class NodeAddress:
    """Which node a sandbox runs, and where that node's objects live."""

    run_id: str
    node_id: str
    store: StoreLocation = field(default_factory=StoreLocation)


@dataclass
class LaunchSpec:
    """Everything a runtime needs to start one guest runner.

    ``run_id``, ``node_id`` and ``store`` (its :class:`NodeAddress`) are what runtimes read;
    ``env`` is what the guest gets. The node driver sets both
    (:func:`prefect_resoluto.node.spec.launch_spec`); a spec without an address (a runtime driven
    directly, a test) answers from its guest variables, here -- no runtime parses ``env`` or
    labels for them.
    """

    sandbox_id: str
    #: RESOLUTO_* variables for the guest (conduit location, ids, argv, workspace, outputs).
    env: dict[str, str]
    #: Variables holding secrets: passed to the guest, never logged or written to a spec file.
    secret_env: dict[str, str] = field(default_factory=dict)
    #: For a local conduit: the host root and the node's key prefix under it. The runtime
    #: makes exactly that node directory writable in the sandbox and rewrites
    #: RESOLUTO_STORE_ROOT to where the root appears inside.
    conduit_root: Path | None = None
    conduit_subdir: str = ""
    #: Mount that directory as a conduit slot of this many bytes (prefect_resoluto.runtimes.slot)
    #: before the sandbox starts: a warm sandbox's, whose state directory the runtime makes.
    conduit_slot: int | None = None
    #: The host's heartbeat directory on a local conduit (prefect_resoluto.node.heartbeat). A
    #: runtime that mounts the conduit binds it read-only at one fixed path under where the
    #: root appears inside, and rewrites RESOLUTO_HOST_BEAT_KEY to match.
    host_beat_dir: Path | None = None
    resources: Resources = field(default_factory=Resources)
    labels: dict[str, str] = field(default_factory=dict)
    egress: list[str] = field(default_factory=list)
    #: A node's per-name allowlist for runtimes that enforce one on this host; None: the
    #: sandbox gets no interface but ``lo``.
    network: NetworkRequest | None = None
    image: str | None = None
    #: Replaces the runtime's way of starting the guest runner (tests, foreign guests).
    command: list[str] | None = None
    #: A warm sandbox (prefect_resoluto.warm.pool): stdin stays an open pipe to the host, the
    #: private channel its assignment arrives on (see ``assign``).
    hold_stdin: bool = False
    #: Which node this sandbox runs and where its objects live (None: as ``env`` says).
    address: NodeAddress | None = None
    #: Lay the sandbox out as one with a network (its resolver files bound) though it has
    #: none: a snapshot template that is restored later into a sandbox that has one.
    network_layout: bool = False

    @property
    def run_id(self) -> str:
        """The node's run id ("" for a warm sandbox, which has no node until assigned)."""
        return self.address.run_id if self.address is not None else self.env.get(wire.ENV_RUN_ID, "")

    @property
    def node_id(self) -> str:
        return self.address.node_id if self.address is not None else self.env.get(wire.ENV_NODE_ID, "")

    @property
    def store(self) -> StoreLocation:
        return self.address.store if self.address is not None else StoreLocation.from_env(self.env)

    @property
    def rel_prefix(self) -> str:
        """The node's key prefix relative to the conduit's base (``run/<run>/nodes/<node>``)."""
        return wire.node_prefix(self.run_id, self.node_id)


@dataclass
class SandboxHandle:
    id: str
    runtime: str
    labels: dict[str, str] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)


PHASES = ("pending", "running", "succeeded", "failed", "unknown")


@dataclass(frozen=True)
class SandboxStatus:
    phase: str
    reason: str = ""
    exit_code: int | None = None
    #: The runtime is sure this sandbox can never start (bad image, admission refused ...).
    unstartable: bool = False
    #: The sandbox no longer exists on the substrate (deleted from outside, or reaped).
    gone: bool = False
    #: An infrastructure kill the guest could not report itself (OOM, eviction, signal).
    infrastructure: bool = False
    #: A process in the sandbox was killed at its memory limit, even if the sandbox itself
    #: then exited cleanly (the guest runner survives a killed workload and reports it).
    memory_exhausted: bool = False

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")

    @property
    def terminal(self) -> bool:
        return self.phase in ("succeeded", "failed")


class RuntimeUnavailable(RuntimeError):
    """The runtime cannot run on this machine (missing binary, no KVM, no cluster ...)."""


class LaunchError(RuntimeError):
    """The substrate refused to start the sandbox."""


class NotWaiting(LaunchError):
    """A warm sandbox can no longer take an assignment (destroyed, assigned already, or
    ended while idle): nothing of the node reached it, so the node may go elsewhere."""


class IsolationTooWeak(RuntimeError):
    """A runtime weaker than the configured minimum isolation level was asked for."""


def check_isolation(runtime: SandboxRuntime, minimum: IsolationLevel | str) -> None:
    minimum = IsolationLevel.parse(minimum)
    if runtime.isolation < minimum:
        raise IsolationTooWeak(
            f"runtime {runtime.name!r} gives isolation level {runtime.isolation.label!r}, below the "
            f"required minimum {minimum.label!r}. Pick a stronger runtime, or lower the floor "
            f"explicitly with min_isolation={runtime.isolation.label!r} "
            f"(CLI: --min-isolation {runtime.isolation.label})."
        )


class SandboxRuntime(ABC):
    """One kind of sandbox. What it can do is its ``capabilities``, declared by its class;
    the warm pool's optional methods below answer as a runtime that declares none."""

    name: ClassVar[str] = ""
    #: The interpreter its sandboxes start the guest runner with (None: the host's own).
    python: str | None = None

    @property
    @abstractmethod
    def isolation(self) -> IsolationLevel: ...

    @abstractmethod
    def availability(self) -> Availability:
        """Whether this runtime can run here, and if not, why (for ``doctor``)."""

    @abstractmethod
    def launch(self, spec: LaunchSpec) -> SandboxHandle: ...

    @abstractmethod
    def status(self, handle: SandboxHandle) -> SandboxStatus: ...

    @abstractmethod
    def destroy(self, handle: SandboxHandle) -> None:
        """Stop and remove the sandbox; idempotent."""

    @abstractmethod
    def sweep(self, labels: dict[str, str]) -> int:
        """Destroy every sandbox of this runtime whose labels include all of ``labels``."""

    @abstractmethod
    def logs(self, handle: SandboxHandle, tail: int = 200) -> str:
        """The last ``tail`` lines the substrate saw (forensics; untrusted)."""

    #: What this runtime can do (:mod:`prefect_resoluto.runtimes.capabilities`); each runtime
    #: class declares its own.
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: Seconds between status checks while a node runs. Cheap for a local child process;
    #: an API call per sandbox on a cluster, where the conduit carries the fast path.
    status_interval: ClassVar[float] = 0.2

    # The flags runtimes declared before ``capabilities``, published from it (and folded into
    # it when a runtime class still sets one itself): see ``capabilities.LEGACY_FLAGS``.
    supports_local_conduit: ClassVar[bool]
    remote: ClassVar[bool]
    mounts_conduit: ClassVar[bool]
    supports_egress_allowlist: ClassVar[bool]
    egress_by_name: ClassVar[bool]
    supports_warm: ClassVar[bool]
    supports_snapshots: ClassVar[bool]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = {k: v for k, v in vars(cls).items() if k in LEGACY_FLAGS}
        inherited = legacy_flags(cls.capabilities)
        cls.capabilities = fold_legacy(cls.capabilities, own, inherited)
        for k, v in legacy_flags(cls.capabilities).items():
            setattr(cls, k, v)

    def exit_fd(self, handle: SandboxHandle) -> int | None:
        """A new descriptor that becomes readable once ``handle``'s sandbox has exited (the
        caller closes it), or None. With one, the driver asks :meth:`status` when it fires
        and on a slow backstop instead of every ``status_interval``."""
        return None

    @property
    def state(self) -> Path | None:
        """The host directory holding one record per sandbox (None: the substrate keeps
        them); a warm sandbox's slot lives under it."""
        return None

    @property
    def display_name(self) -> str:
        """The name with what decides its isolation, for notes and ``doctor`` (``container(kata)``)."""
        return self.name

    # The warm pool's optional half of the seam (runtimes.optional: WarmRuntime, SnapshotRuntime):
    # the answers of a runtime that declares neither.

    def assign(self, handle: SandboxHandle, data: bytes, labels: dict[str, str] | None = None) -> None:
        """Deliver a warm sandbox's assignment on its private channel, once."""
        raise LaunchError(f"runtime {self.name!r} cannot keep sandboxes warm")

    def said(self, handle: SandboxHandle, line: str) -> bool:
        """Whether ``handle``'s output so far holds ``line`` (a warm guest's ready line)."""
        return line in self.logs(handle, tail=5)

    def checkpoint(self, handle: SandboxHandle, image: Path, timeout: float = 120) -> None:
        """Write ``handle``'s checkpoint into the new directory ``image``; the sandbox stops."""
        raise LaunchError(f"runtime {self.name!r} cannot checkpoint sandboxes")

    def restore(self, spec: LaunchSpec, image: Path, wake: bytes = b"") -> SandboxHandle:
        """Start ``spec``'s sandbox from ``image`` instead of booting it."""
        raise LaunchError(f"runtime {self.name!r} cannot restore sandboxes")

    def snapshot_fingerprint(self) -> str:
        """What an image depends on besides the guest (the runtime's version, flags, mounts)."""
        raise LaunchError(f"runtime {self.name!r} cannot restore sandboxes")

    def network_env(self, handle: SandboxHandle) -> dict[str, str]:
        """The variables the runtime gave ``handle``'s guest with its network (the proxy's
        address): a restored guest kept its template's environment and gets them with its
        assignment instead."""
        return {}

    def prepare(self, conduit: Conduit, run_id: str) -> None:  # noqa: B027 - optional hook
        """Called before each launch of a run; runtimes that stage per-run material
        (the Kubernetes guest bundle) do it here, once."""

    def require_available(self) -> None:
        avail = self.availability()
        if not avail.ok:
            raise RuntimeUnavailable(f"runtime {self.name!r} is not available here: {avail.why}")

    def egress_support(self) -> Availability:
        """Whether this runtime can enforce an allowlist here (for ``doctor``); ``detail``
        adds what the runtime's own network stack reports, when it has one to report."""
        if not self.capabilities.egress_allowlist:
            return Availability.refused(
                f"runtime {self.name!r} cannot enforce an egress allowlist (its sandboxes get no network)"
            )
        if self.capabilities.egress_by_name:
            from prefect_resoluto import egress

            return egress.available()
        return Availability(True)

    def check_spec(self, spec: LaunchSpec) -> None:
        if (spec.egress or spec.network is not None) and not self.capabilities.egress_allowlist:
            raise LaunchError(
                f"runtime {self.name!r} cannot enforce an egress allowlist; refusing to run "
                f"with egress={spec.egress!r} (sandboxes here get no network at all)"
            )
        if spec.network is not None and not self.capabilities.egress_by_name:
            raise LaunchError(
                f"runtime {self.name!r} enforces egress by address (CIDR), not by name: per-name "
                "allowlists, setup_egress and egress_forward need a local runtime"
            )


for _flag, _value in legacy_flags(SandboxRuntime.capabilities).items():
    setattr(SandboxRuntime, _flag, _value)
