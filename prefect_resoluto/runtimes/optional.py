"""The warm pool's optional half of the runtime seam, as protocols.

The seam every runtime implements is launch / status / destroy / sweep / logs
(:class:`~.base.SandboxRuntime`). Keeping sandboxes warm, and checkpointing and restoring
them, is what only some runtimes do: they declare it (``capabilities.warm``,
``capabilities.snapshots``) and the pool reaches those methods through :func:`warm_of` and
:func:`snapshots_of`, which answer from the declaration -- never from an attribute's presence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from prefect_resoluto.runtimes.base import LaunchSpec, SandboxHandle, SandboxRuntime


class WarmRuntime(Protocol):
    """The warm pool's half of the seam: a sandbox launched before its node, assigned later."""

    def assign(self, handle: SandboxHandle, data: bytes, labels: dict[str, str] | None = None) -> None:
        """Deliver a warm sandbox's assignment on its private channel, once."""

    def network_env(self, handle: SandboxHandle) -> dict[str, str]:
        """The variables the runtime gave ``handle``'s guest with its network."""

    def said(self, handle: SandboxHandle, line: str) -> bool:
        """Whether ``handle``'s output so far holds ``line`` (a warm guest's ready line)."""


class SnapshotRuntime(WarmRuntime, Protocol):
    """Warm sandboxes that can be checkpointed, and others restored from the image."""

    def checkpoint(self, handle: SandboxHandle, image: Path, timeout: float = 120) -> None: ...

    def restore(self, spec: LaunchSpec, image: Path, wake: bytes = b"") -> SandboxHandle: ...

    def snapshot_fingerprint(self) -> str: ...


def warm_of(runtime: SandboxRuntime) -> WarmRuntime | None:
    """``runtime`` as a :class:`WarmRuntime` if it declares ``warm``, else None."""
    return runtime if runtime.capabilities.warm else None


def snapshots_of(runtime: SandboxRuntime) -> SnapshotRuntime | None:
    """``runtime`` as a :class:`SnapshotRuntime` if it declares ``snapshots``, else None."""
    return runtime if runtime.capabilities.snapshots else None
