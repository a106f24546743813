"""ResolutoTaskRunner end to end against a real Prefect API, tasks in real sandboxes.

What the sandbox changes (a traceback's frames, logs streaming out of it, outputs,
commands, secrets, timeouts and reaping) runs on gVisor. Prefect glue alone (futures,
parameters and returns crossing, retries, refusals before any sandbox, async, options)
runs on the `process` runtime, the cheapest real one that shows it (issue 21), as do the
two that reach out of the sandbox (killing the guest runner to fake an infrastructure
failure). Each says which.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from flows import sample_flows as sf
from prefect import flow, task
from support.guest import plumbing_in
from support.polling import scaled, wait_for
from support.prefect_cli import flow_child_env
from support.prefect_readback import artifacts_of, client, task_runs, times_out_of_order

from guest_runner.conduit import LocalConduit
from prefect_resoluto import ResolutoTaskRunner, output_files, run_command, sandbox_options
from prefect_resoluto.runtimes import get_runtime
from prefect_resoluto.task_runner.call_spec import NotSandboxable, RemoteTaskError
from prefect_resoluto.task_runner.commands import CommandFailed, CommandResult

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect")]

FLOWS = Path(sf.__file__).parent


@pytest.fixture
def conduit(tmp_path: Path) -> LocalConduit:
    return LocalConduit(tmp_path / "conduit")


def runner(conduit: LocalConduit, tmp_path: Path, **kw) -> ResolutoTaskRunner:
    kw.setdefault("runtime", "gvisor")
    return ResolutoTaskRunner(conduit=conduit, workspace=FLOWS, outputs_dir=tmp_path / "outputs", **kw)


def glue_runner(conduit: LocalConduit, tmp_path: Path, **kw) -> ResolutoTaskRunner:
    """For Prefect glue alone: the `process` runtime (no isolation asked)."""
    return runner(conduit, tmp_path, runtime="process", min_isolation="none", **kw)


# -- reading back what a user sees ----------------------------------------------------


def logs_of(task_run_id) -> list:
    from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with client() as c:
        return c.read_logs(
            log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])),
            sort=LogSort.TIMESTAMP_ASC,
        )


def no_orphans(runtime_name: str = "gvisor") -> None:
    rt = get_runtime(runtime_name)
    assert rt.list_ids() == []
    if runtime_name == "gvisor":
        assert rt.containers() == []


def caught(future) -> tuple[type, str]:
    """In a flow: the exception a task's future raises, as (type, message)."""
    try:
        future.result()
    except Exception as e:
        return type(e), str(e)
    raise AssertionError("the task was expected to fail")


# -- the tests ---------------------------------------------------------------------------
def test_map_submit_async_and_wait_for_behave_like_the_thread_pool(conduit, tmp_path):
    """Prefect glue: on `process`."""

    @flow(task_runner=glue_runner(conduit, tmp_path), log_prints=True)
    def fan_out():
        squares = sf.square.map([1, 2, 3])
        total = sf.add_async.submit(5, wait_for=squares)
        return [s.result() for s in squares], total.result()

    @flow(
        task_runner=ResolutoTaskRunner(
            runtime="process",
            min_isolation="none",
            conduit=conduit,
            workspace=FLOWS,
            outputs_dir=tmp_path / "o2",
        )
    )
    def same_on_threads():  # the same flow, for comparison of results only
        return [sf.square.fn(x) for x in (1, 2, 3)], 15

    state = fan_out(return_state=True)
    assert state.is_completed(), state
    assert state.result() == ([1, 4, 9], 15) == same_on_threads()
    fr = state.state_details.flow_run_id
    runs = task_runs(fr)
    assert len(runs) == 4 and all(r.state.is_completed() for r in runs)
    # Created by the API first (issue 41), each run keeps the engine's inputs: the graph's edges.
    assert times_out_of_order(runs) == []
    (total_run,) = [r for r in runs if r.name.startswith("add_async")]
    squares_ids = {r.id for r in runs if r.name.startswith("square")}
    assert {i.id for i in total_run.task_inputs["wait_for"]} == squares_ids
    with client() as c:  # one Pending each, the async engine's repeat of it included
        for r in runs:
            kinds = [s.type.value for s in c.read_task_run_states(r.id)]
            assert kinds == ["PENDING", "RUNNING", "COMPLETED"], (r.name, kinds)
    for r in runs:
        prefix = f"run/{fr}/nodes/{r.id}/"
        keys = conduit.list_prefix(prefix)
        assert prefix + "_manifest.json" in keys and prefix + "result.json" in keys, keys
        assert prefix + "inbox/call.tar.gz" in keys and prefix + "inbox/workspace.tar.gz" in keys
    for r in runs:
        if r.name.startswith("square"):
            msgs = [log.message for log in logs_of(r.id) if log.name == "prefect.task_runs"]
            assert any(m.startswith("squaring ") for m in msgs), msgs  # a print: the flow logs prints
            # Warm or cold: the process runtime's pool may have one ready for the first squares.
            assert any(
                re.match(r"ran in a (warm|cold) process sandbox .*in \d+\.\d s: succeeded$", m) for m in msgs
            ), msgs
    no_orphans("process")


def test_a_server_that_records_no_task_run_holds_one_task_back_at_most(conduit, tmp_path):
    """Prefect glue: on `process`. A server whose task-run recorder never has the run (it is
    off): the first task waits for it RECORDED_WITHIN at most, the later ones of the flow run
    not at all, and both run (issue 41: a run is handed to the engine once recorded)."""
    import json

    import httpx

    real = httpx.HTTPTransport.handle_request
    reads: list[str] = []

    def recording_none(transport, request):
        if request.method == "POST" and request.url.path in ("/api/task_runs/filter", "/api/task_runs/count"):
            wanted = ((json.loads(request.content).get("task_runs") or {}).get("id") or {}).get("any_")
            if wanted:  # the runner's read of the runs it waits for: none recorded
                reads.extend(wanted)
                none = [] if request.url.path.endswith("/filter") else 0
                return httpx.Response(200, json=none, request=request)
        return real(transport, request)

    @flow(task_runner=glue_runner(conduit, tmp_path))
    def unrecorded():
        first = sf.square.submit(4)
        return first.result(), sf.add_async.submit(1, wait_for=[first]).result()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(httpx.HTTPTransport, "handle_request", recording_none)
        state = unrecorded(return_state=True)
    assert state.result() == (16, 11)
    runs = {r.name.rsplit("-", 1)[0]: str(r.id) for r in task_runs(state.state_details.flow_run_id)}
    assert set(reads) == {runs["square"]}, (reads, runs)


@pytest.mark.sandbox
def test_guest_logs_arrive_in_order_with_levels_and_guest_timestamps(gvisor, conduit, tmp_path):
    @flow(task_runner=runner(conduit, tmp_path), log_prints=True)
    def logging_flow():
        return sf.logs_with_levels.submit().result()

    t0 = time.time()
    state = logging_flow(return_state=True)
    assert state.result() == "ok"
    (tr,) = task_runs(state.state_details.flow_run_id)
    logs = [entry for entry in logs_of(tr.id) if entry.name == "prefect.task_runs"]
    msgs = [entry.message for entry in logs]
    order = [
        msgs.index(m)
        for m in ("info from the sandbox", "warning from the sandbox", "printed line 1", "printed line 2")
    ]
    assert order == sorted(order)
    level = {entry.message: entry.level for entry in logs}
    assert level["warning from the sandbox"] == 30 and level["info from the sandbox"] == 20
    assert level["printed line 1"] == 20
    stamps = [entry.timestamp.timestamp() for entry in logs]
    assert stamps == sorted(stamps) and stamps[0] >= t0 - 1
    assert any(
        m.startswith("ran in a ") and m.endswith(" s: succeeded") for m in msgs
    )  # the runner's one line
    assert not artifacts_of(tr.id), "a completed task run carries no runner artifact"


@pytest.mark.sandbox
def test_a_line_is_visible_in_the_api_while_the_task_still_runs(gvisor, conduit, tmp_path):
    seen: dict[str, object] = {}

    @flow(task_runner=runner(conduit, tmp_path), log_prints=True)
    def slow_flow():
        return sf.sleeper.submit(10).result()  # room for a loaded machine's log batching

    def watch():
        from prefect.client.schemas.filters import LogFilter, LogFilterName, LogFilterTimestamp
        from prefect.client.schemas.sorting import LogSort

        # Only this test's lines: earlier tests' logs (however many, whatever their stamps)
        # must not push ours out of the page.
        only_ours = LogFilter(
            name=LogFilterName(any_=["prefect.task_runs"]), timestamp=LogFilterTimestamp(after_=started)
        )
        deadline = time.time() + 120
        while time.time() < deadline and "state" not in seen:
            with client() as c:
                found = c.read_logs(log_filter=only_ours, sort=LogSort.TIMESTAMP_DESC, limit=200)
                hits = [entry for entry in found if entry.message == "sleeping"]
                if hits:
                    with client() as c2:
                        seen["state"] = c2.read_task_run(hits[0].task_run_id).state.type.value
                    return
            time.sleep(0.1)  # polling the API, not synchronising with the flow

    from datetime import UTC, datetime, timedelta

    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # earlier tests' queued log batches must not delay ours
    started = datetime.now(UTC) - timedelta(seconds=1)
    w = threading.Thread(target=watch)
    w.start()
    assert slow_flow() == "woke"
    w.join()
    assert seen.get("state") == "RUNNING", "the sandbox's line reached the API only after the task ended"


def test_pydantic_and_dataclass_parameters_and_returns_are_rebuilt(conduit, tmp_path):
    """Prefect glue: on `process`."""

    @flow(task_runner=glue_runner(conduit, tmp_path))
    def typed():
        return sf.move.submit(sf.Point(x=1, y=2), 3).result(), sf.grow.submit(sf.Box(2, 3)).result()

    p, b = typed()
    assert p == sf.Point(x=4, y=2) and isinstance(p, sf.Point)
    assert b == sf.Box(4, 6) and isinstance(b, sf.Box)


@pytest.mark.sandbox
def test_remote_exception_fails_the_task_with_its_traceback(gvisor, conduit, tmp_path):
    @flow(task_runner=runner(conduit, tmp_path))
    def failing():
        try:
            sf.fail_with.submit("bad input 42").result()
        except Exception as e:
            return type(e), str(e), "".join(traceback.format_exception(e))
        raise AssertionError("the task was expected to fail")

    state = failing(return_state=True)
    kind, text, tb = state.result()
    assert issubclass(kind, ValueError) and issubclass(kind, RemoteTaskError)  # except ValueError works
    assert text == "bad input 42"  # str() of the exception, as on threads
    # Its traceback is the sandbox's frames, from the task's own file down to the raise.
    assert 'sample_flows.py", line' in tb and "raise ValueError(message)" in tb, tb
    assert not plumbing_in(tb), tb
    (tr,) = task_runs(state.state_details.flow_run_id)
    assert tr.state.is_failed()
    assert "ValueError: bad input 42" in tr.state.message  # as the UI shows it
    no_orphans()


def test_prefect_retries_get_their_own_node_ids(conduit, tmp_path):
    """Prefect glue: on `process`."""

    @flow(task_runner=glue_runner(conduit, tmp_path))
    def retrying():
        return sf.fail_on_first_attempt.submit().result()

    state = retrying(return_state=True)
    (tr,) = task_runs(state.state_details.flow_run_id)
    assert state.result() == f"{tr.id}.2"
    assert tr.run_count == 2
    fr = state.state_details.flow_run_id
    nodes = {k.split("/")[3] for k in conduit.list_prefix(f"run/{fr}/nodes/")}
    assert nodes == {str(tr.id), f"{tr.id}.2"}  # the failed attempt's evidence is kept


def test_infrastructure_failure_is_relaunched_without_spending_user_retries(conduit, tmp_path):
    """process runtime: the task kills its own guest runner, which only works outside a sandbox."""

    @flow(
        task_runner=runner(
            conduit, tmp_path, runtime="process", min_isolation="none", infrastructure_retries=1
        )
    )
    def flaky_infra():
        return sf.kill_runner_on_first_attempt.submit().result()

    state = flaky_infra(return_state=True)
    (tr,) = task_runs(state.state_details.flow_run_id)
    assert state.result() == f"{tr.id}.2"
    assert tr.run_count == 1  # Prefect saw one run: the re-launch was the runner's
    msgs = [entry.message for entry in logs_of(tr.id)]
    assert any("infrastructure failure (killed)" in m and "re-launching" in m for m in msgs), msgs
    no_orphans("process")


def test_infrastructure_failures_exhausted_raise_a_distinct_error(conduit, tmp_path):
    """process runtime, as above."""
    from prefect_resoluto.node.outcome import InfrastructureError

    @flow(
        task_runner=runner(
            conduit, tmp_path, runtime="process", min_isolation="none", infrastructure_retries=0
        )
    )
    def broken_infra():
        return caught(sf.kill_runner_on_first_attempt.submit())

    kind, text = broken_infra()
    assert issubclass(kind, InfrastructureError)
    assert "was killed by the sandbox substrate" in text and "SIGKILL" in text


@pytest.mark.sandbox
def test_timeout_destroys_the_sandbox(gvisor, conduit, tmp_path):
    times_out(sf.sleeper.with_options(timeout_seconds=3), runner(conduit, tmp_path))
    no_orphans()


def times_out(slow, task_runner) -> None:
    """A flow of one ``slow`` task of an hour ends at the task's timeout, the task run failed
    as timed out (its sandbox destroyed, or its node cancelled, by then)."""

    @flow(task_runner=task_runner)
    def timing_out():
        return slow.submit(3600)

    started = time.monotonic()
    state = timing_out(return_state=True)
    assert time.monotonic() - started < scaled(90)  # ended at its timeout, not run out (an hour)
    (tr,) = task_runs(state.state_details.flow_run_id)
    assert tr.state.is_failed(), tr.state
    assert "TimedOut" in tr.state.name or "timed out" in str(tr.state.message).lower(), tr.state


def test_an_async_tasks_timeout_cancels_its_sleeping_node(conduit, tmp_path):
    """Prefect glue: on `process`. An async task's timeout cancels its coroutine, and the runner
    the node (its cancel event, whose descriptor wakes the sleeping driver: issue 42)."""
    times_out(sf.sleeper_async.with_options(timeout_seconds=2), glue_runner(conduit, tmp_path))
    no_orphans("process")


@pytest.mark.sandbox
def test_a_failure_elsewhere_in_the_flow_reaps_running_sandboxes(gvisor, conduit, tmp_path):
    @task
    def host_side_failure():
        raise RuntimeError("the flow breaks")

    @flow(task_runner=runner(conduit, tmp_path))
    def breaks_while_running():
        sf.sleeper.submit(3600)
        # let the sandbox start before the flow fails
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not get_runtime("gvisor").list_ids():
            time.sleep(0.05)
        host_side_failure()

    started = time.monotonic()
    state = breaks_while_running(return_state=True)
    assert state.is_failed()
    assert time.monotonic() - started < scaled(90)  # reaped, not run out (an hour)
    no_orphans()


def test_parameters_that_cannot_cross_fail_before_any_sandbox(conduit, tmp_path):
    """Prefect glue (refused on the host): on `process`."""

    @flow(task_runner=glue_runner(conduit, tmp_path))
    def bad_param():
        return caught(sf.square.submit(lambda: 3))

    kind, text = bad_param()
    assert kind is NotSandboxable
    assert "parameter 'x' of task 'square' is a builtins.function" in text
    assert "Write it to a file in the workspace" in text
    assert conduit.list_prefix("run/") == []


def test_nested_function_tasks_are_refused_with_advice(conduit, tmp_path):
    """Prefect glue (refused on the host): on `process`."""

    @task
    def inner(x: int) -> int:
        return x

    @flow(task_runner=glue_runner(conduit, tmp_path))
    def nested():
        return caught(inner.submit(1))

    kind, text = nested()
    assert kind is NotSandboxable
    assert "defined inside another function" in text and "move it to module level" in text
    assert conduit.list_prefix("run/") == []


def test_unserialisable_return_is_a_clear_failure(conduit, tmp_path):
    """Prefect glue (the guest's call protocol, the same in every sandbox): on `process`."""

    @flow(task_runner=glue_runner(conduit, tmp_path))
    def bad_return():
        return caught(sf.returns_unserialisable.submit())

    kind, text = bad_return()
    assert kind is RemoteTaskError
    assert "ResultNotSerializable: the task returned a builtins.object" in text and "return its path" in text


@pytest.mark.sandbox
def test_outputs_come_back_and_output_files_points_at_them(gvisor, conduit, tmp_path):
    @flow(task_runner=runner(conduit, tmp_path, output_paths=["out/*.txt"]))
    def reports():
        report = sf.write_report.submit("alpha")
        returned = report.result()
        return returned, output_files(report)

    returned, files = reports()
    assert returned == "out/alpha.txt"  # the task's own value, not altered
    path = files[returned]
    assert path.is_absolute() and path.read_text() == "report for alpha\n"
    assert path.is_relative_to(tmp_path / "outputs")
    assert not (path.parent / "ignored.tmp").exists()


@pytest.mark.sandbox
def test_run_command_returns_exit_code_output_and_files(gvisor, conduit, tmp_path):
    @flow(task_runner=runner(conduit, tmp_path))
    def commands():
        ok = run_command.submit(
            ["sh", "-c", "echo one; echo two >&2; mkdir -p res; echo 7 > res/n.txt"], output_paths=["res/**"]
        )
        soft = run_command.submit(["sh", "-c", "echo failing; exit 4"], check=False)
        return ok.result(), soft.result()

    ok, soft = commands()
    assert isinstance(ok, CommandResult) and ok.exit_code == 0
    assert ok.output.splitlines() == ["one", "two"]
    assert set(ok.files) == {"res/n.txt"} and ok.files["res/n.txt"].read_text() == "7\n"
    assert soft.exit_code == 4 and soft.output == "failing"

    @flow(task_runner=runner(conduit, tmp_path))
    def checked():
        return caught(run_command.submit(["sh", "-c", "echo broken; exit 3"]))

    kind, text = checked()
    assert kind is CommandFailed
    assert "exited with code 3" in text and text.endswith("--- last output ---\nbroken")


def test_sandbox_options_override_one_submission(conduit, tmp_path):
    """Prefect glue: on `process`."""

    @flow(task_runner=glue_runner(conduit, tmp_path, env={"GREETING": "default"}))
    def overridden():
        plain = sf.env_value.submit("GREETING")
        with sandbox_options(env={"GREETING": "override"}, memory="256Mi"):
            special = sf.env_value.submit("GREETING")
        return plain.result(), special.result()

    assert overridden() == ("default", "override")
    with pytest.raises(TypeError, match="unknown sandbox option 'memroy'"):
        with sandbox_options(memroy="1Gi"):
            pass


@pytest.mark.sandbox
def test_secret_env_reaches_the_task_but_never_the_logs_or_conduit(gvisor, conduit, tmp_path):
    secret = f"tok-{uuid.uuid4().hex}"

    @flow(task_runner=runner(conduit, tmp_path, secret_env={"API_TOKEN": secret}), log_prints=True)
    def secretive():
        return sf.echo_secret.submit().result()

    state = secretive(return_state=True)
    assert state.result() == "done"
    (tr,) = task_runs(state.state_details.flow_run_id)
    msgs = [entry.message for entry in logs_of(tr.id)]
    assert "the secret is ***" in msgs
    assert not any(secret in m for m in msgs)
    everything = b"".join(conduit.get(k) for k in conduit.list_prefix("run/") if not k.endswith(".tar.gz"))
    assert secret.encode() not in everything


def test_isolation_floor_is_enforced_at_flow_start(conduit, tmp_path):
    from prefect_resoluto.runtimes.base import IsolationTooWeak

    @flow(task_runner=runner(conduit, tmp_path, runtime="process"))
    def too_weak():
        return 1

    with pytest.raises(
        IsolationTooWeak, match="runtime 'process' gives isolation level 'none'.*min_isolation='none'"
    ):
        too_weak()


def test_duplicate_copies_all_configuration(conduit, tmp_path):
    r = runner(conduit, tmp_path, memory="1Gi", env={"A": "1"}, infrastructure_retries=3, max_workers=3)
    d = r.duplicate()
    assert d == r and d is not r and d._options == r._options and d._max_workers == 3


def test_the_runner_pickles_with_its_configuration_only(conduit, tmp_path):
    import cloudpickle

    r = runner(conduit, tmp_path, memory="1Gi")
    with r:
        clone = cloudpickle.loads(cloudpickle.dumps(r))
    assert clone == r and clone._config is None and clone._live.handles() == []


def test_async_flow_with_async_tasks(conduit, tmp_path):
    """Prefect glue: on `process`."""

    @flow(task_runner=glue_runner(conduit, tmp_path))
    async def async_flow():
        futures = [sf.add_async.submit(i) for i in range(3)]
        return [f.result() for f in futures]

    assert asyncio.run(async_flow()) == [10, 11, 12]


def interrupted_flow(
    tmp_path: Path, runtime: str, interrupt: Callable[[subprocess.Popen[bytes]], None]
) -> None:
    """tests/flows/interruptible_flow.py on ``runtime``, ``interrupt``-ed once its two sandboxes
    run: it must exit and leave no sandbox behind."""
    state = tmp_path / "state"
    log_path = tmp_path / "flow.log"
    # A hang is dumped, not just timed out: SIGABRT makes faulthandler print every thread's stack.
    env = flow_child_env(
        tmp_path,
        PYTHONFAULTHANDLER="1",
        RESOLUTO_TEST_RUNTIME=runtime,
        RESOLUTO_TEST_MIN_ISOLATION="none",
        RESOLUTO_TEST_SIGINT_ON_STDIN="1",
    )
    with open(log_path, "wb") as log:  # a file, not a pipe: nothing blocks on a full pipe
        proc = subprocess.Popen(
            [sys.executable, str(FLOWS / "interruptible_flow.py")],
            env=env,
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    rt = get_runtime(runtime, state_dir=state)

    def started() -> bool:
        assert proc.poll() is None, log_path.read_text(errors="replace")
        return len(rt.list_ids()) >= 2

    try:
        wait_for(started, timeout=120, what="the flow's two sandboxes to start")
        interrupt(proc)
        try:
            # A hang detector, scaled to the load: Prefect's crash-and-drain exit of the flow.
            proc.wait(timeout=scaled(90))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            proc.wait(timeout=60)
            pytest.fail(
                "the flow did not exit after Ctrl-C; its output and threads:\n"
                + log_path.read_text(errors="replace")[-20000:]
            )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log_path.read_text(errors="replace")
    assert "KeyboardInterrupt" in out or "aborted by an interrupt" in out, out[-4000:]
    assert rt.list_ids() == [], out[-4000:]
    if runtime == "gvisor":
        assert rt.containers() == [], out[-4000:]  # runsc's own listing too


@pytest.mark.sandbox
def test_ctrl_c_on_the_host_destroys_every_sandbox(gvisor, tmp_path):
    interrupted_flow(tmp_path, "gvisor", lambda proc: proc.send_signal(signal.SIGINT))


@pytest.mark.sandbox
def test_a_ctrl_c_noted_while_the_flow_sleeps_on_a_result_is_acted_on(tmp_path):
    """CPython notes a SIGINT that lands just as the main thread goes to sleep in a lock and
    leaves its KeyboardInterrupt for later: with an untimed ``result()`` that is never. The
    flow's thread takes the SIGINT itself here (pthread_kill), so the main thread is certain to
    sleep through it: the flow still ends, its sandboxes destroyed."""

    def from_another_thread(proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin is not None
        proc.stdin.write(b"now\n")
        proc.stdin.close()

    interrupted_flow(tmp_path, "process", from_another_thread)
