"""The Solari runtime's pure parts on their own: what launch sends, and what a gateway error means.

No gateway and no event loop: the create request and guest command are built from a launch
spec, and the SDK's own exception classes (as its HTTP layer raises them) are read the seed's way.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("solari_core", reason="the Solari SDK (solari-sandbox) is not installed")

from solari_core.errors import (  # noqa: E402
    AuthError,
    ConcurrencyLimitError,
    GatewayError,
    NoCapacityError,
    PlanError,
    SolariConnectionError,
)

from prefect_resoluto.runtimes.base import LaunchSpec, Resources  # noqa: E402
from prefect_resoluto.runtimes.solari.errors import admission_kind, refusal, transient_rpc_error  # noqa: E402
from prefect_resoluto.runtimes.solari.request import (  # noqa: E402
    VmLayout,
    create_kwargs,
    create_request,
    guest_command,
    guest_secrets,
)

GW = "https://gw.example.test"


def spec(**overrides: Any) -> LaunchSpec:
    env = {
        "RESOLUTO_STORE_KIND": "s3",
        "RESOLUTO_STORE_BUCKET": "b",
        "RESOLUTO_STORE_PREFIX": "run/r/nodes/n",
        "RESOLUTO_STORE_ENDPOINT": "http://127.0.0.1:9",
        "RESOLUTO_RUN_ID": "r",
        "RESOLUTO_NODE_ID": "n",
    }
    env.update(overrides.pop("env", {}))
    fields: dict[str, Any] = {"sandbox_id": "rsl-1", "env": env, "labels": {"resoluto.task": "t"}}
    fields.update(overrides)
    return LaunchSpec(**fields)


def kind(e: BaseException) -> str | None:
    return admission_kind(e, ConcurrencyLimitError, NoCapacityError, SolariConnectionError)


def test_429_of_any_code_waits_for_a_slot_and_5xx_is_capacity() -> None:
    assert kind(ConcurrencyLimitError()) == "slot"
    assert (
        kind(GatewayError(429, "org at its session cap")) == "slot"
    )  # SDK divergence 11: no code, plain error
    assert (
        kind(NoCapacityError())
        == kind(GatewayError(503, "busy"))
        == kind(SolariConnectionError())
        == "capacity"
    )
    assert kind(AuthError()) is None and kind(GatewayError(400, "bad cpu")) is None


def test_a_refusal_names_the_setting_to_fix() -> None:
    assert "Fix api_key" in refusal(AuthError(), GW) and GW in refusal(AuthError(), GW)
    assert "refused the API key (403)" in refusal(GatewayError(403, "forbidden"), GW)  # SDK divergence 12
    assert "plan does not allow this sandbox (402)" in refusal(PlanError(), GW)
    assert refusal(GatewayError(400, "cpu too large"), GW) == (
        "the Solari gateway rejected the create request (400): cpu too large. Check the runtime options."
    )
    assert "Check base_url and template" in refusal(GatewayError(404, "no template"), GW)


def test_transient_rpc_errors_are_the_ones_a_reconnect_may_cure() -> None:
    assert transient_rpc_error(SolariConnectionError())
    assert transient_rpc_error(RuntimeError("Failed to send frame"))
    assert not transient_rpc_error(GatewayError(500, "boom"))


def test_create_request_rounds_resources_up_and_labels_the_sandbox() -> None:
    s = spec(resources=Resources(cpus=1.2, memory_bytes=300 * 2**20 + 1, disk_bytes=2**30 + 1))
    body = create_request(
        s,
        template="py",
        cpu=None,
        mem_mb=None,
        disk_gb=None,
        metadata={"team": "x"},
        envs={},
        session_timeout_s=300,
        lifecycle=None,
    )
    assert body == {
        "template": "py",
        "kind": "sandbox",
        "cpu": 2,
        "memMb": 301,
        "diskGb": 2,
        "metadata": {
            "team": "x",
            "resoluto.task": "t",
            "resoluto.managed-by": "prefect-resoluto",
            "resoluto.sandbox-id": "rsl-1",
        },
        "timeoutMs": 300000,
    }
    assert create_kwargs(body)["mem_mb"] == 301 and "kind" not in create_kwargs(body)
    pinned = create_request(
        s,
        template=None,
        cpu=4,
        mem_mb=512,
        disk_gb=1,
        metadata={},
        envs={"A": "1"},
        session_timeout_s=60,
        lifecycle={"onTimeout": "kill"},
    )
    assert (pinned["cpu"], pinned["memMb"], pinned["envs"], pinned["lifecycle"]) == (
        4,
        512,
        {"A": "1"},
        {"onTimeout": "kill"},
    )
    assert "template" not in pinned


def test_relaying_the_vm_gets_a_local_store_and_no_store_credentials() -> None:
    s = spec(
        secret_env={"API_TOKEN": "t0k", "AWS_SECRET_ACCESS_KEY": "host-key", "AWS_ACCESS_KEY_ID": "AKIA"}
    )
    secrets = guest_secrets(s, relay=True, store_role_arn=None, mint=None)
    assert secrets == {"API_TOKEN": "t0k"}
    cmd = guest_command(s, VmLayout("/tmp/resoluto"), relay=True, python="python3", secret_env=secrets)
    env = cmd["env"]
    assert (cmd["cmd"], cmd["args"], cmd["cwd"]) == ("python3", ["-m", "guest_runner"], "/tmp/resoluto")
    assert {k: v for k, v in env.items() if k.startswith("RESOLUTO_STORE_")} == {
        "RESOLUTO_STORE_KIND": "localfs",
        "RESOLUTO_STORE_ROOT": "/tmp/resoluto/store",
        "RESOLUTO_STORE_PREFIX": "run/r/nodes/n",
    }
    assert (
        env["PYTHONPATH"] == "/tmp/resoluto/lib"
        and env["RESOLUTO_WORKSPACE_DIR"] == "/tmp/resoluto/workspace"
    )
    assert "host-key" not in json.dumps(cmd) and json.loads(env["RESOLUTO_SECRET_ENV"]) == ["API_TOKEN"]


def test_a_users_own_aws_keys_survive_the_relay() -> None:
    s = spec(
        env={"RESOLUTO_USER_ENV": json.dumps(["AWS_ACCESS_KEY_ID"])}, secret_env={"AWS_ACCESS_KEY_ID": "mine"}
    )
    assert guest_secrets(s, relay=True, store_role_arn=None, mint=None) == {"AWS_ACCESS_KEY_ID": "mine"}


def test_direct_mode_mints_per_node_or_shows_a_placeholder() -> None:
    s = spec(secret_env={"AWS_SECRET_ACCESS_KEY": "host-key"})
    minted = {"AWS_ACCESS_KEY_ID": "ASIA", "AWS_SECRET_ACCESS_KEY": "short", "AWS_SESSION_TOKEN": "tok"}
    assert (
        guest_secrets(s, relay=False, store_role_arn="arn:aws:iam::1:role/r", mint=lambda: minted) == minted
    )
    shown = guest_secrets(s, relay=False, store_role_arn="arn:aws:iam::1:role/r", mint=None)
    assert set(shown.values()) == {"<minted at launch>"}
    # Without a role the host's own conduit credentials go in (the guest reaches S3 itself).
    assert guest_secrets(s, relay=False, store_role_arn=None, mint=None) == {
        "AWS_SECRET_ACCESS_KEY": "host-key"
    }
    cmd = guest_command(s, VmLayout("/vm"), relay=False, python="python3", secret_env=minted)
    assert cmd["env"]["RESOLUTO_STORE_KIND"] == "s3" and cmd["env"]["AWS_SESSION_TOKEN"] == "tok"
