"""Which flow runs a ``resoluto`` worker prepares at all, and what a run's own job variables may set.

The worker builds a run's sandbox from the pool and the deployment, both the operator's.
A flow run is anybody's who may create one (``run_deployment``, the UI's custom run, and
— through its gateway — a sandboxed run itself), so what it brings is judged here before
anything is templated, read with the worker's credential, or launched:

* a run without a deployment is refused: sub-flows (created by a run, through its gateway)
  and runs planted on the pool have none, and the worker would otherwise build their sandbox
  from their own job variables;
* a run's own job variables may set only the keys the pool lists in ``run_overridable``,
  never one of :data:`NEVER_FROM_A_RUN`, and never a templated value (``{{ … }}``: the
  worker resolves templates with its own credential — a Secret block the run may not read);
* the pool's ``min_isolation`` default is a floor: neither a deployment nor a run lowers it.

A refusal raises :class:`RunRefused`; Prefect's base worker marks the run Crashed with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prefect_resoluto.runtimes.base import DEFAULT_MIN_ISOLATION, IsolationLevel

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun, WorkPool
    from prefect.client.schemas.responses import DeploymentResponse

#: Keys a run's own job variables never set, whatever the pool lists: they choose the
#: isolation, what runs, where its events go, what it reaches and what it may read.
NEVER_FROM_A_RUN = frozenset(
    {
        "runtime",
        "min_isolation",
        "command",
        "conduit",
        "egress",
        "allowed_blocks",
        "allowed_variables",
        "sandbox",
        "secret_env_block",
        "secret_env",
        "working_dir",
        "image",
        "api_gateway_address",
        "run_overridable",
    }
)
#: What a pool lets a run set unless it says otherwise (``run_overridable``).
DEFAULT_RUN_OVERRIDABLE = ("env", "memory", "cpus", "silence_window")


class RunRefused(ValueError):
    """The worker will not prepare this flow run; the message says why (the run's Crashed state)."""


def _pool_default(work_pool: WorkPool, name: str) -> Any:
    props = ((work_pool.base_job_template or {}).get("variables") or {}).get("properties") or {}
    spec = props.get(name)
    return spec.get("default") if isinstance(spec, dict) else None


def pool_floor(work_pool: WorkPool) -> IsolationLevel:
    """The pool's isolation floor: its ``min_isolation`` default (the built-in one if unset)."""
    value = _pool_default(work_pool, "min_isolation")
    return IsolationLevel.parse(value) if value else DEFAULT_MIN_ISOLATION


def pool_overridable(work_pool: WorkPool) -> frozenset[str]:
    value = _pool_default(work_pool, "run_overridable")
    names = value if isinstance(value, list) else DEFAULT_RUN_OVERRIDABLE
    return frozenset(str(n) for n in names) - NEVER_FROM_A_RUN


def admit_flow_run(flow_run: FlowRun, work_pool: WorkPool) -> None:
    """Refuse a run the worker must not build a sandbox for (before anything else is read)."""
    who = f"flow run {flow_run.id} ({flow_run.name!r})"
    if flow_run.deployment_id is None:
        made_by = (
            f"created by another flow run (its parent task run {flow_run.parent_task_run_id})"
            if flow_run.parent_task_run_id is not None
            else "created without one"
        )
        raise RunRefused(
            f"the resoluto worker refuses {who}: it has no deployment ({made_by}). A resoluto pool "
            "runs only deployments' runs, whose sandbox the pool and the deployment define; nothing "
            "was launched"
        )
    run_vars = dict(flow_run.job_variables or {})
    allowed = pool_overridable(work_pool)
    keys = sorted({str(k).split(".", 1)[0] for k in run_vars})
    never = [k for k in keys if k in NEVER_FROM_A_RUN]
    if never:
        raise RunRefused(
            f"the resoluto worker refuses {who}: its own job variables set {never}, which only the "
            "pool and the deployment choose; nothing was launched"
        )
    off = [k for k in keys if k not in allowed]
    if off:
        raise RunRefused(
            f"the resoluto worker refuses {who}: its own job variables set {off}, which the pool does "
            f"not let a run override (run_overridable: {sorted(allowed)}); nothing was launched"
        )
    templated = [path for path, text in _strings(run_vars, "") if "{{" in text or "{%" in text]
    if templated:
        raise RunRefused(
            f"the resoluto worker refuses {who}: its own job variables hold templates at {templated} "
            "(the worker would resolve them with its own credential); nothing was launched"
        )


def check_deployment_floor(deployment: DeploymentResponse | None, work_pool: WorkPool) -> None:
    value = (deployment.job_variables or {}).get("min_isolation") if deployment is not None else None
    if value is None:
        return
    floor = pool_floor(work_pool)
    if IsolationLevel.parse(str(value)) < floor:
        raise RunRefused(
            f"deployment {deployment.name!r} asks min_isolation {value!r}, below the pool's floor "  # type: ignore[union-attr]
            f"{floor.label!r} (the pool's min_isolation default); lower the pool's default to run it"
        )


def check_floor(min_isolation: str | IsolationLevel | None, floor: IsolationLevel, where: str) -> None:
    """The sandbox's final floor (a sandbox block's included) is at least the pool's."""
    # IsolationLevel.NONE is falsy: only a missing value means the built-in floor.
    level = (
        DEFAULT_MIN_ISOLATION
        if min_isolation is None or min_isolation == ""
        else IsolationLevel.parse(min_isolation)
    )
    if level < floor:
        raise RunRefused(
            f"{where} asks min_isolation {level.label!r}, below the pool's floor {floor.label!r} "
            "(the pool's min_isolation default); lower the pool's default to run it"
        )


def _strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield path + "." + str(k), str(k)
            yield from _strings(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, f"{path}[{i}]")
