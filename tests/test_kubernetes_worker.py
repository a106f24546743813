"""A ``resoluto`` work pool with ``runtime: kubernetes`` (issue 40): each flow run is a pod on the
genuine apiserver, run by the tests' node agent, reaching the Prefect API only through its run's
gateway on ``api_gateway_address``. A real ``prefect worker start`` process against the session's
Prefect API; evidence read back from the API and from what the API server stores.

The node agent does not enforce NetworkPolicy (a CNI's job) and its sandboxes share this
machine's loopback, so the policy is asserted as the API server stores it: the gateway's one
address and port, the store and DNS, nothing else of the worker's host."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support.k8s_cluster import CONTEXT, Cluster, make_namespace  # noqa: E402
from support.k8s_node_agent import NodeAgent  # noqa: E402
from support.polling import wait_for  # noqa: E402
from test_kubernetes_cluster import IMAGE, STORE_SECRET, core, net, store_secret  # noqa: E402
from test_worker import FLOWS, Worker, create_pool, facts, final_run, running_worker, schedule  # noqa: E402

from guest_runner import refusal  # noqa: E402
from prefect_resoluto.runtimes.kubernetes.manifests import METADATA_V4, SANDBOX_ID_ANNOTATION  # noqa: E402
from prefect_resoluto.runtimes.labels import LABEL_FLOW_RUN, label_value  # noqa: E402
from prefect_resoluto.worker.worker import GATEWAY_ADDRESS_ENV  # noqa: E402

pytestmark = [pytest.mark.k8s, pytest.mark.sandbox, pytest.mark.prefect, pytest.mark.usefixtures("prefect")]


@contextlib.contextmanager
def gateway_address() -> Iterator[str]:
    """An address of this machine that a pod dials the worker's gateway on, made for the test:
    one /32 of 198.18.0.0/15 (reserved for tests of network devices) on the loopback device,
    removed afterwards. The node agent's sandboxes share the host's network, so they reach it;
    127.0.0.1 would not do, since the worker rightly refuses a loopback gateway for pods."""
    import random
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("adding a test address to the loopback device needs root")
    addr = f"198.19.{random.randint(1, 254)}.{random.randint(1, 254)}"
    subprocess.run(["ip", "addr", "add", f"{addr}/32", "dev", "lo"], check=True)
    try:
        yield addr
    finally:
        subprocess.run(["ip", "addr", "del", f"{addr}/32", "dev", "lo"], check=False)


@pytest.fixture(scope="module")
def k8s_pool(
    prefect_api: None,
    k8s_cluster: Cluster,
    k8s_agent: NodeAgent,
    moto_server: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    """One worker on one pool whose sandbox block puts flow runs in a namespace of the real
    cluster; the tests deploy their own flows on it."""
    from prefect_resoluto.blocks import S3ConduitBlock, SandboxBlock

    tmp = tmp_path_factory.mktemp("k8s-worker")
    ns = make_namespace(k8s_cluster, "rsl-w")
    store_secret(k8s_cluster, ns)
    bucket = f"resoluto-worker-{uuid.uuid4().hex[:12]}"
    moto_server.raw_client().create_bucket(Bucket=bucket)
    # Saved, and named as the UI stores a chosen block: a reference the worker resolves.
    block_id = SandboxBlock(
        runtime="kubernetes",
        kube_context=CONTEXT,
        kube_namespace=ns,
        runtime_class="gvisor",
        min_isolation="user-kernel",
        image=IMAGE,
        store_credentials_secret=STORE_SECRET,
        conduit=S3ConduitBlock(bucket=bucket, base_prefix="w", endpoint_url=moto_server.endpoint_url),
    ).save(f"k8s-pool-{uuid.uuid4().hex[:8]}")
    kubeconfig = k8s_cluster.write_kubeconfig(tmp / "kubeconfig", {CONTEXT: ns}, current=CONTEXT)
    pool = create_pool(cli=False, floor=None)
    stack = contextlib.ExitStack()
    address = stack.enter_context(gateway_address())
    # The worker's own default address (as a worker pod sets it from status.podIP); the first
    # test's deployment names it as a job variable instead.
    env = {"KUBECONFIG": kubeconfig, "RESOLUTO_WARM_SNAPSHOTS": "0", GATEWAY_ADDRESS_ENV: address}
    with stack, running_worker(pool, tmp, **env) as worker:
        yield {
            "worker": worker,
            "agent": k8s_agent,
            "namespace": ns,
            "gateway_address": address,
            "sandbox": {"$ref": {"block_document_id": str(block_id)}},
        }
    with contextlib.suppress(Exception):
        core(k8s_cluster).delete_namespace(ns)


def deploy_in_pods(pool: dict[str, Any], entrypoint: str, **job_variables: Any) -> str:
    """A deployment of tests/flows/<entrypoint> whose runs are pods (code found by its pull step:
    the emulated image holds this checkout, as a real one holds the flow's code)."""
    from prefect import flow

    variables = {
        "runtime": "kubernetes",
        "min_isolation": "user-kernel",
        "sandbox": pool["sandbox"],
        **job_variables,
    }
    name = f"pod-{uuid.uuid4().hex[:8]}"
    source = flow.from_source(source=str(FLOWS), entrypoint=entrypoint)
    source.deploy(
        name=name,
        work_pool_name=pool["worker"].pool,
        job_variables=variables,
        build=False,
        push=False,
        print_next_steps=False,
    )
    return f"{source.name}/{name}"


def pods_of(cluster: Cluster, ns: str, run_id: Any) -> list[Any]:
    selector = f"{LABEL_FLOW_RUN}={label_value(str(run_id))}"
    return list(core(cluster).list_namespaced_pod(ns, label_selector=selector).items)


def run_is_final(run_id: Any) -> Any:
    from support.prefect_readback import client

    with client() as c:
        state = c.read_flow_run(run_id).state
    return state if state is not None and state.is_final() else None


def _neighbour(address: str) -> str:
    """Another address of the gateway's /24."""
    ip = ipaddress.ip_address(address)
    return str(ip + 1 if int(ip) & 0xFF < 254 else ip - 1)


def admitting(policy: Any, address: str) -> list[tuple[str, Any]]:
    """Each (ipBlock, port) of the stored NetworkPolicy that lets the pod dial ``address``
    (None: every port)."""
    ip = ipaddress.ip_address(address)
    found = []
    for rule in policy.spec.egress or []:
        ports = [p.port for p in rule.ports or []] or [None]
        for peer in rule.to or []:
            block = peer.ip_block
            if block is None:
                continue  # the cluster's DNS pods, by label
            net_ = ipaddress.ip_network(block.cidr)
            if net_.version == ip.version and ip in net_:
                if not any(ip in ipaddress.ip_network(e) for e in block._except or []):
                    found += [(block.cidr, port) for port in ports]
    return found


def test_worker_flow_run_as_a_pod_reports_logs_artifact_and_a_refusal_through_its_gateway_only(
    k8s_pool: dict[str, Any], k8s_cluster: Cluster
) -> None:
    from prefect.variables import Variable
    from support.prefect_readback import client

    tag = uuid.uuid4().hex[:8]
    granted, private = f"pod_granted_{tag}", f"pod_private_{tag}"
    Variable.set(granted, "g-value")
    Variable.set(private, "private-value-8812")
    worker: Worker = k8s_pool["worker"]
    ns, gateway_ip = k8s_pool["namespace"], k8s_pool["gateway_address"]
    # What a deployment's author who read docs/worker.md tries, to reach the worker's host
    # beyond the gateway (the real API, other runs' gateways): egress wide enough to hold it.
    wide = ["0.0.0.0/0", f"{ipaddress.ip_network(gateway_ip + '/24', strict=False)}:4200", "public_https"]
    dep = deploy_in_pods(
        k8s_pool,
        "pod_call_flows.py:in_a_pod",
        allowed_variables=[granted],
        egress=wide,
        api_gateway_address=gateway_ip,
    )
    run = schedule(dep, variable=granted, refused=private)

    # While it runs: the pod's policy as the API server stores it.
    def stored_policy() -> Any:
        pods = pods_of(k8s_cluster, ns, run.id)
        if not pods:
            assert not run_is_final(run.id), (run_is_final(run.id), worker.output()[-6000:])
            return None
        return net(k8s_cluster).read_namespaced_network_policy(pods[0].metadata.name, ns)

    policy = wait_for(stored_policy, timeout=240, what="the flow run's pod and its NetworkPolicy")
    fr = final_run(run.id, worker)
    assert fr.state.is_completed(), (fr.state, worker.output()[-6000:])
    seen = facts(run.id)
    gateway_port = int(seen["api_url"].rsplit(":", 1)[1].split("/", 1)[0])
    assert seen["api_url"] == f"http://{gateway_ip}:{gateway_port}/api", seen
    assert seen["variable"] == "g-value"
    assert seen["refused"] == {
        "type": "PrefectAPIUnavailable",  # what the same flow run raises on gVisor (test_refusal_parity.py)
        "message": refusal.not_readable("allowed_variables", private, [granted], refusal.WORKER),
    }
    assert "private-value-8812" not in str(seen)
    # Its own output, streamed by the worker as Prefect's process worker streams its child's.
    wait_for(lambda: "plain stdout from the pod's flow run" in worker.output(), timeout=60, what="the output")
    with client() as c:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        arts = c.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))
        )
    assert [(a.key, a.data) for a in arts] == [("pod-flow-report", "# from the pod's flow run")]

    # The worker's host is reachable from the pod at the gateway's one address and port only,
    # whatever the allowlist holds; the metadata address never.
    assert admitting(policy, gateway_ip) == [(f"{gateway_ip}/32", gateway_port)], admitting(
        policy, gateway_ip
    )
    assert admitting(policy, str(METADATA_V4.network_address)) == []
    # ... and the rest of what the allowlist asks for stays allowed: its neighbour, the world.
    neighbour = _neighbour(gateway_ip)
    assert {None, 4200} <= {port for _, port in admitting(policy, neighbour)}, admitting(policy, neighbour)
    assert {port for _, port in admitting(policy, "8.8.8.8")} == {None, 443}
    wait_for(lambda: pods_of(k8s_cluster, ns, run.id) == [], timeout=60, what="the run's pod reaped")


def test_worker_cancelling_deletes_the_pod_and_a_dying_pods_run_is_crashed_with_its_evidence(
    k8s_pool: dict[str, Any], k8s_cluster: Cluster
) -> None:
    """Two runs at once (their pods boot side by side): one cancelled from the API, its pod
    deleted; one whose engine is killed (as the OOM killer would) before it reports, Crashed
    with the runtime's reason and its last output in the run's logs. As on gVisor."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling
    from test_worker import logs_with, started

    worker: Worker = k8s_pool["worker"]
    ns = k8s_pool["namespace"]
    lingering = schedule(deploy_in_pods(k8s_pool, "pod_call_flows.py:lingers"), seconds=600)
    dying = schedule(deploy_in_pods(k8s_pool, "pod_call_flows.py:crashes"))

    started(lingering.id)
    (pod,) = pods_of(k8s_cluster, ns, lingering.id)
    assert pod.status.phase == "Running", pod.status
    with get_client(sync_client=True) as c:
        c.set_flow_run_state(lingering.id, Cancelling(), force=True)
    fr = final_run(lingering.id, worker, timeout=120)
    assert fr.state.is_cancelled(), fr.state
    sandbox = pod.metadata.annotations[SANDBOX_ID_ANNOTATION]
    assert f"its sandbox {sandbox} on kubernetes was destroyed" in (fr.state.message or ""), fr.state.message
    wait_for(
        lambda: pods_of(k8s_cluster, ns, lingering.id) == [],
        timeout=60,
        what="the cancelled run's pod deleted",
    )
    assert f"{ns}/{pod.metadata.name}" not in k8s_pool["agent"].running()

    fr = final_run(dying.id, worker)
    assert fr.state.is_crashed(), fr.state
    msg = fr.state.message or ""
    assert "on kubernetes: the flow run's process exited with code" in msg, msg
    assert "before it reported a final state; it was killed by SIGKILL" in msg, msg
    logs_with(dying.id, "evidence-from-the-pod")
    wait_for(lambda: pods_of(k8s_cluster, ns, dying.id) == [], timeout=60, what="the dead run's pod reaped")
