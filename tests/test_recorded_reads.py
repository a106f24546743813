"""The runner's reads of whether the API has recorded task runs (issue 41), against the real
API of the session: counted first, listed only when some but not all are there."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prefect import flow, task
from support.prefect_readback import client, task_runs

from prefect_resoluto.task_runner import recorded_runs


@task
def _one() -> int:
    return 1


@flow
def _two_tasks() -> list[int]:
    return [_one.submit().result(), _one.submit().result()]


@pytest.fixture(scope="module")
def recorded() -> list[uuid.UUID]:
    state = _two_tasks(return_state=True)
    runs = task_runs(state.state_details.flow_run_id)
    assert len(runs) == 2
    return [r.id for r in runs]


class _Asked(list[str]):
    """The task-run paths the client asked, as they left it; one in ``refused`` is answered 404."""

    refused: tuple[str, ...] = ()


@pytest.fixture
def requests() -> Iterator[_Asked]:
    seen = _Asked()
    real = httpx.HTTPTransport.handle_request

    def counting(transport: Any, request: httpx.Request) -> httpx.Response:
        path = request.url.path.removeprefix("/api")
        if path.startswith("/task_runs/"):  # not the flow's events and logs, still flushing
            seen.append(path)
        if path in seen.refused:
            return httpx.Response(404, json={"detail": "Not Found"}, request=request)
        return real(transport, request)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(httpx.HTTPTransport, "handle_request", counting)
        yield seen


def test_runs_all_there_are_counted_not_listed(recorded: list[uuid.UUID], requests: _Asked) -> None:
    with client() as c:
        assert recorded_runs._recorded(c, recorded) == set(recorded)
    assert requests == ["/task_runs/count"]


def test_runs_none_of_which_is_there_are_counted_not_listed(requests: _Asked) -> None:
    unknown = [uuid.uuid4(), uuid.uuid4()]
    with client() as c:
        assert recorded_runs._recorded(c, unknown) == set()
    assert requests == ["/task_runs/count"]


def test_some_there_are_listed_to_know_which(recorded: list[uuid.UUID], requests: _Asked) -> None:
    unknown = uuid.uuid4()
    with client() as c:
        assert recorded_runs._recorded(c, [recorded[0], unknown, recorded[1]]) == set(recorded)
    assert requests == ["/task_runs/count", "/task_runs/filter"]


def test_an_api_without_the_count_is_listed(recorded: list[uuid.UUID], requests: _Asked) -> None:
    requests.refused = ("/task_runs/count",)
    unknown = uuid.uuid4()
    with client() as c:
        assert recorded_runs._recorded(c, [recorded[0], unknown]) == {recorded[0]}
    assert requests == ["/task_runs/count", "/task_runs/filter"]
