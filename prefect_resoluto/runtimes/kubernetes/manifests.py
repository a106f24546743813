"""The Kubernetes objects of one node, as plain dicts: NetworkPolicy, Secret, Pod.

Pure: no cluster, no upload, no name resolution. The runtime hands in what it had to look
up (the guest bundle's key, the store's addresses) and gets back exactly what it creates
and what ``prefect-resoluto render`` prints. The isolation guarantees are written here
(:func:`build_manifests`) and checked here against the pod the server stored
(:func:`weakened`), so the two cannot drift apart.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from guest_runner import wire
from prefect_resoluto.runtimes.base import LaunchError, LaunchSpec
from prefect_resoluto.runtimes.guest_bundle import ENV_BUNDLE_KEY, ENV_BUNDLE_SHA256, bootstrap_command
from prefect_resoluto.runtimes.labels import label_value as label_value

logger = logging.getLogger(__name__)

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

CONTAINER_NAME = "guest"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "prefect-resoluto"
SANDBOX_LABEL = "resoluto.io/sandbox"
RUN_LABEL = "resoluto.io/run-id"
NODE_LABEL = "resoluto.io/node-id"
TOKEN_ANNOTATION = "resoluto.io/launch-token"
SANDBOX_ID_ANNOTATION = "resoluto.io/sandbox-id"
LABELS_ANNOTATION = "resoluto.io/labels"

#: uid/gid the guest runs as unless the image's own non-root user is preferred.
DEFAULT_RUN_AS_USER = 65532

METADATA_V4 = ipaddress.ip_network("169.254.169.254/32")
METADATA_V6 = ipaddress.ip_network("fd00:ec2::254/128")
#: IPv4 addresses written as IPv6 (``::ffff:a.b.c.d``): the API server stores such a block as
#: it is, and a CNI may read it as the IPv4 addresses it names, past every IPv4 cut (metadata,
#: the worker's host), which only judges IPv4 blocks.
IPV4_MAPPED = ipaddress.ip_network("::ffff:0:0/96")
#: Never reachable through ``public_https``: private, shared, loopback, link-local.
NON_PUBLIC_V4 = tuple(
    ipaddress.ip_network(c)
    for c in (
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.168.0.0/16",
    )
)
#: Never inside a wider DNS block (``dns_cidr``) unless that block is itself inside one of
#: them, i.e. the operator named the private resolver explicitly.
NON_PUBLIC_V6 = tuple(ipaddress.ip_network(c) for c in ("::1/128", "fc00::/7", "fe80::/10"))
DNS_PORT = 53
#: The cluster's own resolvers: CoreDNS/kube-dns and NodeLocal DNSCache, both labelled
#: ``k8s-app`` in kube-system (the namespace's name label is set by the API server itself).
DNS_RESOLVER_APPS = ("kube-dns", "node-local-dns")
# Credentials the pod must never receive as literals: the store's come from a Secret.
STORE_CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


# -- names and labels -----------------------------------------------------------------------


def label_key(key: str) -> str | None:
    """A valid label key for ``key`` (``[prefix/]name``), or None when nothing valid remains."""
    prefix, _, name = str(key).rpartition("/")
    name = label_value(name)
    if not name:
        return None
    if prefix:
        prefix = re.sub(r"[^a-z0-9.-]+", "-", prefix.lower()).strip("-.")[:253]
        parts = [p.strip("-") for p in prefix.split(".") if p.strip("-")]
        prefix = ".".join(parts)
    return f"{prefix}/{name}" if prefix else name


def sanitise_labels(labels: Mapping[str, object]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in labels.items():
        key = label_key(k)
        if key is not None:
            out[key] = label_value(v)
    return out


def dns_name(text: str, limit: int) -> str:
    s = re.sub(r"[^a-z0-9-]+", "-", str(text).lower()).strip("-")[:limit].strip("-")
    return s or "x"


def pod_name(sandbox_id: str, token: str) -> str:
    """``rsl-<sandbox id>-<8 hex>``: a DNS label (<= 63) that also fits a label value."""
    slug = dns_name(sandbox_id, 48)
    if not slug.startswith("rsl-"):
        slug = dns_name(f"rsl-{slug}", 48)
    return f"{slug}-{token[:8]}"


def check_name(name: str) -> None:
    if not DNS_LABEL.match(name) or len(name) > 63:
        raise LaunchError(f"sandbox name {name!r} is not a valid DNS label")


def cpu_quantity(cpus: float) -> str:
    milli = max(1, round(cpus * 1000))
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


# -- egress ---------------------------------------------------------------------------------


def parse_network(text: str) -> IPNetwork:
    return ipaddress.ip_network(text.strip(), strict=False)


def ip_block(net: IPNetwork, extra: Sequence[IPNetwork] = ()) -> dict[str, Any]:
    """An ``ipBlock`` for ``net`` that never includes the cloud metadata address."""
    if net.version == 6 and net.subnet_of(IPV4_MAPPED):  # type: ignore[arg-type]
        raise LaunchError(
            f"egress to {net} is an IPv4-mapped IPv6 block; write its IPv4 form "
            f"({ipaddress.ip_address(int(net.network_address) & 0xFFFFFFFF)}/{net.prefixlen - 96}), "
            "which is judged like every IPv4 block (never the metadata address)"
        )
    meta = METADATA_V4 if net.version == 4 else METADATA_V6
    if meta.subnet_of(net) and net.prefixlen == meta.prefixlen:  # type: ignore[arg-type]
        raise LaunchError(f"egress to {net} is the cloud metadata endpoint; it is never allowed")
    excepts: list[IPNetwork] = []
    for ex in [*extra, meta]:
        if ex.version == net.version and ex.subnet_of(net) and ex != net:  # type: ignore[arg-type]
            if not any(ex.subnet_of(e) for e in excepts):  # type: ignore[arg-type]
                excepts = [e for e in excepts if not e.subnet_of(ex)]  # type: ignore[arg-type]
                excepts.append(ex)
    block: dict[str, Any] = {"cidr": str(net)}
    if excepts:
        block["except"] = [str(e) for e in excepts]
    return block


def parse_egress_entry(entry: str) -> dict[str, Any]:
    """One allowlist entry as a NetworkPolicy egress rule.

    ``public_https`` (TCP 443 to any public IPv4 address), a CIDR or an address, optionally
    with ``:port`` for IPv4 (``10.1.2.0/24:5432``). Host names are refused: NetworkPolicy
    ``ipBlock`` only takes addresses.
    """
    text = str(entry).strip()
    if text.lower() in ("public_https", "public-https"):
        return {
            "to": [{"ipBlock": ip_block(ipaddress.ip_network("0.0.0.0/0"), NON_PUBLIC_V4)}],
            "ports": [{"protocol": "TCP", "port": 443}],
        }
    port: int | None = None
    try:
        net = parse_network(text)
    except ValueError:
        head, sep, tail = text.rpartition(":")
        if not sep or not tail.isdigit() or head.count(":"):
            raise LaunchError(
                f"egress entry {entry!r} is not a CIDR, an IP address, 'CIDR:port' or 'public_https'; "
                "Kubernetes NetworkPolicy cannot match host names -- resolve the host yourself and "
                "allow its addresses, or use 'public_https'"
            ) from None
        try:
            net = parse_network(head)
        except ValueError:
            raise LaunchError(
                f"egress entry {entry!r}: {head!r} is not an IP address or CIDR (NetworkPolicy cannot "
                "match host names)"
            ) from None
        port = int(tail)
        if not 0 < port < 65536:
            raise LaunchError(f"egress entry {entry!r}: port must be 1-65535") from None
    rule: dict[str, Any] = {"to": [{"ipBlock": ip_block(net)}]}
    if port is not None:
        rule["ports"] = [{"protocol": "TCP", "port": port}]
    return rule


def parse_dns_cidrs(value: str | Sequence[str] | None) -> tuple[IPNetwork, ...]:
    """``dns_cidr``: none (the default: the cluster's resolver pods only), one CIDR or
    address, or several (a list, or one string separated by commas)."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    nets: list[IPNetwork] = []
    for item in items:
        if not item.strip():
            continue
        try:
            net = parse_network(item)
        except ValueError:
            raise LaunchError(f"dns_cidr {item.strip()!r} is not an IP address or CIDR") from None
        if net not in nets:
            nets.append(net)
    return tuple(nets)


def dns_block(net: IPNetwork) -> dict[str, Any]:
    """An ``ipBlock`` for a resolver block the operator named: the metadata address never,
    and no private, CGNAT, loopback or link-local range the block merely contains -- a
    range is reached only when the named block lies inside it (named explicitly)."""
    return ip_block(net, NON_PUBLIC_V4 if net.version == 4 else NON_PUBLIC_V6)


def dns_rule(dns_cidrs: Sequence[IPNetwork] = ()) -> dict[str, Any]:
    """Port 53, UDP first, to the cluster's resolver pods; to an address block only when
    the operator named one (``dns_cidr``): never to the world by default."""
    peers: list[dict[str, Any]] = [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchLabels": {"k8s-app": app}},
        }
        for app in DNS_RESOLVER_APPS
    ]
    peers += [{"ipBlock": dns_block(n)} for n in dns_cidrs]
    return {
        "to": peers,
        "ports": [{"protocol": "UDP", "port": DNS_PORT}, {"protocol": "TCP", "port": DNS_PORT}],
    }


def egress_rules(
    allowlist: Sequence[str],
    store_nets: Sequence[IPNetwork],
    store_port: int,
    dns_cidr: str | Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """DNS, the object store, then the node's own allowlist -- nothing else leaves the pod."""
    rules: list[dict[str, Any]] = [
        dns_rule(parse_dns_cidrs(dns_cidr)),
        {
            "to": [{"ipBlock": ip_block(n)} for n in store_nets],
            "ports": [{"protocol": "TCP", "port": store_port}],
        },
    ]
    for entry in allowlist:
        rules.append(parse_egress_entry(entry))
    return rules


# -- the objects ----------------------------------------------------------------------------


@dataclass
class Manifests:
    """What :meth:`KubernetesRuntime.manifests` renders for one node (plain JSON-able dicts)."""

    name: str
    namespace: str
    token: str
    network_policy: dict[str, Any]
    pod: dict[str, Any]
    secret: dict[str, Any] | None = None

    def documents(self) -> list[dict[str, Any]]:
        """In creation order: NetworkPolicy, Secret (if any), Pod."""
        docs = [self.network_policy]
        if self.secret is not None:
            docs.append(self.secret)
        docs.append(self.pod)
        return docs


@dataclass(frozen=True)
class PodSettings:
    """The runtime's options that shape every node's objects."""

    namespace: str
    runtime_class: str
    image_pull_policy: str = "IfNotPresent"
    service_account: str | None = None
    priority_class: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Mapping[str, Any]] = ()
    run_as_user: int | None = DEFAULT_RUN_AS_USER
    read_only_root_filesystem: bool = True
    termination_grace_s: int = 5
    #: Resolver blocks the operator named (comma separated); None: the resolver pods only.
    dns_cidr: str | None = None
    #: The operator's Secret with long-lived store keys, referenced by name (never copied).
    store_credentials_secret: str | None = None
    #: Short-lived store credentials are minted per node and travel in the node's Secret.
    minted_store_credentials: bool = False


def build_manifests(
    spec: LaunchSpec,
    settings: PodSettings,
    *,
    name: str,
    token: str,
    image: str,
    bundle: tuple[str, str] | None,
    store_nets: Sequence[IPNetwork],
    store_port: int,
    secret_values: Mapping[str, str] | None = None,
) -> Manifests:
    """NetworkPolicy, Secret (only when there are secrets) and Pod for ``spec``.

    ``bundle`` is the guest bundle's (key, sha256) when the pod bootstraps the guest runner
    from the conduit. ``secret_values`` replaces the node's secret values (rendering passes
    placeholders; a launch that minted store credentials passes them here).
    """
    ns = settings.namespace
    labels, annotations = _identity(spec, name, token)
    env = _PodEnv.of(spec, settings, bundle, secret_values)
    volumes, mounts = _scratch(spec)
    container_security, pod_security = _security(settings)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": image,
        "imagePullPolicy": settings.image_pull_policy,
        "env": env.entries(name),
        "securityContext": container_security,
        "volumeMounts": mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if env.command:
        container["command"] = env.command
    qty = _quantities(spec)
    if qty:
        container["resources"] = {"requests": dict(qty), "limits": dict(qty)}
    meta = {"name": name, "namespace": ns, "labels": labels, "annotations": annotations}
    pod_spec = _pod_spec(settings, container, pod_security, volumes)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}
    policy = _network_policy(spec, settings, name, token, labels, store_nets, store_port)
    secret = _secret(ns, name, token, labels, env.secret_data, env.minted) if env.secret_data else None
    return Manifests(name=name, namespace=ns, token=token, network_policy=policy, pod=pod, secret=secret)


def _identity(spec: LaunchSpec, name: str, token: str) -> tuple[dict[str, str], dict[str, str]]:
    """The labels every object of the node carries, and the pod's annotations."""
    own = {MANAGED_BY_LABEL: MANAGED_BY, SANDBOX_LABEL: name}
    labels = {
        **sanitise_labels(spec.labels),
        RUN_LABEL: label_value(spec.run_id),
        NODE_LABEL: label_value(spec.node_id),
        **own,
    }
    annotations = {
        TOKEN_ANNOTATION: token,
        SANDBOX_ID_ANNOTATION: spec.sandbox_id,
        LABELS_ANNOTATION: json.dumps(spec.labels, sort_keys=True),
    }
    return labels, annotations


@dataclass
class _PodEnv:
    """The container's environment: literal values for the non-secret configuration only;
    secrets by reference to the node's Secret or the operator's store-credentials Secret."""

    literal: dict[str, str]
    secret_data: dict[str, str]
    #: Variable -> (Secret name, key, optional) in the operator's Secret.
    store_refs: dict[str, tuple[str, str, bool]]
    minted: bool
    command: list[str] | None

    @classmethod
    def of(
        cls,
        spec: LaunchSpec,
        settings: PodSettings,
        bundle: tuple[str, str] | None,
        secret_values: Mapping[str, str] | None,
    ) -> _PodEnv:
        env = cls(
            literal={k: v for k, v in spec.env.items() if k not in STORE_CREDENTIAL_VARS},
            secret_data={k: v for k, v in spec.secret_env.items() if k not in STORE_CREDENTIAL_VARS},
            store_refs={},
            minted=False,
            command=list(spec.command) if spec.command else None,
        )
        withheld = sorted(k for k in STORE_CREDENTIAL_VARS if k in spec.env or k in spec.secret_env)
        if withheld:
            logger.debug(
                "kubernetes runtime: %s withheld from the pod; store credentials come from "
                "store_credentials_secret / store_role_arn",
                ", ".join(withheld),
            )
        if secret_values is not None:
            env.secret_data = {k: secret_values.get(k, "") for k in env.secret_data}
        env._store_credentials(settings, secret_values)
        env._guest(bundle)
        return env

    def _store_credentials(self, settings: PodSettings, secret_values: Mapping[str, str] | None) -> None:
        if settings.minted_store_credentials:
            self.minted = True
            for var in STORE_CREDENTIAL_VARS:
                self.secret_data[var] = (secret_values or {}).get(var, "")
        elif settings.store_credentials_secret:
            for var in STORE_CREDENTIAL_VARS:
                self.store_refs[var] = (settings.store_credentials_secret, var, var == "AWS_SESSION_TOKEN")

    def _guest(self, bundle: tuple[str, str] | None) -> None:
        literal = self.literal
        if self.command is None and bundle is not None:
            key, sha = bundle
            literal[ENV_BUNDLE_KEY] = key
            literal[ENV_BUNDLE_SHA256] = sha
            self.command = bootstrap_command()
        literal.setdefault("HOME", "/tmp")
        literal.setdefault("PYTHONUNBUFFERED", "1")
        redact = set(json.loads(literal.get(wire.ENV_SECRET_ENV) or "[]")) | set(self.secret_data)
        if redact:
            literal[wire.ENV_SECRET_ENV] = json.dumps(sorted(redact))

    def entries(self, secret_name: str) -> list[dict[str, Any]]:
        """The container's ``env`` list: literals, then the node's secrets, then the store's."""
        env: list[dict[str, Any]] = [{"name": k, "value": str(v)} for k, v in sorted(self.literal.items())]
        for var in sorted(self.secret_data):
            env.append({"name": var, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": var}}})
        for var, (sname, skey, optional) in sorted(self.store_refs.items()):
            ref: dict[str, Any] = {"name": sname, "key": skey}
            if optional:
                ref["optional"] = True
            env.append({"name": var, "valueFrom": {"secretKeyRef": ref}})
        return env


def _quantities(spec: LaunchSpec) -> dict[str, str]:
    """Requests = limits, from the node's resources."""
    res = spec.resources
    qty: dict[str, str] = {}
    if res.cpus:
        qty["cpu"] = cpu_quantity(res.cpus)
    if res.memory_bytes:
        qty["memory"] = str(int(res.memory_bytes))
    if res.disk_bytes:
        qty["ephemeral-storage"] = str(int(res.disk_bytes))
    return qty


def _scratch(spec: LaunchSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's writable places (/tmp, the workspace) as emptyDir volumes, and their mounts."""
    disk = spec.resources.disk_bytes
    scratch: dict[str, Any] = {"sizeLimit": str(int(disk))} if disk else {}
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": dict(scratch)}]
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    workspace = spec.env.get(wire.ENV_WORKSPACE_DIR, "")
    if workspace and workspace.startswith("/") and not (workspace + "/").startswith("/tmp/"):
        volumes.append({"name": "workspace", "emptyDir": dict(scratch)})
        mounts.append({"name": "workspace", "mountPath": workspace.rstrip("/") or "/workspace"})
    return volumes, mounts


def _security(settings: PodSettings) -> tuple[dict[str, Any], dict[str, Any]]:
    """The container's and the pod's securityContext."""
    container_security: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": settings.read_only_root_filesystem,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    pod_security: dict[str, Any] = {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if settings.run_as_user is not None:
        for d in (container_security, pod_security):
            d["runAsUser"] = settings.run_as_user
            d["runAsGroup"] = settings.run_as_user
        pod_security["fsGroup"] = settings.run_as_user
    return container_security, pod_security


def _pod_spec(
    settings: PodSettings, container: dict[str, Any], security: dict[str, Any], volumes: list[dict[str, Any]]
) -> dict[str, Any]:
    pod_spec: dict[str, Any] = {
        "runtimeClassName": settings.runtime_class,
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "hostNetwork": False,
        "hostPID": False,
        "hostIPC": False,
        "terminationGracePeriodSeconds": settings.termination_grace_s,
        "securityContext": security,
        "containers": [container],
        "volumes": volumes,
    }
    if settings.service_account:
        pod_spec["serviceAccountName"] = settings.service_account
    if settings.priority_class:
        pod_spec["priorityClassName"] = settings.priority_class
    if settings.node_selector:
        pod_spec["nodeSelector"] = dict(settings.node_selector)
    if settings.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in settings.tolerations]
    return pod_spec


def _network_policy(
    spec: LaunchSpec,
    settings: PodSettings,
    name: str,
    token: str,
    labels: dict[str, str],
    store_nets: Sequence[IPNetwork],
    store_port: int,
) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": name,
            "namespace": settings.namespace,
            "labels": dict(labels),
            "annotations": {TOKEN_ANNOTATION: token},
        },
        "spec": {
            "podSelector": {"matchLabels": {SANDBOX_LABEL: name}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],
            "egress": egress_rules(spec.egress, store_nets, store_port, settings.dns_cidr),
        },
    }


def _secret(
    ns: str, name: str, token: str, labels: dict[str, str], data: dict[str, str], minted: bool
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "immutable": True,
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": dict(labels),
            "annotations": {
                TOKEN_ANNOTATION: token,
                "resoluto.io/minted-store-credentials": str(minted).lower(),
            },
        },
        "data": {k: base64.b64encode(str(v).encode()).decode() for k, v in sorted(data.items())},
    }


def weakened(pod: Any, runtime_class: str, read_only_root_filesystem: bool) -> list[str]:
    """The isolation guarantees the stored pod (a client model) lost on its way in; empty when intact."""
    spec = pod.spec
    psc = spec.security_context
    c = next((c for c in spec.containers if c.name == CONTAINER_NAME), None)
    csc = c.security_context if c is not None else None

    def seccomp(sc: Any) -> Any:
        return getattr(getattr(sc, "seccomp_profile", None), "type", None)

    checks = {
        f"runtimeClassName {runtime_class!r}": spec.runtime_class_name == runtime_class,
        "automountServiceAccountToken false": spec.automount_service_account_token is False,
        "no host namespaces": not (spec.host_network or spec.host_pid or spec.host_ipc),
        "pod runAsNonRoot": bool(psc and psc.run_as_non_root),
        "pod seccompProfile RuntimeDefault": seccomp(psc) == "RuntimeDefault",
        "container securityContext": csc is not None,
        "allowPrivilegeEscalation false": csc is not None and csc.allow_privilege_escalation is False,
        "privileged false": csc is not None and not csc.privileged,
        "capabilities drop ALL": bool(csc and csc.capabilities and "ALL" in (csc.capabilities.drop or [])),
        "container seccompProfile RuntimeDefault": seccomp(csc) == "RuntimeDefault",
        "readOnlyRootFilesystem": not read_only_root_filesystem
        or bool(csc and csc.read_only_root_filesystem),
    }
    return [what for what, ok in checks.items() if not ok]
