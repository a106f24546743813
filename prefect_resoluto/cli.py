"""``prefect-resoluto``: run one command in a sandbox without Prefect, and look after sandboxes.

Subcommands: ``run`` (drive one node and stream its output), ``doctor`` (which runtimes
work here and which one ``run`` picks), ``events`` (replay a node's events from the
conduit, also after the sandbox is gone), ``sweep`` (reap orphaned sandboxes) and
``render`` (the Kubernetes objects of one node as YAML, or the Solari create request and
guest command as JSON).

Output conventions of ``run``:

* stdout carries the workload's own lines (stdout and stderr of the command, which the
  guest merges) as they arrive, and nothing else -- except, with ``--json``, one JSON
  object (``NodeOutcome.to_json()``) on the very last line;
* stderr carries the runner's notes (span open/close, staging, outputs, the verdict),
  prefixed ``resoluto:``; ``--quiet`` keeps only failures; a progress indicator is drawn
  on stderr only when stderr is a terminal;
* the values of ``--secret-env`` variables are replaced by ``***`` in everything printed.

Exit codes: the workload's own exit code (0 on success; 126/127 when the command cannot
be executed / is not found, 128+N when killed by signal N, as a shell reports them; 1
for a workload failure without an exit code); 2 for bad input, detected before anything
is launched; 125 for an infrastructure failure (the sandbox could not start, was lost,
was killed by the substrate, left no result, or broke the wire protocol); 130/143 when
interrupted by SIGINT/SIGTERM (the sandbox is reaped first).

This module never imports Prefect: the CLI has no use for it and must start fast.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

if TYPE_CHECKING:  # runtime imports stay inside the commands, so `--help` is instant
    from guest_runner.conduit import Conduit
    from guest_runner.redact import Redactor
    from prefect_resoluto.node import NodeOutcome, NodeSpec
    from prefect_resoluto.runtimes.base import IsolationLevel, SandboxHandle, SandboxRuntime

PROG = "prefect-resoluto"

EXIT_OK = 0
EXIT_FAILED = 1  # a workload failure without an exit code; `events`/`doctor`/`sweep` problems
EXIT_USAGE = 2  # bad input: nothing was launched
EXIT_INFRA = 125  # the sandbox failed, not the work (as `docker run`/`podman run` use 125)
EXIT_SIGINT = 128 + signal.SIGINT
EXIT_SIGTERM = 128 + signal.SIGTERM

LABEL_SOURCE = "resoluto.source"

RUN_EPILOG = """\
output: the command's lines on stdout as they arrive (with --json, the outcome as one
JSON object on the last line); runner notes and the verdict on stderr.
exit codes: the command's own (0 success, 126/127 cannot execute / not found, 128+N
killed by signal N, 1 failed without a code); 2 bad input (nothing launched);
125 infrastructure failure; 130/143 interrupted (the sandbox is reaped first).
example: prefect-resoluto run --workspace . --output 'out/**' -- python3 build.py"""
DEFAULT_OUTPUTS = "resoluto-outputs"


class UsageError(Exception):
    """Bad input; main() prints it as one line and exits 2."""


class Interrupted(KeyboardInterrupt):
    """SIGINT/SIGTERM during a run. A KeyboardInterrupt, so no ``except Exception`` in the
    driver swallows it and its ``finally`` reaps the sandbox on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line instead of argparse's usage dump: the brief is "clear one-line error".
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    if not lines:
        return "unknown error"
    return lines[0] if len(lines) == 1 else lines[0] + " " + "; ".join(lines[1:])


def _err(message: str) -> None:
    print(f"{PROG}: error: {_one_line(message)}", file=sys.stderr, flush=True)


# =========================================================================== parsing helpers


def _parse_pairs(values: Sequence[str] | None, flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"{flag} {item!r} is malformed: expected KEY=VALUE")
        if "\x00" in key or "\x00" in value:
            raise UsageError(f"{flag} {key!r} contains a NUL byte")
        out[key] = value
    return out


def _parse_secret_env(values: Sequence[str] | None) -> dict[str, str]:
    """``K=V``, or a bare ``K`` taking the value from this process's environment -- so a
    secret need not appear in the command line (``ps`` shows it to every local user)."""
    out: dict[str, str] = {}
    for item in values or ():
        key, sep, value = item.partition("=")
        if not key.strip():
            raise UsageError(f"--secret-env {item!r} is malformed: expected KEY=VALUE or KEY")
        if not sep:
            if key not in os.environ:
                raise UsageError(f"--secret-env {key}: no '=' and no {key} in the environment to take it from")
            value = os.environ[key]
        out[key] = value
    return out


def _parse_options(values: Sequence[str] | None) -> dict[str, Any]:
    """``--runtime-option K=V``: V is JSON when it parses (true, 3, ["a"]), else a string."""
    out: dict[str, Any] = {}
    for key, raw in _parse_pairs(values, "--runtime-option").items():
        try:
            out[key.replace("-", "_")] = json.loads(raw)
        except ValueError:
            out[key.replace("-", "_")] = raw
    return out


def _strip_dashdash(argv: Sequence[str]) -> list[str]:
    # argparse.REMAINDER keeps the separating "--"; the command starts after it.
    argv = list(argv)
    return argv[1:] if argv[:1] == ["--"] else argv


def show_argv(argv: object, limit: int = 160) -> str:
    """A command as one shell-quoted line (newlines escaped, long ones cut) for notes."""
    if not isinstance(argv, list) or not argv:
        return ""
    text = shlex.join(str(a) for a in argv).replace("\r", "\\r").replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _redact_json(obj: Any, redactor: Redactor) -> Any:
    """Redact every string (keys too) without Redactor.data's name-based masking, which
    would blank e.g. an output file called ``api_key.txt``."""
    if isinstance(obj, str):
        return redactor.text(obj)
    if isinstance(obj, dict):
        return {redactor.text(str(k)): _redact_json(v, redactor) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_redact_json(v, redactor) for v in obj]
    return obj


# =========================================================================== runtime selection


def _floor(value: str) -> IsolationLevel:
    from prefect_resoluto.runtimes.base import IsolationLevel

    try:
        return IsolationLevel.parse(value)
    except ValueError as e:
        raise UsageError(f"--min-isolation: {e}") from None


def _known_runtimes() -> list[str]:
    from prefect_resoluto.runtimes import RUNTIMES

    return sorted(RUNTIMES)


def _instantiate(name: str, options: dict[str, Any]) -> SandboxRuntime:
    from prefect_resoluto.runtimes import RUNTIMES, get_runtime

    if name not in RUNTIMES:
        raise UsageError(f"unknown runtime {name!r}; known runtimes: {', '.join(_known_runtimes())}")
    try:
        return get_runtime(name, **options)
    except TypeError as e:  # an option the runtime's constructor does not take
        raise UsageError(f"--runtime-option for {name!r}: {e}") from None
    except (ValueError, RuntimeError) as e:
        raise UsageError(f"runtime {name!r} cannot be configured: {e}") from None


def select_runtime(name: str | None, options: dict[str, Any], floor: IsolationLevel) -> SandboxRuntime:
    """The named runtime (checked against the floor, then probed), or the best one here."""
    from prefect_resoluto.runtimes import best_available, why_unavailable
    from prefect_resoluto.runtimes.base import IsolationTooWeak, check_isolation

    if name:
        rt = _instantiate(name, options)
        try:  # the floor first: no need to probe a runtime that would be refused anyway
            check_isolation(rt, floor)
        except IsolationTooWeak as e:
            raise UsageError(str(e)) from None
        avail = rt.availability()
        if not avail.ok:
            raise UsageError(f"runtime {name!r} is unavailable here: {avail.why}")
        return rt
    try:
        found = best_available(floor, **options)
    except TypeError as e:
        raise UsageError(f"--runtime-option: {e}") from None
    if found is None:
        from prefect_resoluto.runtimes.base import IsolationLevel

        lower = IsolationLevel(max(floor - 1, IsolationLevel.NONE)).label
        raise UsageError(f"{why_unavailable(floor, **options)} -- install gVisor (runsc) or bubblewrap, "
                         f"or lower the floor explicitly with --min-isolation {lower}")
    return found


def _runtime_label(rt: SandboxRuntime) -> str:
    oci = getattr(rt, "oci_runtime", None)  # container: the OCI runtime decides the isolation
    return f"{rt.name}({oci})" if rt.name == "container" and oci else rt.name


# =========================================================================== run


@dataclass
class RunPlan:
    spec: NodeSpec
    conduit: Conduit
    runtime: SandboxRuntime
    floor: IsolationLevel
    silence_window: float
    redactor: Redactor
    labels: dict[str, str] = field(default_factory=dict)


def plan_node(args: argparse.Namespace, *, for_render: bool = False) -> RunPlan:
    """Validate everything ``run``/``render`` were given; raise UsageError on bad input."""
    from guest_runner import archive, wire
    from guest_runner.conduit import ConduitError, LocalConduit, conduit_from_url
    from guest_runner.redact import Redactor
    from prefect_resoluto.config import default_conduit_url
    from prefect_resoluto.node import NodeSpec
    from prefect_resoluto.runtimes.base import IsolationLevel, Resources, parse_cpus, parse_quantity

    argv = _strip_dashdash(args.argv)
    if not argv or not argv[0]:
        raise UsageError(f"no command given: put it after '--', e.g. {PROG} run -- python3 -c 'print(1)'")
    env = _parse_pairs(args.env, "--env")
    secret_env = _parse_secret_env(args.secret_env)
    labels = _parse_pairs(args.label, "--label")
    options = _parse_options(args.runtime_option)
    floor = _floor(args.min_isolation)
    try:
        memory = parse_quantity(args.memory) if args.memory else None
    except ValueError as e:
        raise UsageError(f"--memory: {e}") from None
    try:
        cpus = parse_cpus(args.cpus) if args.cpus else None
    except ValueError as e:
        raise UsageError(f"--cpus: {e}") from None
    if args.silence_window is not None and args.silence_window <= 0:
        raise UsageError("--silence-window must be a positive number of seconds")

    workspace: Path | None = None
    if args.workspace is not None:
        workspace = Path(args.workspace).expanduser()
        if not workspace.exists():
            raise UsageError(f"workspace directory {str(workspace)!r} does not exist")
        if not workspace.is_dir():
            raise UsageError(f"workspace {str(workspace)!r} is not a directory")
        workspace = workspace.resolve()
    outputs = list(args.output or [])
    for pattern in outputs:
        try:
            archive.check_pattern(pattern)
        except ValueError as e:
            raise UsageError(f"--output: {e}") from None

    run_id = args.run_id or uuid.uuid4().hex
    node_id = args.node_id or f"cli-{uuid.uuid4().hex[:12]}"
    for value, what in ((run_id, "--run-id"), (node_id, "--node-id")):
        try:
            wire.check_id(value, what)
        except ValueError as e:
            raise UsageError(str(e)) from None
    outputs_dir = Path(args.outputs_dir).expanduser() if args.outputs_dir else Path(DEFAULT_OUTPUTS) / node_id
    outputs_dir = outputs_dir.absolute()  # relative to the cwd the user ran us in

    conduit_url = args.conduit or default_conduit_url()
    try:
        conduit = conduit_from_url(conduit_url)
    except (ValueError, ImportError, ConduitError) as e:
        raise UsageError(f"--conduit: {e}") from None

    runtime = select_runtime(args.runtime, options, floor) if not for_render else _render_runtime(args, options)
    if isinstance(conduit, LocalConduit) and not runtime.supports_local_conduit:
        raise UsageError(f"runtime {runtime.name!r} runs sandboxes on other machines, which cannot see the "
                         f"local conduit {conduit.root}; pass --conduit s3://bucket/prefix?endpoint_url=...")
    if (not isinstance(conduit, LocalConduit) and runtime.supports_local_conduit and not runtime.remote
            and runtime.isolation > IsolationLevel.NONE):
        # Local sandboxes get no network at all, so they could never reach an object store.
        raise UsageError(f"runtime {runtime.name!r} gives its sandbox no network, so it cannot reach the "
                         f"conduit {conduit.url}; use a local conduit (file:///dir) with it")
    if args.image and not _takes_image(runtime):
        raise UsageError(f"runtime {runtime.name!r} does not run images (it uses the host's /usr); "
                         "--image applies to the container and kubernetes runtimes")

    spec = NodeSpec(
        run_id=run_id, node_id=node_id, argv=argv, workspace=workspace, output_paths=outputs,
        env=env, secret_env=secret_env, resources=Resources.from_quantities(memory=memory, cpus=cpus),
        labels={**labels, LABEL_SOURCE: "cli"}, image=args.image, outputs_dir=outputs_dir,
        egress=list(args.egress or []), egress_resolve=_parse_pairs(args.egress_resolve, "--egress-resolve"),
        setup_egress=list(args.setup_egress) if args.setup_egress is not None else None,
        setup_argv=["sh", "-c", args.setup] if args.setup else None,
    )
    try:
        spec.validate()
        if runtime.egress_by_name:
            spec.network_request()
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None
    if not for_render:
        # Conduit objects are immutable evidence: never run a second node into the same place.
        try:
            taken = conduit.list_prefix(wire.node_prefix(run_id, node_id) + "/")
        except ConduitError as e:
            raise UsageError(f"conduit {conduit.url} is not usable: {e}") from None
        if taken:
            raise UsageError(f"node {node_id!r} of run {run_id!r} already has objects in {conduit.url}; "
                             "pick another --node-id (or --run-id)")
    from prefect_resoluto.tail import DEFAULT_SILENCE_WINDOW

    return RunPlan(
        spec=spec, conduit=conduit, runtime=runtime, floor=floor,
        silence_window=args.silence_window or DEFAULT_SILENCE_WINDOW,
        redactor=Redactor(secret_env.values()), labels=labels,
    )


def _takes_image(runtime: SandboxRuntime) -> bool:
    import inspect

    return "image" in inspect.signature(type(runtime).__init__).parameters


class Progress:
    """A one-line spinner on stderr (only when it is a terminal), redrawn by a thread.

    Every line printed through :class:`EventPrinter` first erases it under the shared lock,
    so workload output never interleaves with it.
    """

    FRAMES = "|/-\\"

    def __init__(self, stream: TextIO, enabled: bool, label: str, lock: threading.Lock) -> None:
        self.stream = stream
        self.enabled = enabled
        self.label = label
        self.lock = lock
        self.phase = "launching"
        self.events = 0
        self.t0 = time.monotonic()
        self._shown = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="resoluto-progress", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        frame = 0
        while not self._stop.wait(0.1):  # animation pace, not synchronisation
            with self.lock:
                elapsed = time.monotonic() - self.t0
                text = (f"{self.FRAMES[frame % len(self.FRAMES)]} {self.label}: {self.phase} "
                        f"{elapsed:.1f}s, {self.events} event(s)")
                self.stream.write("\r\x1b[K" + text)
                self.stream.flush()
                self._shown = True
            frame += 1

    def clear_locked(self) -> None:
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False

    def launched(self, handle: SandboxHandle) -> None:
        self.phase = "starting"

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        with self.lock:
            self.clear_locked()


class EventPrinter:
    """The driver's ``on_event``: workload lines to stdout, runner notes to stderr."""

    def __init__(self, out: TextIO, err: TextIO, redactor: Redactor, *, quiet: bool,
                 progress: Progress) -> None:
        self.out = out
        self.err = err
        self.redactor = redactor
        self.quiet = quiet
        self.progress = progress
        self.lock = progress.lock
        self.span_kinds: dict[str, str] = {}
        self.lines = 0

    def write(self, stream: TextIO, text: str) -> None:
        with self.lock:
            self.progress.clear_locked()
            stream.write(self.redactor.text(text) + "\n")
            stream.flush()

    def note(self, text: str) -> None:
        self.write(self.err, f"resoluto: {text}")

    def __call__(self, ev: dict[str, Any]) -> None:
        import logging

        from prefect_resoluto.logs import describe_event

        self.progress.events += 1
        self.progress.phase = "running"
        kind, event = ev.get("kind", ""), ev.get("event", "")
        if event == "open":
            self.span_kinds[str(ev.get("span_id", ""))] = kind
        described = describe_event(ev)
        if described is None:  # heartbeats
            return
        level, message = described
        if event == "open" and isinstance((ev.get("data") or {}).get("argv"), list):
            message = f"> {kind} {ev.get('name', '')}: {show_argv(ev['data']['argv'])}"
        if event == "log" and kind == "log" and self.span_kinds.get(str(ev.get("parent_span_id"))) == "workload":
            self.lines += 1
            self.write(self.out, message)
            return
        if level >= logging.ERROR or (not self.quiet and level >= logging.INFO):
            self.note(message)


def exit_code_for(outcome: NodeOutcome) -> int:
    if outcome.ok:
        return EXIT_OK
    if outcome.failure == "workload":
        code = outcome.exit_code
        return code if isinstance(code, int) and 1 <= code <= 255 else EXIT_FAILED
    return EXIT_INFRA


@contextmanager
def _interruptible() -> Iterator[None]:
    """SIGINT/SIGTERM raise :class:`Interrupted` once; a second one exits at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    fired: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if fired:  # the user insists: leave now, even if reaping is not finished
            os.write(2, f"\n{PROG}: interrupted again; a sandbox may be left behind -- "
                        f"'{PROG} sweep' reaps it\n".encode())
            os._exit(128 + signum)
        fired.append(signum)
        raise Interrupted(signum)

    for s in previous:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def cmd_run(args: argparse.Namespace) -> int:
    from prefect_resoluto.node import LABEL_NODE, LABEL_RUN, drive_node
    from prefect_resoluto.runtimes.base import IsolationTooWeak

    plan = plan_node(args)
    spec, rt, red = plan.spec, plan.runtime, plan.redactor
    lock = threading.Lock()
    progress = Progress(sys.stderr, enabled=sys.stderr.isatty() and not args.quiet,
                        label=f"{spec.node_id} on {_runtime_label(rt)}", lock=lock)
    printer = EventPrinter(sys.stdout, sys.stderr, red, quiet=args.quiet, progress=progress)
    if not args.quiet:
        printer.note(f"node {spec.node_id} of run {spec.run_id} on {_runtime_label(rt)} "
                     f"({rt.isolation.label}), conduit {plan.conduit.url}")
    launched = False

    def on_launch(handle: SandboxHandle) -> None:
        nonlocal launched
        launched = True
        progress.launched(handle)

    with _interruptible():
        progress.start()
        try:
            outcome = drive_node(
                spec, plan.conduit, rt, on_event=printer, min_isolation=plan.floor,
                silence_window=plan.silence_window, on_launch=on_launch,
            )
        except Interrupted as e:
            progress.stop()
            # drive_node's finally destroyed the sandbox it knew of; one interrupted
            # mid-launch is only findable by its labels.
            try:
                rt.sweep({LABEL_RUN: spec.run_id, LABEL_NODE: spec.node_id})
            except Exception as sweep_error:  # best effort: say so, keep the exit code
                _err(f"could not sweep node {spec.node_id}: {sweep_error}")
            print(f"{PROG}: interrupted ({e}); the sandbox of node {spec.node_id} was reaped",
                  file=sys.stderr, flush=True)
            return 128 + e.signum
        except BrokenPipeError:
            raise
        except Exception as e:
            if not launched and isinstance(e, (ValueError, FileNotFoundError, IsolationTooWeak)):
                # drive_node refuses bad input before launching (validation, floor, packing
                # the workspace -- e.g. a device file or a link pointing outside it).
                raise UsageError(red.text(str(e))) from None
            # Anything else is the machinery's fault (conduit down while putting the inbox,
            # a runtime's prepare step, a status call that broke): infrastructure.
            progress.stop()
            _err(f"infrastructure error{' after launch' if launched else ' before launch'} of node "
                 f"{spec.node_id}: {type(e).__name__}: {red.text(str(e))}")
            return EXIT_INFRA
        finally:
            progress.stop()

    code = exit_code_for(outcome)
    if outcome.ok:
        if not args.quiet:
            n = len(outcome.output_files)
            where = f"; {n} output file(s) in {_rel(outcome.output_dir)}" if spec.output_paths else ""
            printer.note(f"node {outcome.node_id} succeeded on {outcome.runtime} ({outcome.isolation}) in "
                         f"{outcome.timings.get('finish', 0):.2f}s{where}")
    else:
        kind = "infrastructure failure" if outcome.infrastructure_failure else "workload failure"
        printer.note(f"{outcome.describe()}\n({kind}; exit {code}) replay: {PROG} events --conduit "
                     f"{shlex.quote(outcome.conduit_url)} {outcome.run_id} {outcome.node_id}")
    if args.json:
        printer.write(sys.stdout, json.dumps(_redact_json(outcome.to_json(), red), sort_keys=False))
    return code


def _rel(path: Path | None) -> str:
    if path is None:
        return "-"
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# =========================================================================== render


def _render_runtime(args: argparse.Namespace, options: dict[str, Any]) -> SandboxRuntime:
    from prefect_resoluto.runtimes.base import IsolationTooWeak, check_isolation

    if args.runtime == "solari":
        from prefect_resoluto.runtimes.solari import SolariRuntime

        try:
            return SolariRuntime(**options)
        except (TypeError, ValueError) as e:
            raise UsageError(f"solari runtime: {e}") from None
    if (args.runtime or "kubernetes") != "kubernetes":
        raise UsageError(f"render only supports --runtime kubernetes or solari (got {args.runtime!r}); local "
                         "runtimes have no objects to render")
    try:
        from prefect_resoluto.runtimes.kubernetes import KubernetesRuntime
    except ImportError as e:
        raise UsageError(f"render needs the kubernetes runtime, which cannot be imported here: {e}") from None
    if args.image:
        options.setdefault("image", args.image)
    try:
        rt = KubernetesRuntime(**options)
    except (TypeError, ValueError) as e:
        raise UsageError(f"kubernetes runtime: {e}") from None
    try:
        check_isolation(rt, _floor(args.min_isolation))
    except IsolationTooWeak as e:
        raise UsageError(str(e)) from None
    return rt


def cmd_render(args: argparse.Namespace) -> int:
    if args.runtime == "solari":
        return _render_solari(args)
    try:
        from prefect_resoluto.k8s_render import render_yaml
    except ImportError as e:
        raise UsageError(f"render needs the kubernetes runtime's renderer (prefect_resoluto.k8s_render), "
                         f"which is not available here: {e}") from None
    from prefect_resoluto.node import launch_spec

    plan = plan_node(args, for_render=True)
    launch = launch_spec(plan.spec, plan.conduit)  # exactly what drive_node would launch
    try:
        text = render_yaml(launch, plan.runtime)  # type: ignore[arg-type]
    except (ValueError, RuntimeError) as e:
        raise UsageError(f"cannot render: {plan.redactor.text(str(e))}") from None
    sys.stdout.write(plan.redactor.text(text))
    sys.stdout.flush()
    return EXIT_OK


def _render_solari(args: argparse.Namespace) -> int:
    """The create request body and the guest command the Solari runtime would send, as JSON."""
    from prefect_resoluto.node import launch_spec

    plan = plan_node(args, for_render=True)
    launch = launch_spec(plan.spec, plan.conduit)
    try:
        doc = plan.runtime.render(launch)  # type: ignore[attr-defined]
    except (ValueError, RuntimeError) as e:
        raise UsageError(f"cannot render: {plan.redactor.text(str(e))}") from None
    sys.stdout.write(plan.redactor.text(json.dumps(doc, indent=2)) + "\n")
    sys.stdout.flush()
    return EXIT_OK


# =========================================================================== doctor


def doctor_report() -> dict[str, Any]:
    """Every registered runtime (and the variants ``run`` considers), availability, picks."""
    from prefect_resoluto import runtimes
    from prefect_resoluto.config import default_conduit_url
    from prefect_resoluto.runtimes.base import DEFAULT_MIN_ISOLATION, IsolationLevel

    entries: list[tuple[str, dict[str, Any]]] = [(name, {}) for name in runtimes.RUNTIMES]
    defaults: dict[str, SandboxRuntime | None] = {}
    rows: list[dict[str, Any]] = []

    def row(name: str, options: dict[str, Any]) -> dict[str, Any]:
        label = f"{name}({', '.join(f'{k}={v}' for k, v in options.items())})" if options else name
        r: dict[str, Any] = {"name": name, "options": options, "label": label, "isolation": None,
                             "available": False, "why": "", "detail": "", "local": None}
        try:
            cls = runtimes.RUNTIMES[name]
            r["local"] = bool(cls.supports_local_conduit)
            rt = cls(**options)
        except Exception as e:  # e.g. kubernetes without a usable configuration
            r["why"] = f"cannot be configured: {type(e).__name__}: {e}"
            if not options:
                defaults[name] = None
            return r
        if not options:
            defaults[name] = rt
        r["isolation"] = rt.isolation.label
        try:
            avail = rt.availability()
        except Exception as e:  # a probe must never take doctor down
            r["why"] = f"probe failed: {type(e).__name__}: {e}"
            return r
        r.update(available=avail.ok, why=avail.why, detail=avail.detail)
        r["egress"] = _egress_row(rt) if avail.ok else {"enforced": False, "why": "runtime not available"}
        return r

    for name, options in entries:
        rows.append(row(name, options))
    # The variants best_available() tries (e.g. the container runtime with Kata) when they
    # differ from a runtime's defaults -- so the "why not" of a stronger pick is visible.
    for name, options in runtimes.candidates():
        base = defaults.get(name)
        if not options or base is None or all(getattr(base, k, object()) == v for k, v in options.items()):
            continue
        rows.append(row(name, dict(options)))

    picks: list[dict[str, Any]] = []
    for level in sorted(IsolationLevel, reverse=True):
        rt = runtimes.best_available(level)
        picks.append({
            "floor": level.label, "default": level == DEFAULT_MIN_ISOLATION,
            "runtime": rt.name if rt is not None else None,
            "label": _runtime_label(rt) if rt is not None else None,
            "isolation": rt.isolation.label if rt is not None else None,
            "why_none": "" if rt is not None else runtimes.why_unavailable(level),
        })
    default = next(p for p in picks if p["default"])
    return {
        "runtimes": rows,
        "picks": picks,
        "default_floor": DEFAULT_MIN_ISOLATION.label,
        "default_pick": default["runtime"],
        "default_conduit": default_conduit_url(),
        "note": "run picks among local runtimes only; kubernetes and solari (remote runtimes) "
                "are used only when named with --runtime",
    }


def _egress_row(rt: SandboxRuntime) -> dict[str, Any]:
    """Whether ``rt`` can enforce an allowlist here, how, and if not why not."""
    try:
        why = rt.egress_support()
    except Exception as e:  # a probe must never take doctor down
        why = f"probe failed: {type(e).__name__}: {e}"
    if why:
        return {"enforced": False, "why": why}
    if rt.egress_by_name:
        how = "by name: per-run proxy (CONNECT + SNI/Host + DNS), host-side; IMDS and private ranges refused"
        extra = getattr(rt, "egress_detail", None)
        detail = f"{how}; runsc netstack: {extra()}" if callable(extra) else how
    else:
        detail = "by CIDR: a NetworkPolicy per pod (cannot filter by name); IMDS always refused"
    return {"enforced": True, "detail": detail}


def cmd_doctor(args: argparse.Namespace) -> int:
    report = doctor_report()
    if args.json:
        print(json.dumps(report))
        return EXIT_OK if report["default_pick"] else EXIT_FAILED
    rows = report["runtimes"]
    w = max(len(r["label"]) for r in rows) + 2
    print(f"{'RUNTIME':<{w}}{'ISOLATION':<13}{'AVAILABLE':<11}DETAILS / WHY NOT")
    for r in rows:
        info = r["detail"] if r["available"] else r["why"]
        print(f"{r['label']:<{w}}{r['isolation'] or '?':<13}{'yes' if r['available'] else 'no':<11}{info}")
    print()
    print("egress allowlists (--egress), per runtime:")
    for r in rows:
        eg = r.get("egress") or {"enforced": False, "why": r["why"] or "not checked"}
        info = eg.get("detail", "") if eg["enforced"] else eg["why"]
        print(f"  {r['label']:<{w}}{'enforced' if eg['enforced'] else 'no':<10}{info}")
    print()
    print("`run` picks, by --min-isolation floor:")
    for p in report["picks"]:
        mark = " (default floor)" if p["default"] else ""
        if p["runtime"]:
            print(f"  {p['floor']:<12} -> {p['label']} ({p['isolation']}){mark}")
        else:
            print(f"  {p['floor']:<12} -> nothing available{mark}")
    print(f"\ndefault conduit: {report['default_conduit']}")
    print(f"note: {report['note']}")
    if not report["default_pick"]:
        print(f"\nno runtime qualifies at the default floor {report['default_floor']}; install gVisor "
              "(runsc) or pass --min-isolation namespace to run with bubblewrap", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


# =========================================================================== events


class ReplayError(Exception):
    pass


@dataclass
class Replay:
    prefix: str
    chunks: list[int] = field(default_factory=list)
    total_chunks: int | None = None
    manifest_error: str = ""
    outbox: list[str] = field(default_factory=list)


def scan_node(conduit: Conduit, run_id: str, node_id: str) -> Replay:
    from guest_runner import wire
    from guest_runner.conduit import ObjectNotFound

    prefix = wire.node_prefix(run_id, node_id)
    keys = conduit.list_prefix(prefix + "/")
    if not keys:
        raise ReplayError(f"no objects for node {node_id!r} of run {run_id!r} in {conduit.url} "
                          f"(looked under {prefix}/)")
    rep = Replay(prefix=prefix)
    for key in keys:
        rel = key[len(prefix) + 1:]
        idx = wire.chunk_index(rel) if "/" not in rel else None
        if idx is not None:
            rep.chunks.append(idx)
        elif rel.startswith(wire.OUTBOX + "/"):
            rep.outbox.append(key)
    rep.chunks.sort()
    try:
        rep.total_chunks = wire.decode_manifest(conduit.get(wire.manifest_key(prefix)))
    except ObjectNotFound:  # the node is still running, or died before it finished
        pass
    except wire.WireError as e:
        rep.manifest_error = f"{wire.manifest_key(prefix)}: {e}"
    return rep


def iter_events(conduit: Conduit, rep: Replay) -> Iterator[dict[str, Any]]:
    """Events in chunk order; raises ReplayError at the first fault, after yielding all
    that precede it."""
    from guest_runner import wire
    from prefect_resoluto.tail import MalformedChunk, text_line

    expected = 1
    for idx in rep.chunks:
        key = wire.chunk_key(rep.prefix, idx)
        if idx != expected:
            raise ReplayError(f"{wire.chunk_key(rep.prefix, expected)} is missing (the next chunk present "
                              f"is {key})")
        expected += 1
        raw = conduit.get(key)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ReplayError(str(MalformedChunk(key, text_line(raw, e.start), "not UTF-8"))) from None
        for line_no, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            try:
                yield wire.decode_event(line)
            except wire.WireError as e:
                raise ReplayError(str(MalformedChunk(key, line_no, str(e)))) from None
    if rep.manifest_error:
        raise ReplayError(rep.manifest_error)
    if rep.total_chunks is not None and rep.total_chunks != len(rep.chunks):
        raise ReplayError(f"{wire.manifest_key(rep.prefix)} declares {rep.total_chunks} chunk(s) but "
                          f"{len(rep.chunks)} exist")


def read_egress_events(conduit: Conduit, run_id: str, node_id: str) -> list[dict[str, Any]]:
    """The proxy's decisions for a node (written by the host, outside the node's prefix)."""
    from guest_runner import wire
    from guest_runner.conduit import ConduitError, ObjectNotFound
    from prefect_resoluto.node import egress_events_key

    try:
        raw = conduit.get(egress_events_key(run_id, node_id))
    except (ObjectNotFound, ConduitError):
        return []
    out = []
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            out.append(wire.decode_event(line))
        except wire.WireError:
            continue
    return out


def read_result(conduit: Conduit, prefix: str) -> dict[str, Any] | None:
    from guest_runner import wire
    from guest_runner.conduit import ObjectNotFound

    try:
        raw = conduit.get(wire.result_key(prefix))
    except ObjectNotFound:
        return None
    try:
        return wire.decode_result(raw)
    except wire.WireError as e:
        raise ReplayError(str(e)) from None


class TreePrinter:
    """Events as an indented span tree with times relative to the first event."""

    def __init__(self, out: TextIO, heartbeats: bool) -> None:
        self.out = out
        self.heartbeats = heartbeats
        self.t0: float | None = None
        self.depth: dict[str, int] = {}
        self.opened: dict[str, float] = {}
        self.counts = {"events": 0, "heartbeats": 0, "logs": 0}

    def __call__(self, ev: dict[str, Any]) -> None:
        self.counts["events"] += 1
        ts = float(ev["ts"])
        if self.t0 is None:
            self.t0 = ts
            when = datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="milliseconds")
            self.out.write(f"first event at {when}\n")
        kind, event, data = ev["kind"], ev["event"], ev.get("data") or {}
        span, parent = str(ev["span_id"]), str(ev.get("parent_span_id") or "")
        if kind == "heartbeat":
            self.counts["heartbeats"] += 1
            if not self.heartbeats:
                return
        base = self.depth.get(parent, -1) + 1 if parent else 0
        if event == "open":
            self.depth[span] = base
            self.opened[span] = ts
            argv = data.get("argv")
            cmd = f": {show_argv(argv, limit=400)}" if isinstance(argv, list) and argv else ""
            text = f"> {kind} {ev.get('name', '')}{cmd}"
        elif event == "close":
            depth = self.depth.get(span, base)
            status = ev.get("status") or "done"
            code = data.get("exit_code")
            took = f" ({(ts - self.opened[span]) * 1000:.0f} ms)" if span in self.opened else ""
            text = f"< {kind} {ev.get('name', '')}: {status}" + (f", exit code {code}" if code is not None else "") + took
            self.opened.pop(span, None)
            self._line(ts, depth, text)
            return
        else:
            self.counts["logs"] += 1
            line = str(data.get("line", "")) if kind != "heartbeat" else "(heartbeat)"
            level = str(data.get("level", "")).upper()
            logger = data.get("logger")
            tag = "!" if kind == "error" else "|"
            shown = (level and level != "INFO") or logger
            extra = f"[{level or 'INFO'}{' ' + str(logger) if logger else ''}] " if shown else ""
            text = f"{tag} {extra}{line}"
        self._line(ts, base, text)

    def _line(self, ts: float, depth: int, text: str) -> None:
        rel = ts - (self.t0 or ts)
        self.out.write(f"+{rel:8.3f}s {'  ' * depth}{text}\n")
        self.out.flush()


def cmd_events(args: argparse.Namespace) -> int:
    from urllib.parse import unquote, urlparse

    from guest_runner import wire
    from guest_runner.conduit import ConduitError, conduit_from_url

    parsed = urlparse(args.conduit)
    local = unquote(parsed.path) if parsed.scheme == "file" else args.conduit if args.conduit.startswith("/") else ""
    if local and not Path(local).is_dir():
        # A local conduit would create its root: a mistyped URL must not leave directories behind.
        _err(f"conduit directory {local} does not exist")
        return EXIT_FAILED
    try:
        conduit = conduit_from_url(args.conduit)
    except (ValueError, ImportError, ConduitError) as e:
        raise UsageError(f"--conduit: {e}") from None

    for value, what in ((args.run_id, "run id"), (args.node_id, "node id")):
        try:
            wire.check_id(value, what)
        except ValueError as e:
            raise UsageError(str(e)) from None

    events: list[dict[str, Any]] = []
    printer = TreePrinter(sys.stdout, heartbeats=args.heartbeats)
    error = ""
    rep: Replay | None = None
    result: dict[str, Any] | None = None
    try:
        rep = scan_node(conduit, args.run_id, args.node_id)
        if not args.json:
            print(f"node {args.node_id} of run {args.run_id} in {conduit.url} ({rep.prefix}/)")
        for ev in iter_events(conduit, rep):
            events.append(ev)
            if not args.json:
                printer(ev)
        result = read_result(conduit, rep.prefix)
    except ReplayError as e:
        error = str(e)
    except ConduitError as e:
        error = f"conduit {conduit.url}: {e}"
    egress_events = read_egress_events(conduit, args.run_id, args.node_id)
    if egress_events and not args.json:
        print(f"-- egress decisions by the run's proxy (host side): {len(egress_events)}")
        for ev in egress_events:
            printer(ev)
    if args.json:
        print(json.dumps({
            "run_id": args.run_id, "node_id": args.node_id, "conduit": conduit.url,
            "prefix": rep.prefix if rep else None, "events": events, "egress": egress_events,
            "chunks": len(rep.chunks) if rep else 0, "total_chunks": rep.total_chunks if rep else None,
            "result": result, "outbox": rep.outbox if rep else [], "error": error or None,
        }))
    elif rep is not None and not error:
        _print_verdict(rep, result, printer)
    if error:
        _err(error)
        return EXIT_FAILED
    return EXIT_OK


def _print_verdict(rep: Replay, result: dict[str, Any] | None, printer: TreePrinter) -> None:
    c = printer.counts
    state = (f"manifest: {rep.total_chunks} chunk(s)" if rep.total_chunks is not None
             else "no _manifest.json: the node is still running, or died before it finished")
    print(f"-- {len(rep.chunks)} chunk(s), {c['events']} event(s) ({c['heartbeats']} heartbeat(s)); {state}")
    if result is None:
        print("result: none (no result.json)")
        return
    code = f", exit code {result['exit_code']}" if result.get("exit_code") is not None else ""
    reason = f": {result['reason']}" if result.get("reason") else ""
    print(f"result: {result['status']}{code}{reason}")
    if result.get("output_archive"):
        print(f"outputs: {result['output_archive']}")
    for k in ("observed_phase", "substrate_logs"):
        if result.get(k):
            print(f"{k.replace('_', ' ')} (guest's word): {result[k]}")


# =========================================================================== sweep


def cmd_sweep(args: argparse.Namespace) -> int:
    from prefect_resoluto import runtimes

    labels = _parse_pairs(args.label, "--label")
    names: list[str] = list(dict.fromkeys(args.runtime or []))
    explicit = bool(names)
    for name in names:
        if name not in runtimes.RUNTIMES:
            raise UsageError(f"unknown runtime {name!r}; known runtimes: {', '.join(_known_runtimes())}")
    if not explicit:  # remote runtimes (kubernetes) only when named: their sweep is a cluster call
        names = [n for n in runtimes.RUNTIMES
                 if runtimes.RUNTIMES[n].supports_local_conduit and not runtimes.RUNTIMES[n].remote]
    chosen: list[tuple[str, SandboxRuntime | None, str]] = []
    for name in names:
        try:
            rt = runtimes.get_runtime(name)
            avail = rt.availability()
            chosen.append((name, rt, "") if avail.ok else (name, None, avail.why))
        except Exception as e:
            chosen.append((name, None, f"cannot be configured: {e}"))
    if explicit:
        for name, rt, why in chosen:
            if rt is None:
                raise UsageError(f"runtime {name!r} is unavailable here: {why}")
    report: dict[str, Any] = {"labels": labels, "reaped": {}, "skipped": {}, "errors": {}}
    for name, rt, why in chosen:
        if rt is None:
            report["skipped"][name] = why
            continue
        try:
            report["reaped"][name] = rt.sweep(labels)
        except Exception as e:
            report["errors"][name] = f"{type(e).__name__}: {e}"
    if args.json:
        print(json.dumps(report))
    else:
        what = " ".join(f"{k}={v}" for k, v in labels.items()) or "every prefect-resoluto sandbox"
        print(f"sweep ({what}):")
        for name, n in report["reaped"].items():
            print(f"  {name}: reaped {n} sandbox(es)")
        for name, why in report["skipped"].items():
            print(f"  {name}: skipped, unavailable: {why}")
        for name, e in report["errors"].items():
            print(f"  {name}: error: {e}")
    return EXIT_FAILED if report["errors"] else EXIT_OK


# =========================================================================== parser


def _node_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runtime", metavar="NAME", help="sandbox runtime (default: the strongest available "
                   "at or above --min-isolation; see `doctor`)")
    p.add_argument("--runtime-option", action="append", metavar="K=V",
                   help="runtime constructor option, e.g. oci_runtime=kata (V parsed as JSON if it can be)")
    p.add_argument("--conduit", metavar="URL", help="file:///dir or s3://bucket/prefix?endpoint_url=... "
                   "(default: a local directory under the user's cache directory)")
    p.add_argument("--workspace", metavar="DIR", help="directory staged into the sandbox as its working directory")
    p.add_argument("--output", action="append", metavar="GLOB",
                   help="workspace-relative glob of files to bring back (repeatable; ** crosses directories)")
    p.add_argument("--env", action="append", metavar="K=V", help="environment variable for the command")
    p.add_argument("--secret-env", action="append", metavar="K[=V]",
                   help="secret variable: redacted from all output; bare K takes the value from this environment")
    p.add_argument("--label", action="append", metavar="K=V", help="extra sandbox label (for sweep)")
    p.add_argument("--memory", metavar="QTY", help="memory limit, e.g. 512Mi or 2G")
    p.add_argument("--cpus", metavar="N", help="CPU limit, e.g. 1, 0.5 or 500m")
    p.add_argument("--image", metavar="IMG", help="container image (container and kubernetes runtimes)")
    p.add_argument("--min-isolation", default="user-kernel", metavar="LEVEL",
                   help="refuse runtimes weaker than this: vm, user-kernel (default), namespace, none")
    p.add_argument("--silence-window", type=float, metavar="S",
                   help="seconds without any event (not even a heartbeat) before the sandbox is presumed dead "
                   "(default 600)")
    p.add_argument("--egress", action="append", metavar="HOST",
                   help="allowlist a name the sandbox may reach (repeatable): api.example.com, "
                        "*.example.com, host:8443 (default ports 443 and 80); without it: no network")
    p.add_argument("--egress-resolve", action="append", metavar="HOST=IP",
                   help="pin an allowlisted name to an address (like curl --resolve; repeatable)")
    p.add_argument("--setup", metavar="SHELL", help="a shell command run in the sandbox before the command")
    p.add_argument("--setup-egress", action="append", metavar="HOST",
                   help="the --setup command's own allowlist (repeatable); the command gets --egress")
    p.add_argument("--outputs-dir", metavar="DIR", help="where outputs land (default ./resoluto-outputs/<node-id>)")
    p.add_argument("--run-id", metavar="ID", help="run id (default: a fresh random id)")
    p.add_argument("--node-id", metavar="ID", help="node id (default: cli-<random>)")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command and its arguments")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, allow_abbrev=False,
                     description="Run commands in isolated sandboxes (gVisor, bubblewrap, containers, Kubernetes) "
                                 "through a durable conduit, without Prefect.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="run one command in a sandbox and stream its output",
                         allow_abbrev=False, epilog=RUN_EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    _node_options(run)
    run.add_argument("--json", action="store_true", help="print the outcome as one JSON object on the last line")
    run.add_argument("-q", "--quiet", action="store_true", help="stderr: failures only, no progress indicator")
    run.set_defaults(func=cmd_run)

    doc = sub.add_parser("doctor", help="which runtimes work here, and which one `run` picks", allow_abbrev=False)
    doc.add_argument("--json", action="store_true")
    doc.set_defaults(func=cmd_doctor)

    ev = sub.add_parser("events", help="replay a node's events from the conduit as a span tree",
                        allow_abbrev=False)
    ev.add_argument("--conduit", required=True, metavar="URL")
    ev.add_argument("run_id", metavar="RUN_ID")
    ev.add_argument("node_id", metavar="NODE_ID")
    ev.add_argument("--heartbeats", action="store_true", help="show heartbeat records too")
    ev.add_argument("--json", action="store_true", help="one JSON object: events, result, error")
    ev.set_defaults(func=cmd_events)

    sw = sub.add_parser("sweep", help="reap orphaned sandboxes", allow_abbrev=False)
    sw.add_argument("--runtime", action="append", metavar="NAME",
                    help="only this runtime (repeatable; default: every available local runtime)")
    sw.add_argument("--label", action="append", metavar="K=V",
                    help="only sandboxes carrying all these labels (default: every prefect-resoluto sandbox)")
    sw.add_argument("--json", action="store_true")
    sw.set_defaults(func=cmd_sweep)

    rd = sub.add_parser("render", help="print what one node would send: Kubernetes objects as YAML, or the "
                        "Solari create request and guest command as JSON (no cluster or gateway needed)",
                        allow_abbrev=False)
    _node_options(rd)
    rd.set_defaults(func=cmd_render)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        func: Callable[[argparse.Namespace], int] = args.func
        return func(args)
    except UsageError as e:
        _err(str(e))
        return EXIT_USAGE
    except KeyboardInterrupt:  # outside a run (doctor, events ...): nothing to reap
        return EXIT_SIGINT
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as a shell pipeline expects.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
