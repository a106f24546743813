"""A task called directly in a flow (``x = my_task(...)``, no ``.submit``) runs in a sandbox.

Prefect 3 runs a direct call in the flow's thread without its task runner; the runner
routes it (prefect_resoluto.task_runner.direct_calls). Against a real Prefect API; the
isolation test on gVisor, the Prefect glue on the `process` runtime (each says so).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from flows import dropin_flows as df
from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner
from support.prefect_readback import task_runs

from guest_runner.conduit import LocalConduit
from prefect_resoluto import ResolutoTaskRunner
from prefect_resoluto.task_runner.call_spec import RemoteTaskError

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect")]

FLOWS = Path(df.__file__).parent


def runner(tmp_path: Path, **kw) -> ResolutoTaskRunner:
    kw.setdefault("runtime", "process")
    kw.setdefault("min_isolation", "none")
    return ResolutoTaskRunner(
        conduit=LocalConduit(tmp_path / "conduit"), workspace=FLOWS, outputs_dir=tmp_path / "outputs", **kw
    )


@pytest.fixture
def host_secret(tmp_path: Path) -> str:
    path = tmp_path / "host-only" / "secret.txt"
    path.parent.mkdir()
    path.write_text("only the host can read this")
    return str(path)


@pytest.mark.sandbox
def test_a_task_called_directly_runs_in_a_sandbox_that_cannot_read_the_host(gvisor, tmp_path, host_secret):
    @flow(task_runner=runner(tmp_path, runtime="gvisor", min_isolation="user-kernel"))
    def direct() -> tuple[dict, dict, int]:
        return df.where_am_i(host_secret), df.where_am_i.submit(host_secret).result(), os.getpid()

    called, submitted, flow_pid = direct()
    assert called["read"] is None and submitted["read"] is None, (called, submitted)
    assert called["pid"] != flow_pid


def test_a_direct_call_keeps_prefects_semantics(tmp_path, host_secret):
    """Value, the sandbox's exception with the task's retries spent, ``return_state``.
    Prefect glue: on the `process` runtime."""

    @flow(task_runner=runner(tmp_path))
    def direct():
        value = df.where_am_i(host_secret)
        state = df.where_am_i(host_secret, return_state=True)
        try:
            df.always_fails("from a direct call")
        except ValueError as e:
            raised: BaseException = e
        return value, state.result(), raised, os.getpid()

    flow_state = direct(return_state=True)
    value, from_state, raised, flow_pid = flow_state.result()
    assert value["pid"] != flow_pid and from_state["pid"] != flow_pid  # another process: a node's
    assert value["pid"] != from_state["pid"]  # each call its own sandbox
    assert isinstance(raised, ValueError) and isinstance(raised, RemoteTaskError)  # the sandbox's
    assert str(raised) == "from a direct call" and "raise ValueError(message)" in raised.remote_traceback
    runs = {tr.name.rsplit("-", 1)[0]: tr for tr in task_runs(flow_state.state_details.flow_run_id, expect=3)}
    assert runs["always_fails"].run_count == 2 and runs["always_fails"].state.is_failed()


def test_an_async_task_awaited_directly_runs_in_a_sandbox(tmp_path):
    """Prefect glue: on the `process` runtime."""

    @flow(task_runner=runner(tmp_path))
    async def direct() -> int:
        return await df.async_double(21)

    assert asyncio.run(direct()) == 42


def test_a_direct_call_on_another_task_runner_or_outside_a_flow_is_prefects_own(tmp_path, host_secret):
    """Once a sandboxed flow has run in the process, a flow on ThreadPoolTaskRunner and a
    task called outside any flow still run the task in this process, as Prefect does."""

    @flow(task_runner=runner(tmp_path))
    def sandboxed() -> dict:
        return df.where_am_i(host_secret)

    @flow(task_runner=ThreadPoolTaskRunner())
    def threaded() -> dict:
        return df.where_am_i(host_secret)

    assert sandboxed()["pid"] != os.getpid()
    assert threaded() == {"pid": os.getpid(), "read": "only the host can read this"}
    assert df.where_am_i(host_secret) == {"pid": os.getpid(), "read": "only the host can read this"}


def test_a_task_called_from_a_thread_the_flow_started_without_its_context_runs_in_a_sandbox(
    tmp_path, host_secret
):
    """The thread has no flow run context: Prefect would run the task as a task of no flow,
    in this process. The process's one entered runner takes it. Prefect glue: `process`."""
    import threading

    @flow(task_runner=runner(tmp_path))
    def threaded() -> tuple[dict, int]:
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(where=df.where_am_i(host_secret)))
        t.start()
        t.join()
        return got["where"], os.getpid()

    where, flow_pid = threaded()
    assert where["pid"] != flow_pid


def test_a_task_called_before_the_flows_runner_started_is_refused_not_run_on_the_host(tmp_path, host_secret):
    """A ``flow_run_name`` callable runs before the flow's runner is entered: its task has no
    sandbox yet, and Prefect would run it here. Prefect glue: `process`."""
    ran_here: list[int] = []

    def name_it() -> str:
        ran_here.append(df.where_am_i(host_secret)["pid"])
        return "named"

    @flow(task_runner=runner(tmp_path), flow_run_name=name_it)
    def named() -> int:
        return 1

    with pytest.raises(RuntimeError, match="before its flow's ResolutoTaskRunner started"):
        named()
    assert os.getpid() not in ran_here


def test_a_generator_task_is_refused_before_any_sandbox_saying_what_to_do(tmp_path):
    """A generator's values would cross one by one; a sandboxed task's cross once. Refused
    at the call or submission, sync or async, with the way out. Prefect glue: `process`."""
    from prefect import task

    from prefect_resoluto.task_runner.call_spec import NotSandboxable

    @task
    def rows():
        yield 1

    @task
    async def arows():
        yield 1

    @flow(task_runner=runner(tmp_path))
    def generators() -> list[str]:
        said = []
        for call in (lambda: rows(), lambda: rows.submit(), lambda: arows.submit()):
            try:
                call()
            except NotSandboxable as e:
                said.append(str(e))
        return said

    said = generators()
    assert len(said) == 3 and all("is a generator" in s and "Return a list" in s for s in said), said
