"""What a launch sends to Solari for one node: the create request, the guest command, its secrets.

Pure: a launch spec and the runtime's options in, JSON-able dicts out -- what
``prefect-resoluto render --runtime solari`` prints (with secrets redacted) and what the
SDK puts on the wire. Minting store credentials is handed in as a callable.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from guest_runner import wire
from prefect_resoluto.runtimes.base import LaunchSpec

MANAGED_BY_KEY = "resoluto.managed-by"
MANAGED_BY = "prefect-resoluto"
SANDBOX_ID_KEY = "resoluto.sandbox-id"
STORE_CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


@dataclass(frozen=True)
class VmLayout:
    """Where things live inside the VM, all under ``guest_dir``."""

    guest_dir: str

    @property
    def store_root(self) -> str:
        """The guest's local-filesystem store (relay mode), mirrored out by the host."""
        return f"{self.guest_dir}/store"

    @property
    def workspace(self) -> str:
        return f"{self.guest_dir}/workspace"

    @property
    def lib_dir(self) -> str:
        """The guest runner's files, put on ``PYTHONPATH``."""
        return f"{self.guest_dir}/lib"


def create_request(
    spec: LaunchSpec,
    *,
    template: str | None,
    cpu: int | None,
    mem_mb: int | None,
    disk_gb: int | None,
    metadata: Mapping[str, str],
    envs: Mapping[str, str],
    session_timeout_s: float,
    lifecycle: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The ``CreateSandboxRequest`` body for ``spec``, exactly as the SDK puts it on the wire.

    Explicit ``cpu``/``mem_mb``/``disk_gb`` win; otherwise the node's resources, rounded up.
    """
    res = spec.resources
    cpu = cpu if cpu is not None else (max(1, math.ceil(res.cpus)) if res.cpus else None)
    mem = (
        mem_mb
        if mem_mb is not None
        else (max(1, math.ceil(res.memory_bytes / 2**20)) if res.memory_bytes else None)
    )
    disk = (
        disk_gb
        if disk_gb is not None
        else (max(1, math.ceil(res.disk_bytes / 2**30)) if res.disk_bytes else None)
    )
    labels = {
        **metadata,
        **{str(k): str(v) for k, v in spec.labels.items()},
        MANAGED_BY_KEY: MANAGED_BY,
        SANDBOX_ID_KEY: spec.sandbox_id,
    }
    body: dict[str, Any] = {
        "template": template,
        "kind": "sandbox",
        "cpu": int(cpu) if cpu is not None else None,
        "memMb": int(mem) if mem is not None else None,
        "diskGb": int(disk) if disk is not None else None,
        "envs": dict(envs) or None,
        "metadata": labels,
        "timeoutMs": int(session_timeout_s * 1000),
        "lifecycle": lifecycle,
    }
    return {k: v for k, v in body.items() if v is not None}


def create_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """``client.create`` keyword arguments for a ``CreateSandboxRequest`` body."""
    names = {"memMb": "mem_mb", "diskGb": "disk_gb", "timeoutMs": "timeout_ms"}
    return {names.get(k, k): v for k, v in body.items() if k != "kind"}


def guest_command(
    spec: LaunchSpec,
    layout: VmLayout,
    *,
    relay: bool,
    python: str,
    secret_env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``cmd.start`` params for ``spec``: ``python3 -m guest_runner`` with the node's env.

    Relaying, the guest writes a local store inside the VM (the host mirrors it out), so the
    node's ``RESOLUTO_STORE_*`` settings are replaced by that store's.
    """
    rel = spec.rel_prefix
    env = {k: str(v) for k, v in spec.env.items()}
    if relay:
        # The VM sees no heartbeat of the host's store: its bound is the session's timeout,
        # which the gateway enforces and only the host's keep-alive renews.
        for k in [k for k in env if k.startswith(wire.ENV_STORE_NAME_PREFIX)] + [
            wire.ENV_HOST_BEAT_KEY,
            wire.ENV_HOST_LOST_AFTER,
        ]:
            env.pop(k, None)
        env.update(
            {
                wire.ENV_STORE_KIND: "localfs",
                wire.ENV_STORE_ROOT: layout.store_root,
                wire.ENV_STORE_PREFIX: rel,
            }
        )
    env[wire.ENV_WORKSPACE_DIR] = layout.workspace
    env["PYTHONPATH"] = layout.lib_dir + (f":{env['PYTHONPATH']}" if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("HOME", layout.guest_dir)
    env.update(secret_env if secret_env is not None else spec.secret_env)
    # Secrets of the store (relay: none reach the VM) are redacted like the task's own.
    redact = set(json.loads(env.get(wire.ENV_SECRET_ENV) or "[]"))
    redact |= {k for k in (secret_env if secret_env is not None else spec.secret_env)}
    if redact:
        env[wire.ENV_SECRET_ENV] = json.dumps(sorted(redact), separators=(",", ":"))
    return {"cmd": python, "args": ["-m", "guest_runner"], "cwd": layout.guest_dir, "env": env}


def guest_secrets(
    spec: LaunchSpec, *, relay: bool, store_role_arn: str | None, mint: Callable[[], Mapping[str, str]] | None
) -> dict[str, str]:
    """The secret env the VM gets: the node's own; store credentials only when the guest needs them.

    Relaying, the host keeps the store's credentials (the VM holds none). Direct with a role,
    they are minted per node by ``mint`` (None when rendering: a placeholder stands in).
    """
    secrets = dict(spec.secret_env)
    if relay:
        # drive_node hands a local-conduit runtime the host's store credentials; the relay keeps
        # them on the host: the VM holds no credentials at all.
        user = set(json.loads(spec.env.get(wire.ENV_USER_ENV) or "[]"))
        for k in STORE_CREDENTIAL_VARS:
            if k not in user:
                secrets.pop(k, None)
    elif store_role_arn and mint is not None:
        for k in STORE_CREDENTIAL_VARS:
            secrets.pop(k, None)
        secrets.update(mint())
    elif store_role_arn:
        for k in STORE_CREDENTIAL_VARS:
            secrets[k] = "<minted at launch>"
    return secrets
