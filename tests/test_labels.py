"""One label_value for the runner, the worker and the Kubernetes manifests."""

from __future__ import annotations

import uuid

from prefect_resoluto.runtimes import kubernetes, labels
from prefect_resoluto.runtimes.kubernetes.manifests import sanitise_labels
from prefect_resoluto.worker import worker

SAMPLES = [
    "",
    "x",
    "my task!",
    "my  task",
    "-._x_",
    "日本語",
    "ünïcødé value",
    "a" * 100,
    "b" * 62 + "-c",
    "-" * 10 + "c" * 60,
    "a b/c:d",
    "flow.run_1-2",
]


def test_every_surface_uses_the_one_function() -> None:
    assert kubernetes.label_value is labels.label_value
    assert worker.label_value is labels.label_value


def test_values_are_valid_and_a_fixed_point() -> None:
    for raw in SAMPLES:
        v = labels.label_value(raw)
        assert len(v) <= 63
        assert v == "" or (v[0].isalnum() and v[-1].isalnum())
        assert all(c.isascii() and (c.isalnum() or c in "._-") for c in v)
        # What the runner sweeps by is what a runtime that sanitises again wrote.
        assert labels.label_value(v) == v


def test_ids_pass_unchanged_and_unrepresentable_names_are_empty() -> None:
    run = str(uuid.uuid4())
    assert labels.label_value(run) == run
    assert labels.label_value("my  task") == "my-task"  # a run of invalid characters is one dash
    assert labels.label_value("-" * 10 + "c" * 60) == "c" * 60  # ends stripped before the cut
    assert labels.label_value("日本語") == ""
    assert labels.label_value("") == ""


def test_the_runners_labels_survive_the_kubernetes_manifest_unchanged() -> None:
    made = {
        labels.LABEL_FLOW_RUN: labels.label_value(str(uuid.uuid4())),
        labels.LABEL_TASK_RUN: labels.label_value(str(uuid.uuid4())),
        labels.LABEL_TASK: labels.label_value("my task (retry)!"),
        labels.LABEL_ATTEMPT: "2",
    }
    assert sanitise_labels(made) == made
