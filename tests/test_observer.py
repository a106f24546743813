"""The one node path: drive(spec, conduit, runtime, observer) tells the observer what
happened, in order, and asks it what only the host can answer."""

from __future__ import annotations

import os
import select
import sys
from pathlib import Path
from typing import Any

from support.polling import scaled

from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.drive import drive
from prefect_resoluto.node.observer import NodeObserver, WorkloadOutput
from prefect_resoluto.node.outcome import NodeOutcome
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes import get_runtime
from prefect_resoluto.runtimes.base import SandboxHandle, SandboxStatus
from prefect_resoluto.runtimes.process import ProcessRuntime


class Recorder(NodeObserver):
    def __init__(self, *, cancel: bool = False, take: bool = False) -> None:
        self.calls: list[str] = []
        self.lines: list[str] = []
        self.output = WorkloadOutput()
        self.cancel = cancel
        self.take = take
        self.taken: list[SandboxHandle] = []
        self.outcome: NodeOutcome | None = None

    def launched(self, handle: SandboxHandle) -> None:
        self.calls.append("launched")

    def event(self, ev: dict[str, Any]) -> None:
        if not self.calls or self.calls[-1] != "event":
            self.calls.append("event")
        line = self.output.line(ev)
        if line is not None:
            self.lines.append(line)

    def finished(self, outcome: NodeOutcome) -> None:
        self.calls.append("finished")
        self.outcome = outcome

    def cancelled(self) -> bool:
        return self.cancel

    def reap(self, handle: SandboxHandle) -> bool:
        if self.take:
            self.taken.append(handle)
        return self.take

    def pack_workspace(self, root: Path, skip: list[str]) -> bytes:
        self.calls.append("pack")
        return super().pack_workspace(root, skip)


def _spec(tmp_path: Path, code: str, node: str) -> NodeSpec:
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    return NodeSpec(
        run_id="run-obs",
        node_id=node,
        argv=[sys.executable, "-c", code],
        workspace=ws,
        min_isolation="none",
        setup_argv=["sh", "-c", "echo from-setup"],
    )


def test_the_observer_sees_the_node_in_order_and_only_workload_lines(tmp_path: Path) -> None:
    conduit = LocalConduit(tmp_path / "conduit")
    obs = Recorder(take=True)
    out = drive(_spec(tmp_path, "print('one'); print('two')", "n1"), conduit, get_runtime("process"), obs)
    assert out.ok, out.describe()
    assert obs.calls == ["pack", "launched", "event", "finished"]
    assert obs.outcome is out
    assert obs.lines == ["one", "two"]  # not the setup's "from-setup", nor the runner's words
    # A finished node's sandbox was handed over: the host destroys it.
    assert [h.id for h in obs.taken] == [out.sandbox_id]
    get_runtime("process").destroy(obs.taken[0])


class ExitSeenFirst(ProcessRuntime):
    """Answers a status only once the sandbox has exited: the host sees the exit before it
    reads the manifest, the other side of the race between the two."""

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        fd = self.exit_fd(handle)
        if fd is not None:
            try:
                select.select([fd], [], [], scaled(60))
            finally:
                os.close(fd)
        return super().status(handle)


def test_a_successful_node_whose_exit_the_host_saw_first_is_handed_over_too(tmp_path: Path) -> None:
    # Which the host hears of first, a fast guest's manifest or its exit, is a race: the
    # hand-over of a success (its teardown off the node's path) must not depend on it.
    conduit = LocalConduit(tmp_path / "conduit")
    obs = Recorder(take=True)
    rt = ExitSeenFirst()
    out = drive(_spec(tmp_path, "print('one')", "n4"), conduit, rt, obs)
    assert out.ok, out.describe()
    assert out.observed_phase == "succeeded"  # the exit was seen, before the hand-over
    assert [h.id for h in obs.taken] == [out.sandbox_id]
    rt.destroy(obs.taken[0])
    assert rt.list_ids() == []


def test_a_cancelling_observer_stops_the_node(tmp_path: Path) -> None:
    conduit = LocalConduit(tmp_path / "conduit")
    obs = Recorder(cancel=True)
    out = drive(_spec(tmp_path, "import time; time.sleep(60)", "n2"), conduit, get_runtime("process"), obs)
    assert out.failure == "lost" and out.reason == "cancelled by the host"
    assert obs.calls[-1] == "finished" and not obs.taken


def test_workload_output_is_the_plain_lines_of_workload_spans() -> None:
    w = WorkloadOutput()
    evs: list[dict[str, Any]] = [
        {"event": "open", "kind": "setup", "span_id": "s"},
        {"event": "log", "kind": "log", "parent_span_id": "s", "data": {"line": "setup says"}},
        {"event": "open", "kind": "workload", "span_id": "w"},
        {"event": "log", "kind": "log", "parent_span_id": "w", "data": {"line": "hello"}},
        {"event": "log", "kind": "error", "parent_span_id": "w", "data": {"line": "not output"}},
        {"event": "log", "kind": "log", "parent_span_id": "", "data": {"line": "runner"}},
        {"event": "close", "kind": "workload", "span_id": "w"},
    ]
    assert [w.line(ev) for ev in evs] == [None, None, None, "hello", None, None, None]


def test_a_flow_runs_crash_evidence_is_bounded_whatever_the_sandbox_prints(tmp_path: Path) -> None:
    # A flow run's guest printing 60 lines of 1 MiB: the worker keeps its last words for a crash
    # report, each cut, not 40 MiB-sized strings; its own phases' output still counts as output.
    import logging
    import threading

    from prefect_resoluto.worker.worker import EVIDENCE_CHARS, EVIDENCE_LINES, FlowRunObserver

    conduit = LocalConduit(tmp_path / "conduit")
    echoed: list[str] = []
    obs = FlowRunObserver(
        flow_run_name="r",
        where="here",
        runtime=get_runtime("process"),
        logger=logging.getLogger("test.flow_run"),
        worker_logger=logging.getLogger("test.worker"),
        on_launched=lambda: None,
        cancel=threading.Event(),
        echo=echoed.append,
    )
    code = "import sys\nfor i in range(60): sys.stdout.write(str(i) + 'x' * (1 << 20) + '\\n')"
    out = drive(_spec(tmp_path, code, "n3"), conduit, get_runtime("process"), obs)
    assert out.ok, out.describe()
    assert len(obs.evidence) == EVIDENCE_LINES
    assert all(len(line) < EVIDENCE_CHARS + 64 for line in obs.evidence)
    assert obs.evidence[-1].startswith("59xxx") and "characters]" in obs.evidence[-1]
    assert echoed[0] == "from-setup" and len(echoed) == 61  # the setup's line and the workload's
