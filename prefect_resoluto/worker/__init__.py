"""The ``resoluto`` work pool's worker: whole flow runs in sandboxes behind a per-run gateway.

:mod:`.worker` is the Prefect worker and its job configuration; :mod:`.admission` decides
which flow runs may start at all; :mod:`.plan` turns an admitted run into a node; the
gateway (:mod:`.gateway`) forwards a run's API requests only as :mod:`.rules` and
:mod:`.bodies` rebuild them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefect_resoluto.worker.worker import (
        ResolutoJobConfiguration,
        ResolutoWorker,
        ResolutoWorkerResult,
        ResolutoWorkerVariables,
    )

# Resolved on first use: a sibling (imported by the CLI, say) must not pay for Prefect's import.
_EXPORTS = {
    "ResolutoJobConfiguration": "prefect_resoluto.worker.worker",
    "ResolutoWorker": "prefect_resoluto.worker.worker",
    "ResolutoWorkerResult": "prefect_resoluto.worker.worker",
    "ResolutoWorkerVariables": "prefect_resoluto.worker.worker",
}

__all__ = ["ResolutoJobConfiguration", "ResolutoWorker", "ResolutoWorkerResult", "ResolutoWorkerVariables"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
