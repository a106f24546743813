"""Sandbox namespaces are named by sandbox id, machine-wide (``/run/netns``): a name that is
already taken -- another session's sandbox, e.g. a second test suite on the same machine --
must fail this launch and leave the other sandbox's namespace alone."""

from __future__ import annotations

import os

import pytest

from prefect_resoluto.egress import netns

pytestmark = pytest.mark.skipif(
    not netns.available().ok, reason=f"egress needs namespaces: {netns.available().why}"
)


def test_a_taken_sandbox_namespace_name_fails_the_launch_and_is_left_alone() -> None:
    sid = f"rsl-taken-{os.getpid()}-{os.urandom(3).hex()}"
    proxy_a = netns.create_proxy_namespace("run-taken-a")
    proxy_b = netns.create_proxy_namespace("run-taken-b")
    try:
        name, _, _ = netns.create_sandbox_namespace("run-taken-a", sid, proxy_a, 0)
        with pytest.raises(netns.NetnsError):
            netns.create_sandbox_namespace("run-taken-b", sid, proxy_b, 0)
        assert netns.exists(name), "the failed launch deleted the other sandbox's namespace"
        assert [r["run_id"] for r in netns.records() if r["name"] == name] == ["run-taken-a"]
    finally:
        netns.delete(netns.SANDBOX_PREFIX + sid)
        netns.delete(proxy_a)
        netns.delete(proxy_b)
