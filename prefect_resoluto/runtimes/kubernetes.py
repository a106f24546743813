"""Kubernetes runtime: one short-lived pod per node, Kata (or gVisor) RuntimeClass, S3 conduit.

For every node the runtime creates, in this order and all labelled with the node's
unique ``resoluto.io/sandbox`` label:

1. a **NetworkPolicy** selecting exactly that pod: no ingress, and no egress except DNS
   (port 53), the object store's CIDR/port and the node's explicit allowlist; the cloud
   metadata address is excepted from every block that would contain it;
2. a **Secret** holding the node's secret environment (only when there is some, or when
   short-lived store credentials were minted for it) -- the pod reads it through
   ``secretKeyRef``; nothing secret is ever a literal value in the pod spec;
3. the **Pod**: ``runtimeClassName`` kata/gvisor, ``restartPolicy: Never``, no service
   account token, non-root, read-only root filesystem, no privilege escalation, every
   capability dropped, ``RuntimeDefault`` seccomp, requests = limits from the node's
   resources.

The pod the server stored is checked against those guarantees before the launch counts:
servers before 1.25 ignore strict field validation and drop fields they do not know, and
mutating webhooks rewrite pods, so a weakened pod is deleted at once and the launch fails.

Policy and Secret exist before the pod (the policy must be in force when the pod's
network comes up; the kubelet needs the Secret to start the container), so they cannot
name the pod as their owner at creation. Right after the pod exists they are patched to
be owned by it, so the garbage collector removes them with the pod even if this host
dies; :meth:`KubernetesRuntime.destroy` also deletes them explicitly, and
:meth:`KubernetesRuntime.sweep` reaps all three kinds by label.

Why a per-node Secret rather than referencing one: the node's secrets (task secrets,
minted store credentials) are per node, and a per-node object lets the credentials die
with the pod. Long-lived store keys are never copied anywhere: they stay in the
operator's own Secret (``store_credentials_secret``) which pods reference by name.

The guest runner reaches the pod through the conduit: the host uploads a deterministic
tarball of ``guest_runner`` once per run (:mod:`prefect_resoluto.guest_bundle`) and the
container command is a short ``python3 -c`` bootstrap that fetches, verifies, unpacks
and execs it. Any image with Python >= 3.9 and boto3 works; ``guest_source="image"``
uses an image that already contains the runner (``images/Dockerfile``).
"""

from __future__ import annotations

import base64
import ipaddress
import json
import logging
import os
import random
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlparse

from guest_runner import wire
from prefect_resoluto.guest_bundle import (
    ENV_BUNDLE_KEY,
    ENV_BUNDLE_SHA256,
    bootstrap_command,
    build_guest_bundle,
    guest_bundle_key,
    upload_guest_bundle,
)
from prefect_resoluto.runtimes.base import (
    Availability,
    IsolationLevel,
    IsolationTooWeak,
    LaunchError,
    LaunchSpec,
    RuntimeUnavailable,
    SandboxHandle,
    SandboxRuntime,
    SandboxStatus,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

DEFAULT_NAMESPACE = "resoluto-sandboxes"
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
#: Never reachable through ``public_https``: private, shared, loopback, link-local.
NON_PUBLIC_V4 = tuple(
    ipaddress.ip_network(c)
    for c in ("10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
              "192.168.0.0/16")
)

#: Waiting reasons after which a container will never start without outside help.
FATAL_WAITING_REASONS = frozenset({
    "ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
    "CrashLoopBackOff", "PreCreateHookError", "PreStartHookError", "PostStartHookError",
})
#: Pod-level reasons of a Failed pod that come from the node, not from the workload.
INFRA_POD_REASONS = frozenset({
    "Evicted", "NodeLost", "Shutdown", "NodeShutdown", "Terminated", "UnexpectedAdmissionError",
    "OutOfcpu", "OutOfmemory", "OutOfpods", "OutOfephemeral-storage", "NodeAffinity",
    "DeadlineExceeded", "Preempting", "NodeAffinityFailed",
})
_RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
# Credentials the pod must never receive as literals: the store's come from a Secret.
_STORE_CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")

_VM_CLASSES = re.compile(r"^kata([-_.].*)?$")
_USER_KERNEL_CLASSES = re.compile(r"^(gvisor|runsc)([-_.].*)?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


# -- errors ---------------------------------------------------------------------------------


class KubernetesApiError(RuntimeError):
    """The API server refused or failed a request; the message says what to do."""

    def __init__(self, message: str, *, status: int | None = None, verb: str = "",
                 resource: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.verb = verb
        self.resource = resource


class KubernetesConfigError(RuntimeUnavailable):
    """No usable, explicitly chosen cluster connection (context pinning, kubeconfig)."""


# -- small pure helpers ---------------------------------------------------------------------


def isolation_of_runtime_class(runtime_class: str | None, declared: str | None = None) -> IsolationLevel:
    """The isolation a RuntimeClass gives, or :class:`IsolationTooWeak` when it is not a sandbox.

    ``kata`` and ``kata-*`` (kata-qemu, kata-clh, kata-fc ...) are hardware VMs; ``gvisor``,
    ``runsc`` (and ``gvisor-*``) a user-space kernel. Other names must declare their level.
    """
    name = (runtime_class or "").strip()
    if declared:
        level = IsolationLevel.parse(declared)
    elif _VM_CLASSES.match(name):
        level = IsolationLevel.VM
    elif _USER_KERNEL_CLASSES.match(name):
        level = IsolationLevel.USER_KERNEL
    else:
        raise IsolationTooWeak(
            f"RuntimeClass {name or '(none)'!r} is not a sandbox this runtime knows: without Kata "
            "(runtime_class='kata', isolation 'vm') or gVisor (runtime_class='gvisor' or 'runsc', "
            "isolation 'user-kernel') a pod shares the node's kernel with every other pod. Use one of "
            "those, or if your cluster names its Kata/gVisor class differently, say which it is with "
            "runtime_class_isolation='vm' or 'user-kernel'."
        )
    if not name:
        raise IsolationTooWeak("runtime_class must name the cluster's Kata or gVisor RuntimeClass")
    if level < IsolationLevel.USER_KERNEL:
        raise IsolationTooWeak(
            f"RuntimeClass {name!r} declared as isolation {level.label!r}: pods without Kata or gVisor "
            "share the node's kernel, which this runtime does not offer as a sandbox; use a Kata "
            "('vm') or gVisor ('user-kernel') RuntimeClass"
        )
    return level


def label_value(value: object) -> str:
    """A valid label value for ``value``: <= 63 chars of ``[A-Za-z0-9._-]``, alphanumeric ends."""
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", str(value))
    s = s.strip("-._")[:63]
    return s.strip("-._")


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


def _cpu_quantity(cpus: float) -> str:
    milli = max(1, round(cpus * 1000))
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def _parse_network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(text.strip(), strict=False)


def _excepting_metadata(net: ipaddress.IPv4Network | ipaddress.IPv6Network,
                        extra: Sequence[ipaddress.IPv4Network] = ()) -> dict[str, Any]:
    """An ``ipBlock`` for ``net`` that never includes the cloud metadata address."""
    meta = METADATA_V4 if net.version == 4 else METADATA_V6
    if meta.subnet_of(net) and net.prefixlen == meta.prefixlen:  # type: ignore[arg-type]
        raise LaunchError(f"egress to {net} is the cloud metadata endpoint; it is never allowed")
    excepts = []
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
            "to": [{"ipBlock": _excepting_metadata(ipaddress.ip_network("0.0.0.0/0"), NON_PUBLIC_V4)}],
            "ports": [{"protocol": "TCP", "port": 443}],
        }
    port: int | None = None
    try:
        net = _parse_network(text)
    except ValueError:
        head, sep, tail = text.rpartition(":")
        if not sep or not tail.isdigit() or head.count(":"):
            raise LaunchError(
                f"egress entry {entry!r} is not a CIDR, an IP address, 'CIDR:port' or 'public_https'; "
                "Kubernetes NetworkPolicy cannot match host names -- resolve the host yourself and "
                "allow its addresses, or use 'public_https'"
            ) from None
        try:
            net = _parse_network(head)
        except ValueError:
            raise LaunchError(
                f"egress entry {entry!r}: {head!r} is not an IP address or CIDR (NetworkPolicy cannot "
                "match host names)"
            ) from None
        port = int(tail)
        if not 0 < port < 65536:
            raise LaunchError(f"egress entry {entry!r}: port must be 1-65535") from None
    rule: dict[str, Any] = {"to": [{"ipBlock": _excepting_metadata(net)}]}
    if port is not None:
        rule["ports"] = [{"protocol": "TCP", "port": port}]
    return rule


def _status_message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if body:
        try:
            msg = json.loads(body).get("message")
            if msg:
                return str(msg)
        except (ValueError, AttributeError):
            return str(body)[:500]
    return str(getattr(exc, "reason", "") or exc)


# -- rendering result -----------------------------------------------------------------------


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


# -- the runtime ----------------------------------------------------------------------------


class KubernetesRuntime(SandboxRuntime):
    """One pod per node on a Kubernetes cluster, under a Kata (or gVisor) RuntimeClass."""

    name: ClassVar[str] = "kubernetes"
    supports_local_conduit: ClassVar[bool] = False
    supports_egress_allowlist: ClassVar[bool] = True
    # A pod's status is an API request: ask every 2 s and let the conduit carry the fast path.
    status_interval: ClassVar[float] = 2.0

    def __init__(
        self,
        *,
        namespace: str | None = None,
        context: str | None = None,
        kubeconfig: str | None = None,
        allow_ambient_context: bool | None = None,
        in_cluster: bool | None = None,
        runtime_class: str = "kata",
        runtime_class_isolation: str | None = None,
        image: str | None = None,
        image_pull_policy: str = "IfNotPresent",
        guest_source: str = "bundle",
        service_account: str | None = None,
        priority_class: str | None = None,
        node_selector: Mapping[str, str] | None = None,
        tolerations: Sequence[Mapping[str, Any]] | None = None,
        store_egress_cidr: str | None = None,
        store_egress_port: int | None = None,
        store_credentials_secret: str | None = None,
        store_role_arn: str | None = None,
        store_sts_endpoint: str | None = None,
        store_credentials_ttl_s: int = 3600,
        dns_cidr: str = "0.0.0.0/0",
        run_as_user: int | None = DEFAULT_RUN_AS_USER,
        read_only_root_filesystem: bool = True,
        unschedulable_patience_s: float = 300.0,
        delete_grace_s: int = 5,
        api_retries: int = 5,
        api_retry_base_s: float = 0.25,
        request_timeout_s: float = 30.0,
        api_client: Any = None,
    ) -> None:
        env = os.environ
        self.namespace = namespace or env.get("RESOLUTO_SANDBOX_NAMESPACE") or DEFAULT_NAMESPACE
        if not _DNS_LABEL.match(self.namespace) or len(self.namespace) > 63:
            raise ValueError(f"namespace {self.namespace!r} is not a valid Kubernetes namespace name")
        self.context = context if context is not None else (env.get("RESOLUTO_SANDBOX_KUBECONTEXT") or None)
        self.kubeconfig = kubeconfig
        self.allow_ambient_context = (
            allow_ambient_context if allow_ambient_context is not None
            else env.get("RESOLUTO_SANDBOX_ALLOW_AMBIENT_CONTEXT") == "1"
        )
        self.in_cluster = in_cluster
        self.runtime_class = runtime_class
        self.runtime_class_isolation = runtime_class_isolation
        self._isolation = isolation_of_runtime_class(runtime_class, runtime_class_isolation)
        self.image = image or env.get("RESOLUTO_SANDBOX_IMAGE") or None
        if image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            raise ValueError("image_pull_policy must be Always, IfNotPresent or Never")
        self.image_pull_policy = image_pull_policy
        if guest_source not in ("bundle", "image"):
            raise ValueError("guest_source must be 'bundle' (ship guest_runner via the conduit) or 'image'")
        self.guest_source = guest_source
        self.service_account = service_account
        self.priority_class = priority_class
        self.node_selector = dict(node_selector or {})
        self.tolerations = [dict(t) for t in (tolerations or [])]
        self.store_egress_cidr = store_egress_cidr
        self.store_egress_port = store_egress_port
        self.store_credentials_secret = store_credentials_secret
        self.store_role_arn = store_role_arn
        self.store_sts_endpoint = store_sts_endpoint
        if store_credentials_ttl_s < 900:
            raise ValueError("store_credentials_ttl_s must be at least 900 (the STS minimum)")
        self.store_credentials_ttl_s = int(store_credentials_ttl_s)
        self.dns_cidr = str(_parse_network(dns_cidr))
        self.run_as_user = run_as_user
        self.read_only_root_filesystem = read_only_root_filesystem
        self.unschedulable_patience_s = float(unschedulable_patience_s)
        self.delete_grace_s = int(delete_grace_s)
        self.api_retries = max(1, int(api_retries))
        self.api_retry_base_s = float(api_retry_base_s)
        self.request_timeout_s = float(request_timeout_s)
        self._api_client = api_client
        self._lock = threading.Lock()
        self._bundle_lock = threading.Lock()
        self._bundles: dict[str, tuple[str, str]] = {}
        self._core_api: Any = None
        self._net_api: Any = None
        self._target = "injected API client" if api_client is not None else ""
        # Seams for tests: monotonic clock and the back-off sleep.
        self._clock: Callable[[], float] = time.monotonic
        self._sleep: Callable[[float], None] = time.sleep

    # -- interface basics ----------------------------------------------------------------

    @property
    def isolation(self) -> IsolationLevel:
        return self._isolation

    def availability(self) -> Availability:
        try:
            core = self._core()
            self._call("list", "pods", "", lambda: core.list_namespaced_pod(
                self.namespace, limit=1, _request_timeout=self._timeout()))
            # A real server lists an absent namespace as empty (200); a dry-run create says 404
            # (and that this identity may create what a launch creates first). Nothing is stored.
            probe = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                     "metadata": {"generateName": "resoluto-availability-"},
                     "spec": {"podSelector": {"matchLabels": {SANDBOX_LABEL: "availability-probe"}},
                              "policyTypes": ["Ingress"]}}
            net = self._net()
            self._call("create", "networkpolicies", "", lambda: net.create_namespaced_network_policy(
                self.namespace, probe, dry_run="All", _request_timeout=self._timeout()))
        except (KubernetesConfigError, KubernetesApiError) as e:
            return Availability(False, str(e))
        except Exception as e:  # anything else: report, never raise from a probe
            return Availability(False, f"{type(e).__name__}: {e}")
        return Availability(True, detail=f"{self._target}, namespace {self.namespace!r}, "
                                         f"RuntimeClass {self.runtime_class!r}")

    # -- cluster connection ----------------------------------------------------------------

    def _load_client(self) -> Any:
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException

        kubeconfig = self.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        paths = [Path(p).expanduser() for p in kubeconfig.split(os.pathsep) if p]
        have_kubeconfig = any(p.is_file() for p in paths)
        in_cluster = self.in_cluster
        if in_cluster is None:
            in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and not have_kubeconfig \
                and not self.context
        if in_cluster:
            cfg = self._configuration()
            try:
                config.load_incluster_config(client_configuration=cfg)
            except ConfigException as e:
                raise KubernetesConfigError(f"in-cluster Kubernetes configuration unusable: {e}") from e
            self._target = f"in-cluster API at {cfg.host}"
            logger.info("kubernetes runtime: in-cluster API at %s (namespace %s)", cfg.host, self.namespace)
            return client.ApiClient(configuration=cfg)
        if not have_kubeconfig:
            raise KubernetesConfigError(
                f"no kubeconfig found at {kubeconfig} and not running inside a cluster; point "
                "KUBECONFIG (or kubeconfig=) at one and pin its context with RESOLUTO_SANDBOX_KUBECONTEXT"
            )
        try:
            contexts, current = config.list_kube_config_contexts(config_file=kubeconfig)
        except (ConfigException, OSError, ValueError) as e:
            raise KubernetesConfigError(f"cannot read kubeconfig {kubeconfig}: {e}") from e
        names = sorted(c.get("name", "") for c in contexts or [])
        context = self.context
        if context is None:
            if not self.allow_ambient_context:
                raise KubernetesConfigError(
                    "refusing to use the ambient kube context"
                    + (f" ({current.get('name')!r})" if current else "")
                    + ": pin the cluster with RESOLUTO_SANDBOX_KUBECONTEXT=<context> (or context=...), "
                    "or set RESOLUTO_SANDBOX_ALLOW_AMBIENT_CONTEXT=1 to accept whatever context is "
                    f"current. Contexts in {kubeconfig}: {', '.join(names) or '(none)'}"
                )
            if not current:
                raise KubernetesConfigError(f"kubeconfig {kubeconfig} has no current context")
            context = current.get("name")
        elif context not in names:
            raise KubernetesConfigError(
                f"kube context {context!r} is not in {kubeconfig}; available: {', '.join(names) or '(none)'}"
            )
        cfg = self._configuration()
        try:
            config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg,
                                    persist_config=False)
        except (ConfigException, OSError, ValueError) as e:
            raise KubernetesConfigError(f"kube context {context!r} unusable: {e}") from e
        pinned = "pinned" if self.context else "AMBIENT (RESOLUTO_SANDBOX_ALLOW_AMBIENT_CONTEXT=1)"
        self._target = f"kube context {context!r} ({pinned}) at {cfg.host}"
        if self.context:
            logger.info("kubernetes runtime: %s, namespace %s", self._target, self.namespace)
        else:
            logger.warning("kubernetes runtime: %s -- an unpinned context can launch pods on the wrong "
                           "cluster", self._target)
        return client.ApiClient(configuration=cfg)

    @staticmethod
    def _configuration() -> Any:
        from kubernetes import client

        cfg = client.Configuration()
        # One retry layer, ours (_call): it knows which requests are idempotent and backs
        # off; urllib3's own would multiply the attempts and sleep on Retry-After unseen.
        cfg.retries = 0
        return cfg

    def _core(self) -> Any:
        with self._lock:
            if self._core_api is None:
                from kubernetes import client

                if self._api_client is None:
                    self._api_client = self._load_client()
                self._core_api = client.CoreV1Api(self._api_client)
                self._net_api = client.NetworkingV1Api(self._api_client)
            return self._core_api

    def _net(self) -> Any:
        self._core()
        return self._net_api

    def _timeout(self) -> tuple[float, float]:
        return (min(10.0, self.request_timeout_s), self.request_timeout_s)

    # -- API calls with error translation and retries -----------------------------------------

    def _call(self, verb: str, resource: str, name: str, fn: Callable[[], _T], *,
              retry: bool = True, on_conflict: Callable[[], _T | None] | None = None) -> _T:
        """Run one API request; 5xx/429/connection errors are retried when ``retry``.

        ``on_conflict`` makes a create idempotent: after a retried create answers 409, it
        returns the object when it is the one this runtime wrote (else None -> error).
        """
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError as Urllib3Error

        attempts = self.api_retries if retry else 1
        where = f"{resource}/{name}" if name else resource
        last: BaseException | None = None
        for attempt in range(1, attempts + 1):
            try:
                return fn()
            except ApiException as e:
                status = e.status or 0
                if status == 409 and attempt > 1 and on_conflict is not None:
                    mine = on_conflict()
                    if mine is not None:
                        return mine
                if status in _RETRYABLE_STATUS and attempt < attempts:
                    last = e
                    self._backoff(attempt, e)
                    continue
                raise self._api_error(verb, resource, name, e, attempt) from e
            except (Urllib3Error, OSError) as e:
                if attempt < attempts:
                    last = e
                    self._backoff(attempt, None)
                    continue
                raise KubernetesApiError(
                    f"cannot reach the Kubernetes API server ({self._target or 'not connected'}) to "
                    f"{verb} {where} in namespace {self.namespace!r} after {attempt} attempt(s): {e}",
                    verb=verb, resource=resource,
                ) from e
        raise KubernetesApiError(f"{verb} {where}: gave up: {last}", verb=verb, resource=resource)

    def _backoff(self, attempt: int, exc: Any) -> None:
        delay = min(8.0, self.api_retry_base_s * (2 ** (attempt - 1)))
        retry_after = None
        headers = getattr(exc, "headers", None) or {}
        try:
            retry_after = float(headers.get("Retry-After")) if headers.get("Retry-After") else None
        except (TypeError, ValueError):
            retry_after = None
        if retry_after is not None:
            delay = min(max(delay, retry_after), 30.0)
        self._sleep(delay * (0.5 + random.random() / 2))

    def _api_error(self, verb: str, resource: str, name: str, exc: Any, attempts: int) -> KubernetesApiError:
        status = exc.status or 0
        server = _status_message(exc)
        ns = self.namespace
        what = f"{resource}/{name}" if name else resource
        if status == 401:
            msg = (f"the Kubernetes API server ({self._target}) rejected the credentials (401 Unauthorized): "
                   f"{server}. Refresh the kubeconfig's credentials for this context.")
        elif status == 403 and re.search(r"cannot \S+ resource", server):
            rbac_verb = "get" if verb == "read logs of" else verb
            rbac_res = "pods/log" if verb == "read logs of" else resource
            msg = (f"RBAC: cannot {rbac_verb} {rbac_res} in namespace {ns!r} (403 Forbidden): {server}. "
                   f"Grant the identity of {self._target or 'this client'} the verb {rbac_verb!r} on "
                   f"{rbac_res!r} in that namespace (see docs/backends.md, 'RBAC').")
        elif status == 403:
            msg = (f"the cluster refused to {verb} {what} in namespace {ns!r} (403 Forbidden, an admission "
                   f"policy rather than RBAC): {server}" + (
                       f". Check that the RuntimeClass {self.runtime_class!r} exists "
                       "(kubectl get runtimeclass)" if "RuntimeClass" in server else ""))
        elif status == 404 and verb in ("create", "list"):
            msg = (f"cannot {verb} {resource} in namespace {ns!r}: {server}. Create the namespace first "
                   f"(kubectl create namespace {ns}) or set namespace=/RESOLUTO_SANDBOX_NAMESPACE.")
        elif status == 409:
            msg = (f"cannot {verb} {what} in namespace {ns!r}: an object with that name already exists "
                   f"(409 Conflict: {server}). Sandbox names carry a random suffix, so this is another "
                   "writer using the same name; nothing of it was changed.")
        elif status == 422:
            msg = f"the API server rejected {what} as invalid (422): {server}"
        elif status in _RETRYABLE_STATUS:
            msg = (f"the Kubernetes API server kept failing to {verb} {what} in namespace {ns!r}: "
                   f"{status} {server} (gave up after {attempts} attempt(s))")
        else:
            msg = f"cannot {verb} {what} in namespace {ns!r}: {status} {server}"
        return KubernetesApiError(msg, status=status, verb=verb, resource=resource)

    # -- guest bundle ---------------------------------------------------------------------

    def prepare(self, conduit: Any, run_id: str) -> None:
        """Host hook, once per run before launches: refuse a local conduit, upload the guest bundle.

        Optional -- :meth:`launch` uploads the bundle itself (through the conduit described by
        the node's RESOLUTO_STORE_* variables) when the run was not prepared.
        """
        kind = getattr(conduit, "kind", "")
        if kind != "s3":
            raise LaunchError(self._local_conduit_message(kind or type(conduit).__name__))
        if self.guest_source == "bundle":
            with self._lock:
                if run_id in self._bundles:
                    return
            key, sha = upload_guest_bundle(conduit, run_id)
            with self._lock:
                self._bundles[run_id] = (key, sha)

    def _bundle_for(self, spec: LaunchSpec, *, upload: bool) -> tuple[str, str]:
        run_id = spec.env.get("RESOLUTO_RUN_ID", "")
        with self._lock:
            known = self._bundles.get(run_id)
        if known is not None:
            return known
        base = self._store_base(spec)
        if not upload:
            sha, _ = build_guest_bundle()
            return guest_bundle_key(run_id, base, sha), sha
        from guest_runner.s3conduit import S3Conduit

        with self._bundle_lock:  # concurrent first launches of a run upload once
            with self._lock:
                known = self._bundles.get(run_id)
            if known is not None:
                return known
            conduit = S3Conduit(
                spec.env["RESOLUTO_STORE_BUCKET"], base_prefix=base,
                endpoint_url=spec.env.get("RESOLUTO_STORE_ENDPOINT") or None,
                region=spec.env.get("RESOLUTO_STORE_REGION") or None,
            )
            try:
                key, sha = upload_guest_bundle(conduit, run_id)
            except Exception as e:
                raise LaunchError(f"cannot upload the guest runner bundle to s3://"
                                  f"{spec.env['RESOLUTO_STORE_BUCKET']}/{base}: {e}") from e
            finally:
                conduit.close()
            with self._lock:
                self._bundles[run_id] = (key, sha)
        return key, sha

    @staticmethod
    def _store_base(spec: LaunchSpec) -> str:
        prefix = spec.env.get("RESOLUTO_STORE_PREFIX", "").strip("/")
        run_id, node_id = spec.env.get("RESOLUTO_RUN_ID", ""), spec.env.get("RESOLUTO_NODE_ID", "")
        if not prefix:
            return ""
        suffix = wire.node_prefix(run_id, node_id)
        if prefix == suffix:
            return ""
        if prefix.endswith("/" + suffix):
            return prefix[: -len(suffix) - 1]
        raise LaunchError(
            f"RESOLUTO_STORE_PREFIX {prefix!r} does not end with the node's key prefix {suffix!r}"
        )

    # -- spec checks ----------------------------------------------------------------------

    @staticmethod
    def _local_conduit_message(kind: str) -> str:
        return (
            f"the kubernetes runtime cannot use a {kind or 'local'} conduit: pods run on cluster nodes "
            "and cannot see this host's disk. Use an S3-compatible conduit reachable from both this "
            "host and the pods, e.g. conduit='s3://bucket/prefix?endpoint_url=http://minio.example:9000'."
        )

    def _check(self, spec: LaunchSpec) -> None:
        self.check_spec(spec)
        kind = spec.env.get("RESOLUTO_STORE_KIND", "")
        if spec.conduit_root is not None or kind == "localfs":
            raise LaunchError(self._local_conduit_message("local (filesystem)"))
        if kind != "s3":
            raise LaunchError(f"the kubernetes runtime needs RESOLUTO_STORE_KIND=s3 in the node's "
                              f"environment, got {kind!r}")
        for var in ("RESOLUTO_STORE_BUCKET", "RESOLUTO_RUN_ID", "RESOLUTO_NODE_ID"):
            if not spec.env.get(var):
                raise LaunchError(f"the node's environment lacks {var}")
        for var in list(spec.env) + list(spec.secret_env):
            if not _ENV_NAME.match(var):
                raise LaunchError(f"{var!r} is not a valid environment variable name for a pod")

    # -- rendering --------------------------------------------------------------------------

    def _store_egress(self, spec: LaunchSpec) -> tuple[list[ipaddress.IPv4Network | ipaddress.IPv6Network], int]:
        endpoint = spec.env.get("RESOLUTO_STORE_ENDPOINT", "")
        parsed = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}") if endpoint else None
        default_port = (parsed.port or (80 if parsed.scheme == "http" else 443)) if parsed else 443
        port = self.store_egress_port or _int_env("RESOLUTO_STORE_EGRESS_PORT") or default_port
        raw = self.store_egress_cidr or os.environ.get("RESOLUTO_STORE_EGRESS_CIDR", "")
        if raw:
            try:
                nets = [_parse_network(c) for c in raw.split(",") if c.strip()]
            except ValueError as e:
                raise LaunchError(f"store egress CIDR {raw!r} is not a CIDR list: {e}") from None
            return nets, port
        if parsed is None or not parsed.hostname:
            raise LaunchError(
                "cannot derive the object store's address for the pod's NetworkPolicy: no "
                "RESOLUTO_STORE_ENDPOINT (plain AWS S3 has no fixed address). Set store_egress_cidr "
                "(or RESOLUTO_STORE_EGRESS_CIDR), e.g. the CIDR of your S3 VPC endpoint, or allow "
                "'public_https' egress for the node."
            )
        host = parsed.hostname
        try:
            return [_parse_network(host)], port
        except ValueError:
            pass
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            raise LaunchError(
                f"cannot resolve the store endpoint host {host!r} to build the NetworkPolicy ({e}); set "
                "store_egress_cidr / RESOLUTO_STORE_EGRESS_CIDR to the address pods reach the store at"
            ) from None
        nets = sorted({_parse_network(i[4][0]) for i in infos}, key=str)
        logger.info("kubernetes runtime: store %s resolved here to %s; set store_egress_cidr if pods "
                    "reach it at another address (DNAT, in-cluster service)", host, ", ".join(map(str, nets)))
        return list(nets), port

    def egress_rules(self, spec: LaunchSpec) -> list[dict[str, Any]]:
        store_nets, store_port = self._store_egress(spec)
        dns_block = _excepting_metadata(_parse_network(self.dns_cidr))
        rules: list[dict[str, Any]] = [
            {
                "to": [
                    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                     "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}},
                    {"ipBlock": dns_block},
                ],
                "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
            },
            {
                "to": [{"ipBlock": _excepting_metadata(n)} for n in store_nets],
                "ports": [{"protocol": "TCP", "port": store_port}],
            },
        ]
        for entry in spec.egress:
            rules.append(parse_egress_entry(entry))
        return rules

    def manifests(self, spec: LaunchSpec, *, name: str | None = None, token: str | None = None,
                  secret_values: Mapping[str, str] | None = None, upload_bundle: bool = False) -> Manifests:
        """Render NetworkPolicy, Secret and Pod for ``spec`` without touching a cluster.

        ``secret_values`` replaces the node's secret values (rendering passes placeholders).
        """
        self._check(spec)
        token = token or uuid.uuid4().hex
        if name is None:
            name = pod_name(spec.sandbox_id, token)
        if not _DNS_LABEL.match(name) or len(name) > 63:
            raise LaunchError(f"sandbox name {name!r} is not a valid DNS label")
        image = spec.image or self.image
        if not image:
            raise LaunchError(
                "no image for the sandbox pod: set image= on the runtime (or RESOLUTO_SANDBOX_IMAGE) to any "
                "image with python3 >= 3.9 and boto3, e.g. one built from images/Dockerfile"
            )
        ns = self.namespace
        own = {MANAGED_BY_LABEL: MANAGED_BY, SANDBOX_LABEL: name}
        labels = {
            **sanitise_labels(spec.labels),
            RUN_LABEL: label_value(spec.env["RESOLUTO_RUN_ID"]),
            NODE_LABEL: label_value(spec.env["RESOLUTO_NODE_ID"]),
            **own,
        }
        annotations = {
            TOKEN_ANNOTATION: token,
            SANDBOX_ID_ANNOTATION: spec.sandbox_id,
            LABELS_ANNOTATION: json.dumps(spec.labels, sort_keys=True),
        }

        # Environment: literal values for the non-secret RESOLUTO_* configuration only.
        env_literal = {k: v for k, v in spec.env.items() if k not in _STORE_CREDENTIAL_VARS}
        secret_data = {k: v for k, v in spec.secret_env.items() if k not in _STORE_CREDENTIAL_VARS}
        withheld = sorted(k for k in _STORE_CREDENTIAL_VARS if k in spec.env or k in spec.secret_env)
        if withheld:
            logger.debug("kubernetes runtime: %s withheld from the pod; store credentials come from "
                         "store_credentials_secret / store_role_arn", ", ".join(withheld))
        if secret_values is not None:
            secret_data = {k: secret_values.get(k, "") for k in secret_data}
        store_refs: dict[str, tuple[str, str, bool]] = {}
        minted = False
        if self.store_role_arn:
            minted = True
            for var in _STORE_CREDENTIAL_VARS:
                secret_data[var] = (secret_values or {}).get(var, "")
        elif self.store_credentials_secret:
            for var in _STORE_CREDENTIAL_VARS:
                store_refs[var] = (self.store_credentials_secret, var, var == "AWS_SESSION_TOKEN")
        command = list(spec.command) if spec.command else None
        if command is None and self.guest_source == "bundle":
            key, sha = self._bundle_for(spec, upload=upload_bundle)
            env_literal[ENV_BUNDLE_KEY] = key
            env_literal[ENV_BUNDLE_SHA256] = sha
            command = bootstrap_command()
        env_literal.setdefault("HOME", "/tmp")
        env_literal.setdefault("PYTHONUNBUFFERED", "1")
        redact = set(json.loads(env_literal.get("RESOLUTO_SECRET_ENV") or "[]")) | set(secret_data)
        if redact:
            env_literal["RESOLUTO_SECRET_ENV"] = json.dumps(sorted(redact))

        env: list[dict[str, Any]] = [{"name": k, "value": str(v)} for k, v in sorted(env_literal.items())]
        for var in sorted(secret_data):
            env.append({"name": var, "valueFrom": {"secretKeyRef": {"name": name, "key": var}}})
        for var, (sname, skey, optional) in sorted(store_refs.items()):
            ref: dict[str, Any] = {"name": sname, "key": skey}
            if optional:
                ref["optional"] = True
            env.append({"name": var, "valueFrom": {"secretKeyRef": ref}})

        res = spec.resources
        qty: dict[str, str] = {}
        if res.cpus:
            qty["cpu"] = _cpu_quantity(res.cpus)
        if res.memory_bytes:
            qty["memory"] = str(int(res.memory_bytes))
        if res.disk_bytes:
            qty["ephemeral-storage"] = str(int(res.disk_bytes))

        scratch: dict[str, Any] = {"sizeLimit": str(int(res.disk_bytes))} if res.disk_bytes else {}
        volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": dict(scratch)}]
        mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
        workspace = spec.env.get("RESOLUTO_WORKSPACE_DIR", "")
        if workspace and workspace.startswith("/") and not (workspace + "/").startswith("/tmp/"):
            volumes.append({"name": "workspace", "emptyDir": dict(scratch)})
            mounts.append({"name": "workspace", "mountPath": workspace.rstrip("/") or "/workspace"})

        container_security: dict[str, Any] = {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "readOnlyRootFilesystem": self.read_only_root_filesystem,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        pod_security: dict[str, Any] = {
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        if self.run_as_user is not None:
            for d in (container_security, pod_security):
                d["runAsUser"] = self.run_as_user
                d["runAsGroup"] = self.run_as_user
            pod_security["fsGroup"] = self.run_as_user

        container: dict[str, Any] = {
            "name": CONTAINER_NAME,
            "image": image,
            "imagePullPolicy": self.image_pull_policy,
            "env": env,
            "securityContext": container_security,
            "volumeMounts": mounts,
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }
        if command:
            container["command"] = command
        if qty:
            container["resources"] = {"requests": dict(qty), "limits": dict(qty)}

        pod_spec: dict[str, Any] = {
            "runtimeClassName": self.runtime_class,
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "hostNetwork": False,
            "hostPID": False,
            "hostIPC": False,
            "terminationGracePeriodSeconds": self.delete_grace_s,
            "securityContext": pod_security,
            "containers": [container],
            "volumes": volumes,
        }
        if self.service_account:
            pod_spec["serviceAccountName"] = self.service_account
        if self.priority_class:
            pod_spec["priorityClassName"] = self.priority_class
        if self.node_selector:
            pod_spec["nodeSelector"] = dict(self.node_selector)
        if self.tolerations:
            pod_spec["tolerations"] = [dict(t) for t in self.tolerations]

        meta = {"name": name, "namespace": ns, "labels": labels, "annotations": annotations}
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}
        policy = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": ns, "labels": dict(labels),
                         "annotations": {TOKEN_ANNOTATION: token}},
            "spec": {
                "podSelector": {"matchLabels": {SANDBOX_LABEL: name}},
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [],
                "egress": self.egress_rules(spec),
            },
        }
        secret = None
        if secret_data:
            secret = {
                "apiVersion": "v1",
                "kind": "Secret",
                "type": "Opaque",
                "immutable": True,
                "metadata": {"name": name, "namespace": ns, "labels": dict(labels),
                             "annotations": {TOKEN_ANNOTATION: token,
                                             "resoluto.io/minted-store-credentials": str(minted).lower()}},
                "data": {k: base64.b64encode(str(v).encode()).decode() for k, v in sorted(secret_data.items())},
            }
        return Manifests(name=name, namespace=ns, token=token, network_policy=policy, pod=pod, secret=secret)

    # -- short-lived store credentials ------------------------------------------------------

    def _mint_store_credentials(self, spec: LaunchSpec, name: str) -> dict[str, str]:
        import boto3

        bucket = spec.env["RESOLUTO_STORE_BUCKET"]
        prefix = spec.env.get("RESOLUTO_STORE_PREFIX") or wire.node_prefix(
            spec.env["RESOLUTO_RUN_ID"], spec.env["RESOLUTO_NODE_ID"])
        prefix = prefix.strip("/")
        resources = [f"arn:aws:s3:::{bucket}/{prefix}/*"]
        read_only = []
        if self.guest_source == "bundle" and not spec.command:
            key, _ = self._bundle_for(spec, upload=False)
            read_only.append(f"arn:aws:s3:::{bucket}/{key}")
        statements: list[dict[str, Any]] = [
            {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject"], "Resource": resources},
            {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [f"arn:aws:s3:::{bucket}"],
             "Condition": {"StringLike": {"s3:prefix": [f"{prefix}/*", prefix]}}},
        ]
        if read_only:
            statements.append({"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": read_only})
        policy = json.dumps({"Version": "2012-10-17", "Statement": statements})
        region = spec.env.get("RESOLUTO_STORE_REGION") or None
        sts = boto3.client("sts", endpoint_url=self.store_sts_endpoint or None, region_name=region)
        try:
            out = sts.assume_role(RoleArn=self.store_role_arn, RoleSessionName=name[:64], Policy=policy,
                                  DurationSeconds=self.store_credentials_ttl_s)
        except Exception as e:
            raise LaunchError(f"cannot mint short-lived store credentials by assuming {self.store_role_arn!r}: "
                              f"{type(e).__name__}: {e}") from e
        finally:
            sts.close()
        c = out["Credentials"]
        return {"AWS_ACCESS_KEY_ID": c["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": c["SecretAccessKey"],
                "AWS_SESSION_TOKEN": c["SessionToken"]}

    # -- launch -----------------------------------------------------------------------------

    def launch(self, spec: LaunchSpec) -> SandboxHandle:
        self._check(spec)
        try:
            core, net = self._core(), self._net()
        except KubernetesConfigError as e:
            raise LaunchError(str(e)) from e
        token = uuid.uuid4().hex
        name = pod_name(spec.sandbox_id, token)
        secret_values: dict[str, str] | None = None
        if self.store_role_arn:
            secret_values = {**spec.secret_env, **self._mint_store_credentials(spec, name)}
        m = self.manifests(spec, name=name, token=token, secret_values=secret_values, upload_bundle=True)
        ns, t = self.namespace, self._timeout()
        handle = SandboxHandle(
            id=f"{ns}/{name}", runtime=self.name, labels=dict(spec.labels),
            data={"namespace": ns, "name": name, "token": token, "secret": m.secret is not None,
                  "memory_limit": (m.pod["spec"]["containers"][0].get("resources") or {})
                  .get("limits", {}).get("memory")},
        )
        created: list[str] = []
        try:
            self._call("create", "networkpolicies", name, lambda: net.create_namespaced_network_policy(
                ns, m.network_policy, field_validation="Strict", _request_timeout=t),
                on_conflict=lambda: self._mine(lambda: net.read_namespaced_network_policy(name, ns), token))
            created.append("networkpolicies")
            if m.secret is not None:
                self._call("create", "secrets", name, lambda: core.create_namespaced_secret(
                    ns, m.secret, field_validation="Strict", _request_timeout=t),
                    on_conflict=lambda: self._mine(lambda: core.read_namespaced_secret(name, ns), token))
                created.append("secrets")
            pod = self._call("create", "pods", name, lambda: core.create_namespaced_pod(
                ns, m.pod, field_validation="Strict", _request_timeout=t),
                on_conflict=lambda: self._mine(lambda: core.read_namespaced_pod(name, ns), token))
            created.append("pods")
            weakened = self._weakened(pod)
            if weakened:
                raise LaunchError(
                    f"the API server did not keep the sandbox's security settings for pod {ns}/{name} "
                    f"({'; '.join(weakened)}); the pod was deleted at once. Servers before "
                    "Kubernetes 1.25 ignore strict field validation and silently drop fields they do not "
                    "know (seccompProfile needs >= 1.19), and a mutating admission webhook can rewrite pods: "
                    "upgrade the cluster or exempt the namespace from that webhook"
                )
        except KubernetesApiError as e:
            if e.resource == "pods" and (e.status is None or e.status >= 500):
                created.append("pods")  # an earlier attempt may have landed despite the errors
            self._cleanup(name, created)
            raise LaunchError(str(e)) from e
        except BaseException:
            self._cleanup(name, created)
            raise
        handle.data["uid"] = pod.metadata.uid
        handle.data["launched_at"] = self._clock()
        self._adopt(name, pod.metadata.uid, created)
        logger.info("kubernetes runtime: launched pod %s/%s (%s)", ns, name, self.runtime_class)
        return handle

    def _weakened(self, pod: Any) -> list[str]:
        """The isolation guarantees the stored pod lost on its way in (empty when intact)."""
        spec = pod.spec
        psc = spec.security_context
        c = next((c for c in spec.containers if c.name == CONTAINER_NAME), None)
        csc = c.security_context if c is not None else None
        seccomp = lambda sc: getattr(getattr(sc, "seccomp_profile", None), "type", None)  # noqa: E731
        checks = {
            f"runtimeClassName {self.runtime_class!r}": spec.runtime_class_name == self.runtime_class,
            "automountServiceAccountToken false": spec.automount_service_account_token is False,
            "no host namespaces": not (spec.host_network or spec.host_pid or spec.host_ipc),
            "pod runAsNonRoot": bool(psc and psc.run_as_non_root),
            "pod seccompProfile RuntimeDefault": seccomp(psc) == "RuntimeDefault",
            "container securityContext": csc is not None,
            "allowPrivilegeEscalation false": bool(csc) and csc.allow_privilege_escalation is False,
            "privileged false": bool(csc) and not csc.privileged,
            "capabilities drop ALL": bool(csc and csc.capabilities and "ALL" in (csc.capabilities.drop or [])),
            "container seccompProfile RuntimeDefault": seccomp(csc) == "RuntimeDefault",
            "readOnlyRootFilesystem": not self.read_only_root_filesystem
            or bool(csc and csc.read_only_root_filesystem),
        }
        return [what for what, ok in checks.items() if not ok]

    def _mine(self, read: Callable[[], Any], token: str) -> Any:
        try:
            obj = read()
        except Exception:
            return None
        annotations = (obj.metadata.annotations or {}) if obj is not None and obj.metadata else {}
        return obj if annotations.get(TOKEN_ANNOTATION) == token else None

    def _adopt(self, name: str, uid: str, created: list[str]) -> None:
        """Make the policy and Secret owned by the pod, so they are collected with it."""
        patch = {"metadata": {"ownerReferences": [{
            "apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid, "blockOwnerDeletion": False,
        }]}}
        ns, t = self.namespace, self._timeout()
        ct = "application/merge-patch+json"
        targets = [("networkpolicies", lambda: self._net_api.patch_namespaced_network_policy(
            name, ns, patch, _content_type=ct, _request_timeout=t))]
        if "secrets" in created:
            targets.append(("secrets", lambda: self._core_api.patch_namespaced_secret(
                name, ns, patch, _content_type=ct, _request_timeout=t)))
        for resource, fn in targets:
            try:
                self._call("patch", resource, name, fn)
            except KubernetesApiError as e:
                logger.warning("kubernetes runtime: %s/%s will not be garbage-collected with its pod (%s); "
                               "destroy/sweep still delete it", resource, name, e)

    def _cleanup(self, name: str, created: list[str]) -> None:
        for resource in reversed(created):
            try:
                self._delete(resource, name)
            except Exception as e:  # best effort: the original error matters more
                logger.warning("kubernetes runtime: could not remove %s/%s after a failed launch: %s",
                               resource, name, e)

    # -- status ---------------------------------------------------------------------------------

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        from kubernetes.client.exceptions import ApiException

        ns, name = self._where(handle)
        core = self._core()
        try:
            pod = self._call("get", "pods", name, lambda: core.read_namespaced_pod(
                name, ns, _request_timeout=self._timeout()))
        except KubernetesApiError as e:
            if e.status != 404 or not isinstance(e.__cause__, ApiException):
                raise
            return self._gone(handle)
        st = self._map(handle, pod)
        if st.terminal:
            handle.data["last_terminal"] = {
                "phase": st.phase, "reason": st.reason, "exit_code": st.exit_code,
                "infrastructure": st.infrastructure, "unstartable": st.unstartable,
            }
        return st

    def _gone(self, handle: SandboxHandle) -> SandboxStatus:
        ns, name = self._where(handle)
        last = handle.data.get("last_terminal")
        if last:  # it had finished before it went: keep that verdict
            return SandboxStatus(last["phase"], reason=last["reason"], exit_code=last["exit_code"],
                                 gone=True, infrastructure=last["infrastructure"],
                                 unstartable=last["unstartable"])
        if handle.data.get("destroyed"):
            return SandboxStatus("unknown", reason=f"pod {ns}/{name} was destroyed", gone=True)
        return SandboxStatus(
            "unknown", gone=True, infrastructure=True,
            reason=f"pod {ns}/{name} no longer exists: it was deleted from outside prefect-resoluto "
                   "(kubectl delete, a namespace cleanup, or the node's garbage collection) before it "
                   "finished",
        )

    def _map(self, handle: SandboxHandle, pod: Any) -> SandboxStatus:
        ps = pod.status
        phase = (ps.phase if ps else None) or "Pending"
        pod_reason = (ps.reason if ps else None) or ""
        pod_message = (ps.message if ps else None) or ""
        cs = None
        for c in (ps.container_statuses or []) if ps else []:
            if c.name == CONTAINER_NAME:
                cs = c
        state = cs.state if cs is not None else None
        waiting = state.waiting if state is not None else None
        terminated = state.terminated if state is not None else None
        exit_code = terminated.exit_code if terminated is not None else None
        deleted_outside = bool(pod.metadata and pod.metadata.deletion_timestamp) and not handle.data.get("destroyed")
        disruption = None
        for cond in (ps.conditions or []) if ps else []:
            if cond.type == "DisruptionTarget" and cond.status == "True":
                disruption = cond

        # Never going to start. The pod is still Pending: the phase says so, the flag says
        # it will stay that way (callers confirm over a few observations, then give up).
        if waiting is not None and (waiting.reason or "") in FATAL_WAITING_REASONS:
            msg = waiting.message or ""
            return SandboxStatus(
                "running" if phase == "Running" else "pending", unstartable=True,
                reason=f"{waiting.reason}: {msg}".rstrip(": ") + self._hint(waiting.reason or ""),
            )

        if phase == "Pending":
            if self._scheduled(ps):
                handle.data.pop("unschedulable_since", None)
            unsched = self._unschedulable(ps)
            if unsched is not None:
                since = handle.data.setdefault("unschedulable_since", self._clock())
                waited = self._clock() - since
                reason = f"Unschedulable: {unsched}"
                if waited >= self.unschedulable_patience_s:
                    return SandboxStatus(
                        "pending", unstartable=True,
                        reason=f"{reason} (no node accepted the pod for {waited:.0f}s, patience "
                               f"{self.unschedulable_patience_s:.0f}s: check the RuntimeClass "
                               f"{self.runtime_class!r} exists on some node, node selectors/taints and "
                               "free capacity)",
                    )
                return SandboxStatus("pending", reason=reason)
            why = (waiting.reason if waiting is not None else "") or pod_reason or "Pending"
            return SandboxStatus("pending", reason=why)

        if phase == "Running":
            reason = "Running"
            if deleted_outside:
                reason = "the pod is being deleted from outside prefect-resoluto"
            return SandboxStatus("running", reason=reason)

        if phase == "Succeeded":
            return SandboxStatus("succeeded", reason="Completed", exit_code=exit_code if exit_code is not None else 0)

        if phase == "Failed":
            t_reason = (terminated.reason if terminated is not None else "") or ""
            t_message = (terminated.message if terminated is not None else "") or ""
            if pod_reason in INFRA_POD_REASONS or disruption is not None:
                why = pod_reason or (disruption.reason if disruption is not None else "")
                msg = pod_message or (disruption.message if disruption is not None else "") or ""
                return SandboxStatus("failed", reason=f"{why}: {msg}".rstrip(": "), exit_code=exit_code,
                                     infrastructure=True)
            if t_reason == "OOMKilled":
                limit = handle.data.get("memory_limit")
                lim = f" of {limit} bytes" if limit else ""
                return SandboxStatus(
                    "failed", exit_code=exit_code, infrastructure=True,
                    reason=f"OOMKilled: the container exceeded its memory limit{lim} and was killed "
                           f"(exit code {exit_code}); give the task more memory",
                )
            if t_reason in ("ContainerStatusUnknown", "NodeLost"):
                return SandboxStatus("failed", exit_code=exit_code, infrastructure=True,
                                     reason=f"{t_reason}: {t_message or 'the node running the pod was lost'}")
            if deleted_outside:
                return SandboxStatus("failed", exit_code=exit_code, infrastructure=True,
                                     reason="the pod was deleted from outside prefect-resoluto while running "
                                            f"(exit code {exit_code})")
            if exit_code is None:
                return SandboxStatus("failed", infrastructure=True,
                                     reason=f"{pod_reason or 'Failed'}: {pod_message or 'the pod failed without a container exit code'}")
            return SandboxStatus("failed", exit_code=exit_code,
                                 reason=f"the guest exited with code {exit_code}"
                                        + (f" ({t_reason})" if t_reason and t_reason != "Error" else ""))

        # Unknown: the node stopped reporting.
        if pod_reason == "NodeLost":
            return SandboxStatus("failed", infrastructure=True, reason=f"NodeLost: {pod_message}".rstrip(": "))
        return SandboxStatus("unknown", reason=pod_reason or "the pod's node is not reporting its state")

    @staticmethod
    def _scheduled(ps: Any) -> bool:
        return any(c.type == "PodScheduled" and c.status == "True" for c in (ps.conditions or []))

    @staticmethod
    def _unschedulable(ps: Any) -> str | None:
        for c in (ps.conditions or []) if ps else []:
            if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
                return c.message or "no node can run the pod"
        return None

    def _hint(self, reason: str) -> str:
        if reason in ("ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull"):
            return " -- the node cannot pull the image; check the name, the registry's reachability " \
                   "from the nodes and imagePullSecrets"
        if reason == "CreateContainerConfigError":
            return " -- check that the referenced Secrets exist in the namespace" + (
                f" (store credentials Secret {self.store_credentials_secret!r})"
                if self.store_credentials_secret else "")
        return ""

    # -- destroy / sweep / logs -------------------------------------------------------------------

    @staticmethod
    def _where(handle: SandboxHandle) -> tuple[str, str]:
        ns = handle.data.get("namespace")
        name = handle.data.get("name")
        if not ns or not name:
            ns, _, name = handle.id.partition("/")
        return ns, name

    def _delete(self, resource: str, name: str, namespace: str | None = None) -> bool:
        """Delete one object; False when it was already gone."""
        ns = namespace or self.namespace
        t = self._timeout()
        if resource == "pods":
            fn = lambda: self._core_api.delete_namespaced_pod(  # noqa: E731
                name, ns, grace_period_seconds=self.delete_grace_s, propagation_policy="Background",
                _request_timeout=t)
        elif resource == "secrets":
            fn = lambda: self._core_api.delete_namespaced_secret(name, ns, _request_timeout=t)  # noqa: E731
        else:
            fn = lambda: self._net_api.delete_namespaced_network_policy(name, ns, _request_timeout=t)  # noqa: E731
        try:
            self._call("delete", resource, name, fn)
        except KubernetesApiError as e:
            if e.status == 404:
                return False
            raise
        return True

    def destroy(self, handle: SandboxHandle) -> None:
        ns, name = self._where(handle)
        self._core()
        handle.data["destroyed"] = True
        self._delete("pods", name, ns)
        self._delete("networkpolicies", name, ns)
        self._delete("secrets", name, ns)

    def sweep(self, labels: dict[str, str]) -> int:
        """Delete every pod (and its policy and Secret) of this runtime carrying all ``labels``.

        Policies and Secrets carry the pod's labels too, so the leftovers of a launch that
        died half-way (a policy without a pod) are reaped by the same selector.
        """
        core, net = self._core(), self._net()
        wanted = {**sanitise_labels(labels), MANAGED_BY_LABEL: MANAGED_BY}
        selector = ",".join(f"{k}={v}" for k, v in sorted(wanted.items()))
        ns, t = self.namespace, self._timeout()
        listers: list[tuple[str, Callable[[], Any]]] = [
            ("pods", lambda: core.list_namespaced_pod(ns, label_selector=selector, _request_timeout=t)),
            ("networkpolicies", lambda: net.list_namespaced_network_policy(
                ns, label_selector=selector, _request_timeout=t)),
            ("secrets", lambda: core.list_namespaced_secret(ns, label_selector=selector, _request_timeout=t)),
        ]
        pods: set[str] = set()
        for resource, lister in listers:
            for obj in self._call("list", resource, "", lister).items:
                if resource == "pods":
                    pods.add(obj.metadata.name)
                self._delete(resource, obj.metadata.name)
        if pods:
            logger.info("kubernetes runtime: swept %d pod(s) matching %s", len(pods), selector)
        return len(pods)

    def logs(self, handle: SandboxHandle, tail: int = 200) -> str:
        ns, name = self._where(handle)
        core = self._core()
        try:
            out = self._call("read logs of", "pods", name, lambda: core.read_namespaced_pod_log(
                name, ns, container=CONTAINER_NAME, tail_lines=max(1, int(tail)),
                _request_timeout=self._timeout()))
        except KubernetesApiError as e:
            return f"(no logs from pod {ns}/{name}: {e})"
        return out if isinstance(out, str) else str(out)


def _int_env(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not a port number") from None
