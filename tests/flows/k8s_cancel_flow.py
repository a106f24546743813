"""A flow served as a deployment whose tasks run in Kubernetes pods, for the cancellation test.

Run by tests/test_kubernetes_watch.py as its own process (``python k8s_cancel_flow.py``):
RESOLUTO_TEST_CONDUIT (an s3:// URL) and RESOLUTO_TEST_K8S_OPTIONS (the runtime's options as
JSON: namespace, context, image, store Secret) configure it; KUBECONFIG points at the cluster.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from prefect import flow, task

from prefect_resoluto import ResolutoTaskRunner


@task
def linger(n: int, seconds: float = 600.0) -> int:
    print(f"task {n} lingering in its pod", flush=True)
    time.sleep(seconds)
    return n


@flow(
    name="k8s-cancellable",
    task_runner=ResolutoTaskRunner(
        runtime="kubernetes",
        runtime_options=json.loads(os.environ.get("RESOLUTO_TEST_K8S_OPTIONS", "{}")),
        conduit=os.environ.get("RESOLUTO_TEST_CONDUIT"),
        workspace=Path(__file__).parent,
        min_isolation="user-kernel",
        cpus=0.5,  # the test's node has 2: both pods must run at once
        memory="1Gi",
    ),
)
def k8s_cancellable(count: int = 2, seconds: float = 600.0) -> list[int]:
    return [f.result() for f in linger.map(range(count), seconds=seconds)]


if __name__ == "__main__":
    k8s_cancellable.serve(name="cancel-me")
