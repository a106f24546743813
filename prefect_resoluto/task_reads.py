"""The Prefect variables and blocks a sandboxed task may read, read on the host.

There is no Prefect API in a sandbox (guest_runner.prefect_api). The names the runner's
``allowed_variables`` / ``allowed_blocks`` settings allow are read here, in the task run's
context, when its node starts, and reach the sandbox as one more declared secret
(:data:`~guest_runner.prefect_api.READS_ENV`): at assignment, never through the conduit,
and every string value in them (of at least ``MIN_SECRET_LEN`` characters) redacted from
what the node logs, as a ``secret_env`` value is. In the sandbox ``Variable.get`` /
``Block.load`` answer from it; any other name, and every write, fails at once.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from guest_runner.prefect_api import READS_ENV
from guest_runner.redact import MIN_SECRET_LEN

if TYPE_CHECKING:
    from prefect_resoluto.config import SandboxConfig

#: Declared secrets naming each redacted value: RESOLUTO_PREFECT_READ_0, _1, ...
VALUE_ENV_PREFIX = "RESOLUTO_PREFECT_READ_"


def secret_entries(cfg: SandboxConfig) -> dict[str, str]:
    """``secret_env`` entries carrying what the task may read; empty when it may read nothing."""
    if not cfg.allowed_variables and not cfg.allowed_blocks:
        return {}
    reads = {
        "variables": {name: _variable(name) for name in cfg.allowed_variables},
        "blocks": {ref: _block(ref) for ref in cfg.allowed_blocks},
    }
    entries = {READS_ENV: json.dumps(reads, separators=(",", ":"))}
    for i, value in enumerate(sorted(_strings(reads))):
        entries[f"{VALUE_ENV_PREFIX}{i}"] = value
    return entries


def _variable(name: str) -> Any:
    from prefect.variables import Variable

    return Variable.get(name, _sync=True)  # type: ignore[call-overload]


def _block(ref: str) -> dict[str, Any]:
    from prefect.blocks.core import Block

    try:
        block: Any = Block.load(ref, _sync=True)  # type: ignore[call-arg]
    except Exception as e:  # raised again in the sandbox, as it would be on a thread
        return {"error": {"type": type(e).__name__, "message": str(e)}}
    cls = type(block)
    data = block.model_dump(mode="json", context={"include_secrets": True})
    return {"module": cls.__module__, "qualname": cls.__qualname__, "data": data}


def _strings(obj: Any) -> set[str]:
    """Every string value in ``obj`` long enough to redact (keys are names, not values)."""
    if isinstance(obj, str):
        return {obj} if len(obj) >= MIN_SECRET_LEN else set()
    if isinstance(obj, dict):
        return set().union(
            *(_strings(v) for k, v in obj.items() if k not in ("module", "qualname", "block_type_slug"))
        )
    if isinstance(obj, list):
        return set().union(*(_strings(v) for v in obj))
    return set()
