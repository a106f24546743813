"""Sandbox settings as one plain value: what the task runner, the CLI and the blocks share.

Nothing here imports Prefect. A :class:`SandboxConfig` turns into a runtime and a
conduit; blocks and keyword arguments both become one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guest_runner import redact
from guest_runner.conduit import Conduit, LocalConduit
from guest_runner.conduits import conduit_from_url
from prefect_resoluto.paths import cache_dir
from prefect_resoluto.runtimes.base import (
    DEFAULT_MIN_ISOLATION,
    DEFAULT_PIDS,
    IsolationLevel,
    Resources,
    SandboxRuntime,
    check_isolation,
    parse_cpus,
    parse_quantity,
)
from prefect_resoluto.tail import DEFAULT_SILENCE_WINDOW


def default_conduit_url() -> str:
    return (cache_dir() / "conduit").as_uri()


def default_outputs_root() -> Path:
    return cache_dir() / "outputs"


class NoRuntimeAvailable(RuntimeError):
    pass


@dataclass
class SandboxConfig:
    runtime: str | SandboxRuntime | None = None  # None: the strongest available here
    runtime_options: dict[str, Any] = field(default_factory=dict)
    conduit: str | Conduit | None = None  # URL or instance; None: a local directory
    workspace: Path | None = None
    output_paths: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    secret_env: dict[str, str] = field(default_factory=dict)
    memory: str | None = None  # None: DEFAULT_MEMORY (4Gi)
    cpus: str | float | None = None  # None: DEFAULT_CPUS (2)
    disk: str | None = None  # /tmp and /workspace size where the runtime can; None: the memory limit
    pids: int | None = DEFAULT_PIDS
    #: Most bytes of outputs the host takes from one node (quantity); None: what the sandbox
    #: could hold (``disk``, else ``memory``). See node.output_allowance.
    output_limit: str | None = None
    image: str | None = None
    egress: list[str] = field(default_factory=list)
    #: The setup step (``setup_argv``) may reach these instead; see NodeSpec.setup_egress.
    setup_egress: list[str] | None = None
    setup_argv: list[str] | None = None
    egress_resolve: dict[str, str] = field(default_factory=dict)
    min_isolation: IsolationLevel | str = DEFAULT_MIN_ISOLATION
    silence_window: float = DEFAULT_SILENCE_WINDOW
    infrastructure_retries: int = 1
    outputs_dir: Path | None = None
    #: Idle warm sandboxes kept per pool key (prefect_resoluto.pool); 0 disables; None: the
    #: runner's max_workers, capped at pool.DEFAULT_CAP, on runtimes that support it.
    warm_pool: int | None = None

    def __post_init__(self) -> None:
        self.min_isolation = IsolationLevel.parse(self.min_isolation)
        short = redact.too_short(self.secret_env)
        if short:  # refused here, at the flow's start, not when a task is already running
            raise ValueError(redact.too_short_message(short))
        if self.memory is not None:
            parse_quantity(self.memory)
        if self.cpus is not None:
            parse_cpus(self.cpus)
        if self.disk is not None:
            parse_quantity(self.disk)
        if self.output_limit is not None:
            parse_quantity(self.output_limit)
        Resources.from_quantities(pids=self.pids)  # validates pids
        if self.infrastructure_retries < 0:
            raise ValueError("infrastructure_retries must be >= 0")
        if self.warm_pool is not None and (isinstance(self.warm_pool, bool) or int(self.warm_pool) < 0):
            raise ValueError("warm_pool must be a number of sandboxes >= 0 (0 disables the pool)")
        if self.silence_window <= 0:
            raise ValueError("silence_window must be positive (seconds)")
        if self.workspace is not None:
            self.workspace = Path(self.workspace)
        if self.outputs_dir is not None:
            self.outputs_dir = Path(self.outputs_dir)
        self.output_paths = list(self.output_paths)

    def replace(self, **changes: Any) -> SandboxConfig:
        """A copy with ``changes`` applied; dict fields are merged, not replaced."""
        merged: dict[str, Any] = {}
        for k, v in changes.items():
            if v is None:
                continue
            if k not in {f.name for f in dataclasses.fields(self)}:
                raise TypeError(f"unknown sandbox option {k!r}")
            if k in ("env", "secret_env", "runtime_options", "egress_resolve"):
                v = {**getattr(self, k), **v}
            merged[k] = v
        return dataclasses.replace(self, **merged)

    @property
    def resources(self) -> Resources:
        return Resources.from_quantities(memory=self.memory, cpus=self.cpus, disk=self.disk, pids=self.pids)

    @property
    def output_limit_bytes(self) -> int | None:
        return parse_quantity(self.output_limit) if self.output_limit is not None else None

    def build_conduit(self) -> Conduit:
        if isinstance(self.conduit, Conduit):
            return self.conduit
        return conduit_from_url(self.conduit or default_conduit_url())

    def build_runtime(self) -> SandboxRuntime:
        from prefect_resoluto import runtimes

        if isinstance(self.runtime, SandboxRuntime):
            rt = self.runtime
        elif self.runtime:
            rt = runtimes.get_runtime(self.runtime, **self.runtime_options)
        else:
            found = runtimes.best_available(self.min_isolation)
            if found is None:
                raise NoRuntimeAvailable(
                    f"{runtimes.why_unavailable(self.min_isolation)}\nInstall gVisor (bash scripts/setup.sh), "
                    "or lower the floor explicitly with min_isolation='namespace' or 'none'."
                )
            rt = found
        rt.require_available()
        check_isolation(rt, self.min_isolation)
        return rt

    def check_conduit_fits(self, runtime: SandboxRuntime, conduit: Conduit) -> None:
        if isinstance(conduit, LocalConduit) and not runtime.supports_local_conduit:
            raise ValueError(
                f"runtime {runtime.name!r} runs sandboxes on other machines, which cannot see the local "
                f"conduit directory {conduit.root}; configure an S3 conduit (s3://bucket/prefix)"
            )
