"""The typed runtime seam: ids and store on LaunchSpec, capabilities on the interface,
failure kinds as one enum, every "is it usable?" answer an Availability."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from guest_runner.conduit import LocalConduit
from prefect_resoluto import egress
from prefect_resoluto.node.outcome import FailureKind, NodeFailure, WorkloadFailed
from prefect_resoluto.node.spec import NodeSpec, launch_spec
from prefect_resoluto.runtimes import get_runtime
from prefect_resoluto.runtimes.base import (
    Availability,
    LaunchSpec,
    NodeAddress,
    SandboxRuntime,
    StoreLocation,
)
from prefect_resoluto.warm import pool


def test_launch_spec_carries_the_node_ids_and_store(tmp_path: Path) -> None:
    conduit = LocalConduit(tmp_path / "c")
    spec = launch_spec(NodeSpec(run_id="run-1", node_id="node-1", argv=["true"]), conduit)
    assert (spec.run_id, spec.node_id) == ("run-1", "node-1")
    assert spec.rel_prefix == "run/run-1/nodes/node-1"
    assert spec.store == StoreLocation(kind="localfs", prefix="run/run-1/nodes/node-1")
    # The guest is told the same (the wire contract is unchanged).
    assert spec.env["RESOLUTO_RUN_ID"] == "run-1" and spec.env["RESOLUTO_NODE_ID"] == "node-1"


def test_a_spec_without_an_address_answers_from_its_guest_variables() -> None:
    env = {
        "RESOLUTO_RUN_ID": "r",
        "RESOLUTO_NODE_ID": "n",
        "RESOLUTO_STORE_KIND": "s3",
        "RESOLUTO_STORE_BUCKET": "b",
        "RESOLUTO_STORE_PREFIX": "base/run/r/nodes/n",
        "RESOLUTO_STORE_REGION": "eu-west-1",
    }
    spec = LaunchSpec(sandbox_id="rsl-x", env=env)
    assert (spec.run_id, spec.node_id) == ("r", "n")
    assert spec.store == StoreLocation("s3", "b", "base/run/r/nodes/n", "", "eu-west-1")
    # An explicit address wins over the variables.
    other = LaunchSpec(
        sandbox_id="rsl-y", env=env, address=NodeAddress("r2", "n2", StoreLocation(kind="localfs"))
    )
    assert (other.run_id, other.node_id, other.store.kind) == ("r2", "n2", "localfs")
    warm = LaunchSpec(sandbox_id="rsl-w", env={})
    assert (warm.run_id, warm.node_id, warm.store) == ("", "", StoreLocation())


@pytest.mark.sandbox
def test_capabilities_are_declared_on_the_interface() -> None:
    for name in ("supports_warm", "egress_by_name", "remote", "supports_local_conduit", "mounts_conduit"):
        assert isinstance(getattr(SandboxRuntime, name), bool), name
    assert SandboxRuntime.python is None
    proc = get_runtime("process")
    assert proc.display_name == "process"
    assert proc.state is not None and proc.python
    container = get_runtime("container", oci_runtime="kata")
    assert container.display_name == "container(kata)"


def test_usable_answers_are_availabilities(tmp_path: Path) -> None:
    proc = get_runtime("process")
    refused = proc.egress_support()
    assert isinstance(refused, Availability) and not refused.ok
    assert "cannot enforce an egress allowlist" in refused.why
    assert isinstance(egress.available(), Availability)
    assert pool.usable(proc, LocalConduit(tmp_path / "c")) == Availability(True)

    class Cold(type(proc)):  # type: ignore[misc]
        supports_warm = False

    cold = pool.usable(Cold(), LocalConduit(tmp_path / "c"))
    assert not cold.ok and cold.why == "runtime 'process' does not keep sandboxes warm"
    assert Availability.of("") == Availability(True)
    assert Availability.of("no ip", detail="x") == Availability(False, why="no ip")


def test_failure_kinds_keep_their_strings_and_wordings() -> None:
    assert [k.value for k in FailureKind] == [
        "workload",
        "unstartable",
        "lost",
        "killed",
        "no_result",
        "protocol",
        "egress",
    ]
    assert FailureKind.LOST == "lost" and f"{FailureKind.NO_RESULT}" == "no_result"
    assert json.dumps({"failure": FailureKind.KILLED}) == '{"failure": "killed"}'
    assert FailureKind.WORKLOAD.error is WorkloadFailed and not FailureKind.WORKLOAD.infrastructure
    assert all(issubclass(k.error, NodeFailure) for k in FailureKind)
    assert FailureKind.KILLED.what == "was killed by the sandbox substrate"
    assert FailureKind.KILLED.crash_how == "was killed"
    assert FailureKind.NO_RESULT.crash_how == "ended without reporting"
    assert FailureKind.EGRESS.crash_how == "failed"


def test_declared_options_are_the_constructors_keywords() -> None:
    """``capabilities.options`` is what best_available's common options may set: it must
    name exactly the keywords each registered runtime's constructor takes."""
    import inspect

    from prefect_resoluto.runtimes import RUNTIMES

    for name in RUNTIMES:
        cls = RUNTIMES[name]
        params = inspect.signature(cls.__init__).parameters.values()
        named = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):  # kubernetes: its options' fields
            from prefect_resoluto.runtimes.kubernetes import KubernetesOptions

            named |= set(KubernetesOptions.__dataclass_fields__)
        assert cls.capabilities.options == frozenset(named), name


def test_old_capability_flags_fold_into_the_declaration() -> None:
    """A runtime class written against the flags that came before ``capabilities``
    (``supports_local_conduit = False``) is answered the same through either spelling."""

    class Remote(type(get_runtime("process"))):  # type: ignore[misc]
        supports_local_conduit = False

    caps = Remote.capabilities
    assert not (caps.local_conduit or caps.host_credentials or caps.host_loopback or caps.host_python)
    assert not caps.on_host and caps.warm and Remote.supports_local_conduit is False
    k8s = get_runtime("kubernetes", image="x")
    assert (k8s.supports_local_conduit, k8s.remote, k8s.capabilities.on_host) == (False, False, False)
    from prefect_resoluto.runtimes import RUNTIMES

    solari = RUNTIMES["solari"]
    assert (solari.supports_local_conduit, solari.remote, solari.capabilities.on_host) == (True, True, False)
