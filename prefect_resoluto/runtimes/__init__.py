"""Sandbox runtimes: a registry by name, and the pick of the strongest one available.

Runtime modules are imported only when asked for (they probe binaries, and the
Kubernetes one pulls in a client library), so adding one is a line in ``_PATHS``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from .base import (
    Availability,
    IsolationLevel,
    LaunchError,
    LaunchSpec,
    Resources,
    RuntimeUnavailable,
    SandboxHandle,
    SandboxRuntime,
    SandboxStatus,
)
from .capabilities import Capabilities

_PATHS: dict[str, str] = {
    "process": "prefect_resoluto.runtimes.process:ProcessRuntime",
    "bubblewrap": "prefect_resoluto.runtimes.bubblewrap:BubblewrapRuntime",
    "gvisor": "prefect_resoluto.runtimes.gvisor:GVisorRuntime",
    "container": "prefect_resoluto.runtimes.container:ContainerRuntime",
    "kubernetes": "prefect_resoluto.runtimes.kubernetes:KubernetesRuntime",
    "solari": "prefect_resoluto.runtimes.solari:SolariRuntime",
}

# Local candidates for best_available(), strongest isolation first; within a level the
# faster one first (gVisor straight through runsc starts quicker than podman + runsc).
_PREFERENCE: list[tuple[str, dict[str, Any]]] = [
    ("container", {"oci_runtime": "kata"}),
    ("gvisor", {}),
    ("container", {"oci_runtime": "runsc"}),
    ("bubblewrap", {}),
    ("process", {}),
]


class _LazyRegistry(Mapping[str, type[SandboxRuntime]]):
    """``name -> runtime class``, importing a runtime's module on first lookup."""

    def __init__(self, paths: dict[str, str]) -> None:
        self._paths = paths

    def __getitem__(self, name: str) -> type[SandboxRuntime]:
        module, _, attr = self._paths[name].partition(":")
        cls = getattr(importlib.import_module(module), attr)
        if not (isinstance(cls, type) and issubclass(cls, SandboxRuntime)):
            raise TypeError(f"{self._paths[name]} is not a SandboxRuntime")
        return cls

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)


RUNTIMES: Mapping[str, type[SandboxRuntime]] = _LazyRegistry(_PATHS)


def candidates() -> list[tuple[str, dict[str, Any]]]:
    """The local (runtime name, options) pairs best_available() tries, strongest first."""
    return [(name, dict(options)) for name, options in _PREFERENCE]


def get_runtime(name: str, **options: Any) -> SandboxRuntime:
    """An instance of the runtime called ``name``, built with ``options``."""
    if name not in RUNTIMES:
        raise ValueError(f"unknown sandbox runtime {name!r}; known runtimes: {', '.join(sorted(RUNTIMES))}")
    return RUNTIMES[name](**options)


def best_available(
    min_level: IsolationLevel | str = IsolationLevel.USER_KERNEL, **common: Any
) -> SandboxRuntime | None:
    """The strongest local runtime available here at or above ``min_level``, or None.

    ``common`` options (e.g. ``state_dir``) go to every candidate that declares them
    (``capabilities.options``).
    :func:`why_unavailable` explains a None.
    """
    return _pick(IsolationLevel.parse(min_level), common)[0]


def why_unavailable(min_level: IsolationLevel | str = IsolationLevel.USER_KERNEL, **common: Any) -> str:
    """Every local candidate's reason for not qualifying at ``min_level`` (for error messages)."""
    floor = IsolationLevel.parse(min_level)
    rt, reasons = _pick(floor, common)
    if rt is not None:
        return f"{rt.name} is available"
    return f"no sandbox runtime with isolation >= {floor.label} is available here:\n  " + "\n  ".join(reasons)


def _pick(floor: IsolationLevel, common: dict[str, Any]) -> tuple[SandboxRuntime | None, list[str]]:
    reasons: list[str] = []
    for name, options in _PREFERENCE:
        cls = RUNTIMES[name]
        rt = cls(**options, **cls.capabilities.accepted(common))
        label = f"{name}({', '.join(f'{k}={v}' for k, v in options.items())})" if options else name
        if rt.isolation < floor:
            reasons.append(f"{label}: isolation {rt.isolation.label} is below {floor.label}")
            continue
        avail = rt.availability()
        if avail.ok:
            return rt, reasons
        reasons.append(f"{label}: {avail.why}")
    return None, reasons


__all__ = [
    "RUNTIMES",
    "Availability",
    "Capabilities",
    "IsolationLevel",
    "LaunchError",
    "LaunchSpec",
    "Resources",
    "RuntimeUnavailable",
    "SandboxHandle",
    "SandboxRuntime",
    "SandboxStatus",
    "best_available",
    "candidates",
    "get_runtime",
    "why_unavailable",
]
