"""The suite's tiers (a plugin, loaded by tests/conftest.py; docs/testing.md).

Each test declares what it needs with a marker (pyproject.toml registers them), a whole
module with ``pytestmark``:

- ``prefect``: the session Prefect API (``prefect_api``, or a fixture built on it);
- ``sandbox``: a real sandbox on this machine (gVisor, bubblewrap, podman, an egress testnet);
- ``k8s``: the genuine kube-apiserver (``k8s_cluster``), run last when its build is pending;
- ``slow``: every test of the three above (added here), and by hand anything that takes
  seconds without them (the Solari gateway's guests). ``pytest -m "not slow"`` is the quick loop.

A fixture that needs a tier cannot be asked for without its marker: collection stops and
names the test.
"""

from __future__ import annotations

import pytest

TIERS = ("k8s", "prefect", "sandbox")

# The fixtures that put a test in a tier, by name (and every fixture built on them).
FIXTURE_TIERS = {
    "k8s_cluster": "k8s",  # k8s_agent and k8s_ns are built on it
    "prefect_api": "prefect",  # `prefect`, the worker and server fixtures are built on it
    "auth_server": "prefect",  # a `prefect server` of its own, with an auth string
    "gvisor": "sandbox",
    "gv": "sandbox",
    "gw_gvisor": "sandbox",
    "testnet": "sandbox",
    "k8s_agent": "sandbox",  # runs the cluster's pods in gVisor
    "gw": "slow",  # the Solari gateway stand-in: whole guests behind a loopback service
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``slow`` what another tier marks, and refuse a tier's fixture without its marker."""
    unmarked: list[str] = []
    for item in items:
        if any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(pytest.mark.slow)
        names = set(getattr(item, "fixturenames", ()))
        for fixture, tier in FIXTURE_TIERS.items():
            if fixture in names and not item.get_closest_marker(tier):
                unmarked.append(f"{item.nodeid} uses {fixture!r}: mark it @pytest.mark.{tier}")
    if unmarked:
        raise pytest.UsageError("tier markers missing (docs/testing.md):\n  " + "\n  ".join(unmarked))
