"""How the CLI looks: colour only on a terminal, the live progress line, the span tree.

Lines are built as spans of ``(text, rich style)``: on a pipe, a file or with
``NO_COLOR`` they are written as their plain text (rich is not even imported, so a
pipe pays nothing for it and never sees an escape code); on a terminal rich draws them.
The text is the same either way, so what a script greps is what a person reads.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, TextIO

from prefect_resoluto.cli.common import PROG, one_line, show_argv
from prefect_resoluto.node.terminal import safe

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.text import Text

    from guest_runner.wire import SpanEvent

Span = str | tuple[str, str]  # plain text, or (text, rich style)

# Styles by meaning, so every command colours the same thing the same way.
OK, BAD, WARN, DIM, STRONG = "green", "red", "yellow", "dim", "bold"
ISOLATION_STYLE = {"vm": "bold green", "user-kernel": "green", "namespace": "yellow", "none": "red"}
STATUS_STYLE = {"success": OK, "failure": BAD, "crashed": BAD, "cancelled": WARN}


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


def wants_color(stream: TextIO) -> bool:
    """Colour on a terminal only, and never with ``NO_COLOR`` (https://no-color.org) or
    ``TERM=dumb``. ``FORCE_COLOR`` is not honoured: a pipe must stay plain text."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return is_terminal(stream)


class Out:
    """Styled lines (and rich renderables) to one stream."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.terminal = is_terminal(stream)
        self.color = wants_color(stream)
        self._console: Console | None = None

    @property
    def console(self) -> Console:
        if self._console is None:
            from rich.console import Console

            self._console = Console(
                file=self.stream,
                force_terminal=self.terminal,
                color_system="auto" if self.color else None,
                highlight=False,
                markup=False,
                emoji=False,
                # Off a terminal nothing wraps: one record, one line, for grep and cut.
                width=None if self.terminal else 100_000,
            )
        return self._console

    def text(self, spans: Iterable[Span]) -> Text:
        from rich.text import Text

        out = Text()
        for s in spans:
            text, style = (s, "") if isinstance(s, str) else s
            out.append(safe(text), style)
        return out

    def line(self, *spans: Span) -> None:
        """One line, whatever its spans hold: every control character in them (a guest's
        reason, phase or path as much as the host's own text) is shown escaped, never
        obeyed (:mod:`prefect_resoluto.node.terminal`)."""
        if self.color:
            self.console.print(self.text(spans), soft_wrap=True)
        else:
            self.stream.write("".join(safe(s if isinstance(s, str) else s[0]) for s in spans) + "\n")
        self.stream.flush()

    def show(self, renderable: RenderableType) -> None:
        """A table or another renderable; plain (and without trailing blanks) off colour."""
        if self.color:
            self.console.print(renderable)
        else:
            with self.console.capture() as cap:
                self.console.print(renderable)
            self.stream.write("".join(ln.rstrip() + "\n" for ln in cap.get().splitlines()))
        self.stream.flush()


def err(message: str) -> None:
    """``prefect-resoluto: error: <one line>`` on stderr ("error:" in red on a terminal)."""
    Out(sys.stderr).line(f"{PROG}: ", ("error:", "bold red"), f" {one_line(message)}")


class Progress:
    """A one-line live status on stderr while a node runs (only when it is a terminal):
    rich's spinner, the phase (launching, starting, running), elapsed time, events.

    Redrawn by a thread; every line printed through :class:`~prefect_resoluto.cli.run.EventPrinter`
    first erases it under the shared lock, so workload output never interleaves with it.
    """

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
        from rich.spinner import Spinner

        out = Out(self.stream)
        frames: list[str] = list(Spinner("dots").frames)
        frame = 0
        while not self._stop.wait(0.1):  # animation pace, not synchronisation
            with self.lock:
                elapsed = time.monotonic() - self.t0
                line = out.text(
                    [
                        (frames[frame % len(frames)] + " ", "cyan"),
                        (f"{self.label}: ", STRONG),
                        (self.phase, "cyan"),
                        (f" {elapsed:.1f}s, {self.events} event(s)", DIM),
                    ]
                )
                frame += 1
                line.truncate(max(out.console.width - 1, 10), overflow="ellipsis")
                self.stream.write("\r\x1b[K")
                out.console.print(line, end="", soft_wrap=True)
                self.stream.flush()
                self._shown = True

    def clear_locked(self) -> None:
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False

    def launched(self) -> None:
        self.phase = "starting"

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        with self.lock:
            self.clear_locked()


class TreePrinter:
    """Events as a span tree, one line each as they are read, times relative to the first.

    Children are indented under their parent span; on a terminal the nesting is drawn
    with guide lines and statuses in colour.
    """

    def __init__(self, out: Out, heartbeats: bool) -> None:
        self.out = out
        self.heartbeats = heartbeats
        self.guide = "│ " if out.terminal else "  "
        self.t0: float | None = None
        self.depth: dict[str, int] = {}
        self.opened: dict[str, float] = {}
        self.counts = {"events": 0, "heartbeats": 0, "logs": 0}

    def __call__(self, ev: SpanEvent) -> None:
        self.counts["events"] += 1
        ts = float(ev["ts"])
        if self.t0 is None:
            self.t0 = ts
            when = datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="milliseconds")
            self.out.line(("first event at ", DIM), when)
        kind, event, data = ev["kind"], ev["event"], ev.get("data") or {}
        span, parent = str(ev["span_id"]), str(ev.get("parent_span_id") or "")
        if kind == "heartbeat":
            self.counts["heartbeats"] += 1
            if not self.heartbeats:
                return
        base = self.depth.get(parent, -1) + 1 if parent else 0
        name = str(ev.get("name", ""))
        if event == "open":
            self.depth[span] = base
            self.opened[span] = ts
            argv = data.get("argv")
            cmd = f": {show_argv(argv, limit=400)}" if isinstance(argv, list) and argv else ""
            self._line(ts, base, (f"> {kind} {name}", STRONG), cmd)
        elif event == "close":
            depth = self.depth.get(span, base)
            status = str(ev.get("status") or "done")
            code = data.get("exit_code")
            took = f" ({(ts - self.opened[span]) * 1000:.0f} ms)" if span in self.opened else ""
            self.opened.pop(span, None)
            self._line(
                ts,
                depth,
                (f"< {kind} {name}", STRONG),
                ": ",
                (status, STATUS_STYLE.get(status, "")),
                f", exit code {code}" if code is not None else "",
                (took, DIM),
            )
        else:
            self.counts["logs"] += 1
            line = str(data.get("line", "")) if kind != "heartbeat" else "(heartbeat)"
            level = str(data.get("level", "")).upper()
            logger = data.get("logger")
            shown = (level and level != "INFO") or logger
            extra = f"[{level or 'INFO'}{' ' + str(logger) if logger else ''}] " if shown else ""
            style = (
                BAD
                if kind == "error" or level in ("ERROR", "CRITICAL")
                else WARN
                if level == "WARNING"
                else ""
            )
            self._line(ts, base, ("! " if kind == "error" else "| ", style or DIM), (extra, style), line)

    def _line(self, ts: float, depth: int, *spans: Span) -> None:
        # Every span may carry a sandbox's text (names, lines, levels, loggers): escaped.
        rel = ts - (self.t0 or ts)
        shown = [(safe(s[0]), s[1]) if isinstance(s, tuple) else safe(s) for s in spans]
        self.out.line((f"+{rel:8.3f}s ", DIM), (self.guide * depth, DIM), *shown)
