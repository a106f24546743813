"""The pure manifest builder on its own: a launch spec and settings in, NetworkPolicy/Secret/Pod out.

No runtime object, no cluster, no name resolution: what the runtime looked up (the store's
address, the guest bundle's key) is handed in, as the runtime does.
"""

from __future__ import annotations

import base64
import ipaddress
import json
from typing import Any

import pytest

from prefect_resoluto.runtimes._sts import session_policy
from prefect_resoluto.runtimes.base import LaunchError, LaunchSpec, Resources
from prefect_resoluto.runtimes.guest_bundle import ENV_BUNDLE_KEY, ENV_BUNDLE_SHA256
from prefect_resoluto.runtimes.kubernetes.manifests import (
    NON_PUBLIC_V4,
    PodSettings,
    build_manifests,
    egress_rules,
    ip_block,
    weakened,
)

STORE = [ipaddress.ip_network("10.0.0.5/32")]


def spec(**overrides: Any) -> LaunchSpec:
    env = {
        "RESOLUTO_STORE_KIND": "s3",
        "RESOLUTO_STORE_BUCKET": "bucket",
        "RESOLUTO_RUN_ID": "run-1",
        "RESOLUTO_NODE_ID": "node-1",
        "RESOLUTO_WORKSPACE_DIR": "/workspace",
    }
    env.update(overrides.pop("env", {}))
    fields: dict[str, Any] = {"sandbox_id": "rsl-abc", "env": env, "labels": {"resoluto.flow-run-id": "f 1"}}
    fields.update(overrides)
    return LaunchSpec(**fields)


def build(s: LaunchSpec | None = None, settings: PodSettings | None = None, **kw: Any) -> Any:
    kw.setdefault("bundle", None)
    return build_manifests(
        s or spec(),
        settings or PodSettings(namespace="sandboxes", runtime_class="kata"),
        name="rsl-abc-0123abcd",
        token="t" * 32,
        image="guest:1",
        store_nets=STORE,
        store_port=9000,
        **kw,
    )


def env_of(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}


def test_secrets_live_in_the_nodes_secret_and_store_keys_in_the_operators() -> None:
    settings = PodSettings(namespace="sandboxes", runtime_class="kata", store_credentials_secret="store-keys")
    m = build(spec(secret_env={"API_TOKEN": "s3cr3t", "AWS_SECRET_ACCESS_KEY": "host-key"}), settings)
    env = env_of(m.pod)
    assert env["API_TOKEN"] == {
        "name": "API_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": m.name, "key": "API_TOKEN"}},
    }
    # The host's store key is never copied: the operator's Secret is referenced by name.
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "store-keys",
        "key": "AWS_SECRET_ACCESS_KEY",
    }
    assert env["AWS_SESSION_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
    assert m.secret is not None and set(m.secret["data"]) == {"API_TOKEN"}
    assert base64.b64decode(m.secret["data"]["API_TOKEN"]) == b"s3cr3t"
    assert "s3cr3t" not in json.dumps(m.pod) and "host-key" not in json.dumps(m.documents())
    assert json.loads(env["RESOLUTO_SECRET_ENV"]["value"]) == ["API_TOKEN"]


def test_minted_credentials_travel_in_the_secret_only() -> None:
    settings = PodSettings(namespace="sandboxes", runtime_class="kata", minted_store_credentials=True)
    minted = {"AWS_ACCESS_KEY_ID": "ASIA1", "AWS_SECRET_ACCESS_KEY": "short", "AWS_SESSION_TOKEN": "tok"}
    m = build(spec(), settings, secret_values=minted)
    assert m.secret is not None
    assert m.secret["metadata"]["annotations"]["resoluto.io/minted-store-credentials"] == "true"
    assert {k: base64.b64decode(v).decode() for k, v in m.secret["data"].items()} == minted
    assert "short" not in json.dumps(m.pod)


def test_the_bundle_is_bootstrapped_only_without_a_command() -> None:
    boot = build(bundle=("base/run/run-1/_guest/g.tar.gz", "a" * 64)).pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in boot["env"]}
    assert env[ENV_BUNDLE_KEY] == "base/run/run-1/_guest/g.tar.gz" and env[ENV_BUNDLE_SHA256] == "a" * 64
    assert boot["command"][0] == "python3"
    own = build(spec(command=["python3", "-m", "guest_runner"]), bundle=("k", "s")).pod["spec"]["containers"][
        0
    ]
    assert own["command"] == ["python3", "-m", "guest_runner"]
    assert ENV_BUNDLE_KEY not in {e["name"] for e in own["env"]}


def test_requests_equal_limits_and_scratch_is_bounded() -> None:
    c = build(spec(resources=Resources(cpus=1.5, memory_bytes=256 * 2**20, disk_bytes=2**30))).pod
    res = c["spec"]["containers"][0]["resources"]
    assert (
        res["requests"]
        == res["limits"]
        == {"cpu": "1500m", "memory": str(256 * 2**20), "ephemeral-storage": str(2**30)}
    )
    assert {v["name"]: v["emptyDir"] for v in c["spec"]["volumes"]} == {
        "tmp": {"sizeLimit": str(2**30)},
        "workspace": {"sizeLimit": str(2**30)},
    }


def test_egress_never_reaches_the_metadata_address() -> None:
    assert ip_block(ipaddress.ip_network("169.254.0.0/16")) == {
        "cidr": "169.254.0.0/16",
        "except": ["169.254.169.254/32"],
    }
    with pytest.raises(LaunchError, match="cloud metadata endpoint"):
        ip_block(ipaddress.ip_network("169.254.169.254/32"))
    rules = egress_rules(["10.1.0.0/16:5432"], STORE, 9000, "169.254.0.0/16")
    assert rules[0]["to"][2]["ipBlock"] == {"cidr": "169.254.0.0/16", "except": ["169.254.169.254/32"]}
    assert rules[1] == {
        "to": [{"ipBlock": {"cidr": "10.0.0.5/32"}}],
        "ports": [{"protocol": "TCP", "port": 9000}],
    }
    assert rules[2] == {
        "to": [{"ipBlock": {"cidr": "10.1.0.0/16"}}],
        "ports": [{"protocol": "TCP", "port": 5432}],
    }


def admits(rules: list[dict[str, Any]], address: str, port: int, protocol: str) -> bool:
    """Whether a rendered egress rule lets a packet to ``address:port`` leave the pod by
    address (an ``ipBlock``), as a NetworkPolicy implementation judges it."""
    ip = ipaddress.ip_address(address)
    for rule in rules:
        if not any(p["port"] == port and p["protocol"] == protocol for p in rule.get("ports", [])):
            continue
        for peer in rule["to"]:
            block = peer.get("ipBlock")
            if block is None:
                continue  # a pod selector admits those pods, never an arbitrary address
            net = ipaddress.ip_network(block["cidr"])
            if ip.version == net.version and ip in net:
                if not any(ip in ipaddress.ip_network(e) for e in block.get("except", [])):
                    return True
    return False


OUTSIDE = (
    "8.8.8.8",  # any internet host: a two-way TCP channel on port 53
    "10.0.0.53",  # RFC 1918 (an internal DNS server to zone-transfer)
    "172.16.0.53",
    "192.168.1.53",
    "100.100.100.200",  # CGNAT: a cloud's metadata DNS
    "169.254.169.254",  # the metadata endpoint
    "169.254.20.10",  # link-local
    "127.0.0.53",
    "fd00:ec2::254",
    "fe80::53",
    "2001:4860:4860::8888",
)


def test_dns_goes_only_to_the_clusters_resolver_by_default() -> None:
    """Issue 33, finding 1: with no egress at all the policy opened TCP and UDP 53 to
    0.0.0.0/0. By default port 53 goes to the resolver pods only: no address at all."""
    m = build()
    rules = m.network_policy["spec"]["egress"]
    dns = rules[0]
    assert dns["ports"] == [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
    assert dns["to"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
        },
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchLabels": {"k8s-app": "node-local-dns"}},
        },
    ]
    for address in OUTSIDE:
        for proto in ("UDP", "TCP"):
            assert not admits(rules, address, 53, proto), (address, proto)
    # Nothing but the store (its port) leaves by address.
    assert [r for r in rules if any("ipBlock" in p for p in r["to"])] == [rules[1]]


def test_a_named_dns_block_never_holds_private_cgnat_link_local_or_metadata() -> None:
    """An operator's wide block (here the whole internet) admits public resolvers only;
    a private resolver is reached when named itself (the DNS Service IP, NodeLocal DNS)."""
    wide = build(settings=PodSettings(namespace="sandboxes", runtime_class="kata", dns_cidr="0.0.0.0/0,::/0"))
    rules = wide.network_policy["spec"]["egress"]
    assert admits(rules, "8.8.8.8", 53, "UDP") and admits(rules, "2001:4860:4860::8888", 53, "TCP")
    assert not admits(rules, "8.8.8.8", 443, "TCP")
    for address in OUTSIDE[1:-1]:
        assert not admits(rules, address, 53, "UDP"), address
    v4 = rules[0]["to"][2]["ipBlock"]
    assert v4["cidr"] == "0.0.0.0/0" and set(v4["except"]) == {str(n) for n in NON_PUBLIC_V4}
    named = build(
        settings=PodSettings(
            namespace="sandboxes", runtime_class="kata", dns_cidr="10.96.0.10, 169.254.0.0/16"
        )
    ).network_policy["spec"]["egress"]
    assert admits(named, "10.96.0.10", 53, "UDP") and admits(named, "169.254.20.10", 53, "UDP")
    assert not admits(named, "10.96.0.11", 53, "UDP") and not admits(named, "169.254.169.254", 53, "UDP")
    with pytest.raises(LaunchError, match="dns_cidr 'kube-dns' is not an IP address"):
        egress_rules([], STORE, 9000, "kube-dns")


def stored(pod: dict[str, Any]) -> Any:
    """The pod as the client library decodes the server's answer."""
    from kubernetes.client import ApiClient

    return ApiClient().deserialize(json.dumps(pod), "V1Pod", "application/json")


def test_weakened_names_each_guarantee_the_stored_pod_lost() -> None:
    pytest.importorskip("kubernetes", reason="the kubernetes client library is not installed")
    pod = build().pod
    assert weakened(stored(pod), "kata", True) == []
    stripped = json.loads(json.dumps(pod))
    del stripped["spec"]["securityContext"]["seccompProfile"]  # what a pre-1.19 server drops
    stripped["spec"]["containers"][0]["securityContext"]["capabilities"] = {"add": ["NET_ADMIN"]}
    stripped["spec"]["runtimeClassName"] = "runc"  # a mutating webhook
    assert weakened(stored(stripped), "kata", True) == [
        "runtimeClassName 'kata'",
        "pod seccompProfile RuntimeDefault",
        "capabilities drop ALL",
    ]
    del stripped["spec"]["containers"][0]["securityContext"]
    lost = weakened(stored(stripped), "kata", True)
    assert {
        "container securityContext",
        "allowPrivilegeEscalation false",
        "privileged false",
        "readOnlyRootFilesystem",
    } <= set(lost)


def test_session_policy_reaches_only_the_nodes_prefix_and_the_read_only_keys() -> None:
    policy = json.loads(session_policy("bucket", "base/run/r/nodes/n", ["base/run/r/_guest/g.tar.gz"]))
    rw, ls, ro = policy["Statement"]
    assert rw["Resource"] == ["arn:aws:s3:::bucket/base/run/r/nodes/n/*"]
    assert ls["Condition"] == {"StringLike": {"s3:prefix": ["base/run/r/nodes/n/*", "base/run/r/nodes/n"]}}
    assert ro == {
        "Effect": "Allow",
        "Action": ["s3:GetObject"],
        "Resource": ["arn:aws:s3:::bucket/base/run/r/_guest/g.tar.gz"],
    }
    assert len(json.loads(session_policy("bucket", "p"))["Statement"]) == 2


def test_a_short_silence_windows_heartbeat_reaches_the_pods_guest(tmp_path: Any) -> None:
    """The host's heartbeat for a window under the guest's own 10 s (`node.spec.guest_env`)
    travels in the pod's env like the rest of the node's, or the pod's quiet guest is ended."""
    from guest_runner import wire
    from guest_runner.conduit import LocalConduit
    from prefect_resoluto.node.spec import NodeSpec, launch_spec

    node = NodeSpec(run_id="run-1", node_id="node-1", argv=["true"], silence_window=2.0)
    told = launch_spec(node, LocalConduit(tmp_path)).env[wire.ENV_HEARTBEAT_INTERVAL]
    pod = build(spec(env={wire.ENV_HEARTBEAT_INTERVAL: told})).pod
    assert env_of(pod)[wire.ENV_HEARTBEAT_INTERVAL]["value"] == "0.5"
