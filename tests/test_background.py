"""Work the task runner moves off a task's critical path: node artifacts, reaping."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.polling import scaled
from support.prefect_cli import flow_child_env

from prefect_resoluto.runtimes import get_runtime
from prefect_resoluto.task_runner.background import Background

FLOWS = Path(__file__).parent / "flows"


def test_close_finishes_everything_queued_in_order():
    bg = Background("t")
    gate = threading.Event()
    done: list[int] = []
    bg.submit(gate.wait)
    for i in range(5):
        bg.submit(lambda i=i: done.append(i))
    assert done == []  # held behind the first item
    gate.set()
    assert bg.close(timeout=30) == 0
    assert done == [0, 1, 2, 3, 4]


def test_close_gives_up_at_its_deadline_on_stuck_work_and_says_so(caplog):
    bg = Background("t")
    stuck = threading.Event()
    bg.submit(stuck.wait)
    bg.submit(lambda: None)
    t0 = time.monotonic()
    assert bg.close(timeout=0.3) == 2
    assert time.monotonic() - t0 < 5
    assert "2 item(s) unfinished" in caplog.text
    stuck.set()


def test_each_item_runs_in_the_context_it_was_queued_from_and_failures_are_logged(caplog):
    import contextvars

    var: contextvars.ContextVar[str] = contextvars.ContextVar("v", default="none")
    bg = Background("t")
    seen: list[str] = []
    var.set("queued here")
    bg.submit(lambda: seen.append(var.get()))
    bg.submit(lambda: 1 / 0, "the failing item")
    assert bg.close(timeout=30) == 0
    assert seen == ["queued here"]
    assert "background the failing item failed" in caplog.text


def test_work_submitted_after_close_or_beyond_the_bound_runs_on_the_caller():
    bg = Background("t", max_pending=1)
    gate = threading.Event()
    callers: list[str] = []
    bg.submit(gate.wait)  # taken by the thread, or queued
    bg.submit(lambda: callers.append(threading.current_thread().name))
    bg.submit(lambda: callers.append(threading.current_thread().name))  # the bound is reached: inline
    assert threading.current_thread().name in callers
    gate.set()
    bg.close(timeout=30)
    bg.submit(lambda: callers.append("after " + threading.current_thread().name))
    assert callers[-1] == "after " + threading.current_thread().name


def _interrupted_child(mode: str, tmp_path: Path) -> tuple[str, float]:
    """Run the child flow, Ctrl-C it once its artifact is queued: (task run id + output, seconds to exit)."""
    # A hang is dumped, not just timed out: SIGABRT makes faulthandler print every thread's stack.
    env = flow_child_env(tmp_path, PYTHONFAULTHANDLER="1")
    proc = subprocess.Popen(
        [sys.executable, str(FLOWS / "artifact_interrupt_flow.py"), mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    queued = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("TASK "):
                queued.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # The task returns before its artifact is published (a runner that published on
        # the task's thread would never get here: the publication waits for the signal).
        assert queued.wait(timeout=scaled(180)), "".join(lines)
        task_run_id = next(ln for ln in lines if ln.startswith("TASK ")).split()[1]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=scaled(120))  # a hang fails here, with the child's stacks
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            proc.wait()
            reader.join(timeout=30)  # a grandchild may hold the pipe: not waited on forever
            pytest.fail("the flow process did not exit after Ctrl-C; its threads:\n" + "".join(lines))
        took = time.monotonic() - t0
        reader.join(timeout=30)  # EOF once the process is gone (a grandchild may still hold it)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return task_run_id + "\n" + "".join(lines), took


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect")
def test_ctrl_c_with_a_pending_artifact_exits_and_the_artifact_is_published(tmp_path):
    from support.prefect_readback import artifacts_of

    out, _ = _interrupted_child("pending", tmp_path)
    task_run_id = out.split("\n", 1)[0]
    arts = artifacts_of(task_run_id)
    assert arts and arts[0].description.startswith("fail_with-"), out  # the failed attempt's table
    assert "KeyboardInterrupt" in out
    assert get_runtime("process", state_dir=tmp_path / "state").list_ids() == []  # reaped too


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect")
def test_ctrl_c_with_an_artifact_that_never_publishes_does_not_hang(tmp_path):
    from prefect_resoluto.task_runner.runner import ARTIFACT_DRAIN_INTERRUPTED

    out, _ = _interrupted_child("stuck", tmp_path)
    # Not a wall-clock margin on the whole exit (Prefect's own crash report and log drain
    # take what a busy API takes): the runner gave up on the stuck item at its own deadline
    # and said so, and the process exited (a hang fails in _interrupted_child).
    assert f"resoluto-artifacts: 1 item(s) unfinished after {ARTIFACT_DRAIN_INTERRUPTED:.1f} s" in out, out
