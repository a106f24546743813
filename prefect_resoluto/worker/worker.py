"""The ``resoluto`` worker: each flow run of a work pool in its own fresh sandbox.

``prefect work-pool create P --type resoluto`` gives a pool whose base job template
holds the sandbox settings below as variables (a form in the UI); deployments override
them with ``job_variables``; ``prefect worker start --pool P`` runs each flow run as one
sandbox node: Prefect's own entry point (``python -m prefect.engine``, as the process
worker runs it) on the configured runtime, the deployment's code fetched by its own pull
steps. The flow run reports its logs and states to the API itself; the worker watches
from outside: cancellation destroys the sandbox, a sandbox that dies marks the run
Crashed with the runtime's reason, and the sandbox's own output travels the conduit
as node events (so a run that never reached the API still leaves evidence).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import anyio
import anyio.abc
from prefect.blocks.system import Secret
from prefect.workers.base import BaseJobConfiguration, BaseVariables, BaseWorker, BaseWorkerResult
from pydantic import Field, PrivateAttr
from pydantic_core import PydanticUndefined

from guest_runner import wire
from prefect_resoluto.blocks import (
    CONDUIT_CHOICES,
    CONDUIT_DEFAULT_TITLE,
    LocalConduitBlock,
    S3ConduitBlock,
    SandboxBlock,
)
from prefect_resoluto.node.describe import describe_event
from prefect_resoluto.node.drive import drive
from prefect_resoluto.node.observer import NodeObserver, WorkloadOutput
from prefect_resoluto.node.outcome import NodeOutcome
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes.base import IsolationLevel, SandboxHandle, SandboxRuntime
from prefect_resoluto.runtimes.labels import LABEL_FLOW_RUN, LABEL_RUN, label_value
from prefect_resoluto.settings.config import SandboxConfig
from prefect_resoluto.settings.fields import Surface, exposed
from prefect_resoluto.settings.forms import (
    SurfaceType,
    model,
    optional,
    plain_optional,
    setting_fields,
    setting_validators,
    title_choices,
)
from prefect_resoluto.warm.flow_run_images import FlowRunSnapshots
from prefect_resoluto.worker.admission import (
    DEFAULT_RUN_OVERRIDABLE,
    admit_flow_run,
    check_deployment_floor,
    check_floor,
    pool_floor,
)
from prefect_resoluto.worker.gateway import ApiGateway, Upstream, gateway_summary
from prefect_resoluto.worker.plan import (
    LABEL_WORK_POOL,
    LABEL_WORKER,
    LABEL_WORKER_INSTANCE,
    FlowRunPlan,
    SandboxNetwork,
    check_pod_rules,
    code_directories,
    engine_argv,
    gateway_env,
    new_node_id,
    sandbox_network,
    split_env,
    ui_env,
    with_code_mounts,
)
from prefect_resoluto.worker.rules import RunRules

if TYPE_CHECKING:
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.objects import Flow as APIFlow
    from prefect.client.schemas.objects import FlowRun, WorkPool
    from prefect.client.schemas.responses import DeploymentResponse

    from guest_runner.conduit import Conduit

ConduitBlock = Union[LocalConduitBlock, S3ConduitBlock]  # noqa: UP007 - pydantic union of blocks
if TYPE_CHECKING:
    _SecretBlock = Secret[Any]
else:  # pydantic evaluates field annotations, and for Secret[Any] it would make a new block class
    _SecretBlock = Secret

CANCELLED = "cancelled from the API"
WORKER_STOPPED = "the worker stopped"
DELETED = "the flow run was deleted"
#: Seconds between the worker's looks at a running flow run's state (cancellation).
CANCEL_POLL_SECONDS = 2.0
#: Seconds a stopping worker gives a sandbox whose run is already final to exit by itself
#: (the engine flushes its last logs to the API on the way out).
FINISHING_GRACE_SECONDS = 10.0
#: Set to 1 in a worker's environment, its flow runs dial the API themselves with the
#: worker's own credential, as before the gateway: the benchmarks' baseline, never for
#: flows you do not trust (the run's logs say so at WARNING).
DIRECT_API_ENV = "RESOLUTO_UNSAFE_DIRECT_API"
#: The worker's own default for ``api_gateway_address`` (the job variable wins): a worker that
#: runs in the cluster as a pod sets it to its pod IP through the downward API
#: (``status.podIP``), which changes with every restart of the worker's pod.
GATEWAY_ADDRESS_ENV = "RESOLUTO_API_GATEWAY_ADDRESS"
#: Lines of the sandbox's own output kept for a crashed run's report.
EVIDENCE_LINES = 40
#: ...each cut to this many characters: a crash report is the run's last words, not its
#: output, and a guest's 16 MiB lines must not make 40 of them the worker's memory.
EVIDENCE_CHARS = 4096


# --------------------------------------------------------------------------- the pool's form

# The pool's variables are the settings a pool shows (declared once, in settings/fields.py: there
# each setting the pool leaves out says why), then the worker's own below. The job
# configuration is derived from the variables: the same names, unset unless templated.
_SECRET_BLOCK = (
    "A Secret block holding a JSON object {NAME: value}: the flow run's secret environment "
    "variables, stored encrypted, shown masked, redacted from every log line and event."
)
_SANDBOX = (
    "A saved Resoluto Sandbox block as the base: its own values win over the fields here left at "
    "their defaults; env, secret environment and egress are merged."
)
_WORKING_DIR = (
    "A host directory shipped into the sandbox as the flow run's working directory (a copy). "
    "Empty: an empty directory; the deployment's pull steps fetch its code."
)
_STREAM = "Echo the flow run's own output (from the conduit) on the worker's standard output; the guest runner's diagnostics go to the worker's log at DEBUG."
_RUN_OVERRIDABLE = (
    "Job variables a flow run's own job variables may set (run_deployment, a custom run); the pool's "
    "value counts, not a deployment's. Never runtime, min_isolation, command, conduit, egress, image, "
    "allowed blocks or variables, nor a templated value; the pool's minimum isolation is a floor."
)
_GATEWAY_ADDRESS = (
    "An address of the worker's host where the run's API gateway listens for a sandbox on another machine "
    "(kubernetes: an IPv4 address the pods can reach). Empty: the worker's RESOLUTO_API_GATEWAY_ADDRESS, "
    "else its loopback, which only local sandboxes reach."
)


def _conduit_choices(schema: dict[str, Any]) -> None:
    title_choices(schema, CONDUIT_CHOICES, CONDUIT_DEFAULT_TITLE)


def _secret_choices(schema: dict[str, Any]) -> None:
    title_choices(schema, {"Secret": "Secret block"}, "None")


def _sandbox_choices(schema: dict[str, Any]) -> None:
    title_choices(schema, {"SandboxBlock": "Resoluto Sandbox block"}, "None")


def _direct_credential(upstream: Upstream) -> dict[str, str]:
    """The worker's own credential as the sandbox's (the benchmark's direct baseline only)."""
    if upstream.auth_string:
        return {"PREFECT_API_AUTH_STRING": upstream.auth_string}
    if upstream.api_key:
        return {"PREFECT_API_KEY": upstream.api_key}
    return {}


_SETTINGS = setting_fields(
    Surface.POOL, {"conduit": SurfaceType(Optional[ConduitBlock], schema=_conduit_choices)}
)
#: The pool form's defaults: where a sandbox block is chosen, its own value wins over these.
POOL_DEFAULTS: dict[str, Any] = {
    name: info.default
    for name, (_, info) in _SETTINGS.items()
    if info.default not in (None, PydanticUndefined)
}
#: The worker's own variables (not sandbox settings).
_WORKER_FIELDS: dict[str, tuple[Any, Any]] = {
    "secret_env_block": (
        Optional[_SecretBlock],
        Field(
            default=None,
            title="Secret environment variables (Secret block)",
            description=_SECRET_BLOCK,
            json_schema_extra=_secret_choices,
        ),
    ),
    "sandbox": (
        Optional[SandboxBlock],
        Field(default=None, title="Sandbox block", description=_SANDBOX, json_schema_extra=_sandbox_choices),
    ),
    "working_dir": (
        Optional[Path],
        Field(
            default=None,
            title="Working directory",
            description=_WORKING_DIR,
            json_schema_extra=plain_optional,
        ),
    ),
    "stream_output": (bool, Field(default=True, title="Stream output", description=_STREAM)),
    # What the run's API gateway (gateway.py) lets the flow run read besides itself:
    # allowed_blocks / allowed_variables, declared with the runner's in settings/fields.py.
    "run_overridable": (
        list[str],
        Field(
            default=list(DEFAULT_RUN_OVERRIDABLE),
            title="What a flow run may override",
            description=_RUN_OVERRIDABLE,
        ),
    ),
    "api_gateway_address": (
        Optional[str],
        Field(
            default=None,
            title="API gateway address",
            description=_GATEWAY_ADDRESS,
            json_schema_extra=plain_optional,
        ),
    ),
}
_VALIDATORS = {
    **setting_validators(Surface.POOL),
}


def _job_field(annotation: Any, info: Any) -> tuple[Any, Any]:
    """A variable's field in the job configuration: the value the template put there, unset
    (None) unless the variable's default is a container or a flag."""
    if info.default_factory is not None:
        return annotation, Field(default_factory=info.default_factory)
    if annotation is bool:
        return annotation, Field(default=info.default)
    bounds = {
        k: getattr(m, k) for m in info.metadata for k in ("gt", "ge") if getattr(m, k, None) is not None
    }
    return optional(annotation), Field(default=None, **bounds)


class _TypedJobFields:
    """The job configuration's own fields as the worker reads them: one per variable of the
    pool, in its order, each the value the template put there.

    Pydantic's fields are built from the variables (:func:`_job_field`, so the settings stay
    declared once); these annotations are what a type checker sees, and the import checks
    that they name the same fields in the same order (:func:`_check_typed`)."""

    runtime: str | None
    min_isolation: str | None
    memory: str | None
    cpus: str | None
    image: str | None
    conduit: ConduitBlock | None
    allowed_variables: list[str]
    allowed_blocks: list[str]
    egress: list[str]
    silence_window: float | None
    host_lost_after: float | None
    host_heartbeat_interval: float | None
    secret_env_block: _SecretBlock | None
    sandbox: SandboxBlock | None
    working_dir: Path | None
    stream_output: bool
    run_overridable: list[str] | None
    api_gateway_address: str | None


def _check_typed(job_fields: type[BaseJobConfiguration]) -> None:
    built = [name for name in job_fields.model_fields if name not in BaseJobConfiguration.model_fields]
    typed = list(_TypedJobFields.__annotations__)
    if built != typed:
        raise TypeError(
            f"the pool's variables make the job fields {built}, but _TypedJobFields declares {typed}: "
            "a variable added to the pool needs its typed field there"
        )


if TYPE_CHECKING:
    _VariableFields = BaseVariables

    class _JobFields(BaseJobConfiguration, _TypedJobFields): ...

else:
    _VariableFields = model(
        "_VariableFields", BaseVariables, {**_SETTINGS, **_WORKER_FIELDS}, _VALIDATORS, __name__
    )
    _JobFields = model(
        "_JobFields",
        BaseJobConfiguration,
        {name: _job_field(*spec) for name, spec in {**_SETTINGS, **_WORKER_FIELDS}.items()},
        _VALIDATORS,
        __name__,
    )
    _check_typed(_JobFields)


class ResolutoWorkerVariables(_VariableFields):
    """Each flow run of this pool runs in its own fresh sandbox that reaches the Prefect API and
    nothing else. Secrets go in a Secret block, never in these fields: a pool's values are
    stored and shown in clear."""

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        schema = super().model_json_schema(*args, **kwargs)
        # Prefect's server validates a block field as oneOf(the block inline, {"$ref": <its id>}).
        # Every field of the sandbox block is optional, so a reference (what the UI stores for a
        # chosen block) matched both and every deployment naming a saved block was refused: an
        # inline block is one without the "$ref" key.
        block = (schema.get("definitions") or {}).get("SandboxBlock")
        if isinstance(block, dict):
            block["not"] = {"required": ["$ref"]}
        return schema


class ResolutoJobConfiguration(_JobFields):
    """One flow run's sandbox, as the worker receives it (template + job variables)."""

    _command_configured: bool = PrivateAttr(default=False)
    _pull_steps: list[dict[str, Any]] = PrivateAttr(default_factory=list)
    _deployment_path: Optional[str] = PrivateAttr(default=None)
    # The pool's floor, set when the worker resolves a run (nothing known: no floor of its own).
    _isolation_floor: IsolationLevel = PrivateAttr(default=IsolationLevel.NONE)

    @classmethod
    async def resolve_for_flow_run(
        cls,
        flow_run: FlowRun,
        *,
        client: PrefectClient,
        work_pool: WorkPool,
        worker_name: str,
        worker_id: uuid.UUID | None = None,
        deployment: DeploymentResponse | None = None,
    ) -> ResolutoJobConfiguration:
        # Judged before the base worker reads anything or resolves a template with the
        # worker's credential: a refusal is the run's Crashed state, and nothing is launched.
        admit_flow_run(flow_run, work_pool)
        if deployment is None and flow_run.deployment_id is not None:
            deployment = await client.read_deployment(flow_run.deployment_id)
        check_deployment_floor(deployment, work_pool)
        configuration = await super().resolve_for_flow_run(
            flow_run,
            client=client,
            work_pool=work_pool,
            worker_name=worker_name,
            worker_id=worker_id,
            deployment=deployment,
        )
        configuration._isolation_floor = pool_floor(work_pool)
        return configuration

    def prepare_for_flow_run(
        self,
        flow_run: FlowRun,
        deployment: DeploymentResponse | None = None,
        flow: APIFlow | None = None,
        work_pool: WorkPool | None = None,
        worker_name: str | None = None,
        worker_id: uuid.UUID | None = None,
    ) -> None:
        # As the process worker: an explicit command is kept, else Prefect's engine entry point
        # (chosen at launch, when the runtime and so the interpreter are known).
        _refuse_clear_secrets(flow_run, deployment)
        self._command_configured = self.command is not None
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id=worker_id)
        if not self._command_configured:
            self.command = None
        if deployment is not None:
            self._pull_steps = list(deployment.pull_steps or [])
            self._deployment_path = deployment.path

    def code_directories(self) -> list[str]:
        """Host directories holding the deployment's code, as its pull steps will look for it."""
        return code_directories(self._pull_steps, self._deployment_path)

    def _over_block(self, name: str) -> Any:
        """A field's value, or None where a sandbox block is chosen and the field is at the
        pool form's default: the block's own value wins over a default."""
        value = getattr(self, name)
        if self.sandbox is not None and name in POOL_DEFAULTS and value is not None:
            default = POOL_DEFAULTS[name]
            same = float(value) == default if isinstance(default, float) else str(value) == str(default)
            if same:
                return None
        return value

    def sandbox_config(self) -> SandboxConfig:
        """The sandbox block (if any) as the base, the set fields of this job on top."""
        base = self.sandbox.to_config() if self.sandbox is not None else SandboxConfig()
        if self.runtime and base.runtime and self.runtime != base.runtime:
            base = dataclasses.replace(base, runtime_options={})  # options of another runtime do not apply
        secrets = _secret_block_env(self.secret_env_block) if self.secret_env_block is not None else {}
        values = {name: self._over_block(name) for name in exposed(Surface.POOL)}
        cfg = base.replace(
            **{
                **values,
                "conduit": self.conduit.to_conduit() if self.conduit is not None else None,
                "egress": list(dict.fromkeys([*base.egress, *self.egress])),
            },
            secret_env=secrets,
            infrastructure_retries=0,  # a flow run is not idempotent: a dead sandbox is Crashed
        )
        if cfg.runtime == "container" and cfg.image:
            cfg = cfg.replace(runtime_options={"image": cfg.image})
        # A sandbox block's floor counts too: nothing below the pool's.
        check_floor(cfg.min_isolation, self._isolation_floor, "the flow run's sandbox")
        return cfg


def _refuse_clear_secrets(flow_run: FlowRun, deployment: DeploymentResponse | None) -> None:
    """``secret_env`` was a job variable once; its values sat in clear in the pool, the
    deployment and the run. Say where secrets go now rather than run without them."""
    for where, variables in (
        ("flow run", flow_run.job_variables),
        ("deployment", deployment.job_variables if deployment is not None else None),
    ):
        if variables and "secret_env" in variables:
            raise ValueError(
                f"the {where}'s job variables set secret_env, which a resoluto pool no longer takes "
                "(job variables are stored and shown in clear): put the values in a Secret block "
                "holding {NAME: value} and set secret_env_block to it"
            )


def _secret_block_env(block: Secret[Any]) -> dict[str, str]:
    value = block.get()
    if not isinstance(value, dict):
        raise ValueError(
            "the secret environment block must hold a JSON object {NAME: value}, "
            f"not a {type(value).__name__}"
        )
    return {str(k): str(v) for k, v in value.items()}


class ResolutoWorkerResult(BaseWorkerResult):
    """The sandbox's exit, as the flow run's infrastructure result."""


# --------------------------------------------------------------------------- the worker


class _Live:
    """A flow run's sandbox while it runs: how to stop it from the event loop."""

    def __init__(self, flow_run: FlowRun) -> None:
        self.flow_run = flow_run
        self.cancel = threading.Event()
        self.why = ""
        self.outcome: asyncio.Future[NodeOutcome] | None = None

    def stop(self, why: str) -> None:
        if not self.cancel.is_set():
            self.why = why
            self.cancel.set()


class ResolutoWorker(BaseWorker[ResolutoJobConfiguration, ResolutoWorkerVariables, ResolutoWorkerResult]):
    type = "resoluto"
    job_configuration = ResolutoJobConfiguration
    job_configuration_variables = ResolutoWorkerVariables

    _description = (
        "Run each flow run in its own fresh sandbox (gVisor, a Kata microVM, a Kubernetes pod) that "
        "reaches the Prefect API and nothing else (prefect-resoluto)."
    )
    _display_name = "Resoluto Sandbox"
    _documentation_url = "https://github.com/prefect-resoluto/prefect-resoluto/blob/main/docs/worker.md"
    _logo_url = "https://raw.githubusercontent.com/PrefectHQ/prefect/420d0d6a78bb6df1fc18bcf188fdad43c1d22ea9/assets/block-logos/process.png"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Every sandbox of this worker process carries this label: its exit sweeps by it.
        self._instance = uuid.uuid4().hex[:16]
        self._live: dict[str, _Live] = {}
        self._runtimes: dict[str, SandboxRuntime] = {}  # one per runtime name: what the exit sweeps
        self._snapshots = FlowRunSnapshots({LABEL_WORKER_INSTANCE: self._instance})

    async def run(
        self,
        flow_run: FlowRun,
        configuration: ResolutoJobConfiguration,
        # BaseWorker says TaskStatus[int] (a process id) but stores str(value): ours is a sandbox id.
        task_status: anyio.abc.TaskStatus[str] | None = None,  # type: ignore[override]
    ) -> ResolutoWorkerResult:
        if task_status is None:
            task_status = anyio.TASK_STATUS_IGNORED
        logger = self.get_flow_run_logger(flow_run)
        plan = await anyio.to_thread.run_sync(self._plan, flow_run, configuration)
        try:
            if plan.gateway is not None:
                logger.info(gateway_summary(plan.gateway))
            else:
                logger.warning(
                    "%s is set on this worker: this flow run holds the worker's own API credential "
                    "(the forward of before the gateway, for benchmarks only)",
                    DIRECT_API_ENV,
                )
            return await self._run_planned(flow_run, configuration, task_status, logger, plan)
        finally:
            if plan.gateway is not None:
                with anyio.CancelScope(shield=True):
                    # its listener and token die with the run
                    await anyio.to_thread.run_sync(plan.gateway.close)

    async def _run_planned(
        self,
        flow_run: FlowRun,
        configuration: ResolutoJobConfiguration,
        task_status: anyio.abc.TaskStatus[str],
        logger: Any,
        plan: FlowRunPlan,
    ) -> ResolutoWorkerResult:
        fr_id = str(flow_run.id)
        live = self._live[fr_id] = _Live(flow_run)
        loop = asyncio.get_running_loop()
        launched = asyncio.Event()
        observer = FlowRunObserver(
            flow_run_name=str(flow_run.name),
            where=f"conduit {plan.conduit.url} "
            f"{wire.node_prefix(plan.spec.run_id, plan.spec.node_id, base=plan.conduit.base_prefix)}",
            runtime=plan.runtime,
            logger=logger,
            worker_logger=self._logger,
            on_launched=lambda: loop.call_soon_threadsafe(launched.set),
            cancel=live.cancel,
            echo=_stream if configuration.stream_output else None,
        )

        def run_node() -> NodeOutcome:
            try:
                warm, how = self._snapshots.take(plan.spec, plan.runtime, plan.conduit)
                if how:
                    logger.info("flow run sandbox: %s", how)
                return drive(plan.spec, plan.conduit, plan.runtime, observer, warm=warm)
            finally:
                plan.conduit.close()

        outcome_future = live.outcome = _in_own_thread(loop, run_node, name=f"resoluto-flow-run-{fr_id}")
        try:
            try:
                outcome = await self._until_done(
                    outcome_future, launched, flow_run, live, task_status, f"{plan.runtime.name}:{fr_id}"
                )
            except Exception:
                raise  # refused before launch (spec, isolation, egress): the base worker reports it
            except BaseException:
                await self._stop_with_worker(flow_run, live, outcome_future)
                raise
        finally:
            self._live.pop(fr_id, None)

        if not observer.handle_ids:  # never started: the base worker reports the run Crashed with this
            raise RuntimeError(f"the sandbox could not start: {outcome.reason}")
        return await self._report(
            flow_run, outcome, live, list(observer.evidence), logger, plan.config.memory
        )

    async def _stop_with_worker(
        self, flow_run: FlowRun, live: _Live, outcome_future: asyncio.Future[NodeOutcome]
    ) -> None:
        """The worker is stopping (or this task was cancelled): the sandbox goes with it,
        unless the run is already over and only flushing its last logs."""
        with anyio.CancelScope(shield=True):
            if await self._run_is_final(flow_run):
                await asyncio.wait({outcome_future}, timeout=FINISHING_GRACE_SECONDS)
            live.stop(WORKER_STOPPED)
            with contextlib.suppress(Exception):
                outcome = await outcome_future
                if not outcome.ok:
                    await self._propose_crashed_state(flow_run, _stopped_message(outcome))

    async def _until_done(
        self,
        outcome_future: asyncio.Future[NodeOutcome],
        launched: asyncio.Event,
        flow_run: FlowRun,
        live: _Live,
        task_status: anyio.abc.TaskStatus[str],
        infrastructure_pid: str,
    ) -> NodeOutcome:
        """Report the start, then watch the run's state until the sandbox is done."""
        started = False
        while not outcome_future.done():
            if not started and launched.is_set():
                task_status.started(infrastructure_pid)
                started = True
            waiter = asyncio.ensure_future(launched.wait()) if not started else None
            pending = {outcome_future} | ({waiter} if waiter else set())
            await asyncio.wait(
                pending, timeout=CANCEL_POLL_SECONDS if started else None, return_when=asyncio.FIRST_COMPLETED
            )
            if waiter is not None and not waiter.done():
                waiter.cancel()
            if started and not outcome_future.done():
                await self._check_cancelled(flow_run, live)
        if not started and launched.is_set():
            task_status.started(infrastructure_pid)
        return outcome_future.result()

    async def _run_is_final(self, flow_run: FlowRun) -> bool:
        try:
            current = await self.client.read_flow_run(flow_run.id)
        except Exception:
            return False
        return current.state is not None and current.state.is_final()

    async def _check_cancelled(self, flow_run: FlowRun, live: _Live) -> None:
        from prefect.exceptions import ObjectNotFound

        try:
            current = await self.client.read_flow_run(flow_run.id)
        except ObjectNotFound:
            live.stop(DELETED)  # nothing is left to report to
            return
        except Exception as e:  # the API is briefly away: the sandbox keeps running
            self._logger.debug("could not read the state of flow run %s: %s", flow_run.id, e)
            return
        state = current.state
        if state is not None and (state.is_cancelling() or state.is_cancelled()):
            live.stop(CANCELLED)

    async def _report(
        self,
        flow_run: FlowRun,
        outcome: NodeOutcome,
        live: _Live,
        evidence: list[str],
        logger: Any,
        memory: str | None,
    ) -> ResolutoWorkerResult:
        ident = f"{outcome.runtime}:{outcome.sandbox_id}"
        if live.why == DELETED:
            self._logger.info(
                "flow run %s was deleted; its sandbox %s was destroyed", flow_run.id, outcome.sandbox_id
            )
            return ResolutoWorkerResult(status_code=0, identifier=ident)
        if live.why == WORKER_STOPPED and not outcome.ok:
            await self._propose_crashed_state(flow_run, _stopped_message(outcome))
            return ResolutoWorkerResult(status_code=outcome.exit_code or -1, identifier=ident)
        if live.why == CANCELLED:
            from prefect.states import Cancelled

            msg = f"Flow run cancelled; its sandbox {outcome.sandbox_id} on {outcome.runtime} was destroyed."
            await self.client.set_flow_run_state(flow_run.id, Cancelled(message=msg), force=True)
            logger.info(msg)
            return ResolutoWorkerResult(status_code=0, identifier=ident)
        if outcome.ok or outcome.failure == "workload":
            await self._report_workload(flow_run, outcome, evidence, logger, memory)
            return ResolutoWorkerResult(status_code=outcome.exit_code or 0, identifier=ident)
        await self._report_sandbox_failure(flow_run, outcome, evidence, logger)
        code = outcome.exit_code or -1  # None (no exit seen) or 0 from a failed sandbox: -1
        return ResolutoWorkerResult(status_code=code, identifier=ident)

    async def _report_workload(
        self, flow_run: FlowRun, outcome: NodeOutcome, evidence: list[str], logger: Any, memory: str | None
    ) -> None:
        """The flow run itself ran (and its engine reported, unless it died first)."""
        if outcome.ok:
            return
        if evidence:
            logger.info(
                "sandbox output (last %d lines, from the conduit %s %s):\n%s",
                len(evidence),
                outcome.conduit_url,
                outcome.conduit_prefix,
                "\n".join(evidence),
            )
        if not await self._run_is_final(flow_run):
            # The engine died before it could report (killed, out of memory, a crash at
            # import): say what the sandbox saw, before the base worker's generic message.
            await self._propose_crashed_state(flow_run, _died_message(outcome, memory))

    async def _report_sandbox_failure(
        self, flow_run: FlowRun, outcome: NodeOutcome, evidence: list[str], logger: Any
    ) -> None:
        """The sandbox itself failed: killed, OOM, lost, unstartable. Say so with its reason
        before the base worker's generic non-zero exit message can."""
        logger.error(
            "sandbox %s on %s (%s): %s\nsandbox output (last %d lines, from the conduit %s %s):\n%s",
            outcome.sandbox_id,
            outcome.runtime,
            outcome.isolation,
            outcome.failure,
            len(evidence),
            outcome.conduit_url,
            outcome.conduit_prefix,
            "\n".join(evidence) or "(none)",
        )
        await self._propose_crashed_state(
            flow_run,
            f"Sandbox {outcome.sandbox_id} on {outcome.runtime} "
            f"{outcome.failure.crash_how if outcome.failure else 'failed'}: "
            f"{outcome.reason}",
        )

    def _plan(self, flow_run: FlowRun, configuration: ResolutoJobConfiguration) -> FlowRunPlan:
        """Everything decided before launch (may raise: the base worker marks the run Crashed)."""
        cfg = configuration.sandbox_config()
        runtime = cfg.build_runtime()  # which runtime, and whether it can run here
        mounted = with_code_mounts(cfg, runtime.name, configuration.code_directories())
        if mounted.runtime_options != cfg.runtime_options:
            cfg = mounted.replace(runtime=runtime.name)
            runtime = cfg.build_runtime()
        env, secret_env = split_env(dict(configuration.env), cfg.secret_env)
        env = {**cfg.env, **env}
        gateway: ApiGateway | None = None
        if os.environ.get(DIRECT_API_ENV) == "1":
            # The benchmark's baseline: the sandbox dials the API itself with the worker's own
            # credential, as before the gateway. Never for flows you do not trust.
            upstream = Upstream.from_settings()
            api_url, credential = upstream.api_url, _direct_credential(upstream)
        else:
            gateway = self._gateway(flow_run, configuration, remote=not runtime.capabilities.host_loopback)
            api_url, credential = gateway.sandbox_url(), gateway_env(gateway.token)
        try:
            net = sandbox_network(runtime, api_url, cfg.egress)
            env.update(net.env)
            env.update({k: v for k, v in ui_env().items() if k not in env})  # the job's own wins
            secret_env.update(credential)
            if gateway is not None:
                gateway.start()
            spec, conduit = self._spec(flow_run, configuration, cfg, runtime, env, secret_env, net)
        except BaseException:
            if gateway is not None:
                gateway.close()
            raise
        self._runtimes[runtime.name] = runtime
        return FlowRunPlan(spec=spec, runtime=runtime, conduit=conduit, config=cfg, gateway=gateway)

    def _gateway(
        self, flow_run: FlowRun, configuration: ResolutoJobConfiguration, *, remote: bool
    ) -> ApiGateway:
        """The run's API gateway, bound (not yet serving): the worker's credential stays in it.
        On loopback for local sandboxes (the egress proxy forwards to it); on
        ``api_gateway_address`` for a sandbox on another machine."""
        pool = self.work_pool
        rules = RunRules(
            flow_run_id=str(flow_run.id),
            deployment_id=_str_or_none(flow_run.deployment_id),
            flow_id=_str_or_none(flow_run.flow_id),
            work_queue_id=_str_or_none(flow_run.work_queue_id),
            work_pool_name=pool.name if pool is not None else None,
            work_pool_id=_str_or_none(pool.id) if pool is not None else None,
            allowed_blocks=frozenset(configuration.allowed_blocks or ()),
            allowed_variables=frozenset(configuration.allowed_variables or ()),
        )
        address = configuration.api_gateway_address or os.environ.get(GATEWAY_ADDRESS_ENV) or None
        host = (address if remote else None) or "127.0.0.1"
        return ApiGateway(str(flow_run.id), Upstream.from_settings(), rules, host=host)

    def _spec(
        self,
        flow_run: FlowRun,
        configuration: ResolutoJobConfiguration,
        cfg: SandboxConfig,
        runtime: SandboxRuntime,
        env: dict[str, str],
        secret_env: dict[str, str],
        net: SandboxNetwork,
    ) -> tuple[NodeSpec, Conduit]:
        labels = {
            LABEL_FLOW_RUN: label_value(str(flow_run.id)),
            LABEL_WORKER: label_value(self.name),
            LABEL_WORKER_INSTANCE: self._instance,
            LABEL_WORK_POOL: label_value(self.work_pool.name),
        }
        extra: dict[str, Any] = {"egress_forward": net.egress_forward} if net.egress_forward else {}
        spec = NodeSpec(
            run_id=str(flow_run.id),
            node_id=new_node_id(),
            argv=engine_argv(configuration.command, runtime, cfg.image),
            workspace=configuration.working_dir,
            env=env,
            secret_env=secret_env,
            resources=cfg.resources,
            labels=labels,
            egress=net.egress,
            image=cfg.image,
            min_isolation=cfg.min_isolation,
            silence_window=cfg.silence_window,
            host_lost_after=cfg.host_lost_after,
            host_heartbeat_interval=cfg.host_heartbeat_interval,
            **extra,
        )
        spec.validate()
        conduit = cfg.build_conduit()  # last: nothing above may leave it open
        try:
            cfg.check_conduit_fits(runtime, conduit)
            check_pod_rules(runtime, spec, conduit)
        except Exception:
            conduit.close()
            raise
        return spec, conduit

    async def kill_infrastructure(
        self, infrastructure_pid: str, configuration: ResolutoJobConfiguration, grace_seconds: int = 30
    ) -> None:
        """Destroy the flow run's sandbox (``<runtime>:<flow run id>``), in this worker or not."""
        from prefect.exceptions import InfrastructureNotFound

        runtime_name, _, fr_id = infrastructure_pid.partition(":")
        live = self._live.get(fr_id)
        if live is not None:
            live.stop(CANCELLED)
            return
        configuration._isolation_floor = (
            IsolationLevel.NONE
        )  # destroying needs no floor: only the runtime's name
        cfg = configuration.sandbox_config().replace(runtime=runtime_name)
        runtime = await anyio.to_thread.run_sync(cfg.build_runtime)
        n = await anyio.to_thread.run_sync(runtime.sweep, {LABEL_RUN: fr_id})
        if not n:
            raise InfrastructureNotFound(f"no sandbox of flow run {fr_id} on {runtime_name}")

    async def teardown(self, *exc_info: Any) -> None:
        with anyio.CancelScope(shield=True):
            await self._let_finished_runs_exit()
        for live in list(self._live.values()):
            live.stop(WORKER_STOPPED)
        try:
            await super().teardown(*exc_info)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._snapshots.close)
                await anyio.to_thread.run_sync(self._sweep_own)

    async def _let_finished_runs_exit(self) -> None:
        """A run already final is only flushing: its engine sends its batched logs and runs
        its completion hooks after the final state. Destroying its sandbox now would lose
        them (a gVisor engine needs a second or two for that), so it gets a grace first."""
        finishing = [
            lv.outcome
            for lv in list(self._live.values())
            if lv.outcome is not None and not lv.outcome.done() and await self._run_is_final(lv.flow_run)
        ]
        if not finishing:
            return
        self._logger.info(
            "waiting up to %.0f s for %d finished flow run(s) to exit by themselves "
            "(their last logs and hooks) before destroying their sandboxes",
            FINISHING_GRACE_SECONDS,
            len(finishing),
        )
        await asyncio.wait(set(finishing), timeout=FINISHING_GRACE_SECONDS)

    def _sweep_own(self) -> None:
        for rt in self._runtimes.values():
            with contextlib.suppress(Exception):
                n = rt.sweep({LABEL_WORKER_INSTANCE: self._instance})
                if n:
                    self._logger.warning("reaped %d leftover sandbox(es) of this worker on %s", n, rt.name)


#: The guest's phases that run the flow run's own commands: their output is the run's to stream.
_PHASES = frozenset({"setup", "workload", "cleanup"})


def _str_or_none(v: Any) -> str | None:
    return None if v is None else str(v)


def _stream(line: str) -> None:
    # As Prefect's process worker streams its child: to the worker's own stdout, not its
    # logger (whose records may go to the API as worker logs). Lines arrive redacted.
    from prefect_resoluto.node.terminal import safe

    sys.stdout.write(safe(line) + "\n")  # the sandbox's text: no control reaches the terminal
    sys.stdout.flush()


def _died_message(outcome: NodeOutcome, memory: str | None) -> str:
    code = outcome.exit_code
    msg = (
        f"Sandbox {outcome.sandbox_id} on {outcome.runtime}: the flow run's process exited with code {code} "
        "before it reported a final state"
    )
    if code in (137, -9):
        limit = f" (memory limit {memory})" if memory else ""
        msg += f"; it was killed by SIGKILL: out of memory{limit}, or killed from outside"
    return msg + "."


def _stopped_message(outcome: NodeOutcome) -> str:
    return f"The resoluto worker stopped; sandbox {outcome.sandbox_id} on {outcome.runtime} was destroyed."


class FlowRunObserver(NodeObserver):
    """A flow run's node as the worker sees it: the launch goes to the flow run's logs (and
    wakes the worker's wait), each log line is kept as evidence for a crash report (and echoed
    with ``stream_output``), other events go to the worker's own log at DEBUG."""

    def __init__(
        self,
        *,
        flow_run_name: str,
        where: str,
        runtime: SandboxRuntime,
        logger: Any,
        worker_logger: Any,
        on_launched: Callable[[], object],
        cancel: threading.Event,
        echo: Callable[[str], None] | None,
    ) -> None:
        self.flow_run_name = flow_run_name
        self.where = where
        self.runtime = runtime
        self.logger = logger
        self.worker_logger = worker_logger
        self.on_launched = on_launched
        self.cancel = cancel
        self.echo = echo
        self.handle_ids: list[str] = []
        self.evidence: deque[str] = deque(maxlen=EVIDENCE_LINES)
        self._output = WorkloadOutput(_PHASES)

    def launched(self, handle: SandboxHandle) -> None:
        self.handle_ids.append(handle.id)
        self.logger.info(
            "sandbox %s on %s (%s isolation); its events: %s",
            handle.id,
            self.runtime.name,
            self.runtime.isolation.label,
            self.where,
        )
        self.on_launched()

    def event(self, ev: wire.SpanEvent) -> None:
        if ev.get("kind") == "heartbeat":
            return
        own = self._output.line(ev)  # the flow run's own process: what Prefect's process worker streams
        if ev.get("event") == "log":
            data = ev.get("data") or {}
            line = str(data.get("line", ""))
            level = logging.getLevelNamesMapping().get(str(data.get("level", "")).upper(), logging.INFO)
            if ev.get("kind") == "egress" and level <= logging.INFO:
                # A connection the allowlist let through (the API's, mostly): a detail, not news.
                self.worker_logger.debug("%s | %s", self.flow_run_name, line)
                return
            self.evidence.append(
                line if len(line) <= EVIDENCE_CHARS else f"{line[:EVIDENCE_CHARS]}… [{len(line)} characters]"
            )
            if own is not None:
                if self.echo is not None:
                    self.echo(own)
            else:
                # The guest runner's own diagnostics (staging, the egress canary): the worker's
                # log, dated and levelled like its other lines; its chatter at DEBUG.
                self.worker_logger.log(
                    level if level >= logging.WARNING else logging.DEBUG, "%s | %s", self.flow_run_name, line
                )
            return
        described = describe_event(ev)
        if described is not None:
            self.worker_logger.debug("%s | %s", self.flow_run_name, described[1])

    def cancelled(self) -> bool:
        return self.cancel.is_set()


def _in_own_thread(loop: asyncio.AbstractEventLoop, fn: Any, *, name: str) -> asyncio.Future[Any]:
    """``fn()`` in a thread of its own (not the loop's small default pool: every running
    flow run holds one for its whole life), as a future of ``loop``."""
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def target() -> None:
        try:
            value = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            loop.call_soon_threadsafe(settle, False, e)
        else:
            loop.call_soon_threadsafe(settle, True, value)

    threading.Thread(target=target, name=name, daemon=True).start()
    return fut
