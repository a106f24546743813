"""The labels the runner puts on its sandboxes, and the one way a value becomes a label.

A leaf (stdlib only): the task runner, the worker and the Kubernetes manifests all make
label values with :func:`label_value`, so a value the runner sweeps by is exactly the value
a runtime wrote (it is a fixed point: ``label_value(label_value(v)) == label_value(v)``).
"""

from __future__ import annotations

import re

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
