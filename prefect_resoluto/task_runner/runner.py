"""ResolutoTaskRunner: Prefect's task engine on the host, each task's function in a sandbox.

The runner is a ThreadPoolTaskRunner whose submissions carry a copy of the task with
only ``fn`` replaced. States, retries, hooks, caching, result persistence, timeouts
and lineage all stay Prefect's own; the replacement ``fn`` sends the call across the
conduit, blocks for the verdict and returns (or raises) what the sandbox produced.

The runner itself enters, exits, submits and wraps; a task run's node is driven by
:mod:`.task_node`, its artifacts published by :mod:`.node_artifacts`, the runner's
sandboxes reached through :mod:`.sandboxes`, its flow runs kept by :mod:`.flow_runs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import functools
import inspect
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import CoroutineType
from typing import TYPE_CHECKING, Any, overload

from prefect.task_runners import ThreadPoolTaskRunner
from typing_extensions import ParamSpec, TypeVar

from guest_runner.conduit import Conduit
from prefect_resoluto.node.outcome import NodeOutcome
from prefect_resoluto.node.wake import WakeEvent
from prefect_resoluto.runtimes.base import SandboxRuntime
from prefect_resoluto.settings.config import SandboxConfig, default_outputs_root
from prefect_resoluto.settings.fields import unknown_keywords, with_setting_keywords
from prefect_resoluto.task_runner import call_spec, direct_calls, python_calls, remote_traceback
from prefect_resoluto.task_runner.background import Background
from prefect_resoluto.task_runner.flow_runs import FlowRuns, announce
from prefect_resoluto.task_runner.live import LiveSandboxes
from prefect_resoluto.task_runner.logs import ApiLogBatcher
from prefect_resoluto.task_runner.node_artifacts import NodeArtifacts
from prefect_resoluto.task_runner.recorded_runs import Recorder, RecordingExecutor, record_async_first
from prefect_resoluto.task_runner.sandboxes import RunnerSandboxes, sweep
from prefect_resoluto.task_runner.task_node import NodeRequest, TaskNodes
from prefect_resoluto.task_runner.workspace import WorkspacePacker
from prefect_resoluto.warm import pool as warm_pool_mod

if TYPE_CHECKING:
    from prefect.client.schemas.objects import RunInput
    from prefect.futures import PrefectConcurrentFuture, PrefectFuture
    from prefect.tasks import Task

P = ParamSpec("P")
R = TypeVar("R")

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

    Any sandbox setting (settings/fields.py: memory, cpus, output_paths, env, secret_env, image,
    silence_window ...); env dicts are merged.
    """
    probe = SandboxConfig()
    probe.replace(**options)  # unknown or invalid options fail here, at the call site
    if "summary_artifact" in options:  # one table per flow run: no task's to change
        raise TypeError("sandbox_options() got 'summary_artifact': it is the runner's setting, not a task's")
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
        # ``options``: one keyword per sandbox setting (settings/fields.py; the signature spells them out).
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
        self._flow_runs = FlowRuns()
        self._recorder = Recorder()
        self._cancelled = WakeEvent()  # every node's driver sleeps on it (node/wake.py)
        self._deployment_names = python_calls.DeploymentNames()
        self._pool: warm_pool_mod.AnyPool | None = None
        self._packer: WorkspacePacker | None = None
        # While entered: the node's view of the runner's sandboxes, the artifacts' queue,
        # and what driving a task run's node needs.
        self._sandboxes: RunnerSandboxes | None = None
        self._artifacts: NodeArtifacts | None = None
        self._nodes: TaskNodes | None = None
        #: What the runner holds while entered, released in reverse order by __exit__.
        self._resources: contextlib.ExitStack | None = None

    _TRANSIENT = (
        "_config",
        "_runtime",
        "_conduit",
        "_live",
        "_flow_runs",
        "_recorder",
        "_cancelled",
        "_deployment_names",
        "_pool",
        "_packer",
        "_sandboxes",
        "_artifacts",
        "_nodes",
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
        direct_calls.install(ResolutoTaskRunner)
        self._reset_state()
        # Each resource is registered as it is acquired: the exit releases them in reverse
        # (the pool, the reaper, the sweep, held artifacts, the artifacts' drain, the log
        # pacer, the conduit), and a failure half-way through entering releases what was taken.
        with contextlib.ExitStack() as stack:
            config = self._config = self._resolve_config()
            runtime = self._runtime = config.build_runtime()
            conduit = self._conduit = config.build_conduit()
            stack.callback(self._drop_packer)
            stack.callback(conduit.close)
            config.check_conduit_fits(runtime, conduit)
            pacer = ApiLogBatcher()
            pacer.start()
            stack.callback(pacer.stop)
            queue = Background("resoluto-artifacts")
            artifacts = self._artifacts = NodeArtifacts(queue, summary=config.summary_artifact)
            # After the queue below is drained: every node's row is in its table by then.
            stack.callback(artifacts.publish_tables)
            stack.enter_context(_Draining(queue))
            stack.callback(artifacts.flush_held)
            stack.callback(sweep, runtime, self._flow_runs.with_nodes)
            stack.callback(_drop_empty_outputs, config, self._flow_runs.with_nodes)
            reaper = Background("resoluto-reaper")
            stack.callback(reaper.close, REAP_DRAIN)
            self._packer = WorkspacePacker()
            self._sandboxes = RunnerSandboxes(runtime, self._live, self._cancelled, reaper, self._packer)
            super().__enter__()
            if type(self._executor) is ThreadPoolExecutor:  # Prefect's, built just now, no thread yet
                # Its sync engine runs are recorded by the API first (recorded_runs.py: issue 41).
                self._executor.__class__ = RecordingExecutor
                self._executor.recorder = self._recorder  # type: ignore[attr-defined]
            self._pool = warm_pool_mod.start_for(config, runtime, conduit, self._max_workers)
            if self._pool is not None:
                stack.callback(self._pool.close)
            self._nodes = TaskNodes(
                runtime, conduit, pacer, self._pool, self._live, self._sandboxes, artifacts, self._flow_runs
            )
            self._resources = stack.pop_all()
        direct_calls.entered(self)
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        direct_calls.exited(self)
        try:
            if exc_type is not None or self._flow_runs.any_failed():
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
        if self._sandboxes is not None:
            self._sandboxes.packer = None

    def cancel_all(self) -> None:
        self._cancelled.set()
        if self._pool is not None:
            self._pool.close()
        if self._sandboxes is not None:
            self._sandboxes.destroy_all()
        super().cancel_all()

    # -- submission -----------------------------------------------------------------
    @overload
    def submit(
        self,
        task: Task[P, CoroutineType[Any, Any, R]],
        parameters: dict[str, Any],
        wait_for: Iterable[PrefectFuture[Any]] | None = None,
        dependencies: dict[str, set[RunInput]] | None = None,
    ) -> PrefectConcurrentFuture[R]: ...

    @overload
    def submit(
        self,
        task: Task[Any, R],
        parameters: dict[str, Any],
        wait_for: Iterable[PrefectFuture[Any]] | None = None,
        dependencies: dict[str, set[RunInput]] | None = None,
    ) -> PrefectConcurrentFuture[R]: ...

    def submit(
        self,
        task: Task[Any, Any],
        parameters: dict[str, Any],
        wait_for: Iterable[PrefectFuture[Any]] | None = None,
        dependencies: dict[str, set[RunInput]] | None = None,
    ) -> PrefectConcurrentFuture[Any]:
        """Prefect's submission of a copy of ``task`` whose ``fn`` runs in a sandbox."""
        sandboxed, started = self.sandboxed_copy(task)
        if sandboxed.isasync:
            record_async_first(sandboxed, self._recorder)
        try:
            future = super().submit(sandboxed, parameters, wait_for, dependencies)
        except BaseException:
            started()
            raise
        future.add_done_callback(lambda _f: started())
        future.add_done_callback(self._task_done)
        return future

    def sandboxed_copy(self, task: Task[Any, Any]) -> tuple[Task[Any, Any], Callable[[], None]]:
        """A copy of ``task`` whose ``fn`` runs in a sandbox, for a submission or a direct
        call (:mod:`.direct_calls`), and what to call once its body started or never will."""
        if self._config is None:
            raise RuntimeError("Task runner is not started")
        if inspect.isgeneratorfunction(task.fn) or inspect.isasyncgenfunction(task.fn):
            raise call_spec.NotSandboxable(
                f"task {task.name!r} is a generator: a sandboxed task's value crosses to the host "
                "once, when it returns. Return a list of what it would yield instead."
            )
        from prefect.context import FlowRunContext

        fr_ctx = FlowRunContext.get()
        if fr_ctx is not None and fr_ctx.flow_run is not None and self._flow_runs.submitted(fr_ctx.flow_run):
            assert self._runtime is not None and self._conduit is not None
            announce(fr_ctx, self._runtime, self._conduit, self._max_workers, self.config.resources)
        overrides = dict(_overrides.get() or {})
        # Counted by the warm pool as coming until its body starts (or it ends without), so
        # a map's sandboxes are restored ahead of its nodes and none after its last.
        started = warm_pool_mod.expected(self._pool)
        sandboxed = copy.copy(task)
        sandboxed.fn = self._wrap(task, overrides, started)
        return sandboxed, started

    def _task_done(self, future: PrefectFuture[Any]) -> None:
        if self._artifacts is not None:
            self._artifacts.task_done(str(future.task_run_id), completed=_completed(future))

    def _wrap(
        self, task: Task[Any, Any], overrides: dict[str, Any], started: Callable[[], None]
    ) -> Callable[..., Any]:
        fn = task.fn
        command = getattr(fn, "__resoluto_command__", False)

        if command:
            # The command task's body drives its own node; hand it this runner.
            @functools.wraps(fn)
            def run_command_here(*args: Any, **kwargs: Any) -> Any:
                started()
                token = _active_runner.set((self, overrides))
                try:
                    return fn(*args, **kwargs)
                finally:
                    _active_runner.reset(token)

            return run_command_here

        if task.isasync:

            @functools.wraps(fn)
            async def sandboxed_async(*args: Any, **kwargs: Any) -> Any:
                started()
                cancel = WakeEvent()
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
            started()
            try:
                return self._run_python(task, fn, overrides, None)
            except BaseException as e:
                _drop_plumbing(e)
                raise  # a bare raise adds no frame of this function

        return sandboxed_sync

    def _run_python(
        self, task: Task[Any, Any], fn: Any, overrides: dict[str, Any], cancel: threading.Event | None
    ) -> Any:
        return python_calls.call(
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
        read_in_memory: list[str] | None = None,
        cancel: threading.Event | None = None,
        line_sink: Callable[[str], None] | None = None,
        log_prints: bool = True,
        warm_prefect: tuple[str, ...] = (),
    ) -> NodeOutcome:
        """Drive one node for the current task run (:class:`~.task_node.NodeRequest` says
        what each keyword is), re-launching on infrastructure failure."""
        if self._nodes is None:
            raise RuntimeError("the task runner is not started")
        return self._nodes.run(
            NodeRequest(
                task_name=task_name,
                argv=argv,
                cfg=cfg,
                extra_inbox=extra_inbox,
                extra_outputs=extra_outputs,
                read_in_memory=read_in_memory,
                cancel=cancel,
                line_sink=line_sink,
                log_prints=log_prints,
                warm_prefect=warm_prefect,
            )
        )


class _Draining:
    """The artifacts' background queue as a context: drained at exit, for less time when the
    flow was interrupted (exit with an exception) than after a normal end."""

    def __init__(self, background: Background) -> None:
        self.background = background

    def __enter__(self) -> Background:
        return self.background

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        self.background.close(ARTIFACT_DRAIN if exc_type is None else ARTIFACT_DRAIN_INTERRUPTED)


_active_runner: contextvars.ContextVar[tuple[ResolutoTaskRunner, dict[str, Any]] | None] = (
    contextvars.ContextVar("resoluto_active_runner", default=None)
)


def active_runner() -> tuple[ResolutoTaskRunner, dict[str, Any]] | None:
    return _active_runner.get()


def default_max_workers() -> int:
    return max(4, 2 * (os.cpu_count() or 1))


def _drop_empty_outputs(config: SandboxConfig, run_ids: set[str]) -> None:
    """Each flow run's directory of outputs, if its nodes left nothing there: a Python task's
    own call files go as they are read (python_calls), its declared outputs stay."""
    root = config.outputs_dir or default_outputs_root()
    for run_id in list(run_ids):
        try:
            os.rmdir(root / run_id)
        except OSError:  # it holds declared outputs, or was never made
            pass


def _completed(future: PrefectFuture[Any]) -> bool:
    """Whether a done future's task run completed: its final state, as the engine returned it
    to the thread pool (no API read: the server records states asynchronously)."""
    from prefect.client.schemas.objects import State

    try:
        final = future.wrapped_future.result(timeout=0)  # type: ignore[attr-defined]
    except BaseException:  # cancelled, or no state to read: not completed
        return False
    return isinstance(final, State) and final.is_completed()


def _drop_plumbing(e: BaseException) -> None:
    """What a sandboxed task raised, as the engine logs it: the sandbox's frames, not the
    host's between the engine's call and the re-raise (a runner-made error keeps none: its
    message tells). Anything else (a bug here) keeps its whole traceback."""
    from prefect_resoluto.node.outcome import NodeFailure

    if isinstance(e, (call_spec.RemoteError, NodeFailure, call_spec.NotSandboxable)):
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
