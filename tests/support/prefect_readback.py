"""Reading back from the session's Prefect API what a user would see (task runs, artifacts)."""

from __future__ import annotations

import contextlib
import threading

_clients: dict = {}
_lock = threading.Lock()


def client():
    """A sync client of the current API, as a context manager (``with client() as c``).

    Outside a run, one client per API (URL and credentials) is made and kept open for the
    process: tests poll the API hundreds of times, and making a client costs ~30 ms of CPU
    (its TLS context) each time. Inside a run, Prefect's own client of that run."""
    from prefect.client.orchestration import get_client
    from prefect.context import SyncClientContext
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY, PREFECT_API_URL

    if SyncClientContext.get() is not None:
        return get_client(sync_client=True)
    # Either setting is a SecretStr, a plain string or None, by Prefect version and origin.
    secrets = [
        getattr(v, "get_secret_value", lambda v=v: v)()
        for v in (PREFECT_API_AUTH_STRING.value(), PREFECT_API_KEY.value())
    ]
    key = (PREFECT_API_URL.value(), *secrets)
    with _lock:
        c = _clients.get(key)
        if c is None:
            c = _clients[key] = get_client(sync_client=True).__enter__()
    return contextlib.nullcontext(c)


def task_runs(flow_run_id, expect: int | None = None) -> list:
    """The flow run's task runs, in start order. Prefect 3 records a task run's states from
    the events its engine emits (the server's task-run recorder, asynchronously), so right
    after a flow returns the API may still show a task run Running, or not show its last one
    at all: for a Completed flow run this waits until every task run's recorded state is
    final and, with ``expect``, until that many are recorded (a state, not a delay)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from support.polling import wait_for

    def read() -> list:
        with client() as c:
            return c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))

    with client() as c:
        flow_state = c.read_flow_run(flow_run_id).state
    if flow_state is not None and flow_state.is_completed():

        def settled() -> tuple[list] | None:
            rs = read()
            if expect is not None and len(rs) < expect:
                return None
            return (rs,) if all(r.state is not None and r.state.is_final() for r in rs) else None

        (runs,) = wait_for(
            settled, timeout=60, what=f"the task runs of flow run {flow_run_id} to be recorded final"
        )
    else:
        runs = read()
    return sorted(runs, key=lambda r: r.expected_start_time or r.created)


def artifacts_of(task_run_id) -> list:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterTaskRunId

    with client() as c:
        return c.read_artifacts(
            artifact_filter=ArtifactFilter(task_run_id=ArtifactFilterTaskRunId(any_=[task_run_id]))
        )


def times_out_of_order(runs: list, *, created_first: bool = True) -> list[str]:
    """What a task run's page would show out of order, per task run read back (empty: none):
    started before it was expected, ended before it started and, with ``created_first``,
    started before it was created. ThreadPoolTaskRunner's runs are created
    by the server's event recorder after they started (Prefect's own: by 0.05-0.4 s here),
    hence ``created_first=False`` for them."""
    wrong = []
    for r in runs:
        pairs = [("expected_start_time", "start_time"), ("start_time", "end_time")]
        if created_first:
            pairs.insert(0, ("created", "start_time"))
        for earlier, later in pairs:
            a, b = getattr(r, earlier), getattr(r, later)
            if a is None or b is None or a > b:
                wrong.append(f"{r.name}: {earlier} {a} is not before {later} {b}")
    return wrong
