"""The words of a refused Prefect call: one shape wherever a sandbox makes it.

A task under ResolutoTaskRunner (refused in the sandbox: :mod:`guest_runner.prefect_api`)
and a flow run of a ``resoluto`` work pool (refused by the run's API gateway,
``prefect_resoluto.worker.gateway``, and raised in the run by :mod:`guest_runner.engine`)
refuse the same reads; both say so with these messages, naming the setting that would allow
the read and where that setting is set, and both raise
:class:`guest_runner.prefect_api.PrefectAPIUnavailable`. Standard library only.
"""

from __future__ import annotations

from typing import Iterable

#: The response header that makes a 403 the gateway's refusal; its value is the rule's name.
#: The gateway sets it and never relays it from the API (a marker, never the answer's text).
REFUSED_HEADER = "x-resoluto-refused"
#: The setting that would allow the refused call, when one would (``allowed_variables``, ...).
SETTING_HEADER = "x-resoluto-setting"

#: Who refused: a task's sandbox (ResolutoTaskRunner) or a flow run's gateway (the worker).
TASK_RUNNER = "task-runner"
WORKER = "worker"

#: What each setting allows, in a user's words.
KINDS = {"allowed_variables": "variable", "allowed_blocks": "block"}


def where(setting: str, by: str) -> str:
    """Where ``setting`` is set on the path ``by``."""
    if by == WORKER:
        return f"a job variable of the resoluto work pool or of the deployment, {setting}=[...]"
    return f"ResolutoTaskRunner({setting}=[...]) or its sandbox block"


def not_readable(setting: str, name: str, allowed: Iterable[str], by: str) -> str:
    names = ", ".join(sorted(map(repr, allowed))) or "none"
    return (
        f"Prefect {KINDS[setting]} {name!r} is not readable inside a sandbox: add it to {setting} "
        f"({where(setting, by)}; allowed here: {names})"
    )


def not_writable(setting: str, name: str, by: str, how: str = "") -> str:
    """``how``: the call, when the refusal knows it (``Variable.set``)."""
    call = f" ({how})" if how else ""
    instead = "; write it from the flow, outside the sandbox" if by == TASK_RUNNER else ""
    return (
        f"Prefect {KINDS[setting]} {name!r} is not writable inside a sandbox{call}: {setting} "
        f"({where(setting, by)}) allows reads only{instead}"
    )
