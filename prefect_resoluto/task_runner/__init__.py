"""The Prefect task runner: ``@flow(task_runner=ResolutoTaskRunner(...))``.

:mod:`.runner` is the runner itself (enter, exit, submit, wrap); the rest is what it hands
work to: a task run's node (:mod:`.task_node`: its spec, its observer, its re-launches),
the runner's sandboxes as a node reaches them (:mod:`.sandboxes`, over :mod:`.live`), the
flow runs it serves (:mod:`.flow_runs`), the Python-call crossing (:mod:`.call_spec`,
:mod:`.python_calls`, :mod:`.remote_traceback`), the task's Prefect reads (:mod:`.reads`),
logs and artifacts (:mod:`.logs`, :mod:`.artifacts`, :mod:`.node_artifacts`,
:mod:`.relayed_artifacts`), deferred work (:mod:`.background`), the workspace archive
(:mod:`.workspace`) and the ready-made command task (:mod:`.commands`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefect_resoluto.task_runner.runner import ResolutoTaskRunner, output_files, sandbox_options

# Resolved on first use: a sibling (imported by the CLI, say) must not pay for Prefect's import.
_EXPORTS = {
    "ResolutoTaskRunner": "prefect_resoluto.task_runner.runner",
    "output_files": "prefect_resoluto.task_runner.runner",
    "sandbox_options": "prefect_resoluto.task_runner.runner",
}

__all__ = ["ResolutoTaskRunner", "output_files", "sandbox_options"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
