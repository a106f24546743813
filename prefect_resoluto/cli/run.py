"""``prefect-resoluto run``: drive one node in a sandbox and stream its output.

stdout carries the workload's own lines as they arrive (with ``--json``, the outcome
as one JSON object on the very last line); stderr carries the runner's notes, prefixed
``resoluto:``, and the live progress line when it is a terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from prefect_resoluto.cli.common import (
    EXIT_FAILED,
    EXIT_INFRA,
    EXIT_OK,
    PROG,
    UsageError,
    redact_json,
    show_argv,
)
from prefect_resoluto.cli.output import BAD, DIM, OK, WARN, Out, Progress, err
from prefect_resoluto.node.observer import NodeObserver, WorkloadOutput
from prefect_resoluto.node.terminal import safe

if TYPE_CHECKING:
    from guest_runner.redact import Redactor
    from guest_runner.wire import SpanEvent
    from prefect_resoluto.node.outcome import NodeOutcome
    from prefect_resoluto.runtimes.base import SandboxHandle


class Interrupted(KeyboardInterrupt):
    """SIGINT/SIGTERM during a run. A KeyboardInterrupt, so no ``except Exception`` in the
    driver swallows it and its ``finally`` reaps the sandbox on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class EventPrinter:
    """The node's events as the CLI shows them: workload lines to stdout, runner notes to stderr."""

    def __init__(
        self,
        out: TextIO,
        err: TextIO,
        redactor: Redactor,
        *,
        quiet: bool,
        progress: Progress,
        raw: bool = False,
    ) -> None:
        self.out = out
        self.raw = raw
        self.err = err
        self.notes = Out(err)
        self.redactor = redactor
        self.quiet = quiet
        self.progress = progress
        self.lock = progress.lock
        self.output = WorkloadOutput()
        self.lines = 0

    def write(self, stream: TextIO, text: str) -> None:
        """One line (redacted), never styled: the sandbox wrote it, so its control characters
        are shown escaped (``\\x1b``), on a terminal or in a file alike, unless ``--raw``."""
        line = self.redactor.text(text)
        with self.lock:
            self.progress.clear_locked()
            stream.write((line if self.raw else safe(line)) + "\n")
            stream.flush()

    def note(self, text: str, style: str = "") -> None:
        with self.lock:
            self.progress.clear_locked()
            self.notes.line(("resoluto: ", DIM), (self.redactor.text(text), style))

    def __call__(self, ev: SpanEvent) -> None:
        import logging

        from prefect_resoluto.node.describe import describe_event

        self.progress.events += 1
        self.progress.phase = "running"
        kind, event = ev.get("kind", ""), ev.get("event", "")
        workload_line = self.output.line(ev) is not None
        described = describe_event(ev)
        if described is None:  # heartbeats
            return
        level, message = described
        if event == "open" and isinstance((ev.get("data") or {}).get("argv"), list):
            message = f"> {kind} {ev.get('name', '')}: {show_argv(ev['data']['argv'])}"
        if workload_line:
            self.lines += 1
            self.write(self.out, message)
            return
        if level >= logging.ERROR or (not self.quiet and level >= logging.INFO):
            self.note(message, BAD if level >= logging.ERROR else WARN if level >= logging.WARNING else "")


class CliObserver(NodeObserver):
    """One node as ``run`` sees it: the progress line learns of the launch, the printer gets
    every event."""

    def __init__(self, printer: EventPrinter, progress: Progress) -> None:
        self.printer = printer
        self.progress = progress
        self.sandbox_launched = False

    def launched(self, handle: SandboxHandle) -> None:
        self.sandbox_launched = True
        self.progress.launched()

    def event(self, ev: SpanEvent) -> None:
        self.printer(ev)


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
            os.write(
                2,
                f"\n{PROG}: interrupted again; a sandbox may be left behind -- "
                f"'{PROG} sweep' reaps it\n".encode(),
            )
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


def main(args: argparse.Namespace) -> int:
    from prefect_resoluto.cli.plan import plan_node
    from prefect_resoluto.node.drive import drive
    from prefect_resoluto.runtimes.base import IsolationTooWeak
    from prefect_resoluto.runtimes.labels import node_labels

    plan = plan_node(args)
    spec, rt, red = plan.spec, plan.runtime, plan.redactor
    lock = threading.Lock()
    progress = Progress(
        sys.stderr,
        enabled=sys.stderr.isatty() and not args.quiet,
        label=f"{spec.node_id} on {rt.display_name}",
        lock=lock,
    )
    printer = EventPrinter(sys.stdout, sys.stderr, red, quiet=args.quiet, progress=progress, raw=args.raw)
    if not args.quiet:
        printer.note(
            f"node {spec.node_id} of run {spec.run_id} on {rt.display_name} "
            f"({rt.isolation.label}), conduit {plan.conduit.url}"
        )
    node = CliObserver(printer, progress)

    with _interruptible():
        progress.start()
        try:
            outcome = drive(spec, plan.conduit, rt, node)
        except Interrupted as e:
            progress.stop()
            # drive_node's finally destroyed the sandbox it knew of; one interrupted
            # mid-launch is only findable by its labels.
            try:
                rt.sweep(node_labels(spec.run_id, spec.node_id))
            except Exception as sweep_error:  # best effort: say so, keep the exit code
                err(f"could not sweep node {spec.node_id}: {sweep_error}")
            print(
                f"{PROG}: interrupted ({e}); the sandbox of node {spec.node_id} was reaped",
                file=sys.stderr,
                flush=True,
            )
            return 128 + e.signum
        except BrokenPipeError:
            raise
        except Exception as e:
            if not node.sandbox_launched and isinstance(e, (ValueError, FileNotFoundError, IsolationTooWeak)):
                # drive_node refuses bad input before launching (validation, floor, packing
                # the workspace -- e.g. a device file or a link pointing outside it).
                raise UsageError(red.text(str(e))) from None
            # Anything else is the machinery's fault (conduit down while putting the inbox,
            # a runtime's prepare step, a status call that broke): infrastructure.
            progress.stop()
            err(
                f"infrastructure error{' after launch' if node.sandbox_launched else ' before launch'} of node "
                f"{spec.node_id}: {type(e).__name__}: {red.text(str(e))}"
            )
            return EXIT_INFRA
        finally:
            progress.stop()

    code = exit_code_for(outcome)
    if outcome.ok:
        if not args.quiet:
            n = len(outcome.output_files)
            where = f"; {n} output file(s) in {_rel(outcome.output_dir)}" if spec.output_paths else ""
            printer.note(
                f"node {outcome.node_id} succeeded on {outcome.runtime} ({outcome.isolation}) in "
                f"{outcome.timings.get('finish', 0):.2f}s{where}",
                OK,
            )
    else:
        kind = "infrastructure failure" if outcome.infrastructure_failure else "workload failure"
        printer.note(
            f"{outcome.describe()}\n({kind}; exit {code}) replay: {PROG} events --conduit "
            f"{shlex.quote(outcome.conduit_url)} {outcome.run_id} {outcome.node_id}",
            BAD,
        )
    if args.json:
        printer.write(sys.stdout, json.dumps(redact_json(outcome.to_json(), red), sort_keys=False))
    return code


def _rel(path: Path | None) -> str:
    if path is None:
        return "-"
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
