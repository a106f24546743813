"""One task run's node, driven for the runner: its spec, its observer, its re-launches.

:meth:`TaskNodes.run` is ``ResolutoTaskRunner.run_node``: for the current task run it
builds the node's spec, forwards its events to the task run's logs, drives it (warm when
the pool has a sandbox ready) and re-launches it on an infrastructure failure, each node's
artifacts held for the task run's future.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guest_runner import wire
from guest_runner.conduit import Conduit
from guest_runner.redact import Redactor
from prefect_resoluto.node.drive import drive
from prefect_resoluto.node.observer import NodeObserver, WorkloadOutput
from prefect_resoluto.node.outcome import NodeOutcome
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.node.wake import WakeEvent
from prefect_resoluto.runtimes.base import SandboxHandle, SandboxRuntime
from prefect_resoluto.runtimes.labels import task_run_labels
from prefect_resoluto.settings.config import SandboxConfig, default_outputs_root
from prefect_resoluto.task_runner import python_calls
from prefect_resoluto.task_runner.flow_runs import FlowRuns
from prefect_resoluto.task_runner.live import LiveSandboxes
from prefect_resoluto.task_runner.logs import ApiLogBatcher, EventLogForwarder
from prefect_resoluto.task_runner.node_artifacts import NodeArtifacts
from prefect_resoluto.task_runner.relayed_artifacts import ArtifactRelay
from prefect_resoluto.task_runner.sandboxes import RunnerSandboxes
from prefect_resoluto.warm import pool as warm_pool_mod

if TYPE_CHECKING:
    from prefect.client.schemas.objects import TaskRun

    from prefect_resoluto.warm.pool import AnyPool


@dataclass(frozen=True)
class NodeRequest:
    """A node the current task run asks for (``ResolutoTaskRunner.run_node``'s keywords).

    ``line_sink`` receives the workload's merged output lines, in order; ``log_prints``
    whether those lines become log records (Prefect's own decision for the task run: else
    they go to this process's stdout only, as a thread's prints do); ``warm_prefect`` the
    installed modules a warm sandbox pre-imports for it
    (prefect_resoluto.warm.pool.imports_for)."""

    task_name: str
    argv: list[str]
    cfg: SandboxConfig
    extra_inbox: dict[str, bytes] | None = None
    extra_outputs: list[str] | None = None
    read_in_memory: list[str] | None = None
    cancel: threading.Event | None = None
    line_sink: Callable[[str], None] | None = None
    log_prints: bool = True
    warm_prefect: tuple[str, ...] = ()

    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()


@dataclass(frozen=True)
class TaskNodes:
    """What the entered runner lends each task run's nodes."""

    runtime: SandboxRuntime
    conduit: Conduit
    pacer: ApiLogBatcher
    pool: AnyPool | None
    live: LiveSandboxes
    sandboxes: RunnerSandboxes
    artifacts: NodeArtifacts
    flow_runs: FlowRuns

    def run(self, request: NodeRequest) -> NodeOutcome:
        """Drive one node for the current task run, re-launching on infrastructure failure."""
        from prefect.context import TaskRunContext
        from prefect.logging import get_run_logger

        ctx = TaskRunContext.get()
        assert ctx is not None and ctx.task_run is not None
        task_run = ctx.task_run
        run_id = str(task_run.flow_run_id or task_run.id)
        self.flow_runs.with_nodes.add(run_id)
        logger = get_run_logger()
        workspace = request.cfg.workspace or python_calls.default_workspace()
        outcome: NodeOutcome | None = None
        for infra_try in range(request.cfg.infrastructure_retries + 1):
            outcome = self._one_node(request, task_run, run_id, workspace, logger)
            if not self._relaunch(request, outcome, infra_try, logger):
                break
        assert outcome is not None
        return outcome

    def _one_node(
        self, request: NodeRequest, task_run: TaskRun, run_id: str, workspace: Path, logger: Any
    ) -> NodeOutcome:
        key = str(task_run.id)
        attempt = self.live.next_attempt(key)
        node_id = key if attempt == 1 else f"{key}.{attempt}"
        spec = node_spec(request, workspace, run_id, key, node_id, attempt)
        redactor = Redactor(request.cfg.secret_env.values())
        forward = EventLogForwarder(
            task_run_id=task_run.id,
            flow_run_id=task_run.flow_run_id,
            node_id=node_id,
            redactor=redactor,
            batcher=self.pacer,
            run_fields=dict(getattr(logger, "extra", None) or {}),
            log_prints=request.log_prints,
            allowance=request.cfg.log_allowance_bytes,
        )
        forward.artifacts = ArtifactRelay(task_run.id, task_run.flow_run_id, forward.emit, redactor)
        warm, how = warm_pool_mod.take_for(self.pool, spec, imports=request.warm_prefect)
        forward.emit(
            logging.DEBUG,
            f"sandbox node {node_id} on {self.runtime.name} "
            f"({self.runtime.isolation.label} isolation), conduit {self.conduit.url}; {how}",
        )
        observer = TaskRunObserver(
            self.sandboxes, forward, request.line_sink, request.cancel, how, timeout=_has_timeout()
        )
        try:
            outcome = drive(spec, self.conduit, self.runtime, observer, warm=warm)
        finally:
            observer.release()
        if outcome.ok:
            self.live.set_outputs(
                key, {k: v for k, v in outcome.output_files.items() if not k.startswith(".resoluto/")}
            )
        self.artifacts.publish(outcome, attempt, redactor, how)
        return outcome

    def _relaunch(self, request: NodeRequest, outcome: NodeOutcome, infra_try: int, logger: Any) -> bool:
        """Whether a node that failed for its infrastructure runs again (said in the task run's logs)."""
        retries = request.cfg.infrastructure_retries
        if (
            not outcome.infrastructure_failure
            or infra_try >= retries
            or self.sandboxes.cancelling()
            or request.cancelled()
        ):
            return False
        logger.warning(
            "infrastructure failure (%s): %s; re-launching (%d of %d), the task's own retries are not spent",
            outcome.failure,
            outcome.reason,
            infra_try + 1,
            retries,
        )
        return True


def node_spec(
    request: NodeRequest, workspace: Path, run_id: str, task_run_id: str, node_id: str, attempt: int
) -> NodeSpec:
    """The spec of one node of a task run: the request's command, the settings' sandbox."""
    cfg = request.cfg
    outputs_root = cfg.outputs_dir or default_outputs_root()
    return NodeSpec(
        run_id=run_id,
        node_id=node_id,
        argv=request.argv,
        workspace=workspace,
        output_paths=list(cfg.output_paths) + list(request.extra_outputs or []),
        env=dict(cfg.env),
        secret_env=dict(cfg.secret_env),
        resources=cfg.resources,
        labels=task_run_labels(run_id, task_run_id, request.task_name, attempt),
        egress=list(cfg.egress),
        setup_egress=cfg.setup_egress,
        setup_argv=cfg.setup_argv,
        egress_resolve=dict(cfg.egress_resolve),
        image=cfg.image,
        extra_inbox=dict(request.extra_inbox or {}),
        outputs_dir=outputs_root / run_id / node_id,
        read_in_memory=list(request.read_in_memory or []),
        workspace_skip=[outputs_root],
        output_limit=cfg.output_limit_bytes,
        min_isolation=cfg.min_isolation,
        silence_window=cfg.silence_window,
        host_lost_after=cfg.host_lost_after,
        host_heartbeat_interval=cfg.host_heartbeat_interval,
    )


@dataclass(eq=False)
class TaskRunObserver(NodeObserver):
    """One node of a task run, as the runner sees it: its events become the task run's logs
    (and, for a command task, its output lines), its sandbox is live -- reached by
    ``cancel_all`` -- from launch until destroyed, here or by the runner's reaper."""

    runner: RunnerSandboxes
    forward: EventLogForwarder
    line_sink: Callable[[str], None] | None
    cancel: threading.Event | None
    #: How the node got its sandbox (warm_pool.take_for's words), for its summary line.
    how: str = ""
    #: Whether the task run has a timeout (Prefect raises it in the driving thread of a sync task).
    timeout: bool = True
    output: WorkloadOutput = field(default_factory=WorkloadOutput)
    sandboxes: list[SandboxHandle] = field(default_factory=list)
    reaping: set[str] = field(default_factory=set)

    def launched(self, handle: SandboxHandle) -> None:
        self.sandboxes.append(handle)
        self.runner.launched(handle)

    def event(self, ev: wire.SpanEvent) -> None:
        self.forward(ev)
        if self.line_sink is not None:
            line = self.output.line(ev)
            if line is not None:
                self.line_sink(line)

    def cancelled(self) -> bool:
        return self.runner.cancelling() or (self.cancel is not None and self.cancel.is_set())

    def wake_fds(self) -> tuple[int, ...]:
        fds = [self.runner.cancel_fd()]
        if isinstance(self.cancel, WakeEvent):
            fds.append(self.cancel.fileno())
        return tuple(fd for fd in fds if fd is not None)

    def cancel_polled(self) -> bool:
        # A sync task's timeout is an exception Prefect raises in this thread, which lands only
        # when the driver wakes; an async task's sets its cancel event (a WakeEvent) instead.
        runner_told = self.runner.cancel_fd() is not None
        told = self.cancel is None or isinstance(self.cancel, WakeEvent)
        return not (runner_told and told) or (self.timeout and self.cancel is None)

    def reap(self, handle: SandboxHandle) -> bool:
        # Stays live until destroyed, so cancel_all still reaches it.
        self.reaping.add(handle.id)
        self.runner.reap(handle)
        return True

    def pack_workspace(self, root: Path, skip: list[str]) -> bytes:
        packed = self.runner.pack(root, skip)
        return packed if packed is not None else super().pack_workspace(root, skip)

    def finished(self, outcome: NodeOutcome) -> None:
        # One line per node at INFO, what the runner reports by default (its artifacts are
        # opt-in): the details at DEBUG and in the node's events.
        self.forward.report_dropped()
        self.forward.emit(logging.DEBUG, _summary(outcome), held=False)
        self.forward.emit(logging.INFO, runner_line(outcome, self.how), held=False)

    def release(self) -> None:
        """The node is over: its sandboxes are no longer live (unless the reaper holds one)."""
        for h in self.sandboxes:
            if h.id not in self.reaping:
                self.runner.released(h.id)


def _has_timeout() -> bool:
    """Whether the current task run may be timed out (unknown: as if it may)."""
    from prefect.context import TaskRunContext

    ctx = TaskRunContext.get()
    task = getattr(ctx, "task", None)
    return task is None or getattr(task, "timeout_seconds", None) is not None


_RUNTIME_NAMES = {"gvisor": "gVisor", "kubernetes": "Kubernetes", "solari": "Solari"}


def runner_line(o: NodeOutcome, how: str = "") -> str:
    """The one line a node adds to its task run's logs at INFO: the runtime, the sandbox
    (warm or cold, and why: ``how``, warm_pool.take_for's words), the seconds, the outcome.
    ``ran in a warm gVisor sandbox rsl-1 (waited 0.2 ms for it; ...) in 0.3 s: succeeded``."""
    from prefect_resoluto.task_runner.artifacts import outcome

    took = o.timings.get("finish")
    kind = "warm" if o.warm else "cold"
    line = f"ran in a {kind} {_RUNTIME_NAMES.get(o.runtime, o.runtime)} sandbox"
    prefix = f"{kind} sandbox "
    if how.startswith(prefix):  # the words after "warm sandbox " / "cold sandbox "
        line += f" {how[len(prefix) :]}"
    if took is not None:
        line += f" in {took:.1f} s"
    return f"{line}: {outcome(o)}"


def _summary(o: NodeOutcome) -> str:
    """The node's details, at DEBUG: where it ran, the conduit, its exit."""
    took = o.timings.get("finish")
    parts = [
        f"node {o.node_id}: {o.status}",
        f"exit code {o.exit_code}",
        f"runtime {o.runtime}",
        f"isolation {o.isolation}",
        f"conduit {o.conduit_url} prefix {o.conduit_prefix}",
    ]
    if took is not None:
        parts.append(f"{took:.2f}s")
    declared = [k for k in o.output_files if not k.startswith(".resoluto/")]
    if declared:
        parts.append(f"{len(declared)} output file(s) in {o.output_dir}")
    msg = "; ".join(parts)
    if not o.ok:
        msg += f"\n{o.describe()}"
    return msg
