"""How a flow run's sandbox is wired: the one network decision, env, code locations."""

from __future__ import annotations

import json
import sys

import pytest

from prefect_resoluto.runtimes import get_runtime
from prefect_resoluto.worker import plan as flow_runs
from prefect_resoluto.worker.plan import (
    API_ALIAS,
    SandboxNetworkUnavailable,
    code_directories,
    engine_argv,
    sandbox_network,
    split_env,
)


@pytest.fixture
def with_forwarding(monkeypatch):
    monkeypatch.setattr(flow_runs, "egress_forwarding_supported", lambda: True)


def test_host_network_keeps_the_url_and_forwards_nothing():
    net = sandbox_network(get_runtime("process"), "http://127.0.0.1:4200/api", [])
    assert (net.env, net.egress, net.egress_forward) == (
        {"PREFECT_API_URL": "http://127.0.0.1:4200/api"},
        [],
        {},
    )


@pytest.mark.sandbox
def test_a_loopback_api_is_forwarded_as_one_destination(with_forwarding):
    rt = get_runtime("gvisor")
    for url, target in (
        ("http://127.0.0.1:4200/api", "127.0.0.1:4200"),
        ("http://localhost:4201/api", "127.0.0.1:4201"),
    ):
        net = sandbox_network(rt, url, ["pypi.example.test:443"])
        port = target.rsplit(":", 1)[1]
        assert net.env == {"PREFECT_API_URL": f"http://{API_ALIAS}:{port}/api"}
        assert net.egress_forward == {f"{API_ALIAS}:{port}": target}
        assert net.egress == ["pypi.example.test:443"]  # the loopback is never an allowlist entry


@pytest.mark.sandbox
def test_a_remote_api_joins_the_allowlist(with_forwarding):
    net = sandbox_network(get_runtime("gvisor"), "https://prefect.example.test/api", ["a.example.test"])
    assert net.env == {"PREFECT_API_URL": "https://prefect.example.test/api"} and net.egress_forward == {}
    assert net.egress == ["a.example.test", "prefect.example.test:443"]


def test_a_pod_cannot_reach_the_workers_loopback():
    rt = get_runtime("kubernetes")
    with pytest.raises(SandboxNetworkUnavailable, match="on the worker's loopback.*api_gateway_address"):
        sandbox_network(rt, "http://127.0.0.1:4200/api", [])
    net = sandbox_network(rt, "http://10.20.30.40:4200/api", ["10.0.0.0/8:5432", "10.1.0.0/16"])
    # The gateway's address is cut out of the entry that holds it (kube_egress.py), the other kept.
    assert net.egress[-2:] == ["10.1.0.0/16", "10.20.30.40:4200"] and net.egress_forward == {}
    assert "10.20.30.41/32:5432" in net.egress and not any(e.startswith("10.0.0.0/8") for e in net.egress)


@pytest.mark.sandbox
def test_without_the_egress_proxy_a_local_sandbox_refuses_with_the_way_out(monkeypatch):
    monkeypatch.setattr(flow_runs, "egress_forwarding_supported", lambda: False)
    with pytest.raises(SandboxNetworkUnavailable, match="no egress proxy.*runtime 'process'"):
        sandbox_network(get_runtime("gvisor"), "http://127.0.0.1:4200/api", [])
    with pytest.raises(SandboxNetworkUnavailable, match="not an http"):
        sandbox_network(get_runtime("bubblewrap"), "ftp://x/api", [])


def test_the_workers_credentials_and_home_stay_behind():
    """Prefect copies the worker's settings into every job's env: its credentials and its API
    URL never reach the sandbox (the gateway's URL and token replace them)."""
    plain, secret = split_env(
        {
            "PREFECT_API_URL": "http://127.0.0.1:1/api",
            "PREFECT_API_KEY": "pnu_123",
            "PREFECT_API_AUTH_STRING": "admin:pass",
            "PREFECT_HOME": "/root/.prefect",
            "PREFECT_SERVER_API_AUTH_STRING": "admin:pass",
            "PREFECT_API_DATABASE_PASSWORD": "db",
            "PREFECT__FLOW_RUN_ID": "abc",
            "EMPTY": None,
        },
        {"MY_TOKEN": "t"},
    )
    assert plain == {"PREFECT__FLOW_RUN_ID": "abc"}
    assert secret == {"MY_TOKEN": "t"}
    # the run's token travels as Prefect's auth string: on every request and on the events websocket
    assert flow_runs.gateway_env("tok") == {"PREFECT_API_AUTH_STRING": "tok"}


def test_code_directories_follow_the_deployments_own_pull_steps(tmp_path):
    code = tmp_path / "project"
    code.mkdir()
    steps = [
        {"prefect.deployments.steps.git_clone": {"repository": "https://git.example.test/r.git"}},
        {"prefect.deployments.steps.set_working_directory": {"directory": str(code)}},
        {"prefect.deployments.steps.set_working_directory": {"directory": "{{ clone.directory }}"}},
        {"prefect.deployments.steps.set_working_directory": {"directory": str(tmp_path / "missing")}},
    ]
    assert code_directories(steps, None) == [str(code)]
    assert code_directories([], str(code)) == [str(code)]  # no pull steps: the deployment's path
    assert code_directories(steps[:1], str(code)) == []  # pull steps win over the path


@pytest.mark.sandbox
def test_the_entry_point_is_prefects_engine_on_the_right_interpreter():
    # guest_runner.engine: Prefect's prefect.engine, with the gateway's refusals as a task's
    assert engine_argv(None, get_runtime("gvisor"), None) == [sys.executable, "-m", "guest_runner.engine"]
    assert engine_argv(None, get_runtime("kubernetes"), "img:1") == ["python", "-m", "guest_runner.engine"]
    assert engine_argv("prefect flow-run execute", get_runtime("process"), None) == [
        "prefect",
        "flow-run",
        "execute",
    ]


def test_a_pods_network_policy_admits_the_store_the_allowlist_and_the_gateway_and_no_more():
    """The Kubernetes path, rendered by the real runtime (no cluster needed): the pod dials the
    run's gateway (on the worker host's address), which joins the NetworkPolicy; the real API
    does not, and no credential of the worker's is anywhere in the pod's documents."""
    from guest_runner.conduit.s3 import S3Conduit
    from prefect_resoluto.node.spec import NodeSpec, launch_spec
    from prefect_resoluto.runtimes.kubernetes import KubernetesRuntime
    from prefect_resoluto.runtimes.kubernetes.render import render_documents

    rt = KubernetesRuntime(
        namespace="sandboxes", store_egress_cidr="10.9.9.9/32", store_egress_port=9000, image="flows:1"
    )
    api = "http://10.20.30.40:4200/api"  # the worker's real API
    gateway = "http://10.20.30.50:41234/api"  # its gateway on `api_gateway_address`
    net = sandbox_network(rt, gateway, ["10.1.0.0/16:5432"])
    env, secret = split_env(
        {"PREFECT_API_URL": api, "PREFECT_API_KEY": "pnu_worker_key_123", "PREFECT__FLOW_RUN_ID": "x"}, {}
    )
    env.update(net.env)
    secret.update(flow_runs.gateway_env("run-token-456"))
    spec = NodeSpec(
        run_id="0b5d6c1e-flow-run",
        node_id="flow-run-abc",
        argv=engine_argv(None, rt, "flows:1"),
        env=env,
        secret_env=secret,
        egress=net.egress,
        image="flows:1",
    )
    conduit = S3Conduit(
        "bucket", endpoint_url="http://10.9.9.9:9000", access_key_id="a", secret_access_key="b"
    )
    docs = {d["kind"]: d for d in render_documents(launch_spec(spec, conduit), rt)}
    allowed = set()
    for rule in docs["NetworkPolicy"]["spec"]["egress"]:
        ports = {p["port"] for p in rule["ports"]}
        if ports == {53}:
            continue  # DNS
        for peer in rule["to"]:
            allowed |= {(peer["ipBlock"]["cidr"], port) for port in ports}
    assert allowed == {("10.9.9.9/32", 9000), ("10.1.0.0/16", 5432), ("10.20.30.50/32", 41234)}
    everything = json.dumps(list(docs.values()))
    assert "pnu_worker_key_123" not in everything and api not in everything
    pod = json.dumps(docs["Pod"])
    assert "run-token-456" not in pod and "PREFECT_API_AUTH_STRING" in json.dumps(docs["Secret"])
    assert "guest_runner.engine" in pod and gateway in pod


def _admitted(docs: list, address: str) -> list[tuple[str, object]]:
    """(ipBlock, port) of the rendered policy that let a pod dial ``address`` (None: any port)."""
    import ipaddress

    ip = ipaddress.ip_address(address)
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    found = []
    for rule in policy["spec"]["egress"]:
        ports = [p["port"] for p in rule.get("ports", [])] or [None]
        for peer in rule["to"]:
            block = peer.get("ipBlock")
            if block is None:
                continue
            net = ipaddress.ip_network(block["cidr"])
            if net.version == ip.version and ip in net:
                if not any(ip in ipaddress.ip_network(e) for e in block.get("except", [])):
                    found += [(block["cidr"], port) for port in ports]
    return found


@pytest.mark.parametrize(
    "allowlist",
    [["0.0.0.0/0"], ["10.20.0.0/16:4200"], ["public_https", "10.20.30.50"], ["10.20.30.50/32:4200"]],
)
def test_a_wide_allowlist_never_opens_the_workers_host_beyond_its_gateway(allowlist):
    """A deployment's egress that holds the gateway's address (the whole world, the host's
    subnet, the host itself on the real API's port) admits that address only as the gateway's
    own rule; the rest of what it asks for stays allowed."""
    from guest_runner.conduit.s3 import S3Conduit
    from prefect_resoluto.node.spec import NodeSpec, launch_spec
    from prefect_resoluto.runtimes.kubernetes import KubernetesRuntime
    from prefect_resoluto.runtimes.kubernetes.render import render_documents

    rt = KubernetesRuntime(
        namespace="sandboxes", store_egress_cidr="10.9.9.9/32", store_egress_port=9000, image="flows:1"
    )
    net = sandbox_network(rt, "http://10.20.30.50:41234/api", allowlist)
    spec = NodeSpec(run_id="r", node_id="flow-run-x", argv=["true"], egress=net.egress, image="flows:1")
    conduit = S3Conduit(
        "bucket", endpoint_url="http://10.9.9.9:9000", access_key_id="a", secret_access_key="b"
    )
    docs = render_documents(launch_spec(spec, conduit), rt)
    assert _admitted(docs, "10.20.30.50") == [("10.20.30.50/32", 41234)]
    assert _admitted(docs, "169.254.169.254") == []
    if "0.0.0.0/0" in allowlist:
        assert _admitted(docs, "10.20.30.51") == [("10.20.30.51/32", None)]
    if "10.20.0.0/16:4200" in allowlist:
        assert {p for _, p in _admitted(docs, "10.20.30.51")} == {4200}
    if "public_https" in allowlist:
        assert {p for _, p in _admitted(docs, "8.8.8.8")} == {443}


@pytest.mark.parametrize("address", ["[fd00::2]:8080", "0.0.0.0:41234", "224.0.0.1:41234"])
def test_a_gateway_address_a_pod_cannot_dial_as_one_address_is_refused(address):
    """An IPv6 gateway would make "fd00::2:8080" an entry the policy reads as another address
    on every port; the unspecified and multicast addresses are no one address of the host."""
    rt = get_runtime("kubernetes")
    with pytest.raises(SandboxNetworkUnavailable, match="api_gateway_address"):
        sandbox_network(rt, f"http://{address}/api", [])
