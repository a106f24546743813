"""The Kubernetes runtime against a genuine kube-apiserver, controller-manager and scheduler,
with tests/support/k8s_node_agent.py in the kubelet's place (pods run in gVisor sandboxes here).

Everything listens on 127.0.0.1. Each test has its own namespace; the control plane and
the node are started once per session (tests/support/k8s_cluster.py). Faults are injected by a
loopback proxy in front of the real apiserver (tests/support/k8s_fault_proxy.py). Waiting is polling
with a deadline on what the API reports.
"""

from __future__ import annotations

import base64
import importlib
import json
import logging
import os
import re
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support.k8s_cluster import CONTEXT, Cluster  # noqa: E402
from support.k8s_fault_proxy import FaultProxy  # noqa: E402
from support.k8s_node_agent import EMULATED_CONDITION, NodeAgent  # noqa: E402
from support.polling import wait_for  # noqa: E402

from prefect_resoluto.runtimes import guest_bundle  # noqa: E402
from prefect_resoluto.runtimes.base import IsolationLevel, LaunchError, LaunchSpec, Resources  # noqa: E402
from prefect_resoluto.runtimes.kubernetes import (  # noqa: E402
    MANAGED_BY_LABEL,
    KubernetesApiError,
    KubernetesRuntime,
)

pytestmark = pytest.mark.k8s

ROOT = Path(__file__).resolve().parents[1]
STORE_SECRET = "resoluto-store"
IMAGE = "python:3.12-slim"  # the agent's emulated image: this machine's Python with boto3


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
def proxy(k8s_cluster: Cluster) -> Any:
    with FaultProxy(k8s_cluster.server, k8s_cluster.ca) as p:
        yield p


def core(cluster: Cluster) -> Any:
    from kubernetes.client import CoreV1Api

    return CoreV1Api(cluster.api_client())


def net(cluster: Cluster) -> Any:
    from kubernetes.client import NetworkingV1Api

    return NetworkingV1Api(cluster.api_client())


def names(cluster: Cluster, ns: str, resource: str) -> list[str]:
    if resource == "networkpolicies":
        items = net(cluster).list_namespaced_network_policy(ns).items
    elif resource == "secrets":
        items = [
            s
            for s in core(cluster).list_namespaced_secret(ns).items
            if s.type != "kubernetes.io/service-account-token"
        ]
    else:
        items = core(cluster).list_namespaced_pod(ns).items
    return sorted(i.metadata.name for i in items)


def make_runtime(
    cluster: Cluster, ns: str, *, via: FaultProxy | None = None, token: str | None = None, **options: Any
) -> KubernetesRuntime:
    defaults: dict[str, Any] = dict(
        namespace=ns,
        image=IMAGE,
        runtime_class="gvisor",
        store_egress_cidr="127.0.0.1/32",
        store_egress_port=9,
        api_retry_base_s=0.01,
        guest_source="image",
        delete_grace_s=2,
    )
    defaults.update(options)
    if "api_client" not in defaults:
        defaults["api_client"] = cluster.api_client(token=token, server=via.url if via else None)
    return KubernetesRuntime(**defaults)


def make_spec(**overrides: Any) -> LaunchSpec:
    env = {
        "RESOLUTO_STORE_KIND": "s3",
        "RESOLUTO_STORE_BUCKET": "bucket",
        "RESOLUTO_STORE_ENDPOINT": "http://127.0.0.1:9",
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


def py(code: str) -> list[str]:
    return ["python3", "-c", code]


def terminal(rt: KubernetesRuntime, h: Any, timeout: float = 120) -> Any:
    return wait_for(lambda: (s := rt.status(h)).terminal and s, timeout=timeout, what="the pod to finish")


def gone(cluster: Cluster, ns: str, resource: str, name: str, timeout: float = 60) -> None:
    wait_for(
        lambda: name not in names(cluster, ns, resource), timeout=timeout, what=f"{resource}/{name} gone"
    )


# -- launch, ownership, the real garbage collector -------------------------------------------------


@pytest.mark.sandbox
def test_launch_creates_policy_secret_pod_in_order_owned_by_the_pod(
    k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent, proxy: FaultProxy
) -> None:
    rt = make_runtime(k8s_cluster, k8s_ns, via=proxy)
    h = rt.launch(make_spec(secret_env={"API_TOKEN": "v"}, command=py("print('hi')")))
    name = h.data["name"]
    assert [(v, r) for v, r, _ in proxy.requests if v == "create"] == [
        ("create", "networkpolicies"),
        ("create", "secrets"),
        ("create", "pods"),
    ]
    pod = core(k8s_cluster).read_namespaced_pod(name, k8s_ns)
    assert pod.spec.runtime_class_name == "gvisor"
    # Defaulting by the real server: what the runtime left out, the apiserver filled in.
    assert pod.spec.dns_policy == "ClusterFirst" and pod.status.qos_class == "BestEffort"
    for obj in (
        net(k8s_cluster).read_namespaced_network_policy(name, k8s_ns),
        core(k8s_cluster).read_namespaced_secret(name, k8s_ns),
    ):
        (ref,) = obj.metadata.owner_references
        assert (ref.kind, ref.name, ref.uid, ref.block_owner_deletion) == (
            "Pod",
            name,
            pod.metadata.uid,
            False,
        )
    st = terminal(rt, h)
    assert (st.phase, st.exit_code) == ("succeeded", 0)
    rt.destroy(h)
    for resource in ("pods", "networkpolicies", "secrets"):
        gone(k8s_cluster, k8s_ns, resource, name)
    rt.destroy(h)  # idempotent: all 404 now
    st = rt.status(h)
    assert st.gone and not st.infrastructure


def test_garbage_collector_removes_policy_and_secret_with_the_pod(k8s_cluster: Cluster, k8s_ns: str) -> None:
    # No node needed: the pod stays Pending; deleting it (grace 0) leaves the GC to do the rest.
    rt = make_runtime(k8s_cluster, k8s_ns, node_selector={"resoluto.io/none": "x"})
    h = rt.launch(make_spec(secret_env={"API_TOKEN": "v"}))
    name = h.data["name"]
    assert names(k8s_cluster, k8s_ns, "secrets") == [name]
    core(k8s_cluster).delete_namespaced_pod(name, k8s_ns, grace_period_seconds=0)
    gone(k8s_cluster, k8s_ns, "networkpolicies", name, timeout=90)
    gone(k8s_cluster, k8s_ns, "secrets", name, timeout=90)


def test_adoption_patch_survives_a_concurrent_writer(
    k8s_cluster: Cluster, k8s_ns: str, proxy: FaultProxy
) -> None:
    """Someone else bumps the policy's resourceVersion between create and adoption; the merge
    patch carries no resourceVersion precondition, so it still lands (no 409 Conflict)."""
    rt = make_runtime(k8s_cluster, k8s_ns, via=proxy, node_selector={"resoluto.io/none": "x"})

    def meddle(verb: str, resource: str, path: str) -> None:
        name = path.rstrip("/").rsplit("/", 1)[-1]
        net(k8s_cluster).patch_namespaced_network_policy(
            name, k8s_ns, {"metadata": {"annotations": {"someone.else/touched": "yes"}}}
        )

    proxy.before("patch", "networkpolicies", meddle)
    h = rt.launch(make_spec())
    policy = net(k8s_cluster).read_namespaced_network_policy(h.data["name"], k8s_ns)
    assert policy.metadata.annotations["someone.else/touched"] == "yes"
    assert [r.kind for r in policy.metadata.owner_references] == ["Pod"]
    assert proxy.calls("patch", "networkpolicies") == [200]


# -- admission, validation and RBAC by the real server --------------------------------------------------


def test_missing_runtime_class_is_refused_by_admission(k8s_cluster: Cluster, k8s_ns: str) -> None:
    rt = make_runtime(k8s_cluster, k8s_ns, runtime_class="kata-fc")
    with pytest.raises(LaunchError) as ei:
        rt.launch(make_spec())
    msg = str(ei.value)
    assert 'RuntimeClass "kata-fc" not found' in msg and "kubectl get runtimeclass" in msg
    assert "RBAC: cannot" not in msg
    assert names(k8s_cluster, k8s_ns, "networkpolicies") == []  # the policy made before was removed


def test_missing_namespace_says_how_to_create_it(k8s_cluster: Cluster) -> None:
    rt = make_runtime(k8s_cluster, "rsl-no-such-namespace")
    with pytest.raises(LaunchError, match="kubectl create namespace rsl-no-such-namespace"):
        rt.launch(make_spec())


def test_rendered_objects_pass_the_real_servers_validation(k8s_cluster: Cluster, k8s_ns: str) -> None:
    from prefect_resoluto.runtimes.kubernetes.render import render_documents

    rt = make_runtime(
        k8s_cluster,
        k8s_ns,
        guest_source="bundle",
        store_credentials_secret=STORE_SECRET,
        service_account="default",
        tolerations=[{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}],
    )
    spec = make_spec(
        secret_env={"API_TOKEN": "x"},
        egress=["public_https", "10.9.0.0/16:5432", "192.0.2.7"],
        resources=Resources.from_quantities(memory="1Gi", cpus="0.5", disk="2Gi"),
    )
    from kubernetes.client import ApiClient

    raw = ApiClient(k8s_cluster.configuration())
    for doc in render_documents(spec, rt, name="rsl-review-1"):
        kind = doc["kind"]
        path = {
            "NetworkPolicy": f"/apis/networking.k8s.io/v1/namespaces/{k8s_ns}/networkpolicies",
            "Secret": f"/api/v1/namespaces/{k8s_ns}/secrets",
            "Pod": f"/api/v1/namespaces/{k8s_ns}/pods",
        }[kind]
        r = raw.rest_client.pool_manager.request(
            "POST",
            k8s_cluster.server + path + "?dryRun=All",
            body=json.dumps(doc),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {k8s_cluster.token}"},
        )
        assert r.status == 201, (kind, r.data[:500])
    # And the server's validation is real: an ipBlock except outside its CIDR is a 422.
    bad = render_documents(spec, rt, name="rsl-review-2")[0]
    bad["spec"]["egress"][3]["to"][0]["ipBlock"]["except"] = ["192.168.0.0/16"]
    r = raw.rest_client.pool_manager.request(
        "POST",
        k8s_cluster.server + f"/apis/networking.k8s.io/v1/namespaces/{k8s_ns}/networkpolicies?dryRun=All",
        body=json.dumps(bad),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {k8s_cluster.token}"},
    )
    assert r.status == 422 and b"must be a strict subset" in r.data


@pytest.mark.parametrize("dns_cidr", [None, "0.0.0.0/0,::/0", "10.96.0.10,169.254.20.10"])
def test_the_dns_rule_is_stored_as_rendered(k8s_cluster: Cluster, k8s_ns: str, dns_cidr: str | None) -> None:
    """Issue 33, finding 1: the real API server accepts the resolver-only DNS rule (and a
    named block with its private ranges excepted) and stores exactly that: no 0.0.0.0/0."""
    from kubernetes.client import ApiClient

    rt = make_runtime(k8s_cluster, k8s_ns, dns_cidr=dns_cidr)
    tag = uuid.uuid4().hex[:8]
    sent = rt.manifests(make_spec(), name=f"rsl-dns-{tag}", token=tag * 4).network_policy
    api = net(k8s_cluster)
    api.create_namespaced_network_policy(k8s_ns, sent)
    stored = ApiClient().sanitize_for_serialization(
        api.read_namespaced_network_policy(sent["metadata"]["name"], k8s_ns)
    )
    assert stored["spec"]["egress"] == sent["spec"]["egress"]
    dns = stored["spec"]["egress"][0]
    assert dns["ports"][0] == {"protocol": "UDP", "port": 53}
    blocks = [p["ipBlock"] for p in dns["to"] if "ipBlock" in p]
    if dns_cidr is None:
        assert blocks == []
    for block in blocks:
        if block["cidr"] == "0.0.0.0/0":
            assert {"10.0.0.0/8", "100.64.0.0/10", "169.254.0.0/16"} <= set(block["except"])


ROLE_DOC = ROOT / "docs" / "backends.md"


def published_rbac(namespace: str, sa: str, sa_ns: str) -> list[dict[str, Any]]:
    """The Role and RoleBinding exactly as docs/backends.md publishes them, re-aimed."""
    text = ROLE_DOC.read_text()
    section = text[text.index("## 7. RBAC") :]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block, "docs/backends.md section 7 has no yaml block"
    docs = [d for d in yaml.safe_load_all(block.group(1)) if d]
    assert [d["kind"] for d in docs] == ["Role", "RoleBinding"]
    for d in docs:
        d["metadata"]["namespace"] = namespace
    docs[1]["subjects"] = [{"kind": "ServiceAccount", "name": sa, "namespace": sa_ns}]
    return docs


def service_account_token(cluster: Cluster, ns: str, name: str) -> str:
    c = core(cluster)
    c.create_namespaced_service_account(ns, {"metadata": {"name": name}})

    def token() -> str | None:
        for s in c.list_namespaced_secret(ns).items:
            ann = s.metadata.annotations or {}
            if (
                s.type == "kubernetes.io/service-account-token"
                and ann.get("kubernetes.io/service-account.name") == name
                and s.data
                and s.data.get("token")
            ):
                return base64.b64decode(s.data["token"]).decode()
        return None

    return wait_for(token, timeout=60, what=f"a token for ServiceAccount {ns}/{name}")


@pytest.fixture
def least_privilege(k8s_cluster: Cluster, k8s_ns: str) -> Any:
    """A ServiceAccount bound to the published Role only; returns (token, set_rules)."""
    from kubernetes.client import AuthorizationV1Api, RbacAuthorizationV1Api

    tok = service_account_token(k8s_cluster, k8s_ns, "flows")
    role, binding = published_rbac(k8s_ns, "flows", k8s_ns)
    rbac = RbacAuthorizationV1Api(k8s_cluster.api_client())
    rbac.create_namespaced_role(k8s_ns, role)
    rbac.create_namespaced_role_binding(k8s_ns, binding)
    authz = AuthorizationV1Api(k8s_cluster.api_client())
    user = f"system:serviceaccount:{k8s_ns}:flows"

    def allowed(verb: str, resource: str) -> bool:
        res, _, sub = resource.partition("/")
        group = "networking.k8s.io" if res == "networkpolicies" else ""
        review = authz.create_subject_access_review(
            {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SubjectAccessReview",
                "spec": {
                    "user": user,
                    "groups": ["system:serviceaccounts", f"system:serviceaccounts:{k8s_ns}"],
                    "resourceAttributes": {
                        "namespace": k8s_ns,
                        "verb": verb,
                        "group": group,
                        "resource": res,
                        "subresource": sub,
                    },
                },
            }
        )
        return bool(review.status.allowed)

    def without(verb: str, resource: str) -> None:
        rules = []
        for r in role["rules"]:
            r = dict(r)
            if resource in r["resources"]:
                r["verbs"] = [v for v in r["verbs"] if v != verb]
            if r["verbs"]:  # the server refuses a rule without verbs
                rules.append(r)
        rbac.patch_namespaced_role(role["metadata"]["name"], k8s_ns, {"rules": rules})
        # The authorizer caches through a watch: wait until it agrees, not a guessed time.
        wait_for(lambda: not allowed(verb, resource), timeout=30, what=f"RBAC to deny {verb} {resource}")

    wait_for(lambda: allowed("create", "pods"), timeout=30, what="RBAC to allow the published role")
    return tok, without


@pytest.mark.sandbox
def test_published_role_suffices_for_every_operation(
    k8s_cluster: Cluster,
    k8s_ns: str,
    k8s_agent: NodeAgent,
    least_privilege: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    tok, _ = least_privilege
    rt = make_runtime(k8s_cluster, k8s_ns, token=tok)
    assert rt.availability().ok, rt.availability().why
    caplog.set_level(logging.WARNING, "prefect_resoluto")
    h = rt.launch(make_spec(secret_env={"API_TOKEN": "v"}, command=py("print('least privilege')")))
    assert "garbage-collected" not in caplog.text  # the adoption patches were allowed
    assert terminal(rt, h).phase == "succeeded"
    assert "least privilege" in rt.logs(h)
    h2 = rt.launch(make_spec(labels={"resoluto.flow-run-id": "f-2"}))
    assert rt.sweep({"resoluto.flow-run-id": "f-2"}) == 1
    rt.destroy(h)
    for resource in ("pods", "networkpolicies", "secrets"):
        gone(k8s_cluster, k8s_ns, resource, h.data["name"])
        gone(k8s_cluster, k8s_ns, resource, h2.data["name"])


# (verb, resource, the runtime operation that needs it)
_VERB_USES = [
    ("create", "pods", "launch"),
    ("get", "pods", "status"),
    ("watch", "pods", "watch"),
    ("list", "pods", "sweep"),
    ("delete", "pods", "destroy"),
    ("get", "pods/log", "logs"),
    ("create", "networkpolicies", "launch"),
    ("list", "networkpolicies", "sweep"),
    ("delete", "networkpolicies", "destroy"),
    ("create", "secrets", "launch"),
    ("list", "secrets", "sweep"),
    ("delete", "secrets", "destroy"),
]


@pytest.mark.parametrize("verb,resource,op", _VERB_USES, ids=[f"{v}-{r}" for v, r, _ in _VERB_USES])
def test_removing_one_verb_gives_a_403_naming_it(
    k8s_cluster: Cluster, k8s_ns: str, least_privilege: Any, verb: str, resource: str, op: str
) -> None:
    tok, without = least_privilege
    rt = make_runtime(k8s_cluster, k8s_ns, token=tok, node_selector={"resoluto.io/none": "x"})
    spec = make_spec(secret_env={"API_TOKEN": "v"}, labels={"resoluto.flow-run-id": "f-rbac"})
    h = None if op == "launch" else rt.launch(spec)
    without(verb, resource)
    expected = f"RBAC: cannot {verb} {resource} in namespace '{k8s_ns}' (403 Forbidden)"
    if op == "launch":
        with pytest.raises(LaunchError) as ei:
            rt.launch(spec)
        msg = str(ei.value)
    elif op == "logs":
        msg = rt.logs(h)
    elif op == "watch":
        # A runtime that may not watch still answers, by a GET per status, and says why.
        w = rt.pod_watch()
        w.close()
        w.track(h.data["name"])
        wait_for(lambda: w.fatal is not None, timeout=30, what="the watch to be refused")
        msg = str(w.fatal)
        assert rt.status(h).phase == "pending"
        w.close()
    else:
        with pytest.raises(KubernetesApiError) as ei:
            {
                "status": lambda: rt.status_by_get(h),
                "sweep": lambda: rt.sweep({"resoluto.flow-run-id": "f-rbac"}),
                "destroy": lambda: rt.destroy(h),
            }[op]()
        msg = str(ei.value)
    assert expected in msg, msg
    assert f"system:serviceaccount:{k8s_ns}:flows" in msg and "docs/backends.md" in msg


def test_without_patch_it_still_works_but_says_the_gc_cannot_help(
    k8s_cluster: Cluster, k8s_ns: str, least_privilege: Any, caplog: pytest.LogCaptureFixture
) -> None:
    tok, without = least_privilege
    without("patch", "networkpolicies")
    rt = make_runtime(k8s_cluster, k8s_ns, token=tok, node_selector={"resoluto.io/none": "x"})
    caplog.set_level(logging.WARNING, "prefect_resoluto")
    h = rt.launch(make_spec(labels={"resoluto.flow-run-id": "f-np"}))
    assert "will not be garbage-collected" in caplog.text and "cannot patch networkpolicies" in caplog.text
    policy = net(k8s_cluster).read_namespaced_network_policy(h.data["name"], k8s_ns)
    assert not policy.metadata.owner_references
    # The pod goes from outside; the policy stays (no owner) until sweep reaps it by label.
    core(k8s_cluster).delete_namespaced_pod(h.data["name"], k8s_ns, grace_period_seconds=0)
    gone(k8s_cluster, k8s_ns, "pods", h.data["name"])
    assert names(k8s_cluster, k8s_ns, "networkpolicies") == [h.data["name"]]
    assert rt.sweep({"resoluto.flow-run-id": "f-np"}) == 0
    assert names(k8s_cluster, k8s_ns, "networkpolicies") == []


def test_wrong_token_is_401_with_advice(k8s_cluster: Cluster, k8s_ns: str) -> None:
    rt = make_runtime(k8s_cluster, k8s_ns, token="not-a-token")
    with pytest.raises(LaunchError, match="401 Unauthorized"):
        rt.launch(make_spec())


# -- context pinning, with a real kubeconfig ------------------------------------------------------------


def test_refuses_the_ambient_context_without_a_pin(
    k8s_cluster: Cluster, k8s_ns: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = k8s_cluster.write_kubeconfig(tmp_path / "kc", {"prod": k8s_ns, "dev": k8s_ns}, current="prod")
    monkeypatch.setenv("KUBECONFIG", cfg)
    rt = make_runtime(k8s_cluster, k8s_ns, api_client=None)
    with pytest.raises(LaunchError) as ei:
        rt.launch(make_spec())
    msg = str(ei.value)
    assert "RESOLUTO_SANDBOX_KUBECONTEXT" in msg and "'prod'" in msg and "ALLOW_AMBIENT" in msg
    assert rt.availability().ok is False
    assert names(k8s_cluster, k8s_ns, "networkpolicies") == []


def test_pinned_context_reaches_the_cluster(
    k8s_cluster: Cluster, k8s_ns: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ambient context points at a dead port: only the pin can reach the cluster.
    dead = k8s_cluster.write_kubeconfig(
        tmp_path / "kc", {"prod": k8s_ns}, current="prod", server="https://127.0.0.1:9"
    )
    good = k8s_cluster.write_kubeconfig(tmp_path / "kc2", {"dev": k8s_ns})
    monkeypatch.setenv("KUBECONFIG", os.pathsep.join([dead, good]))
    monkeypatch.setenv("RESOLUTO_SANDBOX_KUBECONTEXT", "dev")
    rt = make_runtime(k8s_cluster, k8s_ns, api_client=None, node_selector={"resoluto.io/none": "x"})
    assert rt.context == "dev"
    avail = rt.availability()
    assert avail.ok, avail.why
    assert "'dev'" in avail.detail
    h = rt.launch(make_spec())
    assert names(k8s_cluster, k8s_ns, "pods") == [h.data["name"]]
    rt.destroy(h)


def test_ambient_context_only_when_explicitly_allowed(
    k8s_cluster: Cluster, k8s_ns: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "KUBECONFIG", k8s_cluster.write_kubeconfig(tmp_path / "kc", {"only": k8s_ns}, current="only")
    )
    monkeypatch.setenv("RESOLUTO_SANDBOX_ALLOW_AMBIENT_CONTEXT", "1")
    rt = make_runtime(k8s_cluster, k8s_ns, api_client=None, node_selector={"resoluto.io/none": "x"})
    assert rt.allow_ambient_context is True
    h = rt.launch(make_spec())
    assert names(k8s_cluster, k8s_ns, "pods") == [h.data["name"]]
    rt.destroy(h)


def test_the_scripts_kubeconfig_pins_its_context(k8s_cluster: Cluster, k8s_ns: str) -> None:
    rt = make_runtime(
        k8s_cluster, k8s_ns, api_client=None, kubeconfig=k8s_cluster.kubeconfig, context=CONTEXT
    )
    assert rt.availability().ok
    with pytest.raises(LaunchError, match="'elsewhere' is not in .*available: resoluto-local"):
        make_runtime(
            k8s_cluster, k8s_ns, api_client=None, kubeconfig=k8s_cluster.kubeconfig, context="elsewhere"
        ).launch(make_spec())


# -- status mapping from what the node really reports ------------------------------------------------------


@pytest.mark.sandbox
def test_exit_codes_and_logs(k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent) -> None:
    rt = make_runtime(k8s_cluster, k8s_ns)
    ok = rt.launch(
        make_spec(command=py("import os; [print('line', i) for i in range(5)]; print('uid', os.getuid())"))
    )
    bad = rt.launch(make_spec(command=py("import sys; print('about to fail'); sys.exit(3)")))
    st = terminal(rt, ok)
    assert (st.phase, st.exit_code, st.infrastructure) == ("succeeded", 0, False)
    # Through the apiserver's pods/log proxy to the node's log endpoint.
    assert rt.logs(ok, tail=2) == "line 4\nuid 65532\n"
    assert rt.logs(ok).count("line") == 5
    st = terminal(rt, bad)
    assert (st.phase, st.exit_code, st.infrastructure, st.unstartable) == ("failed", 3, False, False)
    assert "exited with code 3" in st.reason
    for h in (ok, bad):
        rt.destroy(h)


@pytest.mark.sandbox
def test_kata_is_emulated_and_says_so(k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent) -> None:
    rt = make_runtime(k8s_cluster, k8s_ns, runtime_class="kata")
    assert rt.isolation == IsolationLevel.VM
    h = rt.launch(make_spec(command=py("print('in a sandbox')")))
    assert terminal(rt, h).phase == "succeeded"
    pod = core(k8s_cluster).read_namespaced_pod(h.data["name"], k8s_ns)
    cond = {c.type: c for c in pod.status.conditions}[EMULATED_CONDITION]
    assert cond.status == "True" and "gVisor" in cond.message
    rt.destroy(h)


@pytest.mark.sandbox
def test_unpullable_image_is_unstartable(k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent) -> None:
    rt = make_runtime(k8s_cluster, k8s_ns)
    h = rt.launch(make_spec(image="registry.invalid/nope:1"))
    st = wait_for(
        lambda: (s := rt.status(h)).reason.startswith("ImagePullBackOff") and s,
        timeout=60,
        what="ImagePullBackOff",
    )
    assert (
        st.unstartable
        and not st.terminal
        and st.reason.startswith('ImagePullBackOff: Back-off pulling image "registry.invalid/nope:1"')
    )
    assert "cannot pull the image" in st.reason
    # The apiserver itself refuses logs of a container that never started.
    assert "is waiting to start: ImagePullBackOff" in rt.logs(h)
    k8s_agent.refuse_image("python:3.99-refused")
    h2 = rt.launch(make_spec(image="python:3.99-refused"))
    wait_for(lambda: rt.status(h2).unstartable, timeout=60, what="a refused pull")
    rt.destroy(h)
    rt.destroy(h2)


@pytest.mark.sandbox
def test_missing_store_secret_is_create_container_config_error(
    k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent
) -> None:
    rt = make_runtime(k8s_cluster, k8s_ns, store_credentials_secret=STORE_SECRET)
    h = rt.launch(make_spec())
    st = wait_for(
        lambda: (s := rt.status(h)).unstartable and s, timeout=60, what="CreateContainerConfigError"
    )
    assert "CreateContainerConfigError" in st.reason and f'secret "{STORE_SECRET}" not found' in st.reason
    assert f"store credentials Secret {STORE_SECRET!r}" in st.reason
    rt.destroy(h)


@pytest.mark.sandbox
@pytest.mark.parametrize("how", ["selector", "capacity"])
def test_unschedulable_then_unstartable_after_patience(
    k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent, how: str
) -> None:
    opts: dict[str, Any] = {"unschedulable_patience_s": 60}
    res = Resources()
    if how == "selector":
        opts["node_selector"] = {"resoluto.io/kata": "true"}
    else:
        res = Resources.from_quantities(memory="64Gi")  # the node has 8Gi
    rt = make_runtime(k8s_cluster, k8s_ns, **opts)
    now = [1000.0]
    rt._clock = lambda: now[0]
    h = rt.launch(make_spec(resources=res))
    st = wait_for(
        lambda: (s := rt.status(h)).reason.startswith("Unschedulable") and s,
        timeout=60,
        what="the scheduler's verdict",
    )
    assert (st.phase, st.unstartable) == ("pending", False)
    assert "0/1 nodes are available" in st.reason
    assert (
        ("didn't match Pod's node affinity" in st.reason)
        if how == "selector"
        else ("Insufficient memory" in st.reason)
    ), st.reason
    now[0] += 61
    st = rt.status(h)
    assert st.unstartable and "RuntimeClass 'gvisor'" in st.reason
    rt.destroy(h)


@pytest.mark.sandbox
def test_oom_killed_is_infrastructure_with_the_limit(
    k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent
) -> None:
    rt = make_runtime(k8s_cluster, k8s_ns)
    h = rt.launch(
        make_spec(
            resources=Resources.from_quantities(memory="192Mi"),
            command=py("b = []\nwhile True: b.append(bytearray(16 << 20))"),
        )
    )
    st = terminal(rt, h)
    assert (st.phase, st.exit_code, st.infrastructure) == ("failed", 137, True), st
    assert "OOMKilled" in st.reason and str(192 * 1024**2) in st.reason
    rt.destroy(h)


@pytest.mark.sandbox
def test_eviction_is_infrastructure(k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent) -> None:
    rt = make_runtime(k8s_cluster, k8s_ns)
    h = rt.launch(make_spec(command=py("import time; print('up', flush=True); time.sleep(600)")))
    wait_for(lambda: rt.status(h).phase == "running", timeout=60, what="running")
    k8s_agent.evict(k8s_ns, h.data["name"], "The node was low on resource: ephemeral-storage.")
    st = terminal(rt, h)
    assert (st.phase, st.infrastructure) == ("failed", True)
    assert st.reason == "Evicted: The node was low on resource: ephemeral-storage."
    rt.destroy(h)


@pytest.mark.sandbox
def test_deleted_from_outside_while_running(k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent) -> None:
    rt = make_runtime(k8s_cluster, k8s_ns)
    h = rt.launch(make_spec(command=py("import time; print('up', flush=True); time.sleep(600)")))
    name = h.data["name"]
    wait_for(lambda: rt.status(h).phase == "running", timeout=60, what="running")
    core(k8s_cluster).delete_namespaced_pod(name, k8s_ns, grace_period_seconds=5)  # someone's kubectl delete
    seen = []
    final = wait_for(lambda: (seen.append(s := rt.status(h)) or s.gone) and s, timeout=60, what="pod gone")
    assert final.infrastructure and "deleted from outside" in final.reason
    # The node stopped the sandbox: nothing of it is left running.
    wait_for(lambda: f"{k8s_ns}/{name}" not in k8s_agent.running(), timeout=30, what="sandbox stopped")
    assert all(s.infrastructure or not s.terminal for s in seen)


@pytest.mark.sandbox
def test_verdict_kept_after_the_pod_is_deleted(
    k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent
) -> None:
    rt = make_runtime(k8s_cluster, k8s_ns)
    h = rt.launch(make_spec(command=py("pass")))
    assert terminal(rt, h).phase == "succeeded"
    core(k8s_cluster).delete_namespaced_pod(h.data["name"], k8s_ns, grace_period_seconds=0)
    gone(k8s_cluster, k8s_ns, "pods", h.data["name"])
    seen: list[tuple[str, int | None]] = []

    def verdict_kept_until_gone() -> bool:
        # The runtime's pod watch learns of the deletion a moment after the API server: every
        # read until then, and the one after, keeps the verdict.
        st = rt.status(h)
        seen.append((st.phase, st.exit_code))
        return st.gone

    wait_for(verdict_kept_until_gone, timeout=60, what="the runtime to see the pod gone")
    assert set(seen) == {("succeeded", 0)}


@pytest.mark.sandbox
def test_destroy_stops_a_running_sandbox(k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent) -> None:
    rt = make_runtime(k8s_cluster, k8s_ns)
    h = rt.launch(make_spec(command=py("import time; print('up', flush=True); time.sleep(600)")))
    wait_for(lambda: rt.status(h).phase == "running", timeout=60, what="running")
    rt.destroy(h)
    gone(k8s_cluster, k8s_ns, "pods", h.data["name"])
    wait_for(
        lambda: f"{k8s_ns}/{h.data['name']}" not in k8s_agent.running(), timeout=30, what="sandbox stopped"
    )


# -- sweep -------------------------------------------------------------------------------------------------


def test_sweep_by_labels_leaves_others_alone(k8s_cluster: Cluster, k8s_ns: str, proxy: FaultProxy) -> None:
    rt = make_runtime(k8s_cluster, k8s_ns, via=proxy, node_selector={"resoluto.io/none": "x"})
    a = [
        rt.launch(make_spec(labels={"resoluto.flow-run-id": "flow-a"}, secret_env={"T": "1"}))
        for _ in range(2)
    ]
    b = rt.launch(make_spec(labels={"resoluto.flow-run-id": "flow-b"}))
    foreign = rt.manifests(make_spec(labels={"resoluto.flow-run-id": "flow-a"})).pod
    foreign["metadata"]["labels"].pop(MANAGED_BY_LABEL)
    foreign["metadata"]["name"] = "someone-elses"
    core(k8s_cluster).create_namespaced_pod(k8s_ns, foreign)
    assert rt.sweep({"resoluto.flow-run-id": "flow-a"}) == 2
    for h in a:
        gone(k8s_cluster, k8s_ns, "pods", h.data["name"])
    assert names(k8s_cluster, k8s_ns, "pods") == sorted([b.data["name"], "someone-elses"])
    assert names(k8s_cluster, k8s_ns, "networkpolicies") == [b.data["name"]]
    assert names(k8s_cluster, k8s_ns, "secrets") == []
    assert rt.sweep({"resoluto.flow-run-id": "flow-a"}) == 0
    assert proxy.calls("list", "pods")[-1] == 200


# -- retries and faults through the loopback proxy ------------------------------------------------------------


def test_5xx_on_create_retried_then_succeeds(k8s_cluster: Cluster, k8s_ns: str, proxy: FaultProxy) -> None:
    rt = make_runtime(k8s_cluster, k8s_ns, via=proxy, node_selector={"resoluto.io/none": "x"})
    proxy.fail("create", "pods", 503, times=2)
    h = rt.launch(make_spec())
    assert proxy.calls("create", "pods") == [503, 503, 201]
    assert names(k8s_cluster, k8s_ns, "pods") == [h.data["name"]]


def test_create_is_idempotent_when_the_answer_was_lost(
    k8s_cluster: Cluster, k8s_ns: str, proxy: FaultProxy
) -> None:
    """The real server creates the object, the client sees a 504; the retry meets the real
    409 AlreadyExists and recognises its own object by the launch token."""
    rt = make_runtime(k8s_cluster, k8s_ns, via=proxy, node_selector={"resoluto.io/none": "x"})
    proxy.fail("create", "pods", 504, after=True)
    proxy.fail("create", "networkpolicies", 500, after=True)
    h = rt.launch(make_spec())
    assert proxy.calls("create", "pods") == [504, 409]
    assert proxy.calls("create", "networkpolicies") == [500, 409]
    pod = core(k8s_cluster).read_namespaced_pod(h.data["name"], k8s_ns)
    assert h.data["uid"] == pod.metadata.uid
    assert names(k8s_cluster, k8s_ns, "pods") == [h.data["name"]]


def test_a_409_from_another_writer_is_a_clear_error(
    k8s_cluster: Cluster, k8s_ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect_resoluto.runtimes import kubernetes as kmod

    rt = make_runtime(k8s_cluster, k8s_ns, node_selector={"resoluto.io/none": "x"})
    fixed = uuid.UUID("0123456789abcdef0123456789abcdef")
    monkeypatch.setattr(uuid, "uuid4", lambda: fixed)
    theirs = rt.manifests(make_spec(), token="f" * 32, name=kmod.pod_name("rsl-abc123", fixed.hex)).pod
    core(k8s_cluster).create_namespaced_pod(k8s_ns, theirs)
    with pytest.raises(LaunchError, match=r"already exists .*409 Conflict"):
        rt.launch(make_spec())
    pod = core(k8s_cluster).read_namespaced_pod(theirs["metadata"]["name"], k8s_ns)
    assert pod.metadata.annotations["resoluto.io/launch-token"] == "f" * 32  # untouched
    assert names(k8s_cluster, k8s_ns, "networkpolicies") == []  # our half-launch was removed


def test_persistent_5xx_is_a_clear_error_and_cleans_up(
    k8s_cluster: Cluster, k8s_ns: str, proxy: FaultProxy
) -> None:
    rt = make_runtime(k8s_cluster, k8s_ns, via=proxy, api_retries=4, node_selector={"resoluto.io/none": "x"})
    h = rt.launch(make_spec())
    proxy.fail("get", "pods", 503, times=10)
    with pytest.raises(KubernetesApiError) as ei:
        rt.status_by_get(h)  # the GET a pod the watch does not show yet is read by
    msg = str(ei.value)
    assert "kept failing to get pods/" in msg and "503" in msg and "after 4 attempt(s)" in msg
    assert proxy.calls("get", "pods") == [503] * 4
    proxy.fail("create", "pods", 500, after=True)  # lands, but the client never hears of it
    proxy.fail("create", "pods", 500, times=10)
    with pytest.raises(LaunchError, match="kept failing to create pods"):
        rt.launch(make_spec())
    wait_for(
        lambda: names(k8s_cluster, k8s_ns, "pods") == [h.data["name"]],
        timeout=30,
        what="the landed attempt cleaned up",
    )
    assert names(k8s_cluster, k8s_ns, "networkpolicies") == [h.data["name"]]


def test_429_honours_retry_after(k8s_cluster: Cluster, k8s_ns: str, proxy: FaultProxy) -> None:
    rt = make_runtime(k8s_cluster, k8s_ns, via=proxy, node_selector={"resoluto.io/none": "x"})
    slept: list[float] = []
    rt._sleep = slept.append
    h = rt.launch(make_spec())
    proxy.fail("get", "pods", 429, retry_after=3)
    assert rt.status_by_get(h).phase == "pending"
    assert proxy.calls("get", "pods") == [429, 200]
    # The retry waited out Retry-After in the runtime's rate limit (paused for every caller).
    assert any(s >= 2.5 for s in slept), slept
    assert rt._api.limiter.pauses == 1


def test_connection_reset_is_retried(k8s_cluster: Cluster, k8s_ns: str, proxy: FaultProxy) -> None:
    rt = make_runtime(k8s_cluster, k8s_ns, via=proxy, node_selector={"resoluto.io/none": "x"})
    proxy.fail("create", "networkpolicies", reset=True)
    proxy.fail("delete", "pods", reset=True, times=2)
    h = rt.launch(make_spec())
    assert proxy.calls("create", "networkpolicies") == [0, 201]
    rt.destroy(h)
    assert proxy.calls("delete", "pods") == [0, 0, 200]
    gone(k8s_cluster, k8s_ns, "pods", h.data["name"])


def test_slow_answer_times_out_and_the_retry_recognises_the_landed_create(
    k8s_cluster: Cluster, k8s_ns: str, proxy: FaultProxy
) -> None:
    rt = make_runtime(
        k8s_cluster, k8s_ns, via=proxy, request_timeout_s=1.0, node_selector={"resoluto.io/none": "x"}
    )
    proxy.fail("create", "pods", delay_s=3.0)
    h = rt.launch(make_spec())
    # The slow answer was a 201 the client gave up on; the retry met the real 409.
    assert proxy.calls("create", "pods") == [201, 409]
    assert names(k8s_cluster, k8s_ns, "pods") == [h.data["name"]]


def test_api_server_unreachable(k8s_cluster: Cluster, k8s_ns: str) -> None:
    rt = make_runtime(
        k8s_cluster,
        k8s_ns,
        api_client=k8s_cluster.api_client(server="https://127.0.0.1:9"),
        api_retries=2,
        request_timeout_s=2,
    )
    with pytest.raises(LaunchError, match="cannot reach the Kubernetes API server"):
        rt.launch(make_spec())


# -- whole nodes and a Prefect flow on the moto S3 endpoint ---------------------------------------------------


def store_secret(cluster: Cluster, ns: str) -> None:
    core(cluster).create_namespaced_secret(
        ns,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": STORE_SECRET},
            "stringData": {
                "AWS_ACCESS_KEY_ID": os.environ["AWS_ACCESS_KEY_ID"],
                "AWS_SECRET_ACCESS_KEY": os.environ["AWS_SECRET_ACCESS_KEY"],
            },
        },
    )


@pytest.fixture
def k8s_node(
    k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent, s3_conduit: Any, proxy: FaultProxy
) -> Any:
    from prefect_resoluto.node.drive import drive_node
    from prefect_resoluto.node.spec import NodeSpec

    rt = make_runtime(
        k8s_cluster,
        k8s_ns,
        via=proxy,
        guest_source="bundle",
        store_credentials_secret=STORE_SECRET,
        store_egress_cidr=None,
        store_egress_port=None,
    )

    def run(argv: list[str], **fields: Any) -> Any:
        spec = NodeSpec(
            run_id=fields.pop("run_id", "run-k8s"), node_id=fields.pop("node_id", "n1"), argv=argv, **fields
        )
        events: list[dict[str, Any]] = []
        outcome = drive_node(
            spec, s3_conduit, rt, on_event=events.append, min_isolation="user-kernel", silence_window=120
        )
        return outcome, events

    return rt, run


@pytest.mark.sandbox
def test_node_end_to_end_through_a_real_pod(
    k8s_node: Any, k8s_cluster: Cluster, k8s_ns: str, s3_conduit: Any, proxy: FaultProxy, tmp_path: Path
) -> None:
    store_secret(k8s_cluster, k8s_ns)
    rt, run = k8s_node
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "input.txt").write_text("21\n")
    code = (
        "import os, pathlib; n = int(pathlib.Path('input.txt').read_text()); print('doubling', n); "
        "pathlib.Path('out').mkdir(); pathlib.Path('out/answer.txt').write_text(str(2 * n)); "
        "print('token seen:', os.environ.get('API_TOKEN', '')[::-1] == '321-kot'); "
        "print('aws key visible:', 'AWS_SECRET_ACCESS_KEY' in os.environ); print('uid', os.getuid())"
    )
    outcome, events = run(
        ["python3", "-c", code], workspace=ws, output_paths=["out/*.txt"], secret_env={"API_TOKEN": "tok-123"}
    )
    assert outcome.ok, outcome.describe()
    assert outcome.exit_code == 0 and outcome.runtime == "kubernetes" and outcome.isolation == "user-kernel"
    text = "\n".join(str(e["data"].get("line", "")) for e in events if e.get("event") == "log")
    assert "doubling 21" in text and "token seen: True" in text and "uid 65532" in text
    assert "aws key visible: False" in text  # the store credentials are the runner's, not the workload's
    assert (outcome.output_dir / "out" / "answer.txt").read_text() == "42"
    for resource in ("pods", "networkpolicies"):
        wait_for(
            lambda r=resource: names(k8s_cluster, k8s_ns, r) == [], timeout=60, what=f"{resource} reaped"
        )
    wait_for(
        lambda: names(k8s_cluster, k8s_ns, "secrets") == [STORE_SECRET], timeout=60, what="node Secret reaped"
    )
    sha, blob = guest_bundle.build_guest_bundle()
    assert s3_conduit.get(guest_bundle.guest_bundle_key("run-k8s", "", sha)) == blob
    assert proxy.calls("create", "pods") == [201]


@pytest.mark.sandbox
def test_a_setup_steps_leftovers_end_with_it_in_a_real_pod(
    k8s_node: Any, k8s_cluster: Cluster, k8s_ns: str
) -> None:
    """Issue 33, finding 5 on Kubernetes: the guest runner is the pod's PID namespace's init,
    so at the end of the setup it kills every other process there; a child that left the
    setup's session and process group does not run into the workload."""
    from support import phase_leftovers

    store_secret(k8s_cluster, k8s_ns)
    rt, run = k8s_node
    outcome, events = run(
        ["python3", "-c", phase_leftovers.CHECK],
        setup_argv=["python3", "-c", phase_leftovers.DAEMON],
        node_id="n-leftovers",
    )
    text = "\n".join(str(e["data"].get("line", "")) for e in events if e.get("event") == "log")
    assert outcome.ok, outcome.describe() + text
    assert phase_leftovers.ESCAPED in text and "IN WORKLOAD GONE" in text, text


@pytest.mark.sandbox
def test_node_workload_failure_through_a_real_pod(k8s_node: Any, k8s_cluster: Cluster, k8s_ns: str) -> None:
    store_secret(k8s_cluster, k8s_ns)
    rt, run = k8s_node
    outcome, _ = run(["python3", "-c", "import sys; print('about to fail'); sys.exit(3)"], node_id="n2")
    assert not outcome.ok and outcome.failure == "workload" and outcome.exit_code == 3


@pytest.mark.sandbox
def test_node_without_store_credentials_is_unstartable(
    k8s_node: Any, k8s_cluster: Cluster, k8s_ns: str
) -> None:
    rt, run = k8s_node  # no store Secret: the node cannot start the container
    outcome, _ = run(["true"], node_id="n3")
    assert outcome.failure == "unstartable"
    assert (
        f'secret "{STORE_SECRET}" not found' in outcome.reason
        and "CreateContainerConfigError" in outcome.reason
    )
    wait_for(lambda: names(k8s_cluster, k8s_ns, "pods") == [], timeout=60, what="pod reaped")


@pytest.mark.prefect
@pytest.mark.sandbox
@pytest.mark.usefixtures("prefect")
def test_flow_through_the_task_runner_on_a_real_cluster(
    k8s_cluster: Cluster,
    k8s_ns: str,
    k8s_agent: NodeAgent,
    s3_conduit: Any,
    proxy: FaultProxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prefect import flow

    from prefect_resoluto import ResolutoTaskRunner

    ws = tmp_path / "flow_ws"
    ws.mkdir()
    (ws / "k8s_real_flow_tasks.py").write_text(
        "from prefect import task\n\n\n@task\ndef square(x: int) -> int:\n"
        "    print(f'squaring {x} in a pod')\n    return x * x\n"
    )
    monkeypatch.syspath_prepend(str(ws))
    tasks = importlib.import_module("k8s_real_flow_tasks")
    store_secret(k8s_cluster, k8s_ns)
    rt = make_runtime(
        k8s_cluster,
        k8s_ns,
        via=proxy,
        guest_source="bundle",
        runtime_class="kata",
        store_credentials_secret=STORE_SECRET,
        store_egress_cidr=None,
        store_egress_port=None,
    )

    @flow(
        task_runner=ResolutoTaskRunner(
            runtime=rt, conduit=s3_conduit, min_isolation="vm", workspace=ws, outputs_dir=tmp_path / "out"
        )
    )
    def fan_out() -> list[int]:
        return [f.result() for f in tasks.square.map([1, 2, 3])]

    state = fan_out(return_state=True)
    assert state.is_completed(), state
    assert state.result() == [1, 4, 9]
    assert proxy.calls("create", "pods") == [201] * 3
    for resource in ("pods", "networkpolicies"):
        wait_for(
            lambda r=resource: names(k8s_cluster, k8s_ns, r) == [], timeout=60, what=f"{resource} reaped"
        )


@pytest.mark.prefect
@pytest.mark.sandbox
def test_flow_through_a_sandbox_block_with_the_pinned_context(
    k8s_cluster: Cluster,
    k8s_ns: str,
    k8s_agent: NodeAgent,
    moto_server: Any,
    s3_bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    prefect: Any,
) -> None:
    """The block path: runtime by name, context pinned in the block, kubeconfig from KUBECONFIG."""
    from prefect import flow

    from prefect_resoluto import ResolutoTaskRunner
    from prefect_resoluto.blocks import S3ConduitBlock, SandboxBlock

    ws = tmp_path / "block_ws"
    ws.mkdir()
    (ws / "k8s_real_block_tasks.py").write_text(
        "from prefect import task\n\n\n@task\ndef inc(x: int) -> int:\n    return x + 1\n"
    )
    monkeypatch.syspath_prepend(str(ws))
    tasks = importlib.import_module("k8s_real_block_tasks")
    monkeypatch.setenv("KUBECONFIG", k8s_cluster.kubeconfig)
    store_secret(k8s_cluster, k8s_ns)
    block = SandboxBlock(
        runtime="kubernetes",
        kube_context=CONTEXT,
        kube_namespace=k8s_ns,
        runtime_class="gvisor",
        min_isolation="user-kernel",
        image=IMAGE,
        store_credentials_secret=STORE_SECRET,
        conduit=S3ConduitBlock(bucket=s3_bucket, base_prefix="blk", endpoint_url=moto_server.endpoint_url),
    )

    @flow(task_runner=ResolutoTaskRunner(sandbox=block, workspace=ws, outputs_dir=tmp_path / "out"))
    def via_block() -> list[int]:
        return [f.result() for f in tasks.inc.map([1, 2])]

    state = via_block(return_state=True)
    assert state.is_completed(), state
    assert state.result() == [2, 3]
    wait_for(lambda: names(k8s_cluster, k8s_ns, "pods") == [], timeout=60, what="pods reaped")


def test_minted_short_lived_store_credentials(k8s_cluster: Cluster, k8s_ns: str, moto_server: Any) -> None:
    from moto.sts.models import sts_backends

    role = "arn:aws:iam::123456789012:role/resoluto-node"
    rt = make_runtime(
        k8s_cluster,
        k8s_ns,
        store_role_arn=role,
        store_sts_endpoint=moto_server.endpoint_url,
        guest_source="bundle",
        node_selector={"resoluto.io/none": "x"},
    )
    rt._bundles["run-1"] = ("base/run/run-1/_guest/guest_runner-x.tar.gz", "0" * 64)  # as prepare() would
    h = rt.launch(make_spec(env={"AWS_SECRET_ACCESS_KEY": os.environ["AWS_SECRET_ACCESS_KEY"]}))
    name = h.data["name"]
    secret = core(k8s_cluster).read_namespaced_secret(name, k8s_ns)
    creds = {k: base64.b64decode(v).decode() for k, v in secret.data.items()}
    assert set(creds) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
    assert creds["AWS_ACCESS_KEY_ID"] != os.environ["AWS_ACCESS_KEY_ID"]
    assert secret.immutable is True
    env = {e.name: e for e in core(k8s_cluster).read_namespaced_pod(name, k8s_ns).spec.containers[0].env}
    for var in creds:
        assert env[var].value_from.secret_key_ref.name == name and env[var].value is None
    assumed = [r for r in sts_backends["123456789012"]["aws"].assumed_roles if r.session_name == name]
    assert len(assumed) == 1
    rt.destroy(h)


def test_availability_against_the_real_server(k8s_cluster: Cluster, k8s_ns: str) -> None:
    rt = make_runtime(k8s_cluster, k8s_ns)
    avail = rt.availability()
    assert avail.ok and k8s_ns in avail.detail
    # A real server lists an absent namespace as empty (200), so listing alone cannot tell.
    missing = make_runtime(k8s_cluster, "rsl-absent-namespace").availability()
    assert not missing.ok and "kubectl create namespace rsl-absent-namespace" in missing.why


@pytest.mark.sandbox
def test_a_pod_stored_with_weaker_security_is_deleted_at_once(
    k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent, proxy: FaultProxy
) -> None:
    """The proxy drops seccompProfile from the pod on its way in -- what a server that does not
    know the field (< 1.19, Strict validation ignored) or a mutating webhook does. The real
    server stores the weaker pod; the runtime must notice and delete it at once."""

    def strip(body: dict[str, Any]) -> dict[str, Any]:
        body["spec"]["securityContext"].pop("seccompProfile")
        body["spec"]["containers"][0]["securityContext"].pop("seccompProfile")
        return body

    rt = make_runtime(k8s_cluster, k8s_ns, via=proxy)
    proxy.rewrite("create", "pods", strip)
    with pytest.raises(LaunchError) as ei:
        rt.launch(make_spec(command=py("print('must not run')")))
    msg = str(ei.value)
    assert "did not keep the sandbox's security settings" in msg
    assert "pod seccompProfile RuntimeDefault" in msg and "container seccompProfile RuntimeDefault" in msg
    assert proxy.calls("create", "pods") == [201] and proxy.calls("delete", "pods") == [200]
    for resource in ("pods", "networkpolicies"):
        wait_for(
            lambda r=resource: names(k8s_cluster, k8s_ns, r) == [], timeout=60, what=f"{resource} removed"
        )


def _paths(obj: Any, prefix: str = "") -> set[str]:
    out: set[str] = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            if v in ([], {}):  # omitempty: an empty list or map reads back as absent, same meaning
                continue
            out |= {f"{prefix}.{k}"} | _paths(v, f"{prefix}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out |= _paths(v, f"{prefix}[{i}]")
    return out


def test_the_server_keeps_every_field_the_runtime_sends(k8s_cluster: Cluster, k8s_ns: str) -> None:
    """Servers before 1.25 ignore fieldValidation=Strict and silently drop fields they do not
    know -- a dropped securityContext field would be a silent weakening. Nothing may be dropped."""
    from kubernetes.client import ApiClient

    rt = make_runtime(
        k8s_cluster,
        k8s_ns,
        guest_source="bundle",
        store_credentials_secret=STORE_SECRET,
        node_selector={"resoluto.io/none": "x"},
        priority_class=None,
    )
    rt._bundles["run-1"] = ("base/run/run-1/_guest/guest_runner-x.tar.gz", "0" * 64)  # as prepare() would
    spec = make_spec(
        secret_env={"API_TOKEN": "x"},
        egress=["public_https"],
        resources=Resources.from_quantities(memory="1Gi", cpus="0.5", disk="2Gi"),
    )
    h = rt.launch(spec)
    name, token = h.data["name"], h.data["token"]
    sent = rt.manifests(spec, name=name, token=token)
    raw = ApiClient(k8s_cluster.configuration())
    got = {
        "Pod": raw.sanitize_for_serialization(core(k8s_cluster).read_namespaced_pod(name, k8s_ns)),
        "NetworkPolicy": raw.sanitize_for_serialization(
            net(k8s_cluster).read_namespaced_network_policy(name, k8s_ns)
        ),
        "Secret": raw.sanitize_for_serialization(core(k8s_cluster).read_namespaced_secret(name, k8s_ns)),
    }
    for doc in sent.documents():
        # hostNetwork/hostPID/hostIPC are plain booleans with omitempty: false reads back as absent.
        # Pointer booleans (privileged, allowPrivilegeEscalation, runAsNonRoot ...) must come back.
        omitted = {".spec.hostNetwork", ".spec.hostPID", ".spec.hostIPC"}
        dropped = sorted(
            p for p in _paths(doc) - _paths(got[doc["kind"]]) if ".status" not in p and p not in omitted
        )
        assert dropped == [], (doc["kind"], dropped)
    rt.destroy(h)
