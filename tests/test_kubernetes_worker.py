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
import socket
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
from prefect_resoluto.runtimes.kubernetes.manifests import METADATA_V4  # noqa: E402
from prefect_resoluto.runtimes.labels import LABEL_FLOW_RUN, label_value  # noqa: E402

pytestmark = [pytest.mark.k8s, pytest.mark.sandbox, pytest.mark.prefect, pytest.mark.usefixtures("prefect")]


def host_address() -> str:
    """This machine's own non-loopback IPv4 address (the source of its default route): the
    address a pod dials the worker's gateway on. No packet is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 9))
        except OSError as e:
            pytest.skip(f"this machine has no route off loopback, so no address a pod could dial: {e}")
        addr = str(s.getsockname()[0])
    if ipaddress.ip_address(addr).is_loopback:
        pytest.skip("this machine's only address is loopback, which a pod cannot dial")
    return addr


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
    # Inline, as the pool form's fields: a {"$ref": ...} to a saved block is refused by the
    # server's validation of deployment job variables (it matches both of the field's forms).
    sandbox = SandboxBlock(
        runtime="kubernetes",
        kube_context=CONTEXT,
        kube_namespace=ns,
        runtime_class="gvisor",
        min_isolation="user-kernel",
        image=IMAGE,
        store_credentials_secret=STORE_SECRET,
        conduit=S3ConduitBlock(bucket=bucket, base_prefix="w", endpoint_url=moto_server.endpoint_url),
    ).model_dump(mode="json", exclude_unset=True)
    kubeconfig = k8s_cluster.write_kubeconfig(tmp / "kubeconfig", {CONTEXT: ns}, current=CONTEXT)
    pool = create_pool(cli=False, floor=None)
    with running_worker(pool, tmp, KUBECONFIG=kubeconfig, RESOLUTO_WARM_SNAPSHOTS="0") as worker:
        yield {
            "worker": worker,
            "namespace": ns,
            "gateway_address": host_address(),
            "sandbox": sandbox,
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
        "api_gateway_address": pool["gateway_address"],
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


def egress_peers(policy: Any) -> set[tuple[str, Any]]:
    """Each (peer, port) the stored NetworkPolicy admits: ipBlocks by CIDR (and excepts)."""
    out: set[tuple[str, Any]] = set()
    for rule in policy.spec.egress or []:
        ports = [p.port for p in rule.ports or []] or [None]
        for peer in rule.to or []:
            if peer.ip_block is not None:
                text = peer.ip_block.cidr + (
                    f" except {sorted(peer.ip_block._except)}" if peer.ip_block._except else ""
                )
            else:
                text = f"pods {peer.pod_selector.match_labels} in {peer.namespace_selector.match_labels}"
            out |= {(text, port) for port in ports}
    return out


def test_worker_flow_run_as_a_pod_reports_logs_artifact_and_a_refusal_through_its_gateway_only(
    k8s_pool: dict[str, Any], k8s_cluster: Cluster, moto_server: Any, tmp_path: Path
) -> None:
    from prefect.variables import Variable
    from support.prefect_readback import client

    tag = uuid.uuid4().hex[:8]
    granted, private = f"pod_granted_{tag}", f"pod_private_{tag}"
    Variable.set(granted, "g-value")
    Variable.set(private, "private-value-8812")
    worker: Worker = k8s_pool["worker"]
    ns, gateway_ip = k8s_pool["namespace"], k8s_pool["gateway_address"]
    dep = deploy_in_pods(k8s_pool, "pod_call_flows.py:in_a_pod", allowed_variables=[granted])
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

    # The worker's host is reachable from the pod at the gateway's one address and port only.
    store_port = int(moto_server.endpoint_url.rsplit(":", 1)[1])
    peers = egress_peers(policy)
    host_peers = {p for p in peers if p[0].startswith(f"{gateway_ip}/") or "0.0.0.0" in p[0]}
    assert host_peers == {(f"{gateway_ip}/32", gateway_port)}, peers
    ip_blocks = {p for p in peers if not p[0].startswith("pods ")}
    assert ip_blocks == {(f"{gateway_ip}/32", gateway_port), ("127.0.0.1/32", store_port)}, peers
    assert not any(str(METADATA_V4.network_address) in p[0] for p in peers), peers
    wait_for(lambda: pods_of(k8s_cluster, ns, run.id) == [], timeout=60, what="the run's pod reaped")
