"""Every sandbox setting, declared once: :class:`SandboxSettings`.

Each field of :class:`SandboxSettings` is one setting: its name, type and default are the
field's; its title, description, validation and the surfaces that expose it are the
field's :class:`Setting` (``setting(...)``). Every surface is derived from this one class:

- ``ResolutoTaskRunner(...)`` keywords and ``sandbox_options(...)`` (task_runner/runner.py),
- the Resoluto Sandbox block's fields (blocks.py, through settings/forms.py),
- a ``resoluto`` work pool's variables and job configuration (worker.py, the same way),
- the flags of ``prefect-resoluto run`` / ``render`` (cli/__init__.py, checked in cli/plan.py).

A surface that leaves a setting out says why here, in the setting's declaration
(:class:`Omitted`); ``tests/test_settings.py`` fails when a surface and this class disagree.

Nothing here imports Prefect or pydantic (the CLI builds its parser from this module).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Self

from guest_runner import redact
from prefect_resoluto.node import heartbeat
from prefect_resoluto.node.tail import DEFAULT_SILENCE_WINDOW
from prefect_resoluto.runtimes import RUNTIMES
from prefect_resoluto.runtimes.base import (
    DEFAULT_CPUS,
    DEFAULT_MEMORY,
    DEFAULT_MIN_ISOLATION,
    DEFAULT_PIDS,
    IsolationLevel,
    Resources,
    parse_cpus,
    parse_quantity,
)

if TYPE_CHECKING:
    from guest_runner.conduit import Conduit
    from prefect_resoluto.runtimes.base import SandboxRuntime


class Surface(enum.Enum):
    RUNNER = "ResolutoTaskRunner keyword and sandbox_options()"
    BLOCK = "Resoluto Sandbox block field"
    POOL = "resoluto work pool variable"
    CLI = "prefect-resoluto run/render flag"


@dataclass(frozen=True)
class Omitted:
    """A surface that deliberately does not expose a setting, and why."""

    why: str


#: A form's default that is the setting's own.
OWN = "<the setting's own>"


@dataclass(frozen=True)
class Form:
    """How a Prefect form (the sandbox block, the pool's variables) shows a setting.

    ``type``: the field's annotation (a typing form); None: the setting's own; a string:
    a type the surface supplies by that name (a Prefect or pydantic type, which this
    module does not import), with its default factory."""

    type: Any = None
    default: Any = OWN
    title: str | None = None  # None: the setting's
    description: str | None = None  # None: the setting's
    examples: list[Any] | None = None
    gt: float | None = None
    ge: float | None = None
    #: The field validates with the setting's ``check`` (an empty string reads as unset).
    check: bool = False
    #: The field normalises with the setting's ``normalize`` before its type is checked.
    normalize: bool = False
    #: An empty value ("" or []) means "unset" (None) in the settings the form produces.
    blank_is_unset: bool = False


@dataclass(frozen=True)
class Flag:
    """A flag of ``prefect-resoluto run`` and ``render``. The flag's own value arrives as
    ``args.<dest>`` (argparse's name for it); scalar flags are checked with the setting's
    ``check`` by cli/plan.py, repeatable ``K=V`` ones are parsed there."""

    flag: str
    metavar: str
    help: str
    repeat: bool = False
    type: Callable[[str], Any] = str
    default: Any = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Setting:
    """One setting's declaration beyond its name, type and default."""

    title: str
    description: str
    block: Form | Omitted
    pool: Form | Omitted
    cli: Flag | Omitted
    #: Raises ValueError (naming the setting) on a bad value; None: the type says it all.
    check: Callable[[Any], object] | None = None
    #: Turns an accepted spelling into the canonical one (e.g. an isolation level's label).
    normalize: Callable[[Any], Any] | None = None
    #: ResolutoTaskRunner(...) and sandbox_options(...) take every setting today; this is
    #: where a setting would say why they do not.
    runner: None | Omitted = None

    def exposed(self, surface: Surface) -> bool:
        where = {Surface.RUNNER: self.runner, Surface.BLOCK: self.block, Surface.POOL: self.pool}
        return not isinstance(self.cli if surface is Surface.CLI else where[surface], Omitted)


def setting(
    default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None, **info: Any
) -> Any:
    """A :class:`SandboxSettings` field: its default (or ``factory``) and its :class:`Setting`."""
    meta = {"setting": Setting(**info)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------- validation


def _check_secret_env(v: dict[str, str]) -> None:
    short = redact.too_short(v)
    if short:  # refused at the flow's start, not when a task is already running
        raise ValueError(redact.too_short_message(short))


def _check_names(v: list[str], setting_name: str) -> None:
    for name in v:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{setting_name} holds names: {name!r} is not one")


def _check_block_refs(v: list[str]) -> None:
    _check_names(v, "allowed_blocks")
    for ref in v:
        slug, _, name = ref.partition("/")
        if not slug or not name or "/" in name:
            raise ValueError(
                f"allowed_blocks: {ref!r} must be 'block-type-slug/name', e.g. 'secret/db-password'"
            )


#: log_allowance's default: a 1 000-node flow whose every node floods at once holds at most
#: ~4 GiB of their lines (task_runner/holds.py holds them to it).
LOG_ALLOWANCE_DEFAULT = "4Mi"
#: Less would keep no line of a useful length.
LOG_ALLOWANCE_MIN = 64 << 10


def _check_log_allowance(v: str) -> None:
    if parse_quantity(v) < LOG_ALLOWANCE_MIN:
        raise ValueError(f"log_allowance must be at least {LOG_ALLOWANCE_MIN} bytes, got {v!r}")


def _check_pids(v: int | None) -> None:
    Resources.from_quantities(pids=v)


def _check_retries(v: int) -> None:
    if v < 0:
        raise ValueError("infrastructure_retries must be >= 0")


def _check_warm_pool(v: int | None) -> None:
    if v is not None and (isinstance(v, bool) or int(v) < 0):
        raise ValueError("warm_pool must be a number of sandboxes >= 0 (0 disables the pool)")


def _check_silence(v: float) -> None:
    if not v > 0:  # NaN too
        raise ValueError("silence_window must be positive (seconds)")


def _check_beat_interval(v: float) -> None:
    if not v > 0:
        raise ValueError("host_heartbeat_interval must be positive (seconds)")


def _check_lost_after(v: float) -> None:
    if v < 0:
        raise ValueError("host_lost_after must be 0 (no heartbeat) or positive (seconds)")


def _level_label(v: str | IsolationLevel) -> str:
    return IsolationLevel.parse(v).label


# --------------------------------------------------------------------------- shared texts

_ISOLATION_LABELS = tuple(level.label for level in sorted(IsolationLevel, reverse=True))
_RUNTIME_TEXT = (
    "Where sandboxes run: gvisor (a user-space kernel), container (podman with runsc or Kata), "
    "kubernetes (a pod, RuntimeClass kata), bubblewrap (namespaces),{solari} process (no isolation: "
    "needs minimum isolation 'none'). Empty: the strongest runtime available on the host."
)
_ALL_RUNTIMES = tuple(RUNTIMES)
#: The pool's choices, as its form lists them; every registered runtime is one of them or is
#: left out here, with the reason (tests/test_settings.py checks).
POOL_RUNTIMES = ("gvisor", "container", "kubernetes", "bubblewrap", "process")
NOT_POOL_RUNTIMES = {
    "solari": "a Solari VM has no egress setting through which a flow run could reach the Prefect API "
    "(use it from ResolutoTaskRunner, whose host talks to the API)",
}
_NOT_SHARED_PATH = "a path on the machine that starts the flow, not a value to store in a shared block"


@dataclass
class SandboxSettings:
    """The settings of a sandbox, one field each, in the order the forms show them.

    A new setting is one more field here; every surface picks it up (or, where it is
    :class:`Omitted`, says why not)."""

    runtime: str | SandboxRuntime | None = setting(
        None,
        title="Runtime",
        description=_RUNTIME_TEXT.format(solari=""),
        block=Form(
            type=Optional[Literal[_ALL_RUNTIMES]],  # noqa: UP045 - a pydantic annotation
            description=_RUNTIME_TEXT.format(solari=" solari (a hosted micro-VM),"),
            blank_is_unset=True,
        ),
        pool=Form(
            type=Optional[Literal[POOL_RUNTIMES]],  # noqa: UP045 - a pydantic annotation
            description=_RUNTIME_TEXT.format(solari="")
            + f" Solari is not offered here: {NOT_POOL_RUNTIMES['solari']}.",
        ),
        cli=Flag(
            "--runtime",
            "NAME",
            "sandbox runtime (default: the strongest available at or above --min-isolation; see `doctor`)",
        ),
    )
    runtime_options: dict[str, Any] = setting(
        factory=dict,
        title="Runtime options",
        description="Options of the runtime's constructor, e.g. {'oci_runtime': 'kata'}.",
        block=Omitted(
            "shown as one field per option of the runtimes that have any (kube_*, solari_*: blocks.py)"
        ),
        pool=Omitted("a pool picks the runtime; its options come with a sandbox block"),
        cli=Flag(
            "--runtime-option",
            "K=V",
            "runtime constructor option, e.g. oci_runtime=kata (V parsed as JSON if it can be)",
            repeat=True,
        ),
    )
    min_isolation: IsolationLevel | str = setting(
        DEFAULT_MIN_ISOLATION,
        title="Minimum isolation",
        description=(
            "Refuse a runtime weaker than this: vm, user-kernel, namespace or none ('none' is for "
            f"trusted code only). Default: {DEFAULT_MIN_ISOLATION.label}."
        ),
        check=IsolationLevel.parse,
        normalize=_level_label,
        block=Form(type=Literal[_ISOLATION_LABELS], default=DEFAULT_MIN_ISOLATION.label, normalize=True),
        pool=Form(type=Literal[_ISOLATION_LABELS], default=DEFAULT_MIN_ISOLATION.label),
        cli=Flag(
            "--min-isolation",
            "LEVEL",
            "refuse runtimes weaker than this: vm, user-kernel (default), namespace, none",
            default=DEFAULT_MIN_ISOLATION.label,
        ),
    )
    memory: str | None = setting(
        None,  # None: DEFAULT_MEMORY
        title="Memory",
        description=f"Memory limit per sandbox, e.g. 512Mi or 8Gi. Default: {DEFAULT_MEMORY}.",
        check=parse_quantity,
        block=Form(examples=[DEFAULT_MEMORY], blank_is_unset=True),
        pool=Form(type=str, default=DEFAULT_MEMORY, check=True),
        cli=Flag("--memory", "QTY", "memory limit, e.g. 512Mi or 2G"),
    )
    cpus: str | float | None = setting(
        None,  # None: DEFAULT_CPUS
        title="CPUs",
        description=f"CPU limit per sandbox, e.g. 1, 0.5 or 500m. Default: {DEFAULT_CPUS:g}.",
        check=parse_cpus,
        block=Form(type=Optional[str], examples=[f"{DEFAULT_CPUS:g}"], blank_is_unset=True),  # noqa: UP045
        pool=Form(type=str, default=f"{DEFAULT_CPUS:g}", check=True),
        cli=Flag("--cpus", "N", "CPU limit, e.g. 1, 0.5 or 500m"),
    )
    disk: str | None = setting(
        None,  # None: the memory limit
        title="Disk (/tmp and /workspace)",
        description=(
            "Size of /tmp and /workspace per sandbox where the runtime can size them (ephemeral "
            "storage on Kubernetes). Empty: the memory limit; in-memory scratch counts against memory."
        ),
        check=parse_quantity,
        block=Form(examples=["1Gi"], blank_is_unset=True),
        pool=Omitted("a flow run's sandbox is sized by memory; use a sandbox block for more"),
        cli=Flag(
            "--disk",
            "QTY",
            "size of /tmp and /workspace where the runtime can size them, e.g. 1Gi (default: the memory limit)",
        ),
    )
    #: Most bytes of outputs the host takes from one node (quantity); None: what the sandbox
    #: could hold (``disk``, else ``memory``). See node.output_allowance.
    output_limit: str | None = setting(
        None,
        title="Output limit",
        description=(
            "Most bytes of output files the host takes from one sandbox, e.g. 10Gi. Empty: what the "
            "sandbox could hold (disk, else the memory limit)."
        ),
        check=parse_quantity,
        block=Form(examples=["10Gi"], blank_is_unset=True),
        pool=Omitted("a flow run returns no output files to the worker"),
        cli=Flag(
            "--output-limit",
            "QTY",
            "most bytes of --output files taken back, e.g. 10Gi (default: --disk, else the memory limit)",
        ),
    )
    #: Most bytes of one node's lines the task runner's host holds at once (quantity); see
    #: task_runner/holds.py.
    log_allowance: str = setting(
        LOG_ALLOWANCE_DEFAULT,
        title="Log allowance",
        description=(
            "Most bytes of one sandbox's log and print lines the host holds at once while they "
            "wait for the Prefect API and the console, and most of a command task's output it "
            "keeps; past it, lines are dropped and the task run's logs say how many. "
            f"Default: {LOG_ALLOWANCE_DEFAULT}."
        ),
        check=_check_log_allowance,
        block=Form(examples=[LOG_ALLOWANCE_DEFAULT]),
        pool=Omitted("a flow run sends its own logs to the API; the worker holds none of them"),
        cli=Omitted("run writes each line out as it arrives and holds none"),
    )
    pids: int | None = setting(
        DEFAULT_PIDS,
        title="Process limit",
        description=f"Most processes and threads per sandbox. Default: {DEFAULT_PIDS}.",
        check=_check_pids,
        block=Form(type=int, gt=0),
        pool=Omitted("a flow run's sandbox keeps the default; use a sandbox block to change it"),
        cli=Flag(
            "--pids",
            "N",
            f"most processes and threads in the sandbox (default {DEFAULT_PIDS})",
            type=int,
            default=DEFAULT_PIDS,
        ),
    )
    image: str | None = setting(
        None,
        title="Image",
        description=(
            "Image for the container and kubernetes runtimes; it must bring Python (and Prefect for "
            "whole flow runs). Empty: the host's interpreter, bound read-only."
        ),
        block=Form(blank_is_unset=True),
        pool=Form(),
        cli=Flag("--image", "IMG", "container image (container and kubernetes runtimes)"),
    )
    conduit: str | Conduit | None = setting(
        None,  # URL or instance; None: a local directory
        title="Conduit",
        description="Where host and sandboxes exchange work. Empty: a local directory under the user's cache.",
        block=Form(type="conduit"),
        pool=Form(type="conduit"),
        cli=Flag(
            "--conduit",
            "URL",
            "file:///dir or s3://bucket/prefix?endpoint_url=... "
            "(default: a local directory under the user's cache directory)",
        ),
    )
    workspace: Path | None = setting(
        None,
        title="Workspace",
        description="A host directory staged into each sandbox as its working directory.",
        block=Omitted(_NOT_SHARED_PATH),
        pool=Omitted(
            "the pool's working_dir (worker.py): a directory of the worker's host, as a deployment sees it"
        ),
        cli=Flag("--workspace", "DIR", "directory staged into the sandbox as its working directory"),
    )
    env: dict[str, str] = setting(
        factory=dict,
        title="Environment variables",
        description="Environment variables of every sandbox.",
        block=Form(),
        pool=Omitted("Prefect's own job variable env (BaseVariables) is the flow run's environment"),
        cli=Flag("--env", "K=V", "environment variable for the command", repeat=True),
    )
    secret_env: dict[str, str] = setting(
        factory=dict,
        title="Secret environment variables",
        description=(
            "Secret environment variables {NAME: value}: stored encrypted, shown masked, redacted "
            "from every log line, event and artifact."
        ),
        check=_check_secret_env,
        block=Form(type="secret_dict"),
        pool=Omitted(
            "a pool's values are stored and shown in clear: the pool takes a Secret block instead "
            "(secret_env_block, worker.py)"
        ),
        cli=Flag(
            "--secret-env",
            "K[=V]",
            "secret variable: redacted from all output; bare K takes the value from this environment",
            repeat=True,
        ),
    )
    allowed_variables: list[str] = setting(
        factory=list,
        title="Allowed variables",
        description=(
            "Prefect variables a sandboxed task may read (Variable.get), by name: read on the host "
            "when the task starts and handed to its sandbox with its secrets, redacted from its "
            "logs. Any other name, and every write (Variable.set), fails at once."
        ),
        check=lambda v: _check_names(v, "allowed_variables"),
        block=Form(),
        pool=Form(
            check=True,
            description="Variables the flow run may read, by name; read-only. Every other variable is "
            "refused (by the run's API gateway; in a sandboxed task, at once).",
        ),
        cli=Omitted("prefect-resoluto run runs a command, not a Prefect task: nothing reads variables"),
    )
    allowed_blocks: list[str] = setting(
        factory=list,
        title="Allowed blocks",
        description=(
            "Prefect blocks a sandboxed task may load (Secret.load(...).get(), Block.load), as "
            "'block-type-slug/name', e.g. 'secret/db-password': loaded on the host when the task "
            "starts and handed to its sandbox with its secrets, redacted from its logs. Any other "
            "block, and every write (Block.save), fails at once."
        ),
        check=_check_block_refs,
        block=Form(),
        pool=Form(
            check=True,
            description="Blocks the flow run may read, as 'block-type-slug/name' (e.g. "
            "'secret/warehouse-password'); read-only. Every other block is refused (by the run's API "
            "gateway; in a sandboxed task, at once).",
        ),
        cli=Omitted("prefect-resoluto run runs a command, not a Prefect task: nothing loads blocks"),
    )
    egress: list[str] = setting(
        factory=list,
        title="Egress allowlist",
        description=(
            "Hosts a sandbox may reach: names (api.example.com, *.example.com, host:8443) on local "
            "runtimes, CIDRs on Kubernetes. Empty: no network at all."
        ),
        block=Form(),
        pool=Form(
            description="Hosts the flow run may reach besides the Prefect API: names (host, host:port) on "
            "local runtimes, CIDRs on Kubernetes. Added to the sandbox block's; everything else is refused."
        ),
        cli=Flag(
            "--egress",
            "HOST",
            "allowlist a name the sandbox may reach (repeatable): api.example.com, "
            "*.example.com, host:8443 (default ports 443 and 80); without it: no network",
            repeat=True,
        ),
    )
    egress_resolve: dict[str, str] = setting(
        factory=dict,
        title="Egress name pins",
        description="Pin allowlisted names to addresses {HOST: IP}, like curl --resolve.",
        block=Form(),
        pool=Omitted("a sandbox block carries it"),
        cli=Flag(
            "--egress-resolve",
            "HOST=IP",
            "pin an allowlisted name to an address (like curl --resolve; repeatable)",
            repeat=True,
        ),
    )
    setup_argv: list[str] | None = setting(
        None,
        title="Setup command",
        description="A command run in the sandbox before each task (e.g. pip install ...), one argument per item.",
        block=Form(blank_is_unset=True),
        pool=Omitted("a sandbox block carries it"),
        cli=Flag("--setup", "SHELL", "a shell command run in the sandbox before the command"),
    )
    #: The setup step (``setup_argv``) may reach these instead; see NodeSpec.setup_egress.
    setup_egress: list[str] | None = setting(
        None,
        title="Setup egress allowlist",
        description="The setup command's own allowlist (e.g. a package index); the task's is the egress allowlist.",
        block=Form(),
        pool=Omitted("a sandbox block carries it"),
        cli=Flag(
            "--setup-egress",
            "HOST",
            "the --setup command's own allowlist (repeatable); the command gets --egress",
            repeat=True,
        ),
    )
    output_paths: list[str] = setting(
        factory=list,
        title="Output paths",
        description="Paths or globs every node returns from its workspace.",
        block=Form(),
        pool=Omitted("a flow run returns no output files to the worker"),
        cli=Flag(
            "--output",
            "GLOB",
            "workspace-relative glob of files to bring back (repeatable; ** crosses directories)",
            repeat=True,
        ),
    )
    outputs_dir: Path | None = setting(
        None,
        title="Outputs directory",
        description="Where a node's output files land on the host.",
        block=Omitted(_NOT_SHARED_PATH),
        pool=Omitted("a flow run returns no output files to the worker"),
        cli=Flag("--outputs-dir", "DIR", "where outputs land (default ./resoluto-outputs/<node-id>)"),
    )
    silence_window: float = setting(
        DEFAULT_SILENCE_WINDOW,
        title="Silence window (s)",
        description=(
            "Seconds without any event from a sandbox before it is presumed dead. "
            f"Default: {DEFAULT_SILENCE_WINDOW:g}."
        ),
        check=_check_silence,
        block=Form(gt=0),
        pool=Form(gt=0),
        cli=Flag(
            "--silence-window",
            "S",
            "seconds without any event (not even a heartbeat) before the sandbox is presumed dead "
            f"(default {DEFAULT_SILENCE_WINDOW:g})",
            type=float,
        ),
    )
    host_lost_after: float = setting(
        heartbeat.DEFAULT_LOST_AFTER,
        title="Host lost after (s)",
        description=(
            "Seconds the host's heartbeat may stay unchanged before a sandbox takes its host for "
            "gone (killed, its machine lost), kills its work and ends; 0: no heartbeat (only a "
            f"sweep clears what a dead host left). Default: {heartbeat.DEFAULT_LOST_AFTER:g}."
        ),
        check=_check_lost_after,
        block=Form(ge=0),
        pool=Form(ge=0),
        cli=Flag(
            "--host-lost-after",
            "S",
            "seconds without the host's heartbeat before the sandbox ends itself; 0: none "
            f"(default {heartbeat.DEFAULT_LOST_AFTER:g})",
            type=float,
        ),
    )
    host_heartbeat_interval: float = setting(
        heartbeat.DEFAULT_INTERVAL,
        title="Host heartbeat interval (s)",
        description=(
            "Seconds between two of the host's heartbeats (one object per host process, "
            f"whatever the number of sandboxes). Default: {heartbeat.DEFAULT_INTERVAL:g}."
        ),
        check=_check_beat_interval,
        block=Form(gt=0),
        pool=Form(gt=0),
        cli=Flag(
            "--host-heartbeat-interval",
            "S",
            f"seconds between two of the host's heartbeats (default {heartbeat.DEFAULT_INTERVAL:g})",
            type=float,
        ),
    )
    infrastructure_retries: int = setting(
        1,
        title="Infrastructure retries",
        description="Re-launches after an infrastructure failure (not the task's own retries). Default: 1.",
        check=_check_retries,
        block=Form(ge=0),
        pool=Omitted(
            "a flow run is not idempotent: the worker never re-launches it (a dead sandbox is Crashed)"
        ),
        cli=Omitted("one command, one launch: exit code 125 says the infrastructure failed"),
    )
    #: Idle warm sandboxes kept per pool key (prefect_resoluto.warm.pool); 0 disables; None: the
    #: runner's max_workers, capped at pool.DEFAULT_CAP, on runtimes that support it.
    warm_pool: int | None = setting(
        None,
        title="Warm sandboxes",
        description="Warm sandboxes kept ready per kind of node on local runtimes (0 disables). "
        "Empty: the task runner's concurrency, at most 4.",
        check=_check_warm_pool,
        block=Form(ge=0),
        pool=Omitted("one sandbox per flow run: there is nothing to keep warm"),
        cli=Omitted("one command, one sandbox: there is nothing to keep warm"),
    )

    #: The runner's per-run summary table (task_runner/artifacts.py); the runner's, not a
    #: submission's: sandbox_options() refuses it.
    summary_artifact: bool = setting(
        False,
        title="Summary artifact",
        description=(
            "Also write the runner's summary of each flow run as an artifact: a table of its sandbox "
            "nodes, one collection per flow (each run a version), and a failed task run's node table. "
            "Off: the runner reports in the task runs' logs only, and the Artifacts page holds only "
            "what the flow's own code made."
        ),
        block=Form(),
        pool=Omitted(
            "a flow run's own tasks do not go through the task runner's nodes: nothing to summarise"
        ),
        cli=Omitted("prefect-resoluto run runs one command, not a flow run: nothing to summarise"),
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(SandboxSettings):
            s = declaration(f.name)
            value = getattr(self, f.name)
            if value is not None and s.check is not None:
                s.check(value)
        self.min_isolation = IsolationLevel.parse(self.min_isolation)
        if self.workspace is not None:
            self.workspace = Path(self.workspace)
        if self.outputs_dir is not None:
            self.outputs_dir = Path(self.outputs_dir)
        self.output_paths = list(self.output_paths)

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` applied; dict fields are merged, not replaced. Without any
        change, this object itself (settings are not changed in place)."""
        names = {f.name for f in dataclasses.fields(SandboxSettings)}
        merged: dict[str, Any] = {}
        for k, v in changes.items():
            if v is None:
                continue
            if k not in names:
                raise TypeError(f"unknown sandbox option {k!r}")
            if isinstance(getattr(self, k), dict):
                v = {**getattr(self, k), **v}
            merged[k] = v
        if not merged:  # a task without options of its own, every node: no copy to check again
            return self
        return dataclasses.replace(self, **merged)


def declaration(name: str) -> Setting:
    """The declaration of the setting called ``name`` (KeyError: there is none)."""
    return SETTINGS[name]


def _declared() -> dict[str, Setting]:
    out: dict[str, Setting] = {}
    for f in dataclasses.fields(SandboxSettings):
        s = f.metadata.get("setting")
        if not isinstance(s, Setting):
            raise TypeError(f"SandboxSettings.{f.name} is declared without setting(...)")
        out[f.name] = s
    return out


#: Every setting by name, in declaration order.
SETTINGS: dict[str, Setting] = _declared()


def exposed(surface: Surface) -> list[str]:
    """The names of the settings ``surface`` exposes, in declaration order."""
    return [name for name, s in SETTINGS.items() if s.exposed(surface)]


def field_type(name: str) -> str:
    """The setting's type, as written in its declaration."""
    return str({f.name: f for f in dataclasses.fields(SandboxSettings)}[name].type)


def check_value(name: str, value: Any) -> None:
    """Raise ValueError if ``value`` is not a valid value of the setting ``name``."""
    s = SETTINGS[name]
    if value is not None and s.check is not None:
        s.check(value)


def with_setting_keywords(fn: Callable[..., Any], *, keep: tuple[str, ...] = ("self",)) -> inspect.Signature:
    """``fn``'s signature with its ``**options`` spelt out as one keyword per setting of
    :attr:`Surface.RUNNER` (default None: the block's or the built-in value), for help(),
    IDEs and ``inspect``; the parameters named in ``keep`` stay as ``fn`` declares them."""
    own = inspect.Signature.from_callable(fn)
    kept = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    first = [p for p in kept if p.name in keep]
    rest = [p for p in kept if p.name not in keep]
    settings = [
        inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=field_type(name)
            if field_type(name).endswith("| None")
            else f"{field_type(name)} | None",
        )
        for name in exposed(Surface.RUNNER)
    ]
    return own.replace(parameters=[*first, *settings, *rest])


def unknown_keywords(who: str, options: dict[str, Any]) -> None:
    """Refuse a keyword that is no setting of :attr:`Surface.RUNNER`, as Python refuses an
    unknown argument."""
    known = set(exposed(Surface.RUNNER))
    for k in options:
        if k not in known:
            raise TypeError(f"{who} got an unexpected keyword argument {k!r} (not a sandbox setting)")
