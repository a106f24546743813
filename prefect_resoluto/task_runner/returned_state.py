"""A Prefect state a sandboxed task returned to end in, rebuilt on the host.

Under a thread, a task that returns ``Failed(message=...)`` (or ``Completed``,
``Cancelled``, ``Crashed``, with a name of its own such as ``"Skipped"``) ends in that
state: Prefect's engine takes a state its function returns as the run's final state. The
sandbox sends the state's type, name, message and data (``guest_runner.call``); the host
builds a new state from them, a type from a fixed list, its name and message redacted,
then bounded, so what the sandbox chose is only ever one of those four ends.
"""

from __future__ import annotations

from typing import Any

from guest_runner.redact import Redactor
from prefect_resoluto.task_runner import error_file

#: The state types a task may return to end in.
FINAL_STATES = frozenset(("COMPLETED", "FAILED", "CANCELLED", "CRASHED"))
#: Most characters of a returned state's name.
MAX_NAME = 200


def build(record: Any, redactor: Redactor | None) -> Any:
    """The ``prefect.client.schemas.objects.State`` for ``record``; ValueError if it is not
    one a task may end in."""
    from prefect.client.schemas.objects import State, StateType

    if not isinstance(record, dict):
        raise ValueError("a returned state is an object")
    kind = record.get("type")
    if kind not in FINAL_STATES:
        raise ValueError(f"a task cannot end in a state of type {str(kind)[:40]!r}")
    name, message = record.get("name"), record.get("message")
    if name is not None and not isinstance(name, str):
        raise ValueError("a returned state's name is text")
    if message is not None and not isinstance(message, str):
        raise ValueError("a returned state's message is text")
    if redactor is not None and redactor.count:  # whole, then cut: a cut never splits a secret
        name = redactor.text(name) if name else name
        message = redactor.text(message) if message else message
    return State(
        type=StateType(kind),
        name=name[:MAX_NAME] if name else None,
        message=message[: error_file.MAX_MESSAGE] if message is not None else None,
        data=record.get("value"),
    )


def is_state(value: Any) -> bool:
    from prefect.client.schemas.objects import State

    return isinstance(value, State)
