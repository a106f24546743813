"""The pure verdict: what the host concludes from what it saw (no I/O, no clock).

The guest's word on its own workload (``result.json``) and what the host observed from
outside (the runtime's status, the manifest's presence) are judged here, apart from the
polling that gathers them (:mod:`prefect_resoluto.node.drive`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefect_resoluto.node.outcome import EGRESS_NOT_ENFORCED, FailureKind
from prefect_resoluto.node.terminal import safe
from prefect_resoluto.runtimes.base import Resources, SandboxStatus, format_bytes, memory_hint


def of_result(result: Mapping[str, Any], *, networked: bool) -> tuple[FailureKind | None, str]:
    """The guest's own verdict (a decoded ``result.json``): None for success, else the
    workload's failure -- or the egress canary's, which stopped it before it ran."""
    if result["status"] == "success":
        return None, ""
    # The guest's words, one line: shown in state messages, exceptions and terminals, where a
    # control character must be seen, never obeyed.
    reason = safe(str(result.get("reason") or f"workload exited with code {result['exit_code']}"))
    if networked and reason.startswith(EGRESS_NOT_ENFORCED):
        return FailureKind.EGRESS, reason
    return FailureKind.WORKLOAD, reason


def after_exit(st: SandboxStatus, *, manifest: bool) -> tuple[FailureKind | None, str]:
    """The sandbox exited (``st`` terminal): with a complete manifest only a substrate's kill
    fails it; without one, the guest never finished."""
    if manifest:
        if st.infrastructure:
            return FailureKind.KILLED, st.reason or "killed by the substrate"
        return None, ""
    if st.infrastructure:
        return FailureKind.KILLED, st.reason or "killed by the substrate before writing a result"
    code = f" (exit code {st.exit_code})" if st.exit_code is not None else ""
    return FailureKind.NO_RESULT, f"the sandbox exited{code} without writing _manifest.json"


def with_memory(
    failure: FailureKind | None, reason: str, st: SandboxStatus, resources: Resources
) -> tuple[FailureKind | None, str]:
    """A workload that died at the memory limit was killed, not failed (the guest runner only
    saw an exit code); a kill for memory says which setting raises the limit."""
    if failure is FailureKind.WORKLOAD and st.memory_exhausted:
        failure, reason = (
            FailureKind.KILLED,
            f"OOM-killed: the workload was killed at the sandbox's memory limit ({reason})",
        )
    if failure is FailureKind.KILLED and "memory" in reason.lower() and resources.memory_bytes:
        reason += f"; {memory_hint(resources)}"
    return failure, reason


def limit_hint(limit: int | None, source: str) -> str:
    size = format_bytes(limit) if limit else "unlimited"
    return (
        f"The node's output limit is {size} ({source}); raise it with the `output_limit` setting: "
        "ResolutoTaskRunner(output_limit=...), sandbox_options(output_limit=...), the sandbox block's "
        "output_limit, or --output-limit on the command line"
    )
