"""The Python-call path: a task's function called in a sandbox, its value or exception back.

The call crosses as JSON (:mod:`prefect_resoluto.task_runner.call_spec`): the function's reference, its
parameters and what it may read of its run (tags, ``prefect.runtime``); the node's outputs
carry its return value or its exception. Prefect is imported only inside the calls (the
task engine's context), as in the rest of the runner.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from guest_runner.redact import Redactor
from prefect_resoluto.node.outcome import NodeOutcome, WorkloadFailed
from prefect_resoluto.node.spec import output_allowance
from prefect_resoluto.runtimes.base import memory_hint
from prefect_resoluto.settings.config import SandboxConfig
from prefect_resoluto.task_runner import call_spec, reads, returned_state
from prefect_resoluto.warm import pool as warm_pool_mod

if TYPE_CHECKING:
    from prefect_resoluto.warm.pool import AnyPool

log = logging.getLogger("prefect_resoluto")


class RunNode(Protocol):
    """The runner's way to drive one node for the current task run (``ResolutoTaskRunner.run_node``)."""

    def __call__(
        self,
        *,
        task_name: str,
        argv: list[str],
        cfg: SandboxConfig,
        extra_inbox: dict[str, bytes] | None = None,
        extra_outputs: list[str] | None = None,
        read_in_memory: list[str] | None = None,
        cancel: threading.Event | None = None,
        log_prints: bool = True,
        warm_prefect: tuple[str, ...] = (),
    ) -> NodeOutcome: ...


def call(
    task: Any,
    fn: Any,
    cfg: SandboxConfig,
    cancel: threading.Event | None,
    *,
    run_node: RunNode,
    pool: AnyPool | None,
    deployment_name: DeploymentNames,
) -> Any:
    """Run ``fn`` (the body of ``task``) in a sandbox for the current task run and return what
    it returned there -- or raise what it raised, its remote traceback kept."""
    from prefect.context import TaskRunContext

    ctx = TaskRunContext.get()
    if ctx is None or ctx.task_run is None:
        raise RuntimeError("a sandboxed task must run inside Prefect's task engine")
    allowed_reads = reads.secret_entries(cfg)  # the allowed variables and blocks, read here
    if allowed_reads:
        cfg = cfg.replace(secret_env={**cfg.secret_env, **allowed_reads})
    ref = call_spec.function_ref(fn, cfg.workspace or default_workspace())
    task_module = getattr(fn, "__module__", None)
    params = call_spec.encode_parameters(task.name, dict(ctx.parameters or {}), task_module)
    redactor = Redactor(cfg.secret_env.values())
    limit, _ = output_allowance(cfg.output_limit_bytes, cfg.resources)
    outcome = run_node(
        task_name=task.name,
        argv=call_spec.guest_argv(),
        cfg=cfg,
        extra_inbox={
            call_spec.CALL_ARCHIVE: call_spec.call_archive(
                ref, params, context=run_context(ctx, params, deployment_name)
            )
        },
        extra_outputs=call_spec.RESULT_PATHS,
        read_in_memory=call_spec.READ_IN_MEMORY,
        cancel=cancel,
        log_prints=bool(getattr(ctx, "log_prints", False)),
        warm_prefect=warm_pool_mod.imports_for(pool, workspace_file(ref, cfg)),
    )
    return _returned(outcome, fn, cfg, pool, ref, redactor, task_module, limit)


def _returned(
    outcome: NodeOutcome,
    fn: Any,
    cfg: SandboxConfig,
    pool: AnyPool | None,
    ref: dict[str, str],
    redactor: Redactor,
    task_module: str | None,
    limit: int | None,
) -> Any:
    """The task's value from its node's outcome, or the exception the task raised."""
    warm_pool_mod.learn(
        pool,
        workspace_file(ref, cfg),
        outcome.output_data.get(call_spec.call.IMPORTS_FILE),
        succeeded=outcome.ok,
    )
    if outcome.failure == "workload":
        # raises the task's own exception type (or RemoteTaskError), remote traceback kept
        call_spec.read_outcome(
            outcome.output_dir,
            outcome.output_data,
            redactor=redactor,
            task_module=task_module,
            memory_hint=memory_hint(cfg.resources),
            limit=limit,
            workspace=cfg.workspace or default_workspace(),
        )
        raise WorkloadFailed(outcome.describe(), outcome)
    outcome.raise_for_failure()
    found, value = call_spec.read_outcome(
        outcome.output_dir,
        outcome.output_data,
        redactor=redactor,
        task_module=task_module,
        limit=limit,
        workspace=cfg.workspace or default_workspace(),
    )
    if not found:
        raise WorkloadFailed(
            f"node {outcome.node_id} succeeded but left no {call_spec.call.RETURN_FILE}", outcome
        )
    if returned_state.is_state(value):  # the state the task returned to end in, as on a thread
        return value
    return call_spec.rebuild(value, call_spec.return_annotation(fn))


def run_context(ctx: Any, params: dict[str, Any], deployment_name: DeploymentNames) -> dict[str, Any]:
    """What a task can read of its run, as JSON for the sandbox: the current tags,
    prefect.runtime's task_run, flow_run and deployment, and the run context objects."""
    from prefect.context import FlowRunContext, TagsContext

    tr = ctx.task_run
    tags_ctx = TagsContext.get()
    out: dict[str, Any] = {
        "tags": sorted(tags_ctx.current_tags) if tags_ctx is not None else [],
        "task_run": {
            "id": str(tr.id),
            "name": tr.name,
            "task_name": ctx.task.name,
            "run_count": tr.run_count,
            "parameters": params,
            "tags": list(tr.tags or []),
        },
    }
    fr_ctx = FlowRunContext.get()
    fr = fr_ctx.flow_run if fr_ctx is not None else None
    if fr_ctx is not None and fr is not None:
        out["flow_run"] = {
            "id": str(fr.id),
            "name": fr.name,
            "flow_name": fr_ctx.flow.name if fr_ctx.flow is not None else None,
            "tags": list(fr.tags or []),
            "parameters": json_only(fr_ctx.parameters or {}),
        }
        dep = str(fr.deployment_id) if fr.deployment_id else None
        out["deployment"] = {"id": dep, "name": deployment_name(dep) if dep else None}
    out["contexts"] = run_contexts(ctx, params, fr_ctx)
    return out


#: What a sandboxed task's FlowRunContext.get().flow_run holds of its flow run: never
#: job_variables (a deployment's env may carry secrets), context or infrastructure details.
FLOW_RUN_FIELDS = frozenset(
    "id name flow_id deployment_id deployment_version flow_version tags labels parent_task_run_id "
    "run_count state_type state_name created expected_start_time start_time work_pool_name "
    "work_queue_name idempotency_key".split()
)


def run_contexts(ctx: Any, params: dict[str, Any], fr_ctx: Any) -> dict[str, Any]:
    """Prefect's run context objects as a task reads them on a thread (TaskRunContext,
    FlowRunContext), as JSON: the host's own TaskRun (its state's data left out) and the
    allowed fields of its FlowRun (guest_runner/runctx.py rebuilds them)."""
    out: dict[str, Any] = {
        "task": {
            "task": {"name": ctx.task.name, "isasync": bool(ctx.task.isasync)},
            "task_run": ctx.task_run.model_dump(mode="json", exclude={"state": {"data"}}),
            "parameters": params,
            "log_prints": bool(ctx.log_prints),
            "persist_result": bool(ctx.persist_result),
            "start_time": ctx.start_time.isoformat(),
        }
    }
    fr = fr_ctx.flow_run if fr_ctx is not None else None
    if fr_ctx is not None and fr is not None:
        flow_run = fr.model_dump(mode="json", include=set(FLOW_RUN_FIELDS))
        flow_run["parameters"] = json_only(fr.parameters or {})
        out["flow"] = {
            "flow_run": flow_run,
            "parameters": json_only(fr_ctx.parameters or {}),
            "log_prints": bool(fr_ctx.log_prints),
            "persist_result": bool(fr_ctx.persist_result),
            "start_time": fr_ctx.start_time.isoformat(),
        }
    return out


class DeploymentNames:
    """A deployment's name by id, read from the API once per runner (a convenience: the id is
    the reference, so a failed read gives None)."""

    def __init__(self) -> None:
        self._names: dict[str, str | None] = {}

    def __call__(self, deployment_id: str) -> str | None:
        if deployment_id not in self._names:
            try:
                from prefect.client.orchestration import get_client

                with get_client(sync_client=True) as client:
                    self._names[deployment_id] = client.read_deployment(deployment_id).name
            except Exception as e:  # the name is a convenience; the id is the reference
                log.debug("could not read deployment %s: %s", deployment_id, e)
                self._names[deployment_id] = None
        return self._names[deployment_id]


def default_workspace() -> Path:
    """The directory of the flow's source file (the workspace shipped to each node)."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is not None and ctx.flow is not None:
        import inspect

        try:
            src = inspect.getsourcefile(ctx.flow.fn)
            if src:
                return Path(src).resolve().parent
        except TypeError:
            pass
    return Path.cwd()


def json_only(values: dict[str, Any]) -> dict[str, Any]:
    """The values that survive JSON encoding (the rest is left out, not stringified)."""
    import json

    from pydantic_core import to_jsonable_python

    out: dict[str, Any] = {}
    for k, v in values.items():
        try:
            out[str(k)] = to_jsonable_python(v)
            json.dumps(out[str(k)])
        except Exception:
            out.pop(str(k), None)
    return out


def workspace_file(ref: dict[str, str], cfg: SandboxConfig) -> Path | None:
    return (cfg.workspace or default_workspace()) / ref["file"] if ref.get("file") else None
