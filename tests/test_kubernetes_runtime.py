"""The Kubernetes runtime without a cluster: rendering, refusals, and what only the stand-in shows.

Everything the real API machinery does -- validation, admission, RBAC, owner references and
garbage collection, 409s, label selectors, the pod lifecycle a node reports, faults on the
wire -- is tested against a genuine kube-apiserver in tests/test_kubernetes_cluster.py.
tests/support/k8s_fake.py is used here only for pod states that neither Kubernetes 1.20 nor our node
agent produce: kubelet waiting reasons the agent never reaches (InvalidImageName,
CreateContainerError, RunContainerError, CrashLoopBackOff), a pod going from Unschedulable to
scheduled, and node loss as newer control planes report it (DeletionByPodGC, NodeLost), plus
"no request was sent at all" checks that need a recording endpoint and no cluster.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support.k8s_fake import FakeKube, decode_model, parse_selector, unknown_fields  # noqa: E402

from guest_runner.conduit import LocalConduit  # noqa: E402
from prefect_resoluto.runtimes import guest_bundle  # noqa: E402
from prefect_resoluto.runtimes.base import (  # noqa: E402
    IsolationLevel,
    IsolationTooWeak,
    LaunchError,
    LaunchSpec,
    Resources,
    SandboxHandle,
    check_isolation,
)
from prefect_resoluto.runtimes.kubernetes import (  # noqa: E402
    MANAGED_BY,
    MANAGED_BY_LABEL,
    SANDBOX_LABEL,
    KubernetesConfigError,
    KubernetesRuntime,
    label_key,
    label_value,
)
from prefect_resoluto.runtimes.kubernetes.render import render_documents, render_yaml  # noqa: E402

NS = "resoluto-sandboxes"
METADATA = ipaddress.ip_address("169.254.169.254")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in (
        "RESOLUTO_SANDBOX_KUBECONTEXT",
        "RESOLUTO_SANDBOX_ALLOW_AMBIENT_CONTEXT",
        "RESOLUTO_STORE_EGRESS_CIDR",
        "RESOLUTO_STORE_EGRESS_PORT",
        "RESOLUTO_SANDBOX_NAMESPACE",
        "RESOLUTO_SANDBOX_IMAGE",
        "KUBERNETES_SERVICE_HOST",
        "KUBERNETES_SERVICE_PORT",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))


@pytest.fixture
def kube() -> Any:
    with FakeKube() as fake:
        yield fake


def make_runtime(kube: FakeKube | None = None, **options: Any) -> KubernetesRuntime:
    defaults: dict[str, Any] = dict(
        image="python:3.12-slim",
        store_egress_cidr="10.0.0.5/32",
        store_egress_port=9000,
        api_retry_base_s=0.001,
        guest_source="image",
    )
    if kube is not None:
        defaults["api_client"] = kube.api_client()
    defaults.update(options)
    return KubernetesRuntime(**defaults)


def make_spec(**overrides: Any) -> LaunchSpec:
    env = {
        "RESOLUTO_STORE_KIND": "s3",
        "RESOLUTO_STORE_BUCKET": "bucket",
        "RESOLUTO_STORE_ENDPOINT": "http://10.0.0.5:9000",
        "RESOLUTO_STORE_REGION": "us-east-1",
        "RESOLUTO_RUN_ID": "run-1",
        "RESOLUTO_NODE_ID": "node-1",
        "RESOLUTO_STORE_PREFIX": "base/run/run-1/nodes/node-1",
        "RESOLUTO_WORKLOAD_ARGV": json.dumps(["echo", "hi"]),
        "RESOLUTO_WORKSPACE_DIR": "/workspace",
    }
    env.update(overrides.pop("env", {}))
    fields: dict[str, Any] = dict(
        sandbox_id="rsl-abc123",
        env=env,
        labels={"resoluto.flow-run-id": "flow-1", "resoluto.task-name": "my task"},
    )
    fields.update(overrides)
    return LaunchSpec(**fields)


def pod_env(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}


def allows_metadata(block: dict[str, Any]) -> bool:
    net = ipaddress.ip_network(block["cidr"])
    if net.version != 4 or METADATA not in net:
        return False
    return not any(METADATA in ipaddress.ip_network(e) for e in block.get("except", []))


# -- rendered manifests: the security posture, field by field ---------------------------------------


def test_pod_security_posture_field_by_field() -> None:
    rt = make_runtime(
        service_account="sandbox-sa",
        priority_class="batch-low",
        node_selector={"resoluto.io/kata": "true"},
        tolerations=[{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}],
    )
    spec = make_spec(resources=Resources.from_quantities(memory="512Mi", cpus="0.5", disk="2Gi"))
    m = rt.manifests(spec)
    pod = m.pod
    assert pod["apiVersion"] == "v1" and pod["kind"] == "Pod"
    ps = pod["spec"]
    assert ps["runtimeClassName"] == "kata"
    assert ps["restartPolicy"] == "Never"
    assert ps["automountServiceAccountToken"] is False
    assert ps["enableServiceLinks"] is False
    assert ps["hostNetwork"] is False and ps["hostPID"] is False and ps["hostIPC"] is False
    assert ps["serviceAccountName"] == "sandbox-sa"
    assert ps["priorityClassName"] == "batch-low"
    assert ps["nodeSelector"] == {"resoluto.io/kata": "true"}
    assert ps["tolerations"] == [{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}]
    assert ps["securityContext"]["runAsNonRoot"] is True
    assert ps["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert ps["securityContext"]["runAsUser"] == 65532
    assert len(ps["containers"]) == 1
    c = ps["containers"][0]
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["privileged"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["runAsNonRoot"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    qty = {"cpu": "500m", "memory": str(512 * 1024**2), "ephemeral-storage": str(2 * 1024**3)}
    assert c["resources"] == {"requests": qty, "limits": qty}
    assert c["image"] == "python:3.12-slim"
    # Writable places are scratch volumes bounded by the disk size; the root is read-only.
    mounts = {v["mountPath"]: v["name"] for v in c["volumeMounts"]}
    assert mounts == {"/tmp": "tmp", "/workspace": "workspace"}
    assert all(v["emptyDir"] == {"sizeLimit": str(2 * 1024**3)} for v in ps["volumes"])
    labels = pod["metadata"]["labels"]
    assert labels[MANAGED_BY_LABEL] == MANAGED_BY
    assert labels[SANDBOX_LABEL] == m.name
    assert labels["resoluto.flow-run-id"] == "flow-1"
    assert labels["resoluto.task-name"] == "my-task"  # sanitised to a valid label value
    assert pod["metadata"]["annotations"]["resoluto.io/sandbox-id"] == "rsl-abc123"
    # Nothing cluster-scoped, nothing privileged anywhere in the document.
    text = json.dumps(pod)
    for forbidden in ('"privileged": true', "hostPath", '"add"', "SYS_ADMIN"):
        assert forbidden not in text


def test_optional_scheduling_fields_absent_by_default() -> None:
    ps = make_runtime().manifests(make_spec()).pod["spec"]
    for key in ("serviceAccountName", "priorityClassName", "nodeSelector", "tolerations"):
        assert key not in ps
    assert "resources" not in ps["containers"][0]  # no resources asked, none imposed


def test_secret_values_never_literal_in_the_pod() -> None:
    rt = make_runtime(store_credentials_secret="resoluto-store")
    spec = make_spec(
        env={"AWS_SECRET_ACCESS_KEY": "host-long-lived-secret", "AWS_ACCESS_KEY_ID": "AKIAHOSTKEY"},
        secret_env={"API_TOKEN": "s3cr3t-value", "AWS_SESSION_TOKEN": "host-session"},
    )
    m = rt.manifests(spec)
    pod_text = json.dumps(m.pod)
    for value in ("s3cr3t-value", "host-long-lived-secret", "AKIAHOSTKEY", "host-session"):
        assert value not in pod_text
        assert value not in json.dumps(m.network_policy)
    env = pod_env(m.pod)
    assert env["API_TOKEN"] == {
        "name": "API_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": m.name, "key": "API_TOKEN"}},
    }
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[var]["valueFrom"]["secretKeyRef"] == {"name": "resoluto-store", "key": var}
        assert "value" not in env[var]
    assert env["AWS_SESSION_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
    # The per-node Secret holds the task secret only, never the host's store keys.
    assert m.secret is not None
    data = {k: base64.b64decode(v).decode() for k, v in m.secret["data"].items()}
    assert data == {"API_TOKEN": "s3cr3t-value"}
    assert m.secret["immutable"] is True
    assert json.loads(env["RESOLUTO_SECRET_ENV"]["value"]) == ["API_TOKEN"]
    # Rendering for review shows placeholders, not values.
    text = render_yaml(spec, rt, name="rsl-review-1")
    assert "s3cr3t-value" not in text and "REPLACE-ME" in text


def test_no_secret_object_without_secret_env() -> None:
    m = make_runtime().manifests(make_spec())
    assert m.secret is None
    assert [d["kind"] for d in m.documents()] == ["NetworkPolicy", "Pod"]
    assert not any("valueFrom" in e for e in m.pod["spec"]["containers"][0]["env"])


def test_network_policy_is_default_deny_for_exactly_this_pod() -> None:
    m = make_runtime().manifests(make_spec())
    np_ = m.network_policy
    assert np_["apiVersion"] == "networking.k8s.io/v1" and np_["kind"] == "NetworkPolicy"
    spec = np_["spec"]
    assert spec["podSelector"] == {"matchLabels": {SANDBOX_LABEL: m.name}}
    assert m.pod["metadata"]["labels"][SANDBOX_LABEL] == m.name
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert spec["ingress"] == []
    dns, store = spec["egress"]
    assert dns["ports"] == [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
    assert store == {
        "to": [{"ipBlock": {"cidr": "10.0.0.5/32"}}],
        "ports": [{"protocol": "TCP", "port": 9000}],
    }
    for rule in spec["egress"]:
        assert rule.get("ports"), "every egress rule is limited to ports"
        for peer in rule["to"]:
            if "ipBlock" in peer:
                assert not allows_metadata(peer["ipBlock"]), rule


def test_egress_allowlist_widens_but_never_to_metadata() -> None:
    rt = make_runtime()
    m = rt.manifests(make_spec(egress=["public_https", "10.9.0.0/16:5432", "0.0.0.0/0", "192.0.2.7"]))
    rules = m.network_policy["spec"]["egress"][2:]
    public, db, everything, host = rules
    assert public["ports"] == [{"protocol": "TCP", "port": 443}]
    block = public["to"][0]["ipBlock"]
    assert block["cidr"] == "0.0.0.0/0"
    assert {"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16"} <= set(block["except"])
    assert db == {"to": [{"ipBlock": {"cidr": "10.9.0.0/16"}}], "ports": [{"protocol": "TCP", "port": 5432}]}
    assert everything["to"][0]["ipBlock"] == {"cidr": "0.0.0.0/0", "except": ["169.254.169.254/32"]}
    assert host["to"][0]["ipBlock"] == {"cidr": "192.0.2.7/32"}
    for rule in m.network_policy["spec"]["egress"]:
        for peer in rule["to"]:
            if "ipBlock" in peer:
                assert not allows_metadata(peer["ipBlock"])
    with pytest.raises(LaunchError, match="host names"):
        rt.manifests(make_spec(egress=["api.example.com"]))
    with pytest.raises(LaunchError, match="metadata"):
        rt.manifests(make_spec(egress=["169.254.169.254/32"]))


def test_store_egress_from_env_override_and_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = make_runtime(store_egress_cidr=None, store_egress_port=None)
    # Derived from an IP endpoint.
    store = rt.manifests(make_spec()).network_policy["spec"]["egress"][1]
    assert store == {
        "to": [{"ipBlock": {"cidr": "10.0.0.5/32"}}],
        "ports": [{"protocol": "TCP", "port": 9000}],
    }
    # DNAT'd store: the env override wins over the endpoint.
    monkeypatch.setenv("RESOLUTO_STORE_EGRESS_CIDR", "172.20.0.9/32")
    monkeypatch.setenv("RESOLUTO_STORE_EGRESS_PORT", "9443")
    store = rt.manifests(make_spec()).network_policy["spec"]["egress"][1]
    assert store == {
        "to": [{"ipBlock": {"cidr": "172.20.0.9/32"}}],
        "ports": [{"protocol": "TCP", "port": 9443}],
    }
    # An explicit setting wins over the environment.
    rt2 = make_runtime(store_egress_cidr="10.7.0.0/24", store_egress_port=443)
    store = rt2.manifests(make_spec()).network_policy["spec"]["egress"][1]
    assert store["to"] == [{"ipBlock": {"cidr": "10.7.0.0/24"}}] and store["ports"][0]["port"] == 443
    # Plain AWS S3 (no endpoint) and nothing configured: refuse rather than open egress.
    monkeypatch.delenv("RESOLUTO_STORE_EGRESS_CIDR")
    spec = make_spec()
    del spec.env["RESOLUTO_STORE_ENDPOINT"]
    with pytest.raises(LaunchError, match="store_egress_cidr"):
        rt.manifests(spec)


def test_bootstrap_fetches_the_guest_bundle_from_outside_the_inbox() -> None:
    rt = make_runtime(guest_source="bundle")
    m = rt.manifests(make_spec())
    c = m.pod["spec"]["containers"][0]
    assert c["command"] == guest_bundle.bootstrap_command()
    env = pod_env(m.pod)
    sha, blob = guest_bundle.build_guest_bundle()
    key = env["RESOLUTO_GUEST_BUNDLE_KEY"]["value"]
    assert key == f"base/run/run-1/_guest/guest_runner-{sha[:16]}.tar.gz"
    assert "/nodes/" not in key and "inbox" not in key
    assert env["RESOLUTO_GUEST_BUNDLE_SHA256"]["value"] == sha
    # The image-provided runner needs no command at all.
    assert (
        "command"
        not in make_runtime(guest_source="image").manifests(make_spec()).pod["spec"]["containers"][0]
    )


def test_guest_bundle_is_deterministic_and_complete() -> None:
    import io
    import tarfile

    sha1, blob1 = guest_bundle.build_guest_bundle()
    guest_bundle.build_guest_bundle.cache_clear()
    sha2, blob2 = guest_bundle.build_guest_bundle()
    assert (sha1, blob1) == (sha2, blob2)
    with tarfile.open(fileobj=io.BytesIO(blob1)) as t:
        names = t.getnames()
        assert all(m.mtime == 0 and m.uid == 0 and not m.issym() for m in t.getmembers())
    assert "guest_runner/__main__.py" in names and "guest_runner/runner.py" in names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    assert guest_bundle.guest_bundle_key("r1", "", sha1) == f"run/r1/_guest/guest_runner-{sha1[:16]}.tar.gz"


def test_rendered_yaml_is_what_the_api_server_accepts() -> None:
    rt = make_runtime(guest_source="bundle", store_credentials_secret="resoluto-store")
    spec = make_spec(
        secret_env={"API_TOKEN": "x"},
        egress=["public_https"],
        resources=Resources.from_quantities(memory="1Gi", cpus=2),
    )
    text = render_yaml(spec, rt, name="rsl-review-2")
    docs = list(yaml.safe_load_all(text))
    assert [d["kind"] for d in docs] == ["NetworkPolicy", "Secret", "Pod"]
    models = {"NetworkPolicy": "V1NetworkPolicy", "Secret": "V1Secret", "Pod": "V1Pod"}
    for d in docs:
        assert unknown_fields(d, models[d["kind"]]) == []
        decode_model(json.dumps(d), models[d["kind"]])
        assert d["metadata"]["name"] == "rsl-review-2"
    # The same objects the runtime would create (the launch token differs per rendering).
    again = render_documents(spec, rt, name="rsl-review-2")
    assert [d["spec"] for d in (docs[0], docs[2])] == [d["spec"] for d in (again[0], again[2])]
    assert "python3" in docs[2]["spec"]["containers"][0]["command"][0]


def test_label_sanitising() -> None:
    assert label_value("my task!") == "my-task"
    assert label_value("-._x_") == "x"
    assert label_value("a" * 100) == "a" * 63
    assert label_value("b" * 62 + "-c") == "b" * 62
    assert label_value("") == ""
    assert label_key("Prefect.IO/flow run") == "prefect.io/flow-run"
    assert label_key("///") is None
    for raw in ("ünïcødé value", "x" * 80 + ".", "a b/c:d"):
        v = label_value(raw)
        assert len(v) <= 63 and (v == "" or (v[0].isalnum() and v[-1].isalnum()))


# -- isolation and configuration refusals -------------------------------------------------------------


@pytest.mark.parametrize(
    "rc,level",
    [
        pytest.param("kata", IsolationLevel.VM, marks=pytest.mark.sandbox),
        ("kata-qemu", IsolationLevel.VM),
        ("kata-clh", IsolationLevel.VM),
        pytest.param("gvisor", IsolationLevel.USER_KERNEL, marks=pytest.mark.sandbox),
        pytest.param("runsc", IsolationLevel.USER_KERNEL, marks=pytest.mark.sandbox),
    ],
)
def test_runtime_class_isolation(rc: str, level: IsolationLevel) -> None:
    rt = make_runtime(runtime_class=rc)
    assert rt.isolation == level
    assert rt.manifests(make_spec()).pod["spec"]["runtimeClassName"] == rc


def test_runtime_class_below_the_floor_is_refused() -> None:
    for rc in ("runc", "", "crun"):
        with pytest.raises(IsolationTooWeak, match="kernel"):
            make_runtime(runtime_class=rc)
    with pytest.raises(IsolationTooWeak, match="node's kernel"):
        make_runtime(runtime_class="runc", runtime_class_isolation="namespace")
    # A differently named Kata class can say what it is.
    assert (
        make_runtime(runtime_class="sandboxed", runtime_class_isolation="vm").isolation == IsolationLevel.VM
    )
    # And the task runner's floor applies as for any runtime.
    with pytest.raises(IsolationTooWeak, match="below the required minimum 'vm'"):
        check_isolation(make_runtime(runtime_class="gvisor"), "vm")
    check_isolation(make_runtime(runtime_class="kata"), "vm")


def test_local_conduit_refused_before_any_api_call(kube: FakeKube, tmp_path: Path) -> None:
    rt = make_runtime(kube)
    assert rt.supports_local_conduit is False
    local = make_spec(
        conduit_root=tmp_path,
        conduit_subdir="run/run-1/nodes/node-1",
        env={"RESOLUTO_STORE_KIND": "localfs", "RESOLUTO_STORE_ROOT": str(tmp_path)},
    )
    with pytest.raises(LaunchError) as ei:
        rt.launch(local)
    msg = str(ei.value)
    assert "cannot see this host's disk" in msg and "s3://" in msg
    with pytest.raises(LaunchError, match="s3://"):
        rt.prepare(LocalConduit(tmp_path / "c"), "run-1")
    assert kube.requests == []


def test_no_image_is_a_clear_error() -> None:
    with pytest.raises(LaunchError, match="images/Dockerfile"):
        make_runtime(image=None).manifests(make_spec())


# -- cluster connection -----------------------------------------------------------------------------------


def test_in_cluster_is_chosen_inside_a_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    rt = make_runtime()
    # No service-account token here, so the in-cluster loader is what fails -- proof it was chosen.
    with pytest.raises(KubernetesConfigError, match="in-cluster"):
        rt._core()


# -- status mapping -----------------------------------------------------------------------------------------
# The fake serves no watch (a real server's watch is tests/test_kubernetes_watch.py's): these read
# each pod by the runtime's one GET, through the same decision as the watch's events.


def launched(kube: FakeKube, **options: Any) -> tuple[KubernetesRuntime, SandboxHandle, str]:
    rt = make_runtime(kube, **options)
    h = rt.launch(make_spec(resources=Resources.from_quantities(memory="256Mi")))
    return rt, h, h.data["name"]


@pytest.mark.parametrize("reason", ["ImagePullBackOff", "ErrImagePull", "InvalidImageName"])
def test_status_image_pull_failures_are_unstartable(kube: FakeKube, reason: str) -> None:
    rt, h, name = launched(kube)
    kube.image_pull_backoff(name, reason=reason)
    st = rt.status_by_get(h)
    assert st.unstartable and not st.terminal
    assert st.reason.startswith(f'{reason}: Back-off pulling image "python:3.12-slim"')
    assert "cannot pull the image" in st.reason


@pytest.mark.parametrize(
    "reason", ["CreateContainerConfigError", "CreateContainerError", "RunContainerError", "CrashLoopBackOff"]
)
def test_status_fatal_waiting_reasons(kube: FakeKube, reason: str) -> None:
    rt, h, name = launched(kube, store_credentials_secret="resoluto-store")
    kube.container_waiting(name, reason, 'secret "resoluto-store" not found')
    st = rt.status_by_get(h)
    assert st.unstartable and reason in st.reason and 'secret "resoluto-store" not found' in st.reason


def test_status_unschedulable_clock_resets_once_scheduled(kube: FakeKube) -> None:
    rt, h, name = launched(kube, unschedulable_patience_s=60)
    now = [0.0]
    rt._clock = lambda: now[0]
    kube.unschedulable(name, "0/1 nodes are available: 1 Insufficient memory.")
    rt.status_by_get(h)
    kube.schedule(name)
    now[0] += 100
    assert rt.status_by_get(h).unstartable is False


def test_status_node_lost(kube: FakeKube) -> None:
    rt, h, name = launched(kube)
    kube.set_running(name)
    kube.node_lost(name)
    st = rt.status_by_get(h)
    assert (st.phase, st.infrastructure) == ("failed", True)
    assert "DeletionByPodGC" in st.reason
    rt2, h2, name2 = launched(kube)
    kube.set_running(name2)
    kube.node_lost(name2, legacy=True)
    st = rt2.status_by_get(h2)
    assert (st.phase, st.infrastructure) == ("failed", True) and st.reason.startswith("NodeLost")


# -- the stand-in itself must enforce the contract ---------------------------------------------------------


def test_fake_rejects_what_the_api_server_would(kube: FakeKube) -> None:
    from kubernetes.client import ApiClient, CoreV1Api
    from kubernetes.client.exceptions import ApiException

    raw = ApiClient(kube.configuration())

    def send(body: dict[str, Any], path: str = f"/api/v1/namespaces/{NS}/pods") -> tuple[int, dict[str, Any]]:
        r = raw.rest_client.pool_manager.request(
            "POST", kube.url + path, body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        return r.status, json.loads(r.data.decode())

    good = make_runtime().manifests(make_spec()).pod
    bogus = json.loads(json.dumps(good))
    bogus["spec"]["containers"][0]["securityContext"]["runAsRoot"] = True
    status, body = send(bogus)
    assert status == 400 and 'unknown field "spec.containers[0].securityContext.runAsRoot"' in body["message"]
    missing = json.loads(json.dumps(good))
    del missing["spec"]["containers"][0]["name"]
    assert send(missing)[0] == 422
    bad_label = json.loads(json.dumps(good))
    bad_label["metadata"]["labels"]["task"] = "not a valid value"
    assert send(bad_label)[0] == 422
    literal_and_ref = json.loads(json.dumps(good))
    literal_and_ref["spec"]["containers"][0]["env"].append(
        {"name": "X", "value": "1", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}
    )
    assert send(literal_and_ref)[0] == 422
    status, body = send(good)
    assert status == 201 and body["metadata"]["uid"] and body["metadata"]["resourceVersion"]
    assert body["status"]["phase"] == "Pending" and body["metadata"]["creationTimestamp"]
    status, body = send(good)
    assert status == 409 and body["reason"] == "AlreadyExists"
    wrong_ns = json.loads(json.dumps(good))
    wrong_ns["metadata"]["namespace"] = "elsewhere"
    wrong_ns["metadata"]["name"] = "other"
    assert send(wrong_ns)[0] == 400
    np_ = make_runtime().manifests(make_spec(egress=["10.0.0.0/8"])).network_policy
    np_["metadata"]["name"] = "np-bad"
    np_["spec"]["egress"][2]["to"][0]["ipBlock"]["except"] = ["192.168.0.0/16"]
    path = f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies"
    status, body = send(np_, path)
    assert status == 422 and "strict subset" in body["message"]
    nowhere = json.loads(json.dumps(good))
    del nowhere["metadata"]["namespace"]
    status, body = send(nowhere, "/api/v1/namespaces/missing/pods")
    assert status == 404 and body["message"] == 'namespaces "missing" not found'
    with pytest.raises(ApiException) as ei:
        CoreV1Api(raw).read_namespaced_pod("nope", NS)
    assert ei.value.status == 404
    with pytest.raises(ApiException) as ei:
        CoreV1Api(raw).list_namespaced_pod(NS, label_selector="a in (")
    assert ei.value.status == 400


def test_fake_label_selectors() -> None:
    labels = {"app": "x", "tier": "db", "env": "prod"}

    def match(sel: str) -> bool:
        return all(r.matches(labels) for r in parse_selector(sel))

    assert match("app=x,tier==db") and not match("app!=x") and match("env in (prod, dev)")
    assert match("env notin (dev)") and match("tier") and match("!missing") and not match("!app")
    assert match("")
    from support.k8s_fake import ApiError

    for bad in ("app=x,", "a b", "in in ()", "app=not valid"):
        with pytest.raises(ApiError):
            parse_selector(bad)


def test_a_local_conduit_is_refused_for_kubernetes_before_any_pod(kube: FakeKube, tmp_path: Path) -> None:
    from prefect_resoluto.settings.config import SandboxConfig

    rt = make_runtime(kube)
    cfg = SandboxConfig(runtime=rt, conduit=(tmp_path / "c").as_uri(), min_isolation="vm")
    with pytest.raises(ValueError, match="cannot see the local conduit directory .* configure an S3 conduit"):
        cfg.check_conduit_fits(rt, cfg.build_conduit())
    assert kube.calls("create") == []


def test_runtimes_of_one_connection_share_one_watch_and_one_rate_limit(tmp_path: Any) -> None:
    """A worker builds a runtime per flow run: alike ones (same kubeconfig, context, namespace)
    share one pod watch and one rate limit; another namespace has its own; an injected
    client is its runtime's alone. Nothing connects: the watch starts with a launch."""
    kubeconfig = str(tmp_path / "kubeconfig")

    def rt(ns: str) -> KubernetesRuntime:
        return KubernetesRuntime(
            kubeconfig=kubeconfig, context="ctx", namespace=ns, image="img:1", runtime_class="gvisor"
        )

    a, b, other = rt("flows-a"), rt("flows-a"), rt("flows-b")
    assert a.pod_watch() is b.pod_watch() and a._api.limiter is b._api.limiter
    assert other.pod_watch() is not a.pod_watch() and other._api.limiter is not a._api.limiter
    assert not a.pod_watch().running
    with FakeKube() as kube:
        x, y = make_runtime(kube), make_runtime(kube)
        assert x.pod_watch() is not y.pod_watch()
