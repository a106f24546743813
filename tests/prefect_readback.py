"""Reading back from the session's Prefect API what a user would see (task runs, artifacts)."""

from __future__ import annotations


def client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def task_runs(flow_run_id) -> list:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with client() as c:
        runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return sorted(runs, key=lambda r: r.expected_start_time or r.created)


def artifacts_of(task_run_id) -> list:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterTaskRunId

    with client() as c:
        return c.read_artifacts(
            artifact_filter=ArtifactFilter(task_run_id=ArtifactFilterTaskRunId(any_=[task_run_id]))
        )
