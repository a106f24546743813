"""prefect-resoluto: run every task of a Prefect flow in its own isolated sandbox.

Names are resolved lazily so that importing a submodule (the CLI, a runtime, the
guest-side stand-ins) does not pay for Prefect's import.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ResolutoTaskRunner": "prefect_resoluto.task_runner.runner",
    "sandbox_options": "prefect_resoluto.task_runner.runner",
    "output_files": "prefect_resoluto.task_runner.runner",
    "run_command": "prefect_resoluto.task_runner.commands",
    "CommandResult": "prefect_resoluto.task_runner.commands",
    "CommandFailed": "prefect_resoluto.task_runner.commands",
    "SandboxBlock": "prefect_resoluto.blocks",
    "LocalConduitBlock": "prefect_resoluto.blocks",
    "S3ConduitBlock": "prefect_resoluto.blocks",
    "SandboxConfig": "prefect_resoluto.settings.config",
    "NodeSpec": "prefect_resoluto.node.spec",
    "NodeOutcome": "prefect_resoluto.node.outcome",
    "drive_node": "prefect_resoluto.node.drive",
    "InfrastructureError": "prefect_resoluto.node.outcome",
    "WorkloadFailed": "prefect_resoluto.node.outcome",
    "RemoteTaskError": "prefect_resoluto.task_runner.call_spec",
    "NotSandboxable": "prefect_resoluto.task_runner.call_spec",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'prefect_resoluto' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # Listing the lazy names lets `prefect block register -m prefect_resoluto` (which walks
    # inspect.getmembers) find the block classes.
    return sorted({*globals(), *_EXPORTS})
