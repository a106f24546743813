"""Issue 40's Kubernetes features attacked from outside, knowing only the docs: a flow run's
pod reaching the worker's host beyond its gateway, a pod's allowlist reaching what it must not.

Each attack is written as its author would try it, and judged on what the genuine API server
stores (the node agent does not enforce NetworkPolicy; a CNI would enforce exactly that)."""

from __future__ import annotations

import ipaddress
import random
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support.k8s_cluster import Cluster  # noqa: E402
from support.polling import wait_for  # noqa: E402
from test_kubernetes_cluster import core, make_runtime, make_spec, net  # noqa: E402
from test_kubernetes_warm import pool_pods, pools, ready, runtime, spec_of  # noqa: E402, F401

from guest_runner import warmpod, wire  # noqa: E402
from prefect_resoluto.node import heartbeat  # noqa: E402
from prefect_resoluto.runtimes.base import LaunchError  # noqa: E402
from prefect_resoluto.worker.plan import SandboxNetworkUnavailable, sandbox_network  # noqa: E402

pytestmark = pytest.mark.k8s

METADATA = ipaddress.ip_address("169.254.169.254")


def _stored_policy(cluster: Cluster, ns: str, policy: dict[str, Any]) -> dict[str, Any]:
    """``policy`` created at the genuine API server and read back as it stores it."""
    from kubernetes.client import ApiClient

    api = net(cluster)
    api.create_namespaced_network_policy(ns, policy)
    stored = api.read_namespaced_network_policy(policy["metadata"]["name"], ns)
    return dict(ApiClient().sanitize_for_serialization(stored))


def _as_ipv4(net_: ipaddress.IPv4Network | ipaddress.IPv6Network) -> ipaddress.IPv4Network | None:
    """The IPv4 addresses a block names, read as a CNI that takes an IPv4-mapped IPv6 block for
    its IPv4 addresses would (Go's ``To4()`` does): None when it names none."""
    if net_.version == 4:
        return net_  # type: ignore[return-value]
    mapped = ipaddress.ip_network("::ffff:0:0/96")
    if not net_.subnet_of(mapped):  # type: ignore[arg-type]
        return None
    v4 = ipaddress.ip_address(int(net_.network_address) & 0xFFFFFFFF)
    return ipaddress.ip_network(f"{v4}/{net_.prefixlen - 96}")  # type: ignore[return-value]


def admitted(policy: dict[str, Any], address: str) -> list[tuple[str, object]]:
    """(cidr, port) of every egress rule that lets a pod dial IPv4 ``address``, in either of
    the forms a block can name it in (None: any port)."""
    ip = ipaddress.ip_address(address)
    found: list[tuple[str, object]] = []
    for rule in policy["spec"].get("egress") or []:
        ports = [p["port"] for p in rule.get("ports") or []] or [None]
        for peer in rule.get("to") or []:
            block = peer.get("ipBlock")
            if block is None:
                continue
            v4 = _as_ipv4(ipaddress.ip_network(block["cidr"]))
            if v4 is None or ip not in v4:
                continue
            excepts = [_as_ipv4(ipaddress.ip_network(e)) for e in block.get("except") or []]
            if not any(e is not None and ip in e for e in excepts):
                found += [(block["cidr"], port) for port in ports]
    return found


@pytest.fixture
def host_addresses() -> Iterator[tuple[str, str]]:
    """Two addresses of this machine (198.18.0.0/15 on the loopback device, removed after):
    the gateway's, and another one the worker's host also answers on (a second NIC, docker0,
    a CNI bridge: a host has several)."""
    import os

    if os.geteuid() != 0:
        pytest.skip("adding test addresses to the loopback device needs root")
    third = random.randint(1, 253)
    gw = f"198.19.{third}.{random.randint(1, 254)}"
    other = f"198.19.{third + 1}.{random.randint(1, 254)}"
    for a in (gw, other):
        subprocess.run(["ip", "addr", "add", f"{a}/32", "dev", "lo"], check=True)
    try:
        yield gw, other
    finally:
        for a in (gw, other):
            subprocess.run(["ip", "addr", "del", f"{a}/32", "dev", "lo"], check=False)


def _flow_run_policy(cluster: Cluster, ns: str, gateway: str, allowlist: list[str]) -> dict[str, Any]:
    """The policy of a worker's flow-run pod whose deployment asks for ``allowlist``, as stored."""
    rt = make_runtime(cluster, ns)
    network = sandbox_network(rt, f"http://{gateway}:41234/api", allowlist)
    tag = uuid.uuid4().hex[:8]
    sent = rt.manifests(make_spec(egress=network.egress), name=f"rsl-a40-{tag}", token=tag * 4).network_policy
    return _stored_policy(cluster, ns, sent)


@pytest.mark.parametrize("allowlist", [["::ffff:0:0/96"], ["::ffff:198.19.0.0/112"]])
def test_an_ipv4_mapped_allowlist_cannot_reach_the_workers_host_beyond_its_gateway(
    k8s_cluster: Cluster, k8s_ns: str, host_addresses: tuple[str, str], allowlist: list[str]
) -> None:
    """A deployment author writes the worker's host as an IPv4-mapped IPv6 block: the gateway's
    cut only looks at IPv4 blocks, so the entry reached the host on every port (the real API,
    other runs' gateways). Now such a block is refused before anything is created."""
    gw, _ = host_addresses
    try:
        policy = _flow_run_policy(k8s_cluster, k8s_ns, gw, allowlist)
    except (LaunchError, SandboxNetworkUnavailable) as e:
        assert "IPv4-mapped" in str(e)
        return
    assert admitted(policy, gw) == [(f"{gw}/32", 41234)]


@pytest.mark.parametrize("entry", ["::ffff:169.254.169.254", "::ffff:169.254.0.0/112", "::ffff:0:0/96"])
def test_an_ipv4_mapped_allowlist_cannot_reach_the_metadata_address(
    k8s_cluster: Cluster, k8s_ns: str, entry: str
) -> None:
    """The metadata address is refused as ``169.254.169.254`` and cut out of wider IPv4
    blocks; written IPv4-mapped it was stored as ``::ffff:a9fe:a9fe/128``, with no except."""
    rt = make_runtime(k8s_cluster, k8s_ns)
    tag = uuid.uuid4().hex[:8]
    try:
        sent = rt.manifests(make_spec(egress=[entry]), name=f"rsl-a40-{tag}", token=tag * 4).network_policy
    except LaunchError as e:
        assert "IPv4-mapped" in str(e)
        return
    assert admitted(_stored_policy(k8s_cluster, k8s_ns, sent), str(METADATA)) == []


@pytest.mark.parametrize("allowlist", [["198.19.0.0/16"], ["0.0.0.0/0"], ["198.18.0.0/15:4200"]])
def test_a_wide_allowlist_cannot_reach_the_workers_host_at_another_of_its_addresses(
    k8s_cluster: Cluster, k8s_ns: str, host_addresses: tuple[str, str], allowlist: list[str]
) -> None:
    """The gateway's address is cut out of every entry, but the worker's host answers on its
    other addresses too, where the real Prefect API (listening on 0.0.0.0) is: an entry holding
    one of them admitted the host there. Every address of the host is cut out; the rest of the
    block stays allowed."""
    gw, other = host_addresses
    policy = _flow_run_policy(k8s_cluster, k8s_ns, gw, allowlist)
    assert admitted(policy, gw) == [(f"{gw}/32", 41234)]
    assert admitted(policy, other) == []
    neighbour = str(ipaddress.ip_address(other) + 1)
    assert admitted(policy, neighbour), "the rest of the block the deployment asked for stays allowed"


@pytest.mark.sandbox
def test_a_dead_runners_idle_warm_pod_cannot_be_kept_alive_by_forged_heartbeats(
    pools: Any,  # noqa: F811 - the warm tests' fixture, imported above
    k8s_cluster: Cluster,
    k8s_ns: str,
    s3_conduit: Any,
) -> None:
    """Any pod holding the store's credentials (a task's pod of the same runner: its own env
    names the heartbeat's key) keeps writing a changing heartbeat after the runner died, and
    replays the waiting pod's own beat with a higher count. Before: the idle pod watched the
    shared, unauthenticated beat and waited forever. Now it counts only beats its host sealed
    for it, so it ends within its bound as if nobody wrote."""
    pool = pools(runtime(k8s_cluster, k8s_ns), host_lost_after=3.0, host_heartbeat_interval=0.5)
    ready(pool, pool.key_for(spec_of("n")))
    (pod,) = pool_pods(k8s_cluster, k8s_ns, pool, "idle")
    env = {e.name: e.value for e in pod.spec.containers[0].env or [] if e.value is not None}
    base = s3_conduit.base_prefix.strip("/")
    # The keys as the pod's env names them (full keys), as the test's conduit names them.
    shared_beat = env[wire.ENV_HOST_BEAT_KEY].removeprefix(f"{base}/")
    own_beat = f"{env[warmpod.ENV_PREFIX]}/beat".removeprefix(f"{base}/")
    assert s3_conduit.get_stream(shared_beat).close() is None  # the attacker aims at the real one
    stop = threading.Event()

    def attacker() -> None:
        n = 10**6
        while not stop.wait(0.2):
            n += 1
            try:
                s3_conduit.put(shared_beat, f"{n} 1.0".encode())
                with s3_conduit.get_stream(own_beat) as f:
                    old = bytes(f.read(256))
                _, _, tag = old.partition(b" ")
                s3_conduit.put(own_beat, str(n).encode() + b" " + tag)
            except Exception:  # noqa: BLE001 - nothing there yet: the next round writes again
                continue

    # The host dies: its heartbeat stops, nothing deletes the pod; the attacker takes over.
    heartbeat.writer_for(s3_conduit).close()
    thread = threading.Thread(target=attacker, daemon=True)
    thread.start()
    try:

        def ended() -> bool:
            p = core(k8s_cluster).read_namespaced_pod(pod.metadata.name, k8s_ns)
            return bool(p.status.phase in ("Succeeded", "Failed"))

        wait_for(ended, timeout=90, what="the waiting pod to end although someone else beats for its host")
    finally:
        stop.set()
        thread.join(timeout=10)


@pytest.mark.parametrize(
    "options",
    [
        {"store_egress_cidr": "{other}/32", "store_egress_port": 4200},
        {"store_egress_cidr": "198.19.0.0/16"},
        {"dns_cidr": "{other}"},
    ],
)
def test_a_sandbox_blocks_store_or_dns_option_cannot_reach_the_workers_host(
    k8s_cluster: Cluster,
    k8s_ns: str,
    host_addresses: tuple[str, str],
    s3_conduit: Any,
    options: dict[str, Any],
) -> None:
    """A deployment author picks a sandbox block of their own whose kubernetes options say the
    store (or the resolver) is at the worker's host, on the real API's port: the allowlist's
    cuts never see those rules, and the pod reached the host there. The worker now refuses
    such a run before anything is created; otherwise the stored policy must not admit it."""
    from prefect_resoluto.node.spec import NodeSpec, launch_spec
    from prefect_resoluto.worker.plan import check_pod_rules

    gw, other = host_addresses
    opts = {k: v.format(other=other) if isinstance(v, str) else v for k, v in options.items()}
    rt = make_runtime(k8s_cluster, k8s_ns, **{"store_egress_cidr": None, "store_egress_port": None, **opts})
    network = sandbox_network(rt, f"http://{gw}:41234/api", [])
    spec = NodeSpec(
        run_id="r", node_id=f"flow-run-{uuid.uuid4().hex[:8]}", argv=["true"], egress=network.egress
    )
    try:
        check_pod_rules(rt, spec, s3_conduit)
    except SandboxNetworkUnavailable as e:
        assert "an address of the worker's host" in str(e)
        return
    tag = uuid.uuid4().hex[:8]
    sent = rt.manifests(launch_spec(spec, s3_conduit), name=f"rsl-a40-{tag}", token=tag * 4).network_policy
    policy = _stored_policy(k8s_cluster, k8s_ns, sent)
    assert admitted(policy, other) == [] and admitted(policy, gw) == [(f"{gw}/32", 41234)]


def test_the_store_the_worker_itself_writes_to_stays_reachable(
    k8s_cluster: Cluster, k8s_ns: str, s3_conduit: Any
) -> None:
    """Not refused: the store rule derived from the endpoint the worker writes to (here on its
    own loopback), and no DNS block."""
    from prefect_resoluto.node.spec import NodeSpec
    from prefect_resoluto.worker.plan import check_pod_rules

    rt = make_runtime(k8s_cluster, k8s_ns, store_egress_cidr=None, store_egress_port=None)
    check_pod_rules(rt, NodeSpec(run_id="r", node_id="flow-run-y", argv=["true"]), s3_conduit)
