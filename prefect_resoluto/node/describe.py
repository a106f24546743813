"""What one guest event says to a person: its level and line, or nothing (liveness only).

Shared by every caller that shows a node's events (the task run's logs, a flow run's
logs, ``prefect-resoluto run``), so a line reads the same wherever it appears. Pure: the
text is the guest's and stays untrusted (callers escape it for a terminal).
"""

from __future__ import annotations

import logging

from guest_runner import wire

RUNNER_SPANS = frozenset({"node", "setup", "workload", "cleanup"})
_LEVELS = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
}


def describe_event(ev: wire.SpanEvent) -> tuple[int, str] | None:
    """(level, message) for one event, or None for events that are liveness only."""
    kind, event, data = ev.get("kind", ""), ev.get("event", ""), ev.get("data") or {}
    if kind == "heartbeat":
        return None
    if event == "log":
        level = _LEVELS.get(
            str(data.get("level", "")).upper(), logging.ERROR if kind == "error" else logging.INFO
        )
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
