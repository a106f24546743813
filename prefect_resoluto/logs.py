"""Guest span events -> lines in the task run's Prefect logs.

Records carry the guest's own timestamp and the logger name ``resoluto.sandbox`` and
go through the handlers of ``prefect.task_runs`` (the console and the API log handler),
so they appear exactly where the task's own log lines do. Prefect batches API logs; a
background flush keeps a sandbox's output visible within about a second.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from guest_runner.redact import Redactor

SANDBOX_LOGGER = "resoluto.sandbox"
RUNNER_SPANS = frozenset({"node", "setup", "workload", "cleanup"})
_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
           "WARN": logging.WARNING, "ERROR": logging.ERROR, "CRITICAL": logging.CRITICAL}


def describe_event(ev: dict[str, Any]) -> tuple[int, str] | None:
    """(level, message) for one event, or None for events that are liveness only."""
    kind, event, data = ev.get("kind", ""), ev.get("event", ""), ev.get("data") or {}
    if kind == "heartbeat":
        return None
    if event == "log":
        level = _LEVELS.get(str(data.get("level", "")).upper(), logging.ERROR if kind == "error" else logging.INFO)
        line = str(data.get("line", ""))
        logger = data.get("logger")
        if logger and logger not in ("prefect.task_runs", "prefect.flow_runs"):
            line = f"[{logger}] {line}"
        return level, line
    name = ev.get("name", "")
    # The guest runner's own spans are bookkeeping: the host's start and outcome lines say
    # what a user needs (an outcome line carries the failure), so these stay at DEBUG.
    own = kind in RUNNER_SPANS
    if event == "open":
        argv = data.get("argv")
        extra = f" {' '.join(map(str, argv))}" if isinstance(argv, list) and kind in RUNNER_SPANS else ""
        return logging.DEBUG if own else logging.INFO, f"> {kind} {name}{extra}".rstrip()
    if event == "close":
        status = ev.get("status") or "done"
        code = data.get("exit_code")
        tail = f" (exit code {code})" if code is not None else ""
        level = logging.DEBUG if own else logging.ERROR if status == "failure" else logging.INFO
        return level, f"< {kind} {name}: {status}{tail}"
    return logging.INFO, str(ev)


class FlushPacer:
    """Flushes Prefect's API log batch at most every ``interval`` seconds while dirty."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="resoluto-log-flush", daemon=True)
            self._thread.start()

    def mark(self) -> None:
        self._dirty.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._dirty.wait(timeout=1.0):
                # Pace: let what arrives in the next interval join this batch (stop ends it early).
                self._stop.wait(self.interval)
                self._dirty.clear()
                flush_api_logs()

    def stop(self) -> None:
        self._stop.set()
        self._dirty.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        flush_api_logs()


def flush_api_logs() -> None:
    try:
        from prefect.logging.handlers import APILogHandler

        APILogHandler().flush()
    except Exception:  # logging must never break a task
        pass


class EventLogForwarder:
    """Callable handed to the node driver: one Prefect log record per guest event."""

    def __init__(self, *, task_run_id: Any, flow_run_id: Any, node_id: str, redactor: Redactor | None = None,
                 pacer: FlushPacer | None = None) -> None:
        self.task_run_id = task_run_id
        self.flow_run_id = flow_run_id
        self.node_id = node_id
        self.redactor = redactor or Redactor()
        self.pacer = pacer
        self.target = logging.getLogger("prefect.task_runs")
        self.lines = 0

    def emit(self, level: int, message: str, ts: float | None = None) -> None:
        record = logging.LogRecord(SANDBOX_LOGGER, level, __file__, 0, self.redactor.text(message), None, None)
        if ts is not None:
            record.created = float(ts)
            record.msecs = (record.created - int(record.created)) * 1000
        record.task_run_id = self.task_run_id
        record.flow_run_id = self.flow_run_id
        record.resoluto_node_id = self.node_id
        if self.target.isEnabledFor(level):
            self.target.handle(record)
        self.lines += 1
        if self.pacer is not None:
            self.pacer.mark()

    def __call__(self, ev: dict[str, Any]) -> None:
        described = describe_event(ev)
        if described is not None:
            self.emit(described[0], described[1], ev.get("ts"))
