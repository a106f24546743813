"""What a Kubernetes runtime is configured with: one frozen value instead of 28 keywords.

``KubernetesRuntime(namespace=..., image=...)`` still works: its keywords are these fields.
:meth:`KubernetesOptions.resolved` applies the environment's fallbacks and the checks,
once, when a runtime is built.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from prefect_resoluto.runtimes.base import IsolationLevel, IsolationTooWeak
from prefect_resoluto.runtimes.kubernetes.manifests import DEFAULT_RUN_AS_USER, DNS_LABEL, parse_dns_cidrs

DEFAULT_NAMESPACE = "resoluto-sandboxes"

_VM_CLASSES = re.compile(r"^kata([-_.].*)?$")
_USER_KERNEL_CLASSES = re.compile(r"^(gvisor|runsc)([-_.].*)?$")


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


@dataclass(frozen=True)
class KubernetesOptions:
    """The Kubernetes runtime's settings; docs/backends.md describes each."""

    # -- the cluster connection
    namespace: str | None = None
    context: str | None = None
    kubeconfig: str | None = None
    allow_ambient_context: bool | None = None
    in_cluster: bool | None = None
    # -- the pod
    runtime_class: str = "kata"
    runtime_class_isolation: str | None = None
    image: str | None = None
    image_pull_policy: str = "IfNotPresent"
    guest_source: str = "bundle"
    service_account: str | None = None
    priority_class: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Mapping[str, Any]] = ()
    run_as_user: int | None = DEFAULT_RUN_AS_USER
    read_only_root_filesystem: bool = True
    # -- the store, and the network policy's way to it
    store_egress_cidr: str | None = None
    store_egress_port: int | None = None
    store_credentials_secret: str | None = None
    store_role_arn: str | None = None
    store_sts_endpoint: str | None = None
    store_credentials_ttl_s: int = 3600
    dns_cidr: str | Sequence[str] | None = None
    # -- patience and retries
    unschedulable_patience_s: float = 300.0
    delete_grace_s: int = 5
    api_retries: int = 5
    api_retry_base_s: float = 0.25
    request_timeout_s: float = 30.0
    # -- the load on the API server: one rate limit and one pod watch per connection
    api_qps: float = 20.0
    api_burst: int = 30
    watch_timeout_s: int = 300

    @classmethod
    def of(cls, options: KubernetesOptions | None = None, /, **keywords: Any) -> KubernetesOptions:
        """``options`` (default: every field's default) with ``keywords`` replacing fields;
        an unknown keyword is refused as the runtime's constructor refused it."""
        known = {f.name for f in fields(cls)}
        for k in keywords:
            if k not in known:
                raise TypeError(f"KubernetesRuntime.__init__() got an unexpected keyword argument {k!r}")
        return replace(options or cls(), **keywords)

    def resolved(self) -> KubernetesOptions:
        """These options with the environment's fallbacks applied, checked and normalised."""
        env = os.environ
        namespace = self.namespace or env.get("RESOLUTO_SANDBOX_NAMESPACE") or DEFAULT_NAMESPACE
        if not DNS_LABEL.match(namespace) or len(namespace) > 63:
            raise ValueError(f"namespace {namespace!r} is not a valid Kubernetes namespace name")
        allow_ambient = self.allow_ambient_context
        if allow_ambient is None:
            allow_ambient = env.get("RESOLUTO_SANDBOX_ALLOW_AMBIENT_CONTEXT") == "1"
        isolation_of_runtime_class(self.runtime_class, self.runtime_class_isolation)
        if self.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            raise ValueError("image_pull_policy must be Always, IfNotPresent or Never")
        if self.guest_source not in ("bundle", "image"):
            raise ValueError("guest_source must be 'bundle' (ship guest_runner via the conduit) or 'image'")
        if self.api_qps <= 0 or self.api_burst < 1:
            raise ValueError("api_qps must be positive and api_burst at least 1")
        if self.store_credentials_ttl_s < 900:
            raise ValueError("store_credentials_ttl_s must be at least 900 (the STS minimum)")
        return replace(
            self,
            namespace=namespace,
            context=self.context
            if self.context is not None
            else (env.get("RESOLUTO_SANDBOX_KUBECONTEXT") or None),
            allow_ambient_context=allow_ambient,
            image=self.image or env.get("RESOLUTO_SANDBOX_IMAGE") or None,
            node_selector=dict(self.node_selector or {}),
            tolerations=[dict(t) for t in (self.tolerations or [])],
            store_credentials_ttl_s=int(self.store_credentials_ttl_s),
            # None: port 53 to the cluster's resolver pods only (manifests.dns_rule).
            dns_cidr=",".join(str(n) for n in parse_dns_cidrs(self.dns_cidr)) or None,
            unschedulable_patience_s=float(self.unschedulable_patience_s),
            delete_grace_s=int(self.delete_grace_s),
            api_retries=max(1, int(self.api_retries)),
            api_retry_base_s=float(self.api_retry_base_s),
            request_timeout_s=float(self.request_timeout_s),
            api_qps=float(self.api_qps),
            api_burst=int(self.api_burst),
            watch_timeout_s=max(1, int(self.watch_timeout_s)),
        )
