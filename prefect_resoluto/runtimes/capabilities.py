"""What a runtime can do, declared once per runtime class and asked by name.

The host never discovers a capability from a constructor's signature or an attribute's
presence: each question it asks a runtime is one field of :class:`Capabilities` (the
optional warm-pool methods those fields promise are :mod:`.optional`'s protocols).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Capabilities:
    """One answer per question the host asks a runtime; the defaults are a plain local runtime's.

    The first four were once one flag (``supports_local_conduit``); they are separate
    questions that today's runtimes happen to answer alike.
    """

    #: A local conduit directory can serve its sandboxes (the conduit/runtime fit, the node's
    #: slot, ``doctor``'s "local").
    local_conduit: bool = True
    #: Its guest may be handed the host's own store credentials (remote sandboxes mint their own).
    host_credentials: bool = True
    #: Its sandbox reaches this host's loopback: the worker's API gateway may listen there.
    host_loopback: bool = True
    #: Without an image, its guest runs this host's interpreter (``sys.executable``).
    host_python: bool = True
    #: Its sandboxes run on this machine: ``sweep`` is local and runs unasked, and a sandbox
    #: has no network unless it is given one.
    on_host: bool = True
    #: A local conduit reaches the sandbox through a bind mount that follows its directory when
    #: the host renames it (False: the guest sees host paths as they are).
    mounts_conduit: bool = True
    #: It can enforce a non-empty egress allowlist.
    egress_allowlist: bool = False
    #: That allowlist is by name through the host's per-run proxy, rather than by CIDR.
    egress_by_name: bool = False
    #: The warm pool may keep its sandboxes warm (:class:`~.optional.WarmRuntime`).
    warm: bool = False
    #: A warm sandbox can be checkpointed and others restored from its image (:class:`~.optional.SnapshotRuntime`).
    snapshots: bool = False
    #: The keywords its constructor takes (what ``best_available``'s common options may set).
    options: frozenset[str] = field(default_factory=frozenset)

    @property
    def takes_image(self) -> bool:
        return "image" in self.options

    @property
    def takes_extra_ro_paths(self) -> bool:
        """It binds more host paths read-only (the worker's code directories)."""
        return "extra_ro_paths" in self.options

    def accepted(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The part of ``options`` its constructor takes."""
        return {k: v for k, v in options.items() if k in self.options}


#: The flag names runtimes declared before :class:`Capabilities`, for runtimes written
#: against them: ``SandboxRuntime`` still publishes them, read from ``capabilities``.
LEGACY_FLAGS = (
    "supports_local_conduit",
    "remote",
    "mounts_conduit",
    "supports_egress_allowlist",
    "egress_by_name",
    "supports_warm",
    "supports_snapshots",
)


def legacy_flags(caps: Capabilities) -> dict[str, bool]:
    """The old flag names' values for ``caps``."""
    return {
        "supports_local_conduit": caps.local_conduit,
        "remote": caps.local_conduit and not caps.on_host,
        "mounts_conduit": caps.mounts_conduit,
        "supports_egress_allowlist": caps.egress_allowlist,
        "egress_by_name": caps.egress_by_name,
        "supports_warm": caps.warm,
        "supports_snapshots": caps.snapshots,
    }


def fold_legacy(caps: Capabilities, flags: Mapping[str, bool], inherited: Mapping[str, bool]) -> Capabilities:
    """``caps`` with the old flags a runtime class set itself (``flags``) folded in;
    ``inherited`` holds the old flags' values it would otherwise have."""
    if not flags:
        return caps
    changes: dict[str, Any] = {}
    if "supports_local_conduit" in flags or "remote" in flags:
        local = bool(flags.get("supports_local_conduit", inherited["supports_local_conduit"]))
        remote = bool(flags.get("remote", inherited["remote"]))
        changes.update(local_conduit=local, host_credentials=local, host_loopback=local, host_python=local)
        changes["on_host"] = local and not remote
    renamed = {
        "mounts_conduit": "mounts_conduit",
        "supports_egress_allowlist": "egress_allowlist",
        "egress_by_name": "egress_by_name",
        "supports_warm": "warm",
        "supports_snapshots": "snapshots",
    }
    changes.update({renamed[k]: bool(v) for k, v in flags.items() if k in renamed})
    return replace(caps, **changes)
