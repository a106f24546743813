"""What a Prefect user reads of a sandboxed task is what ThreadPoolTaskRunner shows for the
same task, plus one short runner line per node: the same records (levels, logger names,
messages, tracebacks), the same state messages, prints treated alike, the same futures and
return values. Against a real Prefect API.

Prefect glue: on the `process` runtime (the log, exception and future paths are the same on
every runtime); test_drop_in.py has the gVisor case of a failure's records.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from flows import parity_flows as pf
from flows import parity_real_flows as prf
from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner
from support.guest import plumbing_in
from support.prefect_readback import client, task_runs

from guest_runner.conduit import LocalConduit
from guest_runner.redact import Redactor
from prefect_resoluto import ResolutoTaskRunner, sandbox_options
from prefect_resoluto.task_runner import remote_traceback
from prefect_resoluto.task_runner.runner import output_files

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect")]

FLOWS = Path(pf.__file__).parent
RUNNER_LINE = re.compile(
    r"ran in a (warm|cold) process sandbox \(warm pool off\) in \d+\.\d s: (succeeded|failed \(workload\))"
)


def sandboxed(tmp_path: Path) -> ResolutoTaskRunner:
    return ResolutoTaskRunner(
        runtime="process",
        min_isolation="none",
        conduit=LocalConduit(tmp_path / "conduit"),
        workspace=FLOWS,
        outputs_dir=tmp_path / "outputs",
        warm_pool=0,
    )


def records(task_run_id) -> list[tuple[int, str, str]]:
    """(level, logger name, message) of every record of the task run, in order."""
    from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with client() as c:
        rows = c.read_logs(
            log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])),
            sort=LogSort.TIMESTAMP_ASC,
        )
    return [(r.level, r.name, r.message) for r in rows]


def split_runner_lines(rows: list[tuple[int, str, str]]) -> tuple[list, list]:
    ours = [r for r in rows if RUNNER_LINE.fullmatch(r[2])]
    return [r for r in rows if r not in ours], ours


def test_a_failing_task_with_retries_shows_a_threads_records_and_state(tmp_path):
    def run(task_runner) -> tuple[list, str]:
        @flow(task_runner=task_runner)
        def failing() -> str:
            pf.fails_twice.submit(7).wait()
            return "done"

        state = failing(return_state=True)
        (tr,) = task_runs(state.state_details.flow_run_id)
        assert tr.state.is_failed() and tr.run_count == 2
        return records(tr.id), tr.state.message

    threads, threads_message = run(ThreadPoolTaskRunner())
    ours, our_message = run(sandboxed(tmp_path))
    assert (
        our_message
        == threads_message
        == ("Task run encountered an exception ValueError: bad input 7\nsee the second line")
    )
    task_records, runner_lines = split_runner_lines(ours)
    assert len(runner_lines) == 2 and all(r[:2] == (logging.INFO, "prefect.task_runs") for r in runner_lines)
    # record for record the thread's: the retry line, one ERROR with the traceback, the
    # final state; the traceback's frames are the engine's and the task's own
    assert task_records == threads, "\n---\n".join(m for _, _, m in ours)
    assert len(threads) == 3 and [r[0] for r in threads] == [logging.INFO, logging.ERROR, logging.ERROR]
    (traceback_text,) = [m for level, _, m in ours if "Traceback" in m]
    assert f'File "{FLOWS / "parity_flows.py"}", line 16, in fails_twice' in traceback_text
    assert "in check\n    raise ValueError" in traceback_text
    assert not plumbing_in(traceback_text), traceback_text


def test_an_async_tasks_failure_shows_a_threads_records(tmp_path):
    def run(task_runner) -> list:
        @flow(task_runner=task_runner)
        def failing_async() -> str:
            pf.fails_async.submit(3).wait()
            return "done"

        state = failing_async(return_state=True)
        (tr,) = task_runs(state.state_details.flow_run_id)
        assert (
            tr.state.message
            == "Task run encountered an exception ValueError: bad input 3\nsee the second line"
        )
        return records(tr.id)

    threads = run(ThreadPoolTaskRunner())
    task_records, runner_lines = split_runner_lines(run(sandboxed(tmp_path)))
    assert task_records == threads and len(runner_lines) == 1
    (traceback_text,) = [m for _, _, m in threads if "Traceback" in m]
    assert (
        "in fails_async\n    check(x)" in traceback_text
        and "asyncio" not in traceback_text.split("in fails_async")[1]
    )


@pytest.mark.parametrize("log_prints", [False, True])
def test_run_logger_lines_and_prints_are_a_threads(log_prints, tmp_path, capsys):
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    def run(task_runner) -> tuple[list, str, str]:
        @flow(task_runner=task_runner, log_prints=log_prints)
        def talking() -> int:
            return pf.talks.submit(3).result()

        capsys.readouterr()
        state = talking(return_state=True)
        assert state.result() == 9
        (tr,) = task_runs(state.state_details.flow_run_id)
        return records(tr.id), tr.name, capsys.readouterr().out

    keep = Keep()
    logging.getLogger("prefect.task_runs").addHandler(keep)
    try:
        threads, _, threads_out = run(ThreadPoolTaskRunner())
        seen.clear()
        ours, name, our_out = run(sandboxed(tmp_path))
    finally:
        logging.getLogger("prefect.task_runs").removeHandler(keep)
    task_records, runner_lines = split_runner_lines(ours)
    assert task_records == threads and len(runner_lines) == 1
    expected = [(logging.INFO, "prefect.task_runs", "squaring 3")]
    if log_prints:
        expected.append((logging.INFO, "prefect.task_runs", "printed 3"))
    assert [r for r in threads if not r[2].startswith("Finished in state")] == expected
    # not logged, a print goes to stdout, as a thread's does
    assert ("printed 3" in our_out) == ("printed 3" in threads_out) == (not log_prints)
    # on the console: Prefect's own format, naming the task run
    from prefect.logging.formatters import PrefectFormatter

    console = next(
        h.formatter
        for name in ("prefect.task_runs", "prefect", "")
        for h in logging.getLogger(name).handlers
        if isinstance(h.formatter, PrefectFormatter)
    )
    (squaring,) = [r for r in seen if r.getMessage() == "squaring 3"]
    assert console.format(squaring).endswith(f"| INFO    | Task run {name!r} - squaring 3")


def test_a_nested_submit_in_the_real_prefect_hands_back_a_prefect_future(tmp_path):
    def run(task_runner) -> dict:
        @flow(task_runner=task_runner)
        def nesting() -> dict:
            return prf.nests.submit(3).result()

        return nesting()

    expected = {"future": True, "list": True, "value": 4, "completed": True, "mapped": [4, 5], "chained": 5}
    assert run(sandboxed(tmp_path)) == run(ThreadPoolTaskRunner()) == expected


def test_a_returned_output_path_is_returned_as_is_and_output_files_finds_the_file(tmp_path, monkeypatch):
    @flow(task_runner=sandboxed(tmp_path))
    def reporting() -> tuple[str, dict]:
        with sandbox_options(output_paths=["out/*.txt"]):
            report = pf.writes_report.submit("alpha")
        return report.result(), output_files(report)

    value, files = reporting()

    monkeypatch.chdir(tmp_path)  # the thread writes into the working directory

    @flow(task_runner=ThreadPoolTaskRunner())
    def on_threads() -> str:
        return pf.writes_report.submit("alpha").result()

    assert value == on_threads() == "out/alpha.txt"  # the task's data, not altered
    assert set(files) == {"out/alpha.txt"}
    assert files["out/alpha.txt"].read_text() == "report for alpha\n"
    assert files["out/alpha.txt"].is_relative_to(tmp_path / "outputs")


def test_sandbox_frames_never_make_the_host_read_its_own_files(tmp_path):
    """Prefect glue only: a hostile error.json's frames, as the host turns them into a
    traceback. Only workspace files are named as host files; nothing else is opened."""
    import traceback

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "task.py").write_text("def f():\n    raise ValueError('x')\n    token = 's3cr3t-value'\n")
    outside = tmp_path / "host-secret.txt"
    outside.write_text("the host's own secret line\n")
    frames = [
        {"file": "task.py", "workspace": True, "line": 2, "name": "f"},
        {"file": str(outside), "workspace": False, "line": 1, "name": "absolute"},
        {"file": "../host-secret.txt", "workspace": True, "line": 1, "name": "escapes"},
        {"file": str(outside), "workspace": True, "line": 1, "name": "absolute_as_workspace"},
        {"file": "task.py", "workspace": True, "line": 3, "name": "secret_line"},
        {"file": "task.py", "workspace": True, "line": "2", "name": "bad_line"},
        {"file": "task.py", "workspace": True, "line": 2, "name": "n" * 10_000},
        "not a frame",
    ]
    exc = ValueError("x")
    tb = remote_traceback.build(exc, frames, workspace=ws, redactor=Redactor(["s3cr3t-value"]))
    text = "".join(traceback.format_exception(ValueError, exc, tb))
    assert f"File \"{ws / 'task.py'}\", line 2, in f\n    raise ValueError('x')" in text
    assert "the host's own secret line" not in text and "s3cr3t-value" not in text
    assert f'File "<sandbox: {outside}>", line 1, in absolute' in text
    assert 'File "<sandbox: ../host-secret.txt>", line 1, in escapes' in text
    assert f'File "<sandbox: {outside}>", line 1, in absolute_as_workspace' in text
    assert 'File "<sandbox: task.py>", line 3, in secret_line' in text  # its line holds a secret
    assert "bad_line" not in text and "n" * 300 not in text
    assert remote_traceback.from_the_task(tb) is tb


@pytest.mark.parametrize(
    "probe", [pf.reads_run_context, prf.reads_run_context_real], ids=["lazy", "on-import"]
)
def test_a_task_reads_its_run_context_as_on_a_thread_also_on_a_retry(probe, tmp_path):
    """get_run_context(), TaskRunContext.get() and FlowRunContext.get() in a sandboxed task
    give its task run and its flow run, as on a thread; on the retry run_count is 2. The
    real package loads in the task's body (lazy) or on the module's import (on-import)."""

    def run(task_runner) -> tuple[dict, dict]:
        @flow(task_runner=task_runner)
        def reading(n: int = 3, label: str = "x") -> dict:
            return probe.submit(label).result()

        state = reading(return_state=True)
        (tr,) = task_runs(state.state_details.flow_run_id)
        with client() as c:
            fr = c.read_flow_run(state.state_details.flow_run_id)
        expected = {
            "run_is_task_context": True,
            "task_run": {
                "id": str(tr.id),
                "id_type": "UUID",
                "name": tr.name,
                "run_count": 2,
                "tags": ["reads-context"],
                "flow_run_id": str(fr.id),
            },
            "same_task_run": True,
            "task_name": probe.name,
            "parameters": {"label": "x"},
            "flow_run": {"id": str(fr.id), "name": fr.name, "parameters": {"n": 3, "label": "x"}},
        }
        return state.result(), expected

    threads, threads_expected = run(ThreadPoolTaskRunner())
    ours, ours_expected = run(sandboxed(tmp_path))
    assert threads == threads_expected
    assert ours == ours_expected
