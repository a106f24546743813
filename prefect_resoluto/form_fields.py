"""What the sandbox block's form and the ``resoluto`` pool's form say about the settings they
share, and how their JSON schemas are shaped so Prefect's UIs render plain inputs.

One title and one description per setting, used by both forms, so a value reads the same
wherever it is edited. Nothing here decides behaviour; ``config.py`` does.
"""

from __future__ import annotations

from typing import Any

from prefect_resoluto.runtimes.base import DEFAULT_CPUS, DEFAULT_MEMORY, DEFAULT_PIDS
from prefect_resoluto.tail import DEFAULT_SILENCE_WINDOW

#: The built-in defaults, as the forms show them (strings where the setting is a quantity).
MEMORY_DEFAULT = DEFAULT_MEMORY
CPUS_DEFAULT = f"{DEFAULT_CPUS:g}"
SILENCE_DEFAULT = DEFAULT_SILENCE_WINDOW
MIN_ISOLATION_DEFAULT = "user-kernel"

TITLES = {
    "runtime": "Runtime",
    "min_isolation": "Minimum isolation",
    "image": "Image",
    "memory": "Memory",
    "cpus": "CPUs",
    "disk": "Disk (/tmp and /workspace)",
    "output_limit": "Output limit",
    "pids": "Process limit",
    "silence_window": "Silence window (s)",
    "egress": "Egress allowlist",
    "env": "Environment variables",
    "secret_env": "Secret environment variables",
    "conduit": "Conduit",
}

DESCRIPTIONS = {
    "runtime": (
        "Where sandboxes run: gvisor (a user-space kernel), container (podman with runsc or Kata), "
        "kubernetes (a pod, RuntimeClass kata), bubblewrap (namespaces), process (no isolation: "
        "needs minimum isolation 'none'). Empty: the strongest runtime available on the host."
    ),
    "min_isolation": (
        "Refuse a runtime weaker than this: vm, user-kernel, namespace or none ('none' is for "
        f"trusted code only). Default: {MIN_ISOLATION_DEFAULT}."
    ),
    "image": (
        "Image for the container and kubernetes runtimes; it must bring Python (and Prefect for "
        "whole flow runs). Empty: the host's interpreter, bound read-only."
    ),
    "memory": f"Memory limit per sandbox, e.g. 512Mi or 8Gi. Default: {MEMORY_DEFAULT}.",
    "cpus": f"CPU limit per sandbox, e.g. 1, 0.5 or 500m. Default: {CPUS_DEFAULT}.",
    "disk": (
        "Size of /tmp and /workspace per sandbox where the runtime can size them (ephemeral "
        "storage on Kubernetes). Empty: the memory limit; in-memory scratch counts against memory."
    ),
    "output_limit": (
        "Most bytes of output files the host takes from one sandbox, e.g. 10Gi. Empty: what the "
        "sandbox could hold (disk, else the memory limit)."
    ),
    "pids": f"Most processes and threads per sandbox. Default: {DEFAULT_PIDS}.",
    "silence_window": (
        f"Seconds without any event from a sandbox before it is presumed dead. Default: {SILENCE_DEFAULT:g}."
    ),
    "egress": (
        "Hosts a sandbox may reach: names (api.example.com, *.example.com, host:8443) on local "
        "runtimes, CIDRs on Kubernetes. Empty: no network at all."
    ),
    "env": "Environment variables of every sandbox.",
    "secret_env": (
        "Secret environment variables {NAME: value}: stored encrypted, shown masked, redacted "
        "from every log line, event and artifact."
    ),
    "conduit": "Where host and sandboxes exchange work. Empty: a local directory under the user's cache.",
}


def shared_field(name: str, default: Any = None, **extra: Any) -> Any:
    """A ``Field`` for a shared setting, with its one title and description."""
    from pydantic import Field

    if "default_factory" in extra:
        return Field(title=TITLES[name], description=DESCRIPTIONS[name], **extra)
    return Field(default, title=TITLES[name], description=DESCRIPTIONS[name], **extra)


def plain_optional(schema: dict[str, Any]) -> None:
    """Render ``X | None = None`` as a plain input for ``X`` rather than an ``X | null`` toggle.

    Pydantic writes ``anyOf: [X, {type: null}], default: null``; Prefect's forms show that
    as a two-way toggle. Written as ``X`` without a default, as Prefect's own workers'
    variables are, the field is simply optional: an empty input sends no value, and
    Prefect's schema validation (``preprocess_schema``) accepts null for a property that is
    neither required nor defaulted."""
    choices = schema.get("anyOf")
    if not isinstance(choices, list):
        return
    rest = [c for c in choices if c != {"type": "null"}]
    if len(rest) != 1 or len(rest) == len(choices) or "$ref" in rest[0]:
        return
    del schema["anyOf"]
    if schema.get("default", 0) is None:
        del schema["default"]
    for k, v in rest[0].items():
        schema.setdefault(k, v)


def title_choices(schema: dict[str, Any], titles: dict[str, str], none_title: str | None = None) -> None:
    """Human titles on the choices of a union of blocks or models (``anyOf`` of ``$ref``s),
    put on each choice rather than on the referenced definitions: Prefect's server keys
    nested *block* definitions by their title, so renaming those would break the form's
    references."""
    for choice in schema.get("anyOf", []):
        # While the schema is built, refs carry pydantic's provisional names
        # (``prefect_resoluto__blocks__LocalConduitBlock-Input__1``).
        ref = str(choice.get("$ref", "")).rsplit("/", 1)[-1]
        found = [
            t for name, t in titles.items() if ref == name or f"__{name}-" in ref or ref.endswith(f"__{name}")
        ]
        if found:
            choice["title"] = found[0]
        elif choice.get("type") == "null" and none_title:
            choice["title"] = none_title
