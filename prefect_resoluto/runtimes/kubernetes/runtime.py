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
tarball of ``guest_runner`` once per run (:mod:`prefect_resoluto.runtimes.guest_bundle`) and the
container command is a short ``python3 -c`` bootstrap that fetches, verifies, unpacks
and execs it. Any image with Python >= 3.9 and boto3 works; ``guest_source="image"``
uses an image that already contains the runner (``images/Dockerfile``).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any, ClassVar

from guest_runner import wire

if TYPE_CHECKING:
    from guest_runner.conduit import Conduit


from prefect_resoluto.runtimes._sts import mint_node_credentials
from prefect_resoluto.runtimes.base import (
    Availability,
    IsolationLevel,
    LaunchError,
    LaunchSpec,
    SandboxHandle,
    SandboxRuntime,
    SandboxStatus,
)
from prefect_resoluto.runtimes.capabilities import Capabilities
from prefect_resoluto.runtimes.kubernetes.api import KubernetesApi, KubernetesApiError, KubernetesConfigError
from prefect_resoluto.runtimes.kubernetes.manifests import (
    CONTAINER_NAME,
    ENV_NAME,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    SANDBOX_LABEL,
    TOKEN_ANNOTATION,
    IPNetwork,
    Manifests,
    PodSettings,
    build_manifests,
    check_name,
    egress_rules,
    pod_name,
    sanitise_labels,
    weakened,
)
from prefect_resoluto.runtimes.kubernetes.options import (
    DEFAULT_NAMESPACE,
    KubernetesOptions,
    isolation_of_runtime_class,
)
from prefect_resoluto.runtimes.kubernetes.ratelimit import RateLimiter
from prefect_resoluto.runtimes.kubernetes.status import gone_status, pod_status, remember_terminal
from prefect_resoluto.runtimes.kubernetes.store import GuestBundles, store_egress
from prefect_resoluto.runtimes.kubernetes.watch import WATCH_LABEL, PodWatch, Shared, shared, watch_of

#: Seconds a stopped watch may go unrepaired before statuses are read by GET again.
WATCH_STALE_S = 15.0
#: Seconds after its launch a pod the watch has not shown yet is looked up by one GET
#: (then again at most this often): never reported gone before the cache could know it.
UNSEEN_GET_AFTER_S = 10.0

logger = logging.getLogger(__name__)


class KubernetesRuntime(SandboxRuntime):
    """One pod per node on a Kubernetes cluster, under a Kata (or gVisor) RuntimeClass."""

    name: ClassVar[str] = "kubernetes"
    # Pods run on cluster nodes: nothing of this host is theirs; the allowlist is by CIDR.
    capabilities: ClassVar[Capabilities] = Capabilities(
        local_conduit=False,
        host_credentials=False,
        host_loopback=False,
        host_python=False,
        on_host=False,
        egress_allowlist=True,
        options=frozenset({f.name for f in fields(KubernetesOptions)} | {"api_client"}),
    )
    # A pod's status is read from the runtime's pod watch (no request): cheap to ask often.
    status_interval: ClassVar[float] = 1.0

    def __init__(
        self, options: KubernetesOptions | None = None, /, *, api_client: Any = None, **keywords: Any
    ) -> None:
        """``options``, or its fields as keywords (``KubernetesRuntime(namespace=..., image=...)``);
        ``api_client``: a ready Kubernetes API client (tests), instead of the configured context."""
        o = self.options = KubernetesOptions.of(options, **keywords).resolved()
        self._isolation = isolation_of_runtime_class(o.runtime_class, o.runtime_class_isolation)
        self._bundle_cache = GuestBundles()
        self._bundles = self._bundle_cache.known  # run id -> (key, sha256); tests pre-fill it
        # Seams for tests: monotonic clock and the back-off sleep.
        self._clock: Callable[[], float] = time.monotonic
        self._sleep: Callable[[float], None] = time.sleep
        self._api = KubernetesApi(
            namespace=self.namespace,
            context=o.context,
            kubeconfig=o.kubeconfig,
            allow_ambient_context=bool(o.allow_ambient_context),
            in_cluster=o.in_cluster,
            runtime_class=o.runtime_class,
            retries=o.api_retries,
            retry_base_s=o.api_retry_base_s,
            request_timeout_s=o.request_timeout_s,
            api_client=api_client,
            sleep=lambda seconds: self._sleep(seconds),
        )
        self._shared = self._share(api_client)
        self._api.limiter = self._shared.limiter
        self._watch: PodWatch | None = None

    def _share(self, api_client: Any) -> Shared:
        """The rate limit and pod watch of this connection and namespace, shared in this process by
        runtimes configured alike (an injected client is this runtime's alone)."""
        o = self.options

        def limiter() -> RateLimiter:
            return RateLimiter(o.api_qps, o.api_burst, sleep=lambda seconds: self._sleep(seconds))

        if api_client is not None:
            return Shared(limiter())
        key = (
            "kubernetes",
            o.kubeconfig or os.environ.get("KUBECONFIG") or "",
            o.context,
            o.in_cluster,
            bool(o.allow_ambient_context),
            self.namespace,
            o.api_qps,
            o.api_burst,
        )
        return shared(key, limiter)

    def pod_watch(self) -> PodWatch:
        """The watch that feeds :meth:`status` (made on first use, started by a launch)."""
        if self._watch is None:
            o = self.options
            self._watch = watch_of(
                self._shared,
                lambda: PodWatch(self._api, self.namespace, timeout_s=o.watch_timeout_s, clock=self._clock),
            )
        return self._watch

    def close(self) -> None:
        """Stop this runtime's pod watch (a later launch starts it again)."""
        if self._watch is not None:
            self._watch.close()

    # -- interface basics ----------------------------------------------------------------

    @property
    def namespace(self) -> str:
        return self.options.namespace or DEFAULT_NAMESPACE

    @property
    def context(self) -> str | None:
        return self.options.context

    @property
    def allow_ambient_context(self) -> bool:
        return bool(self.options.allow_ambient_context)

    @property
    def image(self) -> str | None:
        return self.options.image

    @property
    def runtime_class(self) -> str:
        return self.options.runtime_class

    @property
    def _dns_cidr(self) -> str | None:
        """The resolver blocks, normalised to one comma-separated string by ``resolved``."""
        d = self.options.dns_cidr
        return d if d is None or isinstance(d, str) else ",".join(d)

    @property
    def isolation(self) -> IsolationLevel:
        return self._isolation

    def availability(self) -> Availability:
        api = self._api
        try:
            core = api.core()
            api.call(
                "list",
                "pods",
                "",
                lambda: core.list_namespaced_pod(self.namespace, limit=1, _request_timeout=api.timeout()),
            )
            # A real server lists an absent namespace as empty (200); a dry-run create says 404
            # (and that this identity may create what a launch creates first). Nothing is stored.
            probe = {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": {"generateName": "resoluto-availability-"},
                "spec": {
                    "podSelector": {"matchLabels": {SANDBOX_LABEL: "availability-probe"}},
                    "policyTypes": ["Ingress"],
                },
            }
            net = api.net()
            api.call(
                "create",
                "networkpolicies",
                "",
                lambda: net.create_namespaced_network_policy(
                    self.namespace, probe, dry_run="All", _request_timeout=api.timeout()
                ),
            )
        except (KubernetesConfigError, KubernetesApiError) as e:
            return Availability(False, str(e))
        except Exception as e:  # anything else: report, never raise from a probe
            return Availability(False, f"{type(e).__name__}: {e}")
        return Availability(
            True,
            detail=f"{api.target}, namespace {self.namespace!r}, RuntimeClass {self.options.runtime_class!r}",
        )

    def _core(self) -> Any:
        """The cluster connection's ``CoreV1Api`` (connecting on first use)."""
        return self._api.core()

    # -- guest bundle ---------------------------------------------------------------------

    def prepare(self, conduit: Conduit, run_id: str) -> None:
        """Host hook, once per run before launches: refuse a local conduit, upload the guest bundle.

        Optional -- :meth:`launch` uploads the bundle itself (through the conduit described by
        the node's RESOLUTO_STORE_* variables) when the run was not prepared.
        """
        kind = conduit.kind
        if kind != "s3":
            raise LaunchError(self._local_conduit_message(kind or type(conduit).__name__))
        if self.options.guest_source == "bundle":
            self._bundle_cache.prepare(conduit, run_id)

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
        kind = spec.store.kind
        if spec.conduit_root is not None or kind == "localfs":
            raise LaunchError(self._local_conduit_message("local (filesystem)"))
        if kind != "s3":
            raise LaunchError(
                f"the kubernetes runtime needs {wire.ENV_STORE_KIND}=s3 in the node's environment, got {kind!r}"
            )
        for var, value in (
            (wire.ENV_STORE_BUCKET, spec.store.bucket),
            (wire.ENV_RUN_ID, spec.run_id),
            (wire.ENV_NODE_ID, spec.node_id),
        ):
            if not value:
                raise LaunchError(f"the node's environment lacks {var}")
        for var in list(spec.env) + list(spec.secret_env):
            if not ENV_NAME.match(var):
                raise LaunchError(f"{var!r} is not a valid environment variable name for a pod")

    # -- what the pod is made of --------------------------------------------------------------

    def _store_egress(self, spec: LaunchSpec) -> tuple[list[IPNetwork], int]:
        return store_egress(spec, cidr=self.options.store_egress_cidr, port=self.options.store_egress_port)

    def egress_rules(self, spec: LaunchSpec) -> list[dict[str, Any]]:
        store_nets, store_port = self._store_egress(spec)
        return egress_rules(spec.egress, store_nets, store_port, self._dns_cidr)

    def pod_settings(self) -> PodSettings:
        """This runtime's options as :func:`~.manifests.build_manifests` takes them."""
        return PodSettings(
            namespace=self.namespace,
            runtime_class=self.options.runtime_class,
            image_pull_policy=self.options.image_pull_policy,
            service_account=self.options.service_account,
            priority_class=self.options.priority_class,
            node_selector=dict(self.options.node_selector),
            tolerations=[dict(t) for t in self.options.tolerations],
            run_as_user=self.options.run_as_user,
            read_only_root_filesystem=self.options.read_only_root_filesystem,
            termination_grace_s=self.options.delete_grace_s,
            dns_cidr=self._dns_cidr,
            store_credentials_secret=self.options.store_credentials_secret,
            minted_store_credentials=bool(self.options.store_role_arn),
        )

    def manifests(
        self,
        spec: LaunchSpec,
        *,
        name: str | None = None,
        token: str | None = None,
        secret_values: Mapping[str, str] | None = None,
        upload_bundle: bool = False,
    ) -> Manifests:
        """Render NetworkPolicy, Secret and Pod for ``spec`` without touching a cluster.

        ``secret_values`` replaces the node's secret values (rendering passes placeholders).
        """
        self._check(spec)
        token = token or uuid.uuid4().hex
        if name is None:
            name = pod_name(spec.sandbox_id, token)
        check_name(name)
        image = spec.image or self.options.image
        if not image:
            raise LaunchError(
                "no image for the sandbox pod: set image= on the runtime (or RESOLUTO_SANDBOX_IMAGE) to any "
                "image with python3 >= 3.9 and boto3, e.g. one built from images/Dockerfile"
            )
        bundle = None
        if not spec.command and self.options.guest_source == "bundle":
            bundle = self._bundle_cache.for_spec(spec, upload=upload_bundle)
        store_nets, store_port = self._store_egress(spec)
        return build_manifests(
            spec,
            self.pod_settings(),
            name=name,
            token=token,
            image=image,
            bundle=bundle,
            store_nets=store_nets,
            store_port=store_port,
            secret_values=secret_values,
        )

    def _mint_store_credentials(self, spec: LaunchSpec, name: str) -> dict[str, str]:
        bucket = spec.store.bucket
        prefix = spec.store.prefix or spec.rel_prefix
        read_only = []
        if self.options.guest_source == "bundle" and not spec.command:
            key, _ = self._bundle_cache.for_spec(spec, upload=False)
            read_only.append(key)
        if spec.env.get(wire.ENV_HOST_BEAT_KEY):  # the host's heartbeat, outside the prefix
            read_only.append(spec.env[wire.ENV_HOST_BEAT_KEY])
        return mint_node_credentials(
            role_arn=self.options.store_role_arn,
            bucket=bucket,
            prefix=prefix.strip("/"),
            session_name=name,
            ttl_s=self.options.store_credentials_ttl_s,
            sts_endpoint=self.options.store_sts_endpoint,
            region=spec.store.region or None,
            read_only_keys=read_only,
        )

    # -- launch -----------------------------------------------------------------------------

    def launch(self, spec: LaunchSpec) -> SandboxHandle:
        self._check(spec)
        api = self._api
        try:
            api.net()  # connects first (core, then networking): a bad configuration refuses the launch
        except KubernetesConfigError as e:
            raise LaunchError(str(e)) from e
        token = uuid.uuid4().hex
        name = pod_name(spec.sandbox_id, token)
        secret_values: dict[str, str] | None = None
        if self.options.store_role_arn:
            secret_values = {**spec.secret_env, **self._mint_store_credentials(spec, name)}
        m = self.manifests(spec, name=name, token=token, secret_values=secret_values, upload_bundle=True)
        ns = self.namespace
        handle = SandboxHandle(
            id=f"{ns}/{name}",
            runtime=self.name,
            labels=dict(spec.labels),
            data={
                "namespace": ns,
                "name": name,
                "token": token,
                "secret": m.secret is not None,
                "memory_limit": (m.pod["spec"]["containers"][0].get("resources") or {})
                .get("limits", {})
                .get("memory"),
            },
        )
        watch = self.pod_watch()
        m.pod["metadata"]["labels"][WATCH_LABEL] = watch.id  # in the watch's server-side selection
        watch.track(name)  # before the create: its first event must not be missed
        created: list[str] = []
        try:
            pod = self._create(m, created)
        except KubernetesApiError as e:
            if e.resource == "pods" and (e.status is None or e.status >= 500):
                created.append("pods")  # an earlier attempt may have landed despite the errors
            self._cleanup(name, created)
            watch.release(name)
            raise LaunchError(str(e)) from e
        except BaseException:
            self._cleanup(name, created)
            watch.release(name)
            raise
        handle.data["uid"] = pod.metadata.uid
        handle.data["created_rv"] = pod.metadata.resource_version
        handle.data["launched_at"] = self._clock()
        self._adopt(name, pod.metadata.uid, created)
        logger.info("kubernetes runtime: launched pod %s/%s (%s)", ns, name, self.options.runtime_class)
        return handle

    def _create(self, m: Manifests, created: list[str]) -> Any:
        """Create the node's NetworkPolicy, Secret and Pod in that order, noting each in ``created``;
        the pod as stored, refused when it lost a security setting on its way in."""
        api, ns, name, token = self._api, m.namespace, m.name, m.token
        core, net, t = api.core(), api.net(), api.timeout()
        api.call(
            "create",
            "networkpolicies",
            name,
            lambda: net.create_namespaced_network_policy(
                ns, m.network_policy, field_validation="Strict", _request_timeout=t
            ),
            on_conflict=lambda: self._mine(lambda: net.read_namespaced_network_policy(name, ns), token),
        )
        created.append("networkpolicies")
        if m.secret is not None:
            api.call(
                "create",
                "secrets",
                name,
                lambda: core.create_namespaced_secret(
                    ns, m.secret, field_validation="Strict", _request_timeout=t
                ),
                on_conflict=lambda: self._mine(lambda: core.read_namespaced_secret(name, ns), token),
            )
            created.append("secrets")
        pod = api.call(
            "create",
            "pods",
            name,
            lambda: core.create_namespaced_pod(ns, m.pod, field_validation="Strict", _request_timeout=t),
            on_conflict=lambda: self._mine(lambda: core.read_namespaced_pod(name, ns), token),
        )
        created.append("pods")
        lost = weakened(pod, self.options.runtime_class, self.options.read_only_root_filesystem)
        if lost:
            raise LaunchError(
                f"the API server did not keep the sandbox's security settings for pod {ns}/{name} "
                f"({'; '.join(lost)}); the pod was deleted at once. Servers before "
                "Kubernetes 1.25 ignore strict field validation and silently drop fields they do not "
                "know (seccompProfile needs >= 1.19), and a mutating admission webhook can rewrite pods: "
                "upgrade the cluster or exempt the namespace from that webhook"
            )
        return pod

    @staticmethod
    def _mine(read: Callable[[], Any], token: str) -> Any:
        try:
            obj = read()
        except Exception:
            return None
        annotations = (obj.metadata.annotations or {}) if obj is not None and obj.metadata else {}
        return obj if annotations.get(TOKEN_ANNOTATION) == token else None

    def _adopt(self, name: str, uid: str, created: list[str]) -> None:
        """Make the policy and Secret owned by the pod, so they are collected with it."""
        api = self._api
        patch = {
            "metadata": {
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": name,
                        "uid": uid,
                        "blockOwnerDeletion": False,
                    }
                ]
            }
        }
        ns, t = self.namespace, api.timeout()
        ct = "application/merge-patch+json"
        core, net = api.core(), api.net()
        targets: list[tuple[str, Callable[[], Any]]] = [
            (
                "networkpolicies",
                lambda: net.patch_namespaced_network_policy(
                    name, ns, patch, _content_type=ct, _request_timeout=t
                ),
            )
        ]
        if "secrets" in created:
            targets.append(
                (
                    "secrets",
                    lambda: core.patch_namespaced_secret(
                        name, ns, patch, _content_type=ct, _request_timeout=t
                    ),
                )
            )
        for resource, fn in targets:
            try:
                api.call("patch", resource, name, fn)
            except KubernetesApiError as e:
                logger.warning(
                    "kubernetes runtime: %s/%s will not be garbage-collected with its pod (%s); "
                    "destroy/sweep still delete it",
                    resource,
                    name,
                    e,
                )

    def _cleanup(self, name: str, created: list[str]) -> None:
        for resource in reversed(created):
            try:
                self._api.delete(resource, name, grace_s=self.options.delete_grace_s)
            except Exception as e:  # best effort: the original error matters more
                logger.warning(
                    "kubernetes runtime: could not remove %s/%s after a failed launch: %s", resource, name, e
                )

    # -- status ---------------------------------------------------------------------------------

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        """The pod's status from the runtime's watch; by one GET for a pod the watch does not
        keep (not launched here, or destroyed), while the watch is not allowed or down for
        longer than :data:`WATCH_STALE_S`, and for a pod it has not shown for a while."""
        ns, name = self._where(handle)
        w = self._watch
        if w is None or not w.tracking(name) or w.fatal is not None or w.stale_for() > WATCH_STALE_S:
            return self.status_by_get(handle)
        seen = w.lookup(name)
        if seen.pod is None:
            if w.covers(handle.data.get("created_rv")):  # the cache is past its creation: deleted
                return gone_status(ns, name, handle.data)
            return self._unseen(handle)
        st = self._judge(seen.pod, handle)
        return gone_status(ns, name, handle.data) if seen.deleted else st

    def _unseen(self, handle: SandboxHandle) -> SandboxStatus:
        """A pod created after the watch's last event: pending until the watch shows it, but
        looked up by one GET once it is overdue (and then at most every few seconds)."""
        now = self._clock()
        last = handle.data.get("unseen_get_at", handle.data.get("launched_at", now))
        if now - last < UNSEEN_GET_AFTER_S:
            return SandboxStatus("pending", reason="created; not yet in the pod watch")
        handle.data["unseen_get_at"] = now
        return self.status_by_get(handle)

    def _judge(self, pod: Any, handle: SandboxHandle) -> SandboxStatus:
        st = pod_status(
            pod,
            handle.data,
            clock=self._clock,
            unschedulable_patience_s=self.options.unschedulable_patience_s,
            runtime_class=self.options.runtime_class,
            store_credentials_secret=self.options.store_credentials_secret,
        )
        remember_terminal(handle.data, st)
        return st

    def status_by_get(self, handle: SandboxHandle) -> SandboxStatus:
        """The pod's status by one ``GET pod`` (a 404 is :func:`~.status.gone_status`)."""
        from kubernetes.client.exceptions import ApiException

        ns, name = self._where(handle)
        api = self._api
        core = api.core()
        try:
            pod = api.call(
                "get",
                "pods",
                name,
                lambda: core.read_namespaced_pod(name, ns, _request_timeout=api.timeout()),
            )
        except KubernetesApiError as e:
            if e.status != 404 or not isinstance(e.__cause__, ApiException):
                raise
            return gone_status(ns, name, handle.data)
        return self._judge(pod, handle)

    # -- destroy / sweep / logs -------------------------------------------------------------------

    @staticmethod
    def _where(handle: SandboxHandle) -> tuple[str, str]:
        ns = handle.data.get("namespace")
        name = handle.data.get("name")
        if not ns or not name:
            ns, _, name = handle.id.partition("/")
        return ns, name

    def destroy(self, handle: SandboxHandle) -> None:
        ns, name = self._where(handle)
        api = self._api
        api.core()
        handle.data["destroyed"] = True
        try:
            for resource in ("pods", "networkpolicies", "secrets"):
                api.delete(resource, name, ns, grace_s=self.options.delete_grace_s)
        finally:
            if self._watch is not None:
                self._watch.release(name)  # the last node's end stops the watch

    def sweep(self, labels: dict[str, str]) -> int:
        """Delete every pod (and its policy and Secret) of this runtime carrying all ``labels``.

        Policies and Secrets carry the pod's labels too, so the leftovers of a launch that
        died half-way (a policy without a pod) are reaped by the same selector.
        """
        api = self._api
        core, net = api.core(), api.net()
        wanted = {**sanitise_labels(labels), MANAGED_BY_LABEL: MANAGED_BY}
        selector = ",".join(f"{k}={v}" for k, v in sorted(wanted.items()))
        ns, t = self.namespace, api.timeout()
        listers: list[tuple[str, Callable[[], Any]]] = [
            ("pods", lambda: core.list_namespaced_pod(ns, label_selector=selector, _request_timeout=t)),
            (
                "networkpolicies",
                lambda: net.list_namespaced_network_policy(ns, label_selector=selector, _request_timeout=t),
            ),
            ("secrets", lambda: core.list_namespaced_secret(ns, label_selector=selector, _request_timeout=t)),
        ]
        pods: set[str] = set()
        for resource, lister in listers:
            for obj in api.call("list", resource, "", lister).items:
                if resource == "pods":
                    pods.add(obj.metadata.name)
                api.delete(resource, obj.metadata.name, grace_s=self.options.delete_grace_s)
        if self._watch is not None:
            for name in pods:
                self._watch.release(name)
        if pods:
            logger.info("kubernetes runtime: swept %d pod(s) matching %s", len(pods), selector)
        return len(pods)

    def logs(self, handle: SandboxHandle, tail: int = 200) -> str:
        ns, name = self._where(handle)
        api = self._api
        core = api.core()
        try:
            out = api.call(
                "read logs of",
                "pods",
                name,
                lambda: core.read_namespaced_pod_log(
                    name,
                    ns,
                    container=CONTAINER_NAME,
                    tail_lines=max(1, int(tail)),
                    _request_timeout=api.timeout(),
                ),
            )
        except KubernetesApiError as e:
            return f"(no logs from pod {ns}/{name}: {e})"
        return out if isinstance(out, str) else str(out)
