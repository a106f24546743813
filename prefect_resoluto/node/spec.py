"""One node as asked for: the pure spec, its checks, and what a runtime is asked to start.

No I/O beyond checking that a workspace directory exists: the driver
(:mod:`prefect_resoluto.node.drive`) runs a :class:`NodeSpec`; the CLI's ``render`` and the
worker build and check one without running it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guest_runner import archive, redact, wire
from guest_runner.conduit import Conduit
from prefect_resoluto.node import heartbeat
from prefect_resoluto.node.tail import DEFAULT_SILENCE_WINDOW, heartbeat_interval
from prefect_resoluto.runtimes import labels
from prefect_resoluto.runtimes.base import (
    DEFAULT_MIN_ISOLATION,
    IsolationLevel,
    LaunchSpec,
    NodeAddress,
    Resources,
    StoreLocation,
)

if TYPE_CHECKING:
    from prefect_resoluto.egress import NetworkRequest

GUEST_WORKSPACE = "/workspace"


class NodeSpecError(ValueError):
    """The node cannot be run as specified (bad argv, workspace, outputs, ids, env)."""


@dataclass
class NodeSpec:
    run_id: str
    node_id: str
    argv: list[str]
    workspace: Path | None = None
    output_paths: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    secret_env: dict[str, str] = field(default_factory=dict)
    resources: Resources = field(default_factory=Resources)
    labels: dict[str, str] = field(default_factory=dict)
    #: Names the workload may reach (``api.example.com``, ``*.example.com``, ``host:8443``).
    egress: list[str] = field(default_factory=list)
    #: The setup step's own allowlist (None: the same as ``egress``); the proxy switches
    #: to ``egress`` before the workload starts, without restarting the sandbox.
    setup_egress: list[str] | None = None
    #: Name -> address pins for allowlisted names, like ``curl --resolve``.
    egress_resolve: dict[str, str] = field(default_factory=dict)
    #: ``"name:port"`` the sandbox dials -> one host ``"127.0.0.1:port"`` (e.g. the Prefect API).
    egress_forward: dict[str, str] = field(default_factory=dict)
    #: Destinations the guest checks are unreachable before the workload (default: egress.DEFAULT_CANARY).
    egress_canary: list[str] | None = None
    image: str | None = None
    setup_argv: list[str] | None = None
    cleanup_argv: list[str] | None = None
    #: Additional inbox archives: name -> gzip tar bytes (e.g. a Python call).
    extra_inbox: dict[str, bytes] = field(default_factory=dict)
    #: Where declared outputs land on the host (default: a fresh temporary directory).
    outputs_dir: Path | None = None
    #: Output files (exact names, also in ``output_paths``) the host only reads: taken from
    #: the outbox into :attr:`NodeOutcome.output_data`, never written to ``outputs_dir``.
    read_in_memory: list[str] = field(default_factory=list)
    #: Host directories never shipped with the workspace even when inside it (an outputs
    #: root; the local conduit and ``outputs_dir`` are always left out).
    workspace_skip: list[Path] = field(default_factory=list)
    #: Most bytes the host extracts from the node's outbox (None: the node's own allowance,
    #: what its sandbox could hold; see :meth:`output_allowance`).
    output_limit: int | None = None
    #: The weakest isolation the node may run under (a weaker runtime is refused before launch).
    min_isolation: IsolationLevel | str = DEFAULT_MIN_ISOLATION
    #: Seconds without any event (heartbeats included) after which the sandbox is presumed dead.
    silence_window: float = DEFAULT_SILENCE_WINDOW
    #: Seconds the host's heartbeat may stay unchanged before the node's sandbox ends itself
    #: (prefect_resoluto.node.heartbeat); 0: no heartbeat, only ``sweep`` clears what a dead
    #: host left.
    host_lost_after: float = heartbeat.DEFAULT_LOST_AFTER
    #: Seconds between two of the host's heartbeats.
    host_heartbeat_interval: float = heartbeat.DEFAULT_INTERVAL

    def output_allowance(self) -> tuple[int | None, str]:
        """The outbox limit in bytes (None: unlimited) and where it comes from."""
        return output_allowance(self.output_limit, self.resources)

    def validate(self) -> None:
        """Raises NodeSpecError for anything that would make the node unrunnable."""
        try:
            wire.check_id(self.run_id, "run id")
            wire.check_id(self.node_id, "node id")
            for p in self.output_paths:
                archive.check_pattern(p)
        except ValueError as e:
            raise NodeSpecError(str(e)) from None
        if not self.argv or not all(isinstance(a, str) for a in self.argv) or not self.argv[0]:
            raise NodeSpecError(
                "argv must be a non-empty list of strings (the command to run in the sandbox)"
            )
        if not self.silence_window > 0:  # NaN too: a window no silence ever reaches
            raise NodeSpecError(f"silence_window must be positive (seconds), got {self.silence_window!r}")
        if self.output_limit is not None and (isinstance(self.output_limit, bool) or self.output_limit <= 0):
            raise NodeSpecError(f"output_limit must be a positive number of bytes, got {self.output_limit!r}")
        if self.workspace is not None and not Path(self.workspace).is_dir():
            raise NodeSpecError(f"workspace directory {str(self.workspace)!r} does not exist")
        for k in list(self.env) + list(self.secret_env):
            if not k or "=" in k or "\x00" in k:
                raise NodeSpecError(f"invalid environment variable name {k!r}")
        try:
            heartbeat.check(self.host_heartbeat_interval, self.host_lost_after)
        except ValueError as e:
            raise NodeSpecError(str(e)) from None
        short = redact.too_short(self.secret_env)
        if short:
            raise NodeSpecError(redact.too_short_message(short))

    def network_request(self) -> NetworkRequest | None:
        """The node's per-name egress request (None: no network), for local runtimes."""
        from prefect_resoluto import egress

        try:
            return egress.network_request(
                self.run_id,
                self.node_id,
                egress=self.egress,
                setup_egress=self.setup_egress,
                resolve=self.egress_resolve,
                forward=self.egress_forward,
                has_setup=bool(self.setup_argv),
                canary=self.egress_canary,
            )
        except egress.EgressPolicyError as e:
            raise NodeSpecError(str(e)) from None


def output_allowance(output_limit: int | None, resources: Resources) -> tuple[int | None, str]:
    """The most a node's outbox may put on the host (None: unlimited), and why: the
    ``output_limit`` setting, else what the sandbox could have held (its ``disk``, else
    its memory limit, which bounds its in-memory scratch)."""
    if output_limit is not None:
        return output_limit, "the output_limit setting"
    if resources.disk_bytes:
        return resources.disk_bytes, "the node's disk setting"
    if resources.memory_bytes:
        return resources.memory_bytes, "the node's memory limit"
    return None, "unlimited"


def guest_env(spec: NodeSpec, conduit: Conduit, store_prefix: str) -> dict[str, str]:
    env: dict[str, str] = dict(spec.env)
    env.update(conduit.guest_env())
    env.update(
        {
            wire.ENV_RUN_ID: spec.run_id,
            wire.ENV_NODE_ID: spec.node_id,
            wire.ENV_STORE_PREFIX: store_prefix,
            wire.ENV_WORKLOAD_ARGV: _json(spec.argv),
            wire.ENV_WORKSPACE_DIR: GUEST_WORKSPACE,
            wire.ENV_OUTPUT_PATHS: _json(spec.output_paths),
        }
    )
    # Paced to the window (tail.heartbeat_interval), not the guest's own 10 s.
    env.setdefault(wire.ENV_HEARTBEAT_INTERVAL, f"{heartbeat_interval(spec.silence_window):g}")
    if spec.setup_argv:
        env[wire.ENV_SETUP_ARGV] = _json(spec.setup_argv)
    if spec.cleanup_argv:
        env[wire.ENV_CLEANUP_ARGV] = _json(spec.cleanup_argv)
    if spec.secret_env:
        env[wire.ENV_SECRET_ENV] = _json(sorted(spec.secret_env))
    user = sorted(set(spec.env) | set(spec.secret_env))
    if user:
        env[wire.ENV_USER_ENV] = _json(user)
    return env


def _json(v: Any) -> str:
    import json

    return json.dumps(v, separators=(",", ":"))


def launch_spec(spec: NodeSpec, conduit: Conduit) -> LaunchSpec:
    """What the runtime is asked to start for ``spec`` (also used to render manifests)."""
    rel_prefix = wire.node_prefix(spec.run_id, spec.node_id)
    store_prefix = wire.node_prefix(spec.run_id, spec.node_id, base=conduit.base_prefix)
    root = conduit.local_root
    env = guest_env(spec, conduit, store_prefix)
    return LaunchSpec(
        sandbox_id=new_sandbox_id(),
        address=NodeAddress(spec.run_id, spec.node_id, StoreLocation.from_env(env)),
        env=env,
        secret_env=dict(spec.secret_env),
        conduit_root=root,
        conduit_subdir=rel_prefix if root is not None else "",
        resources=spec.resources,
        labels={**spec.labels, **labels.node_labels(spec.run_id, spec.node_id)},
        egress=list(spec.egress),
        image=spec.image,
    )


def new_sandbox_id() -> str:
    return f"rsl-{uuid.uuid4().hex[:16]}"
