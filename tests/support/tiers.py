"""Each test's tier markers, from what it needs (a plugin, loaded by tests/conftest.py)."""

from __future__ import annotations

import inspect
import re

import pytest

# Tiers, by what a test needs (pyproject.toml lists the markers; README, "Development"):
# markers come from the fixtures a test uses, so a new test is tiered by what it asks for.
K8S_FIXTURES = {"k8s_cluster"}  # k8s_agent, k8s_ns and every fixture built on them need it
# `prefect`, the worker and server fixtures are built on prefect_api; auth_server is a
# `prefect server` of its own (with an auth string) and a worker on it.
PREFECT_FIXTURES = {"prefect_api", "auth_server"}
# Fixtures that hand the test a real sandbox (gVisor, bubblewrap, podman, an egress testnet).
SANDBOX_FIXTURES = {"gvisor", "gv", "gw_gvisor", "testnet", "k8s_agent"}
# Fixtures that run whole guests behind a loopback service (the Solari gateway fake): no
# sandbox, but seconds each; they are `slow` too.
SLOW_FIXTURES = {"gw"}
SANDBOX_MODULE_RT = {  # the modules whose `rt` fixture is a real sandbox runtime
    "test_runtime_gvisor.py",
    "test_runtime_bubblewrap.py",
    "test_runtime_container.py",
}
# A runtime named in the test itself: ResolutoTaskRunner(runtime="gvisor"), get_runtime("gvisor"),
# or a parametrize value; `process` and `solari` (the loopback gateway) are no sandbox here.
SANDBOX_RUNTIMES = {"gvisor", "runsc", "bubblewrap", "container", "podman", "kata"}
_NAMED_RUNTIME = re.compile(r"""(?:runtime\s*=\s*|get_runtime\(\s*)["'](\w+)["']""")


def _uses_sandbox(item: pytest.Item) -> bool:
    names = set(getattr(item, "fixturenames", ()))
    if names & SANDBOX_FIXTURES or (item.path.name in SANDBOX_MODULE_RT and "rt" in names):
        return True
    callspec = getattr(item, "callspec", None)
    if callspec is not None and any(
        isinstance(v, str) and v in SANDBOX_RUNTIMES for v in callspec.params.values()
    ):
        return True
    fn = getattr(item, "function", None)
    try:
        src = inspect.getsource(fn) if fn is not None else ""
    except (OSError, TypeError):
        src = ""
    return any(m in SANDBOX_RUNTIMES for m in _NAMED_RUNTIME.findall(src))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Mark each test by what it needs, and run the ones against the genuine apiserver last
    (the session may be building it meanwhile, tests/support/k8s_build.py)."""
    k8s: list[pytest.Item] = []
    rest: list[pytest.Item] = []
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        needs_k8s = bool(names & K8S_FIXTURES)
        needs_prefect = bool(names & PREFECT_FIXTURES)
        needs_sandbox = _uses_sandbox(item)
        if needs_k8s:
            item.add_marker(pytest.mark.k8s)
        if needs_prefect:
            item.add_marker(pytest.mark.prefect)
        if needs_sandbox:
            item.add_marker(pytest.mark.sandbox)
        if (
            needs_k8s
            or needs_prefect
            or needs_sandbox
            or names & SLOW_FIXTURES
            or item.get_closest_marker("slow")
        ):
            item.add_marker(pytest.mark.slow)
        (k8s if needs_k8s else rest).append(item)
