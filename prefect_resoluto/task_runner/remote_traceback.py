"""A sandbox's traceback as a host exception's own ``__traceback__``.

Prefect logs a failed task with ``exc_info``: what a user reads is the exception's
traceback as Python formats it. For a sandboxed task that traceback is made of the
sandbox's frames (the task's function and what it called, as the guest reported them),
so the record reads as the same task's record on threads: Prefect's engine frames, then
the task's own, then the exception. Neither the guest runner's frames nor the host's
plumbing appear.

Each frame is a real frame object of a two-line code object (``raise (__exc)``) carrying
the remote file name, function name and line. Everything in a frame came from the
sandbox and is hostile: names are bounded and redacted; a frame names a host file only
for a workspace file (the host's own copy, the file shipped to the sandbox, its source
line shown as on threads, unless that line holds a secret); any other path is shown as
``<sandbox: path>``, a name Python's ``linecache`` never opens, so a sandbox cannot make
the host read one of its files into a log.
"""

from __future__ import annotations

import linecache
import types
from pathlib import Path, PurePosixPath
from typing import Any

from guest_runner.redact import Redactor

MAX_FRAMES = 1000
MAX_CHAIN = 8
MAX_NAME = 200
MAX_PATH = 1024
MAX_LINE = 10_000_000
_EXC = "__resoluto_exc"
# Two lines, so the frame's position spans lines and Python draws no carets under a
# source line this code was not compiled from.
_TEMPLATE = compile(f"raise (\n    {_EXC})\n", "<sandbox>", "exec")


def _text(value: Any, limit: int, redactor: Redactor) -> str | None:
    if not isinstance(value, str) or not value or len(value) > limit or "\x00" in value:
        return None
    return redactor.text(value)


def _host_file(rel: str, workspace: Path | None, lineno: int, redactor: Redactor) -> str | None:
    """The host's copy of a workspace file, if ``rel`` names one and the line shown is clean."""
    if workspace is None:
        return None
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        return None
    root = workspace.resolve()
    path = (root / p).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        return None
    line = linecache.getline(str(path), lineno)
    if redactor.text(line) != line:
        return None  # a secret on that line: shown without it
    return str(path)


def _frame(exc: BaseException, filename: str, lineno: int, name: str) -> types.TracebackType | None:
    code = _TEMPLATE.replace(co_filename=filename, co_name=name, co_firstlineno=lineno)
    try:
        exec(code, {_EXC: exc, "__builtins__": {}})
    except BaseException as raised:  # the point: the frame it was raised in
        tb = raised.__traceback__
        return tb.tb_next if tb is not None else None
    return None


def build(
    exc: BaseException, frames: Any, *, workspace: Path | None, redactor: Redactor | None = None
) -> types.TracebackType | None:
    """A traceback of the sandbox's ``frames`` (error.json's list) for ``exc``; frames
    that do not make sense are left out."""
    redactor = redactor or Redactor()
    if not isinstance(frames, list):
        return None
    head: types.TracebackType | None = None
    for f in reversed(frames[-MAX_FRAMES:]):
        if not isinstance(f, dict):
            continue
        lineno = f.get("line")
        if not isinstance(lineno, int) or isinstance(lineno, bool) or not 0 < lineno <= MAX_LINE:
            continue
        name = _text(f.get("name"), MAX_NAME, redactor)
        path = _text(f.get("file"), MAX_PATH, redactor)
        if name is None or path is None:
            continue
        host = _host_file(path, workspace, lineno, redactor) if f.get("workspace") is True else None
        shown = host or f"<sandbox: {path.replace('>', '?')}>"
        tb = _frame(exc, shown, lineno, name)
        if tb is None:
            continue
        tb.tb_next = head
        head = tb
    return head


def is_sandbox_frame(tb: types.TracebackType) -> bool:
    code = tb.tb_frame.f_code
    return code.co_code == _TEMPLATE.co_code and code.co_names == _TEMPLATE.co_names


def from_the_task(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` from the sandbox's first frame on: the host's plumbing between the engine's
    call of the task function and the re-raise goes (None when no frame came from the
    sandbox: a runner-made error, whose message says it all)."""
    while tb is not None and not is_sandbox_frame(tb):
        tb = tb.tb_next
    return tb
