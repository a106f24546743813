"""Sandbox settings as one plain value: what the task runner, the CLI and the blocks share.

Nothing here imports Prefect. The settings themselves are declared in ``fields.py``;
a :class:`SandboxConfig` is those settings turning into a runtime and a conduit, and
which conduit fits which runtime is decided here, once.
"""

from __future__ import annotations

from pathlib import Path

from guest_runner.conduit import Conduit
from guest_runner.conduit.registry import conduit_from_url
from prefect_resoluto.host.paths import cache_dir
from prefect_resoluto.runtimes.base import (
    IsolationLevel,
    Resources,
    SandboxRuntime,
    check_isolation,
    parse_quantity,
)
from prefect_resoluto.settings.fields import SandboxSettings


def default_conduit_url() -> str:
    return (cache_dir() / "conduit").as_uri()


def default_outputs_root() -> Path:
    return cache_dir() / "outputs"


class NoRuntimeAvailable(RuntimeError):
    pass


class SandboxConfig(SandboxSettings):
    """The settings (declared in settings/fields.py) and what they turn into: a runtime, a conduit."""

    @property
    def resources(self) -> Resources:
        return Resources.from_quantities(memory=self.memory, cpus=self.cpus, disk=self.disk, pids=self.pids)

    @property
    def output_limit_bytes(self) -> int | None:
        return parse_quantity(self.output_limit) if self.output_limit is not None else None

    @property
    def log_allowance_bytes(self) -> int:
        return parse_quantity(self.log_allowance)

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
        check_conduit_fits(runtime, conduit)


def check_conduit_fits(runtime: SandboxRuntime, conduit: Conduit) -> None:
    """Which conduit fits which runtime: the one rule the task runner, the worker and the CLI apply."""
    root = conduit.local_root
    if root is not None and not runtime.capabilities.local_conduit:
        raise ValueError(
            f"runtime {runtime.name!r} runs sandboxes on other machines, which cannot see the local "
            f"conduit directory {root}; configure an S3 conduit (s3://bucket/prefix)"
        )


def check_store_reachable(runtime: SandboxRuntime, conduit: Conduit) -> None:
    """A sandbox on this host with no network at all cannot reach an object store.

    Only ``prefect-resoluto run`` applies it, before launching: the task runner's sandboxes
    may be given egress per task (``sandbox_options``) after the runner's start, and a
    worker's always have a network (the API gateway), so neither can decide it up front."""
    if (
        conduit.local_root is None
        and runtime.capabilities.on_host
        and runtime.isolation > IsolationLevel.NONE
    ):
        raise ValueError(
            f"runtime {runtime.name!r} gives its sandbox no network, so it cannot reach the "
            f"conduit {conduit.url}; use a local conduit (file:///dir) with it"
        )
