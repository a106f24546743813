"""``prefect-resoluto``: run one command in a sandbox without Prefect, and look after sandboxes.

Subcommands, one module each: ``run`` (drive one node and stream its output),
``doctor`` (which runtimes work here and which one ``run`` picks), ``events`` (replay a
node's events from the conduit, also after the sandbox is gone), ``sweep`` (reap
orphaned sandboxes) and ``render`` (the Kubernetes objects of one node as YAML, or the
Solari create request and guest command as JSON). This module is the parser and the
dispatch; ``output`` is how things look, ``plan`` validates a node's flags.

Output conventions of ``run``:

* stdout carries the workload's own lines (stdout and stderr of the command, which the
  guest merges) as they arrive, and nothing else -- except, with ``--json``, one JSON
  object (``NodeOutcome.to_json()``) on the very last line;
* stderr carries the runner's notes (span open/close, staging, outputs, the verdict),
  prefixed ``resoluto:``; ``--quiet`` keeps only failures; a live progress line is drawn
  on stderr only when stderr is a terminal;
* colour only on a terminal, never with ``NO_COLOR``; ``--json`` output is never styled;
* the values of ``--secret-env`` variables are replaced by ``***`` in everything printed.

Exit codes: the workload's own exit code (0 on success; 126/127 when the command cannot
be executed / is not found, 128+N when killed by signal N, as a shell reports them; 1
for a workload failure without an exit code); 2 for bad input, detected before anything
is launched; 125 for an infrastructure failure (the sandbox could not start, was lost,
was killed by the substrate, left no result, or broke the wire protocol); 130/143 when
interrupted by SIGINT/SIGTERM (the sandbox is reaped first).

The CLI never imports Prefect, and a command's module (and rich) is imported only when
that command runs: ``--help`` costs argparse and the settings' declaration (settings/fields.py).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from prefect_resoluto.cli.common import EXIT_SIGINT, EXIT_USAGE, PROG, UsageError

__all__ = ["PROG", "UsageError", "build_parser", "main"]

RUN_EPILOG = """\
output: the command's lines on stdout as they arrive (with --json, the outcome as one
JSON object on the last line); runner notes and the verdict on stderr.
exit codes: the command's own (0 success, 126/127 cannot execute / not found, 128+N
killed by signal N, 1 failed without a code); 2 bad input (nothing launched);
125 infrastructure failure; 130/143 interrupted (the sandbox is reaped first).
example: prefect-resoluto run --workspace . --output 'out/**' -- python3 build.py"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line instead of argparse's usage dump: the brief is "clear one-line error".
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _node_options(p: argparse.ArgumentParser) -> None:
    # One flag per sandbox setting the CLI takes, as declared (settings/fields.py), then the CLI's own.
    from prefect_resoluto.settings.fields import SETTINGS, Flag

    for s in SETTINGS.values():
        if isinstance(s.cli, Flag):
            p.add_argument(
                s.cli.flag,
                action="append" if s.cli.repeat else "store",
                metavar=s.cli.metavar,
                help=s.cli.help,
                default=s.cli.default,
                type=s.cli.type,
            )
    p.add_argument("--label", action="append", metavar="K=V", help="extra sandbox label (for sweep)")
    p.add_argument("--run-id", metavar="ID", help="run id (default: a fresh random id)")
    p.add_argument("--node-id", metavar="ID", help="node id (default: cli-<random>)")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command and its arguments")


def build_parser() -> argparse.ArgumentParser:
    """Every command and flag. A command is dispatched to ``prefect_resoluto.cli.<command>.main``."""
    parser = _Parser(
        prog=PROG,
        allow_abbrev=False,
        description="Run commands in isolated sandboxes (gVisor, bubblewrap, containers, Kubernetes) "
        "through a durable conduit, without Prefect.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="run one command in a sandbox and stream its output",
        allow_abbrev=False,
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _node_options(run)
    run.add_argument(
        "--json", action="store_true", help="print the outcome as one JSON object on the last line"
    )
    run.add_argument(
        "-q", "--quiet", action="store_true", help="stderr: failures only, no progress indicator"
    )
    run.add_argument(
        "--raw",
        action="store_true",
        help="write the command's output as it is, control characters included "
        "(default: shown escaped, e.g. \\x1b, so it cannot drive the terminal)",
    )

    doc = sub.add_parser(
        "doctor", help="which runtimes work here, and which one `run` picks", allow_abbrev=False
    )
    doc.add_argument("--json", action="store_true")

    ev = sub.add_parser(
        "events", help="replay a node's events from the conduit as a span tree", allow_abbrev=False
    )
    ev.add_argument("--conduit", required=True, metavar="URL")
    ev.add_argument("run_id", metavar="RUN_ID")
    ev.add_argument("node_id", metavar="NODE_ID")
    ev.add_argument("--heartbeats", action="store_true", help="show heartbeat records too")
    ev.add_argument("--json", action="store_true", help="one JSON object: events, result, error")

    sw = sub.add_parser("sweep", help="reap orphaned sandboxes", allow_abbrev=False)
    sw.add_argument(
        "--runtime",
        action="append",
        metavar="NAME",
        help="only this runtime (repeatable; default: every available local runtime)",
    )
    sw.add_argument(
        "--label",
        action="append",
        metavar="K=V",
        help="only sandboxes carrying all these labels (default: every prefect-resoluto sandbox)",
    )
    sw.add_argument("--json", action="store_true")

    rd = sub.add_parser(
        "render",
        help="print what one node would send: Kubernetes objects as YAML, or the "
        "Solari create request and guest command as JSON (no cluster or gateway needed)",
        allow_abbrev=False,
    )
    _node_options(rd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if not args.command:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        command = importlib.import_module(f"{__name__}.{args.command}")
        code: int = command.main(args)
        return code
    except UsageError as e:
        from prefect_resoluto.cli.output import err  # only on bad input: no cost at start

        err(str(e))
        return EXIT_USAGE
    except KeyboardInterrupt:  # outside a run (doctor, events ...): nothing to reap
        return EXIT_SIGINT
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as a shell pipeline expects.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
