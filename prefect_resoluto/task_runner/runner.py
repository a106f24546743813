"""ResolutoTaskRunner: Prefect's task engine on the host, each task's function in a sandbox.

The runner is a ThreadPoolTaskRunner whose submissions carry a copy of the task with
only ``fn`` replaced. States, retries, hooks, caching, result persistence, timeouts
and lineage all stay Prefect's own; the replacement ``fn`` sends the call across the
conduit, blocks for the verdict and returns (or raises) what the sandbox produced.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prefect.task_runners import ThreadPoolTaskRunner

from guest_runner import wire
from guest_runner.conduit import Conduit
from guest_runner.redact import Redactor
from prefect_resoluto.node.drive import drive
from prefect_resoluto.node.observer import NodeObserver, WorkloadOutput
from prefect_resoluto.node.outcome import NodeOutcome
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes.base import SandboxHandle, SandboxRuntime
from prefect_resoluto.runtimes.labels import LABEL_FLOW_RUN, label_value, task_run_labels
from prefect_resoluto.settings.config import SandboxConfig, default_outputs_root
from prefect_resoluto.settings.fields import unknown_keywords, with_setting_keywords
from prefect_resoluto.task_runner import call_spec as pycall
from prefect_resoluto.task_runner import python_calls as python_tasks
from prefect_resoluto.task_runner import remote_traceback
from prefect_resoluto.task_runner.artifacts import NodeTable, flow_run_key, publish_tables
from prefect_resoluto.task_runner.artifacts import publish_node_artifact as _publish_artifact
from prefect_resoluto.task_runner.background import Background
from prefect_resoluto.task_runner.live import LiveSandboxes
from prefect_resoluto.task_runner.logs import ApiLogBatcher, EventLogForwarder
from prefect_resoluto.task_runner.relayed_artifacts import ArtifactRelay
from prefect_resoluto.task_runner.workspace import WorkspacePacker
from prefect_resoluto.warm import pool as warm_pool_mod

log = logging.getLogger("prefect_resoluto")

#: Seconds the runner's exit waits for queued artifacts (normal exit / interrupted or failed
#: flow) and for sandboxes being reaped; a daemon thread never holds the process beyond them.
ARTIFACT_DRAIN = 30.0
ARTIFACT_DRAIN_INTERRUPTED = 5.0
REAP_DRAIN = 60.0

_overrides: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "resoluto_overrides", default=None
)


@contextlib.contextmanager
def sandbox_options(**options: Any) -> Iterator[None]:
    """Per-submission overrides: ``with sandbox_options(memory="4Gi"): big.submit(x)``.

    Any sandbox setting (settings.py: memory, cpus, output_paths, env, secret_env, image,
    silence_window ...); env dicts are merged.
    """
    probe = SandboxConfig()
    probe.replace(**options)  # unknown or invalid options fail here, at the call site
    token = _overrides.set({**(_overrides.get() or {}), **options})
    try:
        yield
    finally:
        _overrides.reset(token)


class ResolutoTaskRunner(ThreadPoolTaskRunner[Any]):
    """Run each task run of a flow in its own sandbox.

    Either pass a saved sandbox block (``sandbox="my-sandbox"`` or an instance) or the
    settings directly; explicit keywords win over the block's. Every setting is declared
    once, in :class:`~prefect_resoluto.settings.fields.SandboxSettings`.
    """

    def __init__(self, *, sandbox: Any = None, max_workers: int | None = None, **options: Any) -> None:
        # Runs at import time (@flow(task_runner=...)): record, validate cheaply, load nothing.
        # ``options``: one keyword per sandbox setting (settings.py; the signature spells them out).
        unknown_keywords("ResolutoTaskRunner()", options)
        self._options: dict[str, Any] = {k: v for k, v in options.items() if v is not None}
        SandboxConfig().replace(**{k: v for k, v in self._options.items() if k != "conduit"})
        self._sandbox = sandbox
        if max_workers is None:
            # As ThreadPoolTaskRunner: PREFECT_TASKS_RUNNER_THREAD_POOL_MAX_WORKERS, read
            # now; without it, a bound (each worker holds a sandbox), not sys.maxsize.
            from prefect.settings import get_current_settings

            max_workers = get_current_settings().tasks.runner.thread_pool_max_workers or default_max_workers()
        super().__init__(max_workers=max_workers)
        self._reset_state()

    setattr(__init__, "__signature__", with_setting_keywords(__init__, keep=("self", "sandbox")))  # noqa: B010

    def _reset_state(self) -> None:
        self._config: SandboxConfig | None = None
        self._runtime: SandboxRuntime | None = None
        self._conduit: Conduit | None = None
        self._live = LiveSandboxes()  # sandboxes alive now, attempts, each task run's outputs
        self._live_lock = threading.Lock()  # what the runner keeps per flow run and per task run
        self._flow_runs: set[str] = set()
        self._flow_run_objs: dict[str, Any] = {}  # the engine's own FlowRun objects, state kept current
        self._cancelled = threading.Event()
        self._pacer: ApiLogBatcher | None = None
        self._announced: set[str] = set()
        self._deployment_names = python_tasks.DeploymentNames()
        self._pool: warm_pool_mod.WarmPool | None = None
        self._artifacts: Background | None = None
        self._reaper: Background | None = None
        self._packer: WorkspacePacker | None = None
        # Artifacts of task runs whose future is not done yet: published once it is, so the
        # API call never competes with the task's own Completed-state call.
        self._held: dict[str, list[Callable[[], None]]] = {}
        self._node_tables: dict[str, NodeTable] = {}  # per flow run: its keyed artifact
        #: What the runner holds while entered, released in reverse order by __exit__.
        self._resources: contextlib.ExitStack | None = None

    _TRANSIENT = (
        "_config",
        "_runtime",
        "_conduit",
        "_live",
        "_live_lock",
        "_flow_runs",
        "_flow_run_objs",
        "_cancelled",
        "_pacer",
        "_announced",
        "_deployment_names",
        "_pool",
        "_artifacts",
        "_reaper",
        "_packer",
        "_held",
        "_node_tables",
        "_resources",
    )

    def __getstate__(self) -> dict[str, Any]:
        # Prefect's runner cloudpickles the flow (and so this runner) into the flow-run
        # process: only configuration travels; live state is rebuilt on the other side.
        state = super().__getstate__()
        for name in self._TRANSIENT:
            state.pop(name, None)
        state["_executor"] = None  # a started runner pickles as a fresh one
        state["_cancel_events"] = {}
        state["_started"] = False
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._reset_state()

    def duplicate(self) -> ResolutoTaskRunner:
        return type(self)(sandbox=self._sandbox, max_workers=self._max_workers, **self._options)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ResolutoTaskRunner)
            and self._options == other._options
            and self._sandbox == other._sandbox
            and self._max_workers == other._max_workers
        )

    __hash__ = None  # type: ignore[assignment]

    # -- lifecycle ----------------------------------------------------------------
    @property
    def config(self) -> SandboxConfig:
        if self._config is None:
            raise RuntimeError("the task runner is not started")
        return self._config

    def _resolve_config(self) -> SandboxConfig:
        base = SandboxConfig()
        if self._sandbox is not None:
            from prefect_resoluto.blocks import load_sandbox_block

            base = load_sandbox_block(self._sandbox).to_config()
        options = dict(self._options)
        conduit = options.pop("conduit", None)
        if conduit is not None and not isinstance(conduit, (str, Conduit)):
            conduit = conduit.to_conduit()  # a conduit block
        if conduit is not None:
            options["conduit"] = conduit
        return base.replace(**options)

    def __enter__(self) -> ResolutoTaskRunner:
        self._reset_state()
        # Each resource is registered as it is acquired: the exit releases them in reverse
        # (the pool, the reaper, the sweep, held artifacts, the artifacts' drain, the log
        # pacer, the conduit), and a failure half-way through entering releases what was taken.
        with contextlib.ExitStack() as stack:
            self._config = self._resolve_config()
            self._runtime = self._config.build_runtime()
            self._conduit = self._config.build_conduit()
            stack.callback(self._drop_packer)
            stack.callback(self._conduit.close)
            self._config.check_conduit_fits(self._runtime, self._conduit)
            self._pacer = ApiLogBatcher()
            self._pacer.start()
            stack.callback(self._pacer.stop)
            # After the queue below is drained: every node's row is in its table by then.
            stack.callback(self._publish_tables)
            self._artifacts = stack.enter_context(_Draining(Background("resoluto-artifacts")))
            stack.callback(self._flush_held)
            stack.callback(self._sweep)
            self._reaper = Background("resoluto-reaper")
            stack.callback(self._reaper.close, REAP_DRAIN)
            self._packer = WorkspacePacker()
            super().__enter__()
            self._pool = warm_pool_mod.start_for(
                self._config, self._runtime, self._conduit, self._max_workers
            )
            if self._pool is not None:
                stack.callback(self._pool.close)
            self._resources = stack.pop_all()
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        try:
            if exc_type is not None or self._flow_failed():
                # The flow is over and not completed: nothing may keep running for it.
                self.cancel_all()
            elif self._executor is not None:
                # A clean exit lets running sandboxes finish; the parent's exit cancels.
                self._executor.shutdown(wait=True)
            super().__exit__(exc_type, exc_value, traceback)
        finally:
            resources, self._resources = self._resources, None
            if resources is not None:
                resources.__exit__(exc_type, exc_value, traceback)

    def _drop_packer(self) -> None:
        self._packer = None  # its archives go with the runner

    def _flush_held(self) -> None:
        """Queue the artifacts of task runs whose future never completed (cancelled, interrupted)."""
        with self._live_lock:
            held = [job for jobs in self._held.values() for job in jobs]
            self._held.clear()
        for job in held:
            self._queue_artifact(job)

    def _publish_tables(self) -> None:
        with self._live_lock:
            tables = list(self._node_tables.values())
        publish_tables(tables)

    def _flow_failed(self) -> bool:
        # The flow engine handles the flow's exception before leaving the runner's context,
        # so a failed flow exits here "cleanly": its final state tells.
        for fr in self._flow_run_objs.values():
            state = getattr(fr, "state", None)
            if state is not None and state.is_final() and not state.is_completed():
                return True
        return False

    def cancel_all(self) -> None:
        self._cancelled.set()
        if self._pool is not None:
            self._pool.close()
        for handle in self._live.handles():
            self._destroy(handle)
        super().cancel_all()

    def _reap(self, handle: SandboxHandle) -> None:
        self._destroy(handle)
        self._live.drop(handle.id)

    def _publish(self, outcome: NodeOutcome, attempt: int, redactor: Redactor, sandbox: str = "") -> None:
        """The node's artifacts (artifacts.py), off the task's critical path (API round trips):
        queued when the task run's future is done, in the API before the runner's exit
        returns, so before the flow call does."""
        from prefect.context import FlowRunContext, TaskRunContext

        ctx = TaskRunContext.get()
        fr_ctx = FlowRunContext.get()
        task_run_name = ctx.task_run.name if ctx is not None and ctx.task_run is not None else outcome.node_id
        table = None
        if fr_ctx is not None and fr_ctx.flow_run is not None:
            fr_id = str(fr_ctx.flow_run.id)
            with self._live_lock:
                table = self._node_tables.get(fr_id)
                if table is None:
                    name = fr_ctx.flow_run.name or fr_id
                    table = self._node_tables[fr_id] = NodeTable(fr_id, flow_run_key(name, fr_id), name)
        publish = functools.partial(
            _publish_artifact, outcome, task_run_name, attempt, redactor, table, sandbox
        )
        job = functools.partial(contextvars.copy_context().run, publish)  # the task run's context
        if ctx is None or ctx.task_run is None or self._artifacts is None:
            job()
            return
        with self._live_lock:
            self._held.setdefault(str(ctx.task_run.id), []).append(job)

    def _queue_artifact(self, job: Callable[[], None]) -> None:
        if self._artifacts is None:
            job()
        else:
            self._artifacts.submit(job, "node artifact")

    def _destroy(self, handle: SandboxHandle) -> None:
        try:
            if self._runtime is not None:
                self._runtime.destroy(handle)
        except Exception as e:
            log.warning("could not destroy sandbox %s: %s", handle.id, e)

    def _sweep(self) -> None:
        if self._runtime is None:
            return
        for fr in self._flow_runs:
            try:
                n = self._runtime.sweep({LABEL_FLOW_RUN: label_value(fr)})
                if n:
                    log.warning("reaped %d leftover sandbox(es) of flow run %s", n, fr)
            except Exception as e:
                log.warning("sweeping sandboxes of flow run %s failed: %s", fr, e)

    # -- submission -----------------------------------------------------------------
    def submit(
        self, task: Any, parameters: dict[str, Any], wait_for: Any = None, dependencies: Any = None
    ) -> Any:
        if self._config is None:
            raise RuntimeError("Task runner is not started")
        from prefect.context import FlowRunContext

        fr_ctx = FlowRunContext.get()
        if fr_ctx is not None and fr_ctx.flow_run is not None:
            self._flow_run_objs[str(fr_ctx.flow_run.id)] = fr_ctx.flow_run
            self._announce(fr_ctx)
        overrides = dict(_overrides.get() or {})
        sandboxed = copy.copy(task)
        sandboxed.fn = self._wrap(task, overrides)
        future = super().submit(sandboxed, parameters, wait_for, dependencies)
        future.add_done_callback(self._task_done)
        return future

    def _task_done(self, future: Any) -> None:
        with self._live_lock:
            held = self._held.pop(str(future.task_run_id), [])
        for job in held:
            self._queue_artifact(job)

    def _announce(self, fr_ctx: Any) -> None:
        """One line in the flow run's logs saying where its tasks will run. The flow engine
        enters the runner before its run context exists, so this waits for the first
        submission of each flow run."""
        key = str(fr_ctx.flow_run.id)
        with self._live_lock:
            if key in self._announced:
                return
            self._announced.add(key)
        from prefect.logging.loggers import flow_run_logger

        rt, conduit = self._runtime, self._conduit
        assert rt is not None and conduit is not None
        r = self.config.resources
        flow_run_logger(fr_ctx.flow_run, fr_ctx.flow).info(
            "ResolutoTaskRunner: each task runs in its own sandbox; runtime %s, isolation %s, conduit %s, "
            "max_workers %d, per sandbox %s",
            rt.name,
            rt.isolation.label,
            conduit.url,
            self._max_workers,
            r.describe(),
        )

    def _wrap(self, task: Any, overrides: dict[str, Any]) -> Any:
        fn = task.fn
        command = getattr(fn, "__resoluto_command__", False)

        if command:
            # The command task's body drives its own node; hand it this runner.
            @functools.wraps(fn)
            def run_command_here(*args: Any, **kwargs: Any) -> Any:
                token = _active_runner.set((self, overrides))
                try:
                    return fn(*args, **kwargs)
                finally:
                    _active_runner.reset(token)

            return run_command_here

        if task.isasync:

            @functools.wraps(fn)
            async def sandboxed_async(*args: Any, **kwargs: Any) -> Any:
                cancel = threading.Event()
                try:
                    # to_thread carries the task run's context into the thread
                    return await asyncio.to_thread(self._run_python, task, fn, overrides, cancel)
                except asyncio.CancelledError:
                    cancel.set()  # the timeout or cancellation reaches the node driver's loop
                    raise
                except BaseException as e:
                    _drop_plumbing(e)
                    raise  # a bare raise adds no frame of this function

            return sandboxed_async

        @functools.wraps(fn)
        def sandboxed_sync(*args: Any, **kwargs: Any) -> Any:
            try:
                return self._run_python(task, fn, overrides, None)
            except BaseException as e:
                _drop_plumbing(e)
                raise  # a bare raise adds no frame of this function

        return sandboxed_sync

    # -- one Python task ------------------------------------------------------------
    def _run_python(
        self, task: Any, fn: Any, overrides: dict[str, Any], cancel: threading.Event | None
    ) -> Any:
        return python_tasks.call(
            task,
            fn,
            self.config.replace(**overrides),
            cancel,
            run_node=self.run_node,
            pool=self._pool,
            deployment_name=self._deployment_names,
        )

    def run_node(
        self,
        *,
        task_name: str,
        argv: list[str],
        cfg: SandboxConfig,
        extra_inbox: dict[str, bytes] | None = None,
        extra_outputs: list[str] | None = None,
        cancel: threading.Event | None = None,
        line_sink: Callable[[str], None] | None = None,
        log_prints: bool = True,
        warm_prefect: tuple[str, ...] = (),
    ) -> NodeOutcome:
        """Drive one node for the current task run, re-launching on infrastructure failure.

        ``line_sink`` receives the workload's merged output lines, in order; ``log_prints``
        whether those lines become log records (Prefect's own decision for the task run:
        else they go to this process's stdout only, as a thread's prints do);
        ``warm_prefect`` the installed modules a warm sandbox pre-imports for it
        (prefect_resoluto.warm.pool.imports_for)."""
        from prefect.context import TaskRunContext
        from prefect.logging import get_run_logger

        ctx = TaskRunContext.get()
        assert ctx is not None and ctx.task_run is not None
        tr = ctx.task_run
        run_id = str(tr.flow_run_id or tr.id)
        self._flow_runs.add(run_id)
        logger = get_run_logger()
        runtime, conduit = self._runtime, self._conduit
        assert runtime is not None and conduit is not None
        workspace = cfg.workspace or python_tasks.default_workspace()
        outcome: NodeOutcome | None = None
        for infra_try in range(cfg.infrastructure_retries + 1):
            key = str(tr.id)
            attempt = self._live.next_attempt(key)
            node_id = key if attempt == 1 else f"{key}.{attempt}"
            spec = NodeSpec(
                run_id=run_id,
                node_id=node_id,
                argv=argv,
                workspace=workspace,
                output_paths=list(cfg.output_paths) + list(extra_outputs or []),
                env=dict(cfg.env),
                secret_env=dict(cfg.secret_env),
                resources=cfg.resources,
                labels=task_run_labels(run_id, key, task_name, attempt),
                egress=list(cfg.egress),
                setup_egress=cfg.setup_egress,
                setup_argv=cfg.setup_argv,
                egress_resolve=dict(cfg.egress_resolve),
                image=cfg.image,
                extra_inbox=dict(extra_inbox or {}),
                outputs_dir=(cfg.outputs_dir or default_outputs_root()) / run_id / node_id,
                workspace_skip=[cfg.outputs_dir or default_outputs_root()],
                output_limit=cfg.output_limit_bytes,
                min_isolation=cfg.min_isolation,
                silence_window=cfg.silence_window,
            )
            redactor = Redactor(cfg.secret_env.values())
            forward = EventLogForwarder(
                task_run_id=tr.id,
                flow_run_id=tr.flow_run_id,
                node_id=node_id,
                redactor=redactor,
                batcher=self._pacer,
                run_fields=dict(getattr(logger, "extra", None) or {}),
                log_prints=log_prints,
            )
            forward.artifacts = ArtifactRelay(tr.id, tr.flow_run_id, forward.emit, redactor)
            warm, how = warm_pool_mod.take_for(self._pool, spec, imports=warm_prefect)
            forward.emit(
                logging.DEBUG,
                f"sandbox node {node_id} on {runtime.name} "
                f"({runtime.isolation.label} isolation), conduit {conduit.url}; {how}",
            )
            node = TaskRunNode(self, forward, line_sink, cancel)
            try:
                outcome = drive(spec, conduit, runtime, node, warm=warm)
            finally:
                node.release()
            if outcome.ok:
                self._live.set_outputs(
                    key, {k: v for k, v in outcome.output_files.items() if not k.startswith(".resoluto/")}
                )
            self._publish(outcome, attempt, redactor, how)
            if (
                outcome.infrastructure_failure
                and infra_try < cfg.infrastructure_retries
                and not self._cancelled.is_set()
                and not (cancel is not None and cancel.is_set())
            ):
                logger.warning(
                    "infrastructure failure (%s): %s; re-launching (%d of %d), the task's own retries are "
                    "not spent",
                    outcome.failure,
                    outcome.reason,
                    infra_try + 1,
                    cfg.infrastructure_retries,
                )
                continue
            break
        assert outcome is not None
        return outcome


class _Draining:
    """The artifacts' background queue as a context: drained at exit, for less time when the
    flow was interrupted (exit with an exception) than after a normal end."""

    def __init__(self, background: Background) -> None:
        self.background = background

    def __enter__(self) -> Background:
        return self.background

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        self.background.close(ARTIFACT_DRAIN if exc_type is None else ARTIFACT_DRAIN_INTERRUPTED)


class TaskRunNode(NodeObserver):
    """One node of a task run, as the runner sees it: its events become the task run's logs
    (and, for a command task, its output lines), its sandbox is live -- reached by
    ``cancel_all`` -- from launch until destroyed, here or by the runner's reaper."""

    def __init__(
        self,
        runner: ResolutoTaskRunner,
        forward: EventLogForwarder,
        line_sink: Callable[[str], None] | None,
        cancel: threading.Event | None,
    ) -> None:
        self.runner = runner
        self.forward = forward
        self.line_sink = line_sink
        self.cancel = cancel
        self.output = WorkloadOutput()
        self.sandboxes: list[SandboxHandle] = []
        self.reaping: set[str] = set()

    def launched(self, handle: SandboxHandle) -> None:
        self.sandboxes.append(handle)
        self.runner._live.add(handle)

    def event(self, ev: wire.SpanEvent) -> None:
        self.forward(ev)
        if self.line_sink is not None:
            line = self.output.line(ev)
            if line is not None:
                self.line_sink(line)

    def cancelled(self) -> bool:
        return self.runner._cancelled.is_set() or (self.cancel is not None and self.cancel.is_set())

    def reap(self, handle: SandboxHandle) -> bool:
        reaper = self.runner._reaper
        if reaper is None:
            return False
        # Stays live until destroyed, so cancel_all still reaches it.
        self.reaping.add(handle.id)
        reaper.submit(functools.partial(self.runner._reap, handle), f"reaping sandbox {handle.id}")
        return True

    def pack_workspace(self, root: Path, skip: list[str]) -> bytes:
        packer = self.runner._packer
        return packer(root, skip) if packer is not None else super().pack_workspace(root, skip)

    def finished(self, outcome: NodeOutcome) -> None:
        # One short line per node at INFO (a failure is told by the task's exception, as
        # on threads); the details at DEBUG, in the artifact and in the node's events.
        self.forward.emit(logging.DEBUG, _summary(outcome))
        self.forward.emit(logging.INFO, runner_line(outcome))

    def release(self) -> None:
        """The node is over: its sandboxes are no longer live (unless the reaper holds one)."""
        for h in self.sandboxes:
            if h.id not in self.reaping:
                self.runner._live.drop(h.id)


_active_runner: contextvars.ContextVar[tuple[ResolutoTaskRunner, dict[str, Any]] | None] = (
    contextvars.ContextVar("resoluto_active_runner", default=None)
)


def active_runner() -> tuple[ResolutoTaskRunner, dict[str, Any]] | None:
    return _active_runner.get()


def default_max_workers() -> int:
    return max(4, 2 * (os.cpu_count() or 1))


_RUNTIME_NAMES = {"gvisor": "gVisor", "kubernetes": "Kubernetes", "solari": "Solari"}


def runner_line(o: NodeOutcome) -> str:
    """The one line a node adds to its task run's logs at INFO."""
    took = o.timings.get("finish")
    kind = "warm" if o.warm else "cold"
    line = f"ran in a {kind} {_RUNTIME_NAMES.get(o.runtime, o.runtime)} sandbox"
    if took is not None:
        line += f" in {took:.1f} s"
    if o.infrastructure_failure:
        line += f" (infrastructure failure: {o.failure})"
    return line


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


def _drop_plumbing(e: BaseException) -> None:
    """What a sandboxed task raised, as the engine logs it: the sandbox's frames, not the
    host's between the engine's call and the re-raise (a runner-made error keeps none: its
    message tells). Anything else (a bug here) keeps its whole traceback."""
    from prefect_resoluto.node.outcome import NodeFailure

    if isinstance(e, (pycall.RemoteError, NodeFailure, pycall.NotSandboxable)):
        e.__traceback__ = remote_traceback.from_the_task(e.__traceback__)


def output_files(future_or_id: Any) -> dict[str, Path]:
    """The declared output files (``output_paths``) a task run's node left, by workspace-
    relative path -> host path. Call it in the flow with the task's future (or task run
    id); the task's return value is never rewritten to point at them."""
    from prefect.context import FlowRunContext

    key = str(getattr(future_or_id, "task_run_id", future_or_id))
    ctx = FlowRunContext.get()
    runner = getattr(ctx, "task_runner", None) if ctx is not None else None
    if not isinstance(runner, ResolutoTaskRunner):
        raise RuntimeError("output_files() works inside a flow whose task runner is ResolutoTaskRunner")
    return runner._live.outputs(key)
