"""The Prefect variables and blocks a sandboxed task may read, read on the host.

There is no Prefect API in a sandbox (guest_runner.prefect_api). The names the runner's
``allowed_variables`` / ``allowed_blocks`` settings allow are read here, in the task run's
context, when its node starts, and reach the sandbox as one more declared secret
(:data:`~guest_runner.prefect_api.READS_ENV`): at assignment, never through the conduit,
and every value Prefect itself keeps secret (a block's ``SecretStr`` / ``SecretDict``
fields: what its own dump obfuscates) redacted from what the node logs, as a
``secret_env`` value is. Variables and a block's plain fields are not secret in Prefect and
are not redacted: a task writes them into its logs and artifacts as it does on a thread.
In the sandbox ``Variable.get`` / ``Block.load`` answer from it; any other name, and every
write, fails at once.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from guest_runner import wire
from guest_runner.prefect_api import READS_ENV
from guest_runner.redact import MIN_SECRET_LEN

if TYPE_CHECKING:
    from prefect_resoluto.settings.config import SandboxConfig

#: Declared secrets naming each redacted value: RESOLUTO_PREFECT_READ_0, _1, ...
VALUE_ENV_PREFIX = wire.ENV_PREFECT_READ_NAME_PREFIX


def secret_entries(cfg: SandboxConfig) -> dict[str, str]:
    """``secret_env`` entries carrying what the task may read; empty when it may read nothing."""
    if not cfg.allowed_variables and not cfg.allowed_blocks:
        return {}
    hidden: set[str] = set()
    reads = {
        "variables": {name: _variable(name) for name in cfg.allowed_variables},
        "blocks": {ref: _block(ref, hidden) for ref in cfg.allowed_blocks},
    }
    entries = {READS_ENV: json.dumps(reads, separators=(",", ":"))}
    for i, value in enumerate(sorted(hidden)):
        entries[f"{VALUE_ENV_PREFIX}{i}"] = value
    return entries


def _variable(name: str) -> Any:
    from prefect.variables import Variable

    return Variable.get(name, _sync=True)  # type: ignore[call-overload]


def _block(ref: str, hidden: set[str]) -> dict[str, Any]:
    """The block's fields, secrets included; adds its secret values to ``hidden``."""
    from prefect.blocks.core import Block

    try:
        block: Any = Block.load(ref, _sync=True)  # type: ignore[call-arg]
    except Exception as e:  # raised again in the sandbox, as it would be on a thread
        return {"error": {"type": type(e).__name__, "message": str(e)}}
    cls = type(block)
    data = block.model_dump(mode="json", context={"include_secrets": True})
    hidden |= _secrets(data, block.model_dump(mode="json"))
    return {"module": cls.__module__, "qualname": cls.__qualname__, "data": data}


def _secrets(revealed: Any, shown: Any) -> set[str]:
    """The string values (long enough to redact) where Prefect's own dump hides what the
    revealing one holds: its secret fields, however nested."""
    if revealed == shown:
        return set()
    if isinstance(revealed, dict) and isinstance(shown, dict):
        return set().union(*(_secrets(v, shown.get(k)) for k, v in revealed.items()))
    if isinstance(revealed, list) and isinstance(shown, list) and len(revealed) == len(shown):
        return set().union(*(_secrets(v, w) for v, w in zip(revealed, shown, strict=True)))
    return _strings(revealed)


def _strings(obj: Any) -> set[str]:
    """Every string value in ``obj`` long enough to redact (keys are names, not values)."""
    if isinstance(obj, str):
        return {obj} if len(obj) >= MIN_SECRET_LEN else set()
    if isinstance(obj, dict):
        return set().union(*(_strings(v) for v in obj.values()))
    if isinstance(obj, list):
        return set().union(*(_strings(v) for v in obj))
    return set()
