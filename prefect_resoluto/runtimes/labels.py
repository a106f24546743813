"""The labels the runner puts on its sandboxes, and the one way a value becomes a label.

A leaf (stdlib only): the task runner, the worker and the Kubernetes manifests all make
label values with :func:`label_value`, so a value the runner sweeps by is exactly the value
a runtime wrote (it is a fixed point: ``label_value(label_value(v)) == label_value(v)``).
"""

from __future__ import annotations

import re

#: Every sandbox of a node (the driver adds them; the CLI sweeps an interrupted run by them).
LABEL_RUN = "resoluto.run-id"
LABEL_NODE = "resoluto.node-id"
#: A task run's sandbox (the task runner).
LABEL_FLOW_RUN = "resoluto.flow-run-id"
LABEL_TASK_RUN = "resoluto.task-run-id"
LABEL_TASK = "resoluto.task-name"
LABEL_ATTEMPT = "resoluto.attempt"

_INVALID = re.compile(r"[^A-Za-z0-9._-]+")


def label_value(value: object) -> str:
    """A valid label value for ``value`` (Kubernetes' rules, which container engines and the
    local runtimes' records accept too): at most 63 characters of ``[A-Za-z0-9._-]`` with
    alphanumeric ends; a run of other characters becomes one ``-``.

    Nothing representable gives ``""``, itself a valid label value on every backend, rather
    than an invented stand-in (the runner once wrote ``"x"``, which made every such name look
    like a task called ``x``).
    """
    s = _INVALID.sub("-", str(value))
    s = s.strip("-._")[:63]
    return s.strip("-._")


def node_labels(run_id: str, node_id: str) -> dict[str, str]:
    """The labels every node's sandbox carries (as given: run and node ids are already valid)."""
    return {LABEL_RUN: run_id, LABEL_NODE: node_id}


def task_run_labels(flow_run_id: str, task_run_id: str, task_name: str, attempt: int) -> dict[str, str]:
    """The labels of a task run's sandbox: the runner's exit sweeps by the flow run's."""
    return {
        LABEL_FLOW_RUN: label_value(flow_run_id),
        LABEL_TASK_RUN: label_value(task_run_id),
        LABEL_TASK: label_value(task_name),
        LABEL_ATTEMPT: str(attempt),
    }
