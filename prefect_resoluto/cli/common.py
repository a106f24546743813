"""The vocabulary every command shares: exit codes, bad input, ``KEY=VALUE`` flags.

Standard library only, imported when the parser is built: nothing here may cost start time.
A leaf of the CLI: how things look (``err`` among them) is :mod:`prefect_resoluto.cli.output`,
which imports this module, never the other way round.
"""

from __future__ import annotations

import os
import shlex
import signal
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from guest_runner.redact import Redactor

PROG = "prefect-resoluto"

EXIT_OK = 0
EXIT_FAILED = 1  # a workload failure without an exit code; `events`/`doctor`/`sweep` problems
EXIT_USAGE = 2  # bad input: nothing was launched
EXIT_INFRA = 125  # the sandbox failed, not the work (as `docker run`/`podman run` use 125)
EXIT_SIGINT = 128 + signal.SIGINT
EXIT_SIGTERM = 128 + signal.SIGTERM


class UsageError(Exception):
    """Bad input; main() prints it as one line and exits 2."""


def one_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    if not lines:
        return "unknown error"
    return lines[0] if len(lines) == 1 else lines[0] + " " + "; ".join(lines[1:])


def parse_pairs(values: Sequence[str] | None, flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"{flag} {item!r} is malformed: expected KEY=VALUE")
        if "\x00" in key or "\x00" in value:
            raise UsageError(f"{flag} {key!r} contains a NUL byte")
        out[key] = value
    return out


def parse_secret_env(values: Sequence[str] | None) -> dict[str, str]:
    """``K=V``, or a bare ``K`` taking the value from this process's environment -- so a
    secret need not appear in the command line (``ps`` shows it to every local user)."""
    out: dict[str, str] = {}
    for item in values or ():
        key, sep, value = item.partition("=")
        if not key.strip():
            raise UsageError(f"--secret-env {item!r} is malformed: expected KEY=VALUE or KEY")
        if not sep:
            if key not in os.environ:
                raise UsageError(
                    f"--secret-env {key}: no '=' and no {key} in the environment to take it from"
                )
            value = os.environ[key]
        out[key] = value
    return out


def parse_options(values: Sequence[str] | None) -> dict[str, Any]:
    """``--runtime-option K=V``: V is JSON when it parses (true, 3, ["a"]), else a string."""
    import json

    out: dict[str, Any] = {}
    for key, raw in parse_pairs(values, "--runtime-option").items():
        try:
            out[key.replace("-", "_")] = json.loads(raw)
        except ValueError:
            out[key.replace("-", "_")] = raw
    return out


def strip_dashdash(argv: Sequence[str]) -> list[str]:
    # argparse.REMAINDER keeps the separating "--"; the command starts after it.
    argv = list(argv)
    return argv[1:] if argv[:1] == ["--"] else argv


def show_argv(argv: object, limit: int = 160) -> str:
    """A command as one shell-quoted line (newlines escaped, long ones cut) for notes."""
    if not isinstance(argv, list) or not argv:
        return ""
    text = shlex.join(str(a) for a in argv).replace("\r", "\\r").replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def redact_json(obj: Any, redactor: Redactor) -> Any:
    """Redact every string (keys too) without Redactor.data's name-based masking, which
    would blank e.g. an output file called ``api_key.txt``."""
    if isinstance(obj, str):
        return redactor.text(obj)
    if isinstance(obj, dict):
        return {redactor.text(str(k)): redact_json(v, redactor) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_json(v, redactor) for v in obj]
    return obj


def known_runtimes() -> list[str]:
    from prefect_resoluto.runtimes import RUNTIMES

    return sorted(RUNTIMES)
