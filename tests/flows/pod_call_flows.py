"""One task that makes every Prefect call a sandboxed task may make, and one it may not: run
in a Kubernetes pod, on gVisor and on threads (tests/test_kubernetes_prefect_calls.py), one
sandbox covers artifacts, allowed reads and a refusal."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact
from prefect.artifacts import update_progress_artifact as update_progress


@contextlib.contextmanager
def sends_and_waits() -> Iterator[dict[str, int]]:
    """Counts, during a sync call, what would make it slow however idle the host: requests
    handed to an HTTP transport and sleeps of this thread (a retry's backoff)."""
    import threading

    import httpx

    me, seen = threading.get_ident(), {"sends": 0, "sleeps": 0}
    sleep, send = time.sleep, httpx.HTTPTransport.handle_request

    def counted_sleep(seconds: float) -> None:
        seen["sleeps"] += threading.get_ident() == me
        sleep(seconds)

    def counted_send(transport: Any, request: Any) -> Any:
        seen["sends"] += 1
        return send(transport, request)

    time.sleep, httpx.HTTPTransport.handle_request = counted_sleep, counted_send  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        time.sleep, httpx.HTTPTransport.handle_request = sleep, send  # type: ignore[method-assign]


@task
def calls(variable: str, block: str, refused: str) -> dict[str, Any]:
    from prefect import get_run_logger
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect.variables import Variable

    from guest_runner.prefect_api import PrefectAPIUnavailable

    create_markdown_artifact("# from the task\n\nall good", key="pod-report", description="the report")
    create_table_artifact([{"x": i, "y": i * i} for i in range(3)], key="pod-squares")
    progress = create_progress_artifact(10.0, key="pod-progress", description="starting")
    update_progress(progress, 100.0, description="done")
    secret = Secret.load(block).get()
    get_run_logger().info("the secret is %s", secret)  # redacted on its way out of a sandbox
    out: dict[str, Any] = {"variable": Variable.get(variable), "secret": secret}
    try:
        Variable.get(refused)
        out["refused"] = None
    except PrefectAPIUnavailable as e:  # on threads nothing is refused
        out["refused"] = {"type": type(e).__name__, "message": str(e)}
    with sends_and_waits() as seen:  # refused at once: nothing sent, nothing waited for
        try:
            with get_client(sync_client=True) as client:
                client.read_flow_runs(limit=1)
            out["client"] = None
        except PrefectAPIUnavailable as e:
            out["client"] = {"type": type(e).__name__, "message": str(e), **seen}
    return out


@flow
def in_a_pod(variable: str, refused: str) -> None:
    """A worker's flow run as a pod (tests/test_kubernetes_worker.py): its own output, an
    artifact, an allowed read and a refused one, all through its run's API gateway."""
    import json
    import os

    from prefect import get_run_logger
    from prefect.variables import Variable

    from guest_runner.prefect_api import PrefectAPIUnavailable

    print("plain stdout from the pod's flow run", flush=True)
    create_markdown_artifact("# from the pod's flow run", key="pod-flow-report")
    facts: dict[str, Any] = {"api_url": os.environ.get("PREFECT_API_URL"), "variable": Variable.get(variable)}
    try:
        facts["refused"] = {"value": Variable.get(refused)}
    except PrefectAPIUnavailable as e:  # what a user writes to handle a refusal
        facts["refused"] = {"type": type(e).__name__, "message": str(e)}
    get_run_logger().info("FACTS %s", json.dumps(facts))


@flow
def lingers(seconds: float = 600.0) -> None:
    import json

    from prefect import get_run_logger

    get_run_logger().info("FACTS %s", json.dumps({"lingering": seconds}))
    time.sleep(seconds)


@flow
def crashes() -> None:
    """Dies without a word to the API: SIGKILL of its own process, as the OOM killer would."""
    import os
    import signal

    print("evidence-from-the-pod", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
