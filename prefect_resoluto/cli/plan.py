"""The flags of ``run`` and ``render`` turned into one validated node: spec, conduit, runtime.

Everything is checked here, before anything is put on a conduit or launched, so bad
input is always a one-line :class:`UsageError` (exit 2) and never a half-started node.
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect_resoluto.cli.common import (
    PROG,
    UsageError,
    known_runtimes,
    parse_options,
    parse_pairs,
    parse_secret_env,
    strip_dashdash,
)

if TYPE_CHECKING:
    from guest_runner.conduit import Conduit
    from guest_runner.redact import Redactor
    from prefect_resoluto.node.spec import NodeSpec
    from prefect_resoluto.runtimes.base import IsolationLevel, SandboxRuntime

LABEL_SOURCE = "resoluto.source"
DEFAULT_OUTPUTS = "resoluto-outputs"

# How a command picks its runtime from the flags: (args, --runtime-option values) -> runtime.
RuntimePicker = Callable[[argparse.Namespace, dict[str, Any]], "SandboxRuntime"]


@dataclass
class RunPlan:
    spec: NodeSpec
    conduit: Conduit
    runtime: SandboxRuntime
    floor: IsolationLevel
    silence_window: float
    redactor: Redactor
    labels: dict[str, str] = field(default_factory=dict)


def floor(value: str) -> IsolationLevel:
    from prefect_resoluto.runtimes.base import IsolationLevel

    try:
        return IsolationLevel.parse(value)
    except ValueError as e:
        raise UsageError(f"--min-isolation: {e}") from None


def instantiate(name: str, options: dict[str, Any]) -> SandboxRuntime:
    from prefect_resoluto.runtimes import RUNTIMES, get_runtime

    if name not in RUNTIMES:
        raise UsageError(f"unknown runtime {name!r}; known runtimes: {', '.join(known_runtimes())}")
    try:
        return get_runtime(name, **options)
    except TypeError as e:  # an option the runtime's constructor does not take
        raise UsageError(f"--runtime-option for {name!r}: {e}") from None
    except (ValueError, RuntimeError) as e:
        raise UsageError(f"runtime {name!r} cannot be configured: {e}") from None


def select_runtime(name: str | None, options: dict[str, Any], level: IsolationLevel) -> SandboxRuntime:
    """The named runtime (checked against the floor, then probed), or the best one here."""
    from prefect_resoluto.runtimes import best_available, why_unavailable
    from prefect_resoluto.runtimes.base import IsolationLevel, IsolationTooWeak, check_isolation

    if name:
        rt = instantiate(name, options)
        try:  # the floor first: no need to probe a runtime that would be refused anyway
            check_isolation(rt, level)
        except IsolationTooWeak as e:
            raise UsageError(str(e)) from None
        avail = rt.availability()
        if not avail.ok:
            raise UsageError(f"runtime {name!r} is unavailable here: {avail.why}")
        return rt
    try:
        found = best_available(level, **options)
    except TypeError as e:
        raise UsageError(f"--runtime-option: {e}") from None
    if found is None:
        lower = IsolationLevel(max(level - 1, IsolationLevel.NONE)).label
        raise UsageError(
            f"{why_unavailable(level, **options)} -- install gVisor (runsc) or bubblewrap, "
            f"or lower the floor explicitly with --min-isolation {lower}"
        )
    return found


def pick_local(args: argparse.Namespace, options: dict[str, Any]) -> SandboxRuntime:
    """``run``'s pick: the named runtime, or the strongest available at the floor."""
    return select_runtime(args.runtime, options, floor(args.min_isolation))


def check_flags(args: argparse.Namespace) -> None:
    """Each setting's flag checked as the setting checks its value (settings/fields.py), so the CLI
    refuses what the task runner and the forms refuse, in the flag's words."""
    from prefect_resoluto.settings.fields import SETTINGS, Flag, check_value

    for name, s in SETTINGS.items():
        flag = s.cli
        if not isinstance(flag, Flag) or flag.repeat:
            continue  # repeatable K=V flags are parsed (and refused) one by one below
        value = getattr(args, flag.dest, None)
        try:
            check_value(name, value)
        except ValueError as e:
            msg = str(e)
            raise UsageError(
                flag.flag + msg[len(name) :] if msg.startswith(name + " ") else f"{flag.flag}: {msg}"
            ) from None


def takes_image(runtime: SandboxRuntime) -> bool:
    return runtime.capabilities.takes_image


def plan_node(args: argparse.Namespace, pick: RuntimePicker = pick_local, *, fresh: bool = True) -> RunPlan:
    """Validate everything ``run``/``render`` were given; raise UsageError on bad input.

    ``fresh``: refuse a node id that already has objects in the conduit (``run``; a
    ``render`` puts nothing there).
    """
    from guest_runner.redact import Redactor
    from prefect_resoluto.runtimes.base import parse_quantity

    argv = _command(args)
    env = parse_pairs(args.env, "--env")
    secret_env = parse_secret_env(args.secret_env)
    labels = parse_pairs(args.label, "--label")
    options = parse_options(args.runtime_option)
    check_flags(args)
    level = floor(args.min_isolation)
    output_limit = parse_quantity(args.output_limit) if args.output_limit else None
    workspace = _workspace(args)
    outputs = _output_patterns(args)
    run_id, node_id = _ids(args)
    outputs_dir = Path(args.outputs_dir).expanduser() if args.outputs_dir else Path(DEFAULT_OUTPUTS) / node_id
    outputs_dir = outputs_dir.absolute()  # relative to the cwd the user ran us in
    conduit = _conduit(args)
    runtime = _runtime(args, pick, options, conduit)
    spec = _node_spec(
        args,
        _NodeInputs(
            run_id, node_id, argv, workspace, outputs, env, secret_env, labels, outputs_dir, output_limit
        ),
        level,
    )
    _check_spec(spec, runtime)
    if fresh:
        _check_fresh(conduit, run_id, node_id)
    return RunPlan(
        spec=spec,
        conduit=conduit,
        runtime=runtime,
        floor=level,
        silence_window=spec.silence_window,
        redactor=Redactor(secret_env.values()),
        labels=labels,
    )


def _command(args: argparse.Namespace) -> list[str]:
    argv = strip_dashdash(args.argv)
    if not argv or not argv[0]:
        raise UsageError(f"no command given: put it after '--', e.g. {PROG} run -- python3 -c 'print(1)'")
    return argv


def _workspace(args: argparse.Namespace) -> Path | None:
    if args.workspace is None:
        return None
    workspace = Path(args.workspace).expanduser()
    if not workspace.exists():
        raise UsageError(f"workspace directory {str(workspace)!r} does not exist")
    if not workspace.is_dir():
        raise UsageError(f"workspace {str(workspace)!r} is not a directory")
    return workspace.resolve()


def _output_patterns(args: argparse.Namespace) -> list[str]:
    from guest_runner import archive

    outputs = list(args.output or [])
    for pattern in outputs:
        try:
            archive.check_pattern(pattern)
        except ValueError as e:
            raise UsageError(f"--output: {e}") from None
    return outputs


def _ids(args: argparse.Namespace) -> tuple[str, str]:
    from guest_runner import wire

    run_id = args.run_id or uuid.uuid4().hex
    node_id = args.node_id or f"cli-{uuid.uuid4().hex[:12]}"
    for value, what in ((run_id, "--run-id"), (node_id, "--node-id")):
        try:
            wire.check_id(value, what)
        except ValueError as e:
            raise UsageError(str(e)) from None
    return run_id, node_id


def _conduit(args: argparse.Namespace) -> Conduit:
    from guest_runner.conduit import ConduitError
    from guest_runner.conduit.registry import conduit_from_url
    from prefect_resoluto.settings.config import default_conduit_url

    url = args.conduit or default_conduit_url()
    try:
        return conduit_from_url(url)
    except (ValueError, ImportError, ConduitError) as e:
        raise UsageError(f"--conduit: {e}") from None


def _runtime(
    args: argparse.Namespace, pick: RuntimePicker, options: dict[str, Any], conduit: Conduit
) -> SandboxRuntime:
    """The picked runtime, refused when the conduit or ``--image`` does not fit it."""
    from prefect_resoluto.settings.config import check_conduit_fits, check_store_reachable

    runtime = pick(args, options)
    try:
        check_conduit_fits(runtime, conduit)
        check_store_reachable(runtime, conduit)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.image and not takes_image(runtime):
        raise UsageError(
            f"runtime {runtime.name!r} does not run images (it uses the host's /usr); "
            "--image applies to the container and kubernetes runtimes"
        )
    return runtime


@dataclass(frozen=True)
class _NodeInputs:
    """What :func:`plan_node` parsed and checked before the spec is built."""

    run_id: str
    node_id: str
    argv: list[str]
    workspace: Path | None
    outputs: list[str]
    env: dict[str, str]
    secret_env: dict[str, str]
    labels: dict[str, str]
    outputs_dir: Path
    output_limit: int | None


def _node_spec(args: argparse.Namespace, i: _NodeInputs, level: IsolationLevel) -> NodeSpec:
    from prefect_resoluto.node import heartbeat
    from prefect_resoluto.node.spec import NodeSpec
    from prefect_resoluto.node.tail import DEFAULT_SILENCE_WINDOW
    from prefect_resoluto.runtimes.base import Resources

    return NodeSpec(
        run_id=i.run_id,
        node_id=i.node_id,
        argv=i.argv,
        workspace=i.workspace,
        output_paths=i.outputs,
        env=i.env,
        secret_env=i.secret_env,
        resources=Resources.from_quantities(
            memory=args.memory, cpus=args.cpus, disk=args.disk, pids=args.pids
        ),
        labels={**i.labels, LABEL_SOURCE: "cli"},
        image=args.image,
        outputs_dir=i.outputs_dir,
        egress=list(args.egress or []),
        egress_resolve=parse_pairs(args.egress_resolve, "--egress-resolve"),
        setup_egress=list(args.setup_egress) if args.setup_egress is not None else None,
        setup_argv=["sh", "-c", args.setup] if args.setup else None,
        output_limit=i.output_limit,
        min_isolation=level,
        silence_window=args.silence_window or DEFAULT_SILENCE_WINDOW,
        host_lost_after=heartbeat.DEFAULT_LOST_AFTER
        if args.host_lost_after is None
        else args.host_lost_after,
        host_heartbeat_interval=args.host_heartbeat_interval or heartbeat.DEFAULT_INTERVAL,
    )


def _check_spec(spec: NodeSpec, runtime: SandboxRuntime) -> None:
    try:
        spec.validate()
        if runtime.capabilities.egress_by_name:
            spec.network_request()
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None


def _check_fresh(conduit: Conduit, run_id: str, node_id: str) -> None:
    """Conduit objects are immutable evidence: never run a second node into the same place."""
    from guest_runner import wire
    from guest_runner.conduit import ConduitError

    try:
        taken = conduit.list_prefix(wire.node_prefix(run_id, node_id) + "/")
    except ConduitError as e:
        raise UsageError(f"conduit {conduit.url} is not usable: {e}") from None
    if taken:
        raise UsageError(
            f"node {node_id!r} of run {run_id!r} already has objects in {conduit.url}; "
            "pick another --node-id (or --run-id)"
        )
