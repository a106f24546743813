"""Warm pods: pods started ahead of demand, each taken by one node through the conduit.

``ResolutoTaskRunner(runtime="kubernetes", warm_pool=N)`` keeps up to N ready pods per
:class:`PodKey` (image, resources, RuntimeClass), at most :data:`TOTAL_CAP` in all. A pod
carries nothing of a node: its run and node ids are the pool's own (``warm-<pool>``, a
random token), no secret, and its guest (:mod:`guest_runner.warmpod`) waits for an
authenticated assignment at ``run/warm-<pool>/nodes/<token>/assign``.

Pools are **per runner**. A pod is labelled with its pool's id and key; a runner only
considers pods of its own pool. Taking one is a **claim** at the API server: a merge patch
of the pod's labels (``resoluto.io/warm=claimed``, ``claimed-by``, the node's labels)
carrying the ``resourceVersion`` the runner last saw, so of two claimers exactly one gets
200 and the other 409 (it tries its next pod, or runs cold). Even a claimer that is not
the pod's host cannot use the pod: only the host can seal an assignment the pod accepts.

Network: every pod of a pool is selected by the pool's one NetworkPolicy
(``rsl-warm-<pool>``): DNS and the object store only, what a waiting pod needs. At the
assignment, before it is written, the host creates the pod's own policy (named as the pod,
owned by it) with exactly the node's egress (:func:`~.manifests.egress_rules`); policies
add up, and the pool's is contained in every node's, so a claimed pod reaches exactly
what its node may. Pods are not keyed by egress: none waits with more than the conduit.

Nodes with secret environment run cold (an assignment travels through the conduit, where
other pods' store credentials could read it), and so does everything when the store
credentials are minted per node (``store_role_arn``: a pod's are scoped to its node's
prefix, unknown when it starts). A waiting pod watches its host's heartbeat and exits when
it stops: its own copy, sealed at every beat of the host's writer under the pod's key (the
shared beat is writable by every pod holding the store's credentials); ``close`` deletes the idle pods and the pool's policy, and the runner's sweep
finds claimed ones by their node's labels.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guest_runner import warmpod, wire
from prefect_resoluto.node import heartbeat
from prefect_resoluto.node.spec import GUEST_WORKSPACE
from prefect_resoluto.runtimes.base import (
    LaunchError,
    LaunchSpec,
    NodeAddress,
    NotWaiting,
    Resources,
    SandboxHandle,
    StoreLocation,
)
from prefect_resoluto.runtimes.kubernetes.api import KubernetesApiError
from prefect_resoluto.runtimes.kubernetes.manifests import (
    MANAGED_BY,
    MANAGED_BY_LABEL,
    NODE_LABEL,
    RUN_LABEL,
    SANDBOX_LABEL,
    TOKEN_ANNOTATION,
    egress_rules,
    label_value,
    sanitise_labels,
    weakened,
)
from prefect_resoluto.runtimes.kubernetes.watch import WATCH_LABEL

if TYPE_CHECKING:
    from guest_runner.conduit import Conduit
    from prefect_resoluto.runtimes.kubernetes.runtime import KubernetesRuntime

log = logging.getLogger("prefect_resoluto.runtimes.kubernetes.warm")

LABEL_WARM = "resoluto.io/warm"
LABEL_POOL = "resoluto.io/warm-pool"
LABEL_KEY = "resoluto.io/warm-key"
LABEL_CLAIMED_BY = "resoluto.io/claimed-by"
#: Idle pods (ready or starting) of all keys of one pool at most.
TOTAL_CAP = 16
#: Pods starting at once per pool.
MAX_STARTING = 4
#: Seconds between two looks at starting pods (their status is the watch's: no request).
READY_POLL = 0.1
#: Pods of one key that end before they are ready before the key runs cold.
MAX_FAILURES = 3
MERGE_PATCH = "application/merge-patch+json"


@dataclass(frozen=True)
class PodKey:
    """What is fixed when a pod starts (egress is not: it is set when the pod is claimed)."""

    image: str | None = None
    resources: Resources = field(default_factory=Resources)
    runtime_class: str = ""

    def digest(self) -> str:
        raw = json.dumps(asdict(self), sort_keys=True, default=str)
        return hashlib.sha256(raw.encode()).hexdigest()[:12]


class WarmPod:
    """One pod of the pool: what the node's driver uses of a warm sandbox."""

    def __init__(self, pool: WarmPods, key: PodKey, handle: SandboxHandle, token: str) -> None:
        self.pool, self.key, self.handle, self.token = pool, key, handle, token
        self.started = time.monotonic()
        #: The key sealing its assignment, once its hello was read (it is then ready).
        self.secret: bytes | None = None
        self.failed = False
        #: Never a directory: the conduit is S3 (the driver's warm-slot attribute).
        self.placed: Path | None = None

    @property
    def name(self) -> str:
        return str(self.handle.data["name"])

    def place(self, conduit: Conduit, rel_prefix: str) -> None:
        """Nothing moves: the pod reaches the node's canonical keys in the store itself."""

    def assign(self, launch: LaunchSpec) -> SandboxHandle:
        return self.pool.assign(self, launch)

    def replacement(self) -> WarmPod | None:
        return None  # a pod that could not take its node: the node launches its own

    def ended(self) -> None:
        """Nothing to tell: the pod pool keeps no count of the nodes in flight."""

    def discard(self) -> None:
        try:
            self.pool.runtime.destroy(self.handle)
        except Exception as e:
            log.warning("could not delete warm pod %s: %s", self.handle.id, e)


def pod_prefix(pool_id: str, token: str, base: str = "") -> str:
    """Where a warm pod's hello and assignment live (its boot node's prefix)."""
    return wire.node_prefix(f"warm-{pool_id}", token, base)


def claim(runtime: KubernetesRuntime, name: str, resource_version: str, labels: dict[str, str]) -> bool:
    """Label pod ``name`` claimed iff it is still at ``resource_version``: True for the one
    claimer the API server let through, False for a 409 (changed: claimed, ended) or a 404."""
    api, ns = runtime._api, runtime.namespace
    core, t = api.core(), api.timeout()
    body = {"metadata": {"resourceVersion": resource_version, "labels": labels}}
    try:
        # Not retried: a retry of a claim that landed would see its own change as a conflict.
        api.call(
            "patch",
            "pods",
            name,
            lambda: core.patch_namespaced_pod(name, ns, body, _content_type=MERGE_PATCH, _request_timeout=t),
            retry=False,
        )
    except KubernetesApiError as e:
        if e.status in (404, 409):
            return False
        raise
    return True


class WarmPods:
    """One runner's warm pods on one Kubernetes runtime, per key, refilled in the background."""

    def __init__(
        self,
        runtime: KubernetesRuntime,
        conduit: Conduit,
        *,
        size: int,
        total: int = TOTAL_CAP,
        host_lost_after: float = heartbeat.DEFAULT_LOST_AFTER,
        host_heartbeat_interval: float = heartbeat.DEFAULT_INTERVAL,
    ) -> None:
        self.runtime, self.conduit = runtime, conduit
        self.size = max(0, min(size, total))
        self.total = total
        self.id = uuid.uuid4().hex[:12]
        self.policy_name = f"rsl-warm-{self.id}"
        self._private, self._public = warmpod.keypair()
        self._lease = (
            heartbeat.lease(conduit, host_heartbeat_interval, host_lost_after) if host_lost_after else None
        )
        self._idle: dict[PodKey, list[WarmPod]] = {}
        self._wanted: list[PodKey] = []
        self._failures: dict[PodKey, int] = {}
        self._lock = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._policy = False
        if self._lease is not None:  # beats with the host's, and stops with them
            self._lease.writer.also(self._seal_beats)
        #: Claims lost to another claimer, and pods taken (for the log line and doctor).
        self.lost_claims = 0
        self.claimed = 0

    # -- the task's side --------------------------------------------------------------------
    def key_for(self, spec: Any) -> PodKey:
        return PodKey(
            image=spec.image or self.runtime.image,
            resources=spec.resources,
            runtime_class=self.runtime.runtime_class,
        )

    def want(self, key: PodKey) -> None:
        with self._lock:
            if self._closed or self._failures.get(key, 0) >= MAX_FAILURES:
                return
            if key not in self._wanted:
                self._wanted.append(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._refill, name="resoluto-warm-pods", daemon=True)
                self._thread.start()
            self._lock.notify_all()

    def take_spec(self, spec: Any) -> tuple[WarmPod | None, str]:
        """A ready pod of ``spec``'s key, claimed for it, and the words for the task's log."""
        if spec.secret_env:
            return None, (
                "cold sandbox (a node with secret environment never takes a warm pod: its "
                "assignment travels through the conduit)"
            )
        key = self.key_for(spec)
        self.want(key)
        t0 = time.monotonic()
        lost = 0
        labels = {
            LABEL_WARM: "claimed",
            LABEL_CLAIMED_BY: self.id,
            **sanitise_labels(spec.labels),
            RUN_LABEL: label_value(spec.run_id),
            NODE_LABEL: label_value(spec.node_id),
        }
        while True:
            with self._lock:
                idle = self._idle.get(key) or []
                pick = next((w for w in idle if w.secret is not None), None)
                if pick is None:
                    starting = sum(1 for w in idle if w.secret is None)
                    return None, (
                        f"cold sandbox (no warm pod of key {key.digest()} ready: {starting} starting, "
                        f"pool {self.id} keeps {self.size} per key; looked for "
                        f"{(time.monotonic() - t0) * 1000:.1f} ms)"
                    )
                idle.remove(pick)
                self._lock.notify_all()  # the refill starts its replacement
            try:
                won = self._claim(pick, labels)
            except KubernetesApiError as e:
                # It may have landed: a pod no node will be assigned must not wait on.
                log.warning("claiming warm pod %s failed (%s); deleting it", pick.handle.id, e)
                pick.discard()
                continue
            if won:
                break
            # Claimed by another, or ended: never ours to assign (nor to delete) again.
            lost += 1
            self.lost_claims += 1
            self._forget(pick)
        self.claimed += 1
        pick.handle.labels.update(labels)
        age = time.monotonic() - pick.started
        return pick, (
            f"warm sandbox {pick.handle.id} (a warm pod of key {key.digest()} claimed in "
            f"{(time.monotonic() - t0) * 1000:.1f} ms{f' after {lost} lost claim(s)' if lost else ''}; "
            f"started {age:.1f} s ahead; pool {self.id} keeps {self.size} per key)"
        )

    def _claim(self, w: WarmPod, labels: dict[str, str]) -> bool:
        """Claim ``w`` at the version the watch last showed; after a 409, once more at the
        version one GET shows if the pod is still idle and this pool's (the watch was behind
        a status update): a pod someone else claimed is never retried."""
        seen = self.runtime.pod_watch().lookup(w.name)
        rv = None if seen.deleted else self._idle_version(seen.pod)
        if rv is not None and claim(self.runtime, w.name, rv, labels):
            return True
        api, ns = self.runtime._api, self.runtime.namespace
        core, t = api.core(), api.timeout()
        try:
            pod = api.call(
                "get", "pods", w.name, lambda: core.read_namespaced_pod(w.name, ns, _request_timeout=t)
            )
        except KubernetesApiError:  # gone, or the API away: lost either way
            return False
        rv = self._idle_version(pod)
        return rv is not None and claim(self.runtime, w.name, rv, labels)

    def _idle_version(self, pod: Any) -> str | None:
        """The pod's resourceVersion while it is idle and this pool's, else None."""
        if pod is None:
            return None
        labels = pod.metadata.labels or {}
        if labels.get(LABEL_WARM) != "idle" or labels.get(LABEL_POOL) != self.id:
            return None
        return str(pod.metadata.resource_version)

    def assign(self, w: WarmPod, launch: LaunchSpec) -> SandboxHandle:
        """Give the claimed pod exactly the node's egress, then its sealed assignment."""
        if w.secret is None or launch.secret_env:
            raise NotWaiting("the warm pod cannot take a node with secret environment")
        try:
            self._node_policy(w, launch)
        except (KubernetesApiError, LaunchError) as e:
            raise NotWaiting(f"its network policy could not be set: {e}") from e
        body = wire.encode_assignment(dict(launch.env), {})
        prefix = pod_prefix(self.id, w.token)
        self.conduit.put(f"{prefix}/{warmpod.ASSIGN}", warmpod.seal(w.secret, w.token, body))
        w.handle.labels.update(launch.labels)
        return w.handle

    def _node_policy(self, w: WarmPod, launch: LaunchSpec) -> None:
        rt = self.runtime
        api, ns = rt._api, rt.namespace
        net, t = api.net(), api.timeout()
        rules = rt.egress_rules(launch)
        labels = {
            **sanitise_labels(launch.labels),
            RUN_LABEL: label_value(launch.run_id),
            NODE_LABEL: label_value(launch.node_id),
            MANAGED_BY_LABEL: MANAGED_BY,
            SANDBOX_LABEL: w.name,
        }
        policy = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {
                "name": w.name,
                "namespace": ns,
                "labels": labels,
                "annotations": {TOKEN_ANNOTATION: w.handle.data["token"]},
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": w.name,
                        "uid": w.handle.data["uid"],
                        "blockOwnerDeletion": False,
                    }
                ],
            },
            "spec": {
                "podSelector": {"matchLabels": {SANDBOX_LABEL: w.name}},
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [],
                "egress": rules,
            },
        }
        api.call(
            "create",
            "networkpolicies",
            w.name,
            lambda: net.create_namespaced_network_policy(
                ns, policy, field_validation="Strict", _request_timeout=t
            ),
        )

    # -- state ------------------------------------------------------------------------------
    def counts(self) -> dict[str, dict[str, int]]:
        """Per key digest: idle pods ready and starting (doctor, tests, benchmarks)."""
        with self._lock:
            return {
                k.digest(): {
                    "ready": sum(1 for w in ws if w.secret is not None),
                    "starting": sum(1 for w in ws if w.secret is None),
                }
                for k, ws in self._idle.items()
            }

    def ready_count(self, key: PodKey) -> int:
        with self._lock:
            return sum(1 for w in self._idle.get(key) or [] if w.secret is not None)

    def close(self) -> None:
        """Delete every idle pod and the pool's policy, and stop the heartbeat it held (once:
        a cancelled runner closes its pool, then its exit does again)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = [w for ws in self._idle.values() for w in ws]
            self._idle.clear()
            self._lock.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)
        with self._lock:
            idle += [w for ws in self._idle.values() for w in ws]
            self._idle.clear()
        rt = self.runtime
        for w in idle:
            self._delete_pod(w)
        try:  # one whose launch was cut short, and what a crashed earlier close left
            rt.sweep({LABEL_POOL: self.id, LABEL_WARM: "idle"})
            if self._policy:
                rt._api.delete("networkpolicies", self.policy_name)
        except Exception as e:
            log.warning("reaping warm pool %s failed: %s", self.id, e)
        try:
            self.conduit.delete_prefix(wire.run_prefix(f"warm-{self.id}") + "/")
        except Exception as e:  # the pods' hellos and assignments: small, and nothing secret
            log.debug("warm pool %s objects not deleted: %s", self.id, e)
        if self._lease is not None:
            self._lease.writer.drop(self._seal_beats)
            self._lease.release()

    def _seal_beats(self, count: int) -> None:
        """Each ready idle pod's beat number ``count``, sealed for it (at the host's beat)."""
        with self._lock:
            if self._closed:
                return
            pods = [w for ws in self._idle.values() for w in ws if w.secret is not None]
        for w in pods:
            assert w.secret is not None
            key = f"{pod_prefix(self.id, w.token)}/{warmpod.BEAT}"
            try:
                self.conduit.put_transient(key, warmpod.beat_body(w.secret, w.token, count))
            except Exception as e:  # late is fine, within the bound: the next beat retries
                log.warning("warm pod %s: beat not written: %s", w.handle.id, e)

    def _forget(self, w: WarmPod) -> None:
        watch = self.runtime._watch
        if watch is not None:
            watch.release(w.name)

    def _delete_pod(self, w: WarmPod) -> None:
        try:
            # An idle pod runs nothing of a node: no grace to give it.
            self.runtime._api.delete("pods", w.name, grace_s=0)
        except Exception as e:
            log.warning("could not delete warm pod %s: %s", w.handle.id, e)
        watch = self.runtime._watch
        if watch is not None:
            watch.release(w.name)

    # -- the refill thread ----------------------------------------------------------------
    def _refill(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                todo = self._next_key()
                if todo is None:
                    self._lock.wait(timeout=READY_POLL)
            self._check_starting()
            if todo is None:
                continue
            try:
                w = self._launch(todo)
            except Exception as e:
                self._failed_key(todo, f"could not start a warm pod: {e}")
                continue
            with self._lock:
                closed = self._closed
                if not closed:
                    self._idle.setdefault(todo, []).append(w)
            if closed:
                self._delete_pod(w)
                return

    def _next_key(self) -> PodKey | None:
        idle = sum(len(ws) for ws in self._idle.values())
        starting = sum(1 for ws in self._idle.values() for w in ws if w.secret is None)
        if idle >= self.total or starting >= MAX_STARTING:
            return None
        for key in self._wanted:
            if len(self._idle.get(key) or []) < self.size:
                return key
        return None

    def _failed_key(self, key: PodKey, why: str) -> None:
        with self._lock:
            n = self._failures[key] = self._failures.get(key, 0) + 1
            if n >= MAX_FAILURES and key in self._wanted:
                self._wanted.remove(key)
        log.warning(
            "warm pool %s, key %s: %s%s",
            self.id,
            key.digest(),
            why,
            "; it runs cold" if n >= MAX_FAILURES else "",
        )

    def _check_starting(self) -> None:
        """Starting pods that run now: their hello read (then they are ready); ones that
        ended: dropped."""
        with self._lock:
            pods = [(k, w) for k, ws in self._idle.items() for w in ws if w.secret is None]
        for key, w in pods:
            st = self.runtime.status(w.handle)
            if st.terminal or st.gone:
                with self._lock:
                    if w in self._idle.get(key, []):
                        self._idle[key].remove(w)
                self._failed_key(key, f"pod {w.handle.id} ended before it was ready: {st.reason}")
                threading.Thread(target=w.discard, daemon=True).start()
                continue
            if st.phase != "running":
                continue
            try:
                w.secret = self._hello(w)
            except ValueError as e:
                with self._lock:
                    if w in self._idle.get(key, []):
                        self._idle[key].remove(w)
                self._failed_key(key, f"pod {w.handle.id} said a bad hello: {e}")
                threading.Thread(target=w.discard, daemon=True).start()

    def _hello(self, w: WarmPod) -> bytes | None:
        from guest_runner.conduit import ObjectNotFound

        key = f"{pod_prefix(self.id, w.token)}/{warmpod.HELLO}"
        try:
            with self.conduit.get_stream(key) as f:
                raw = bytes(f.read(warmpod.MAX_HELLO_BYTES + 1))
        except ObjectNotFound:
            return None
        if len(raw) > warmpod.MAX_HELLO_BYTES:
            raise ValueError("hello too large")
        try:
            public = warmpod.public_value(json.loads(raw)["public"])
        except (KeyError, TypeError, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise ValueError(str(e)) from None
        return warmpod.shared_key(self._private, public)

    def _ensure_policy(self, spec: LaunchSpec) -> None:
        """The pool's policy (DNS and the store only), before its first pod exists."""
        if self._policy:
            return
        rt = self.runtime
        api, ns = rt._api, rt.namespace
        net, t = api.net(), api.timeout()
        store_nets, store_port = rt._store_egress(spec)
        policy = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {
                "name": self.policy_name,
                "namespace": ns,
                "labels": {MANAGED_BY_LABEL: MANAGED_BY, LABEL_POOL: self.id, LABEL_WARM: "pool"},
            },
            "spec": {
                "podSelector": {"matchLabels": {LABEL_POOL: self.id}},
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [],
                "egress": egress_rules([], store_nets, store_port, rt._dns_cidr),
            },
        }
        api.call(
            "create",
            "networkpolicies",
            self.policy_name,
            lambda: net.create_namespaced_network_policy(
                ns, policy, field_validation="Strict", _request_timeout=t
            ),
        )
        self._policy = True

    def _boot_spec(self, key: PodKey, token: str) -> LaunchSpec:
        """A waiting pod's spec: the pool's own run and node ids, the conduit's address, the
        host's public value and heartbeat; nothing of a node, nothing secret."""
        run_id = f"warm-{self.id}"
        prefix = pod_prefix(self.id, token, self.conduit.base_prefix)
        env = {
            **self.conduit.guest_env(),
            wire.ENV_RUN_ID: run_id,
            wire.ENV_NODE_ID: token,
            wire.ENV_STORE_PREFIX: prefix,
            wire.ENV_WORKSPACE_DIR: GUEST_WORKSPACE,
            warmpod.ENV_PREFIX: prefix,
            warmpod.ENV_HOST_KEY: format(self._public, "x"),
            **(self._lease.env if self._lease is not None else {}),
        }
        return LaunchSpec(
            sandbox_id=f"rsl-w{token[:12]}",
            env=env,
            address=NodeAddress(run_id, token, StoreLocation.from_env(env)),
            resources=key.resources,
            labels={LABEL_POOL: self.id, LABEL_KEY: key.digest(), LABEL_WARM: "idle"},
            image=key.image,
        )

    def _launch(self, key: PodKey) -> WarmPod:
        """Create one waiting pod of ``key`` (its pool's policy first): the pod only, one request."""
        rt = self.runtime
        token = uuid.uuid4().hex
        spec = self._boot_spec(key, token)
        self._ensure_policy(spec)
        m = rt.manifests(spec, token=token, upload_bundle=True)
        api, ns, name = rt._api, rt.namespace, m.name
        core, t = api.core(), api.timeout()
        watch = rt.pod_watch()
        m.pod["metadata"]["labels"][WATCH_LABEL] = watch.id
        watch.track(name)
        try:
            pod = api.call(
                "create",
                "pods",
                name,
                lambda: core.create_namespaced_pod(ns, m.pod, field_validation="Strict", _request_timeout=t),
                on_conflict=lambda: rt._mine(lambda: core.read_namespaced_pod(name, ns), token),
            )
        except BaseException:
            watch.release(name)
            raise
        limits = (m.pod["spec"]["containers"][0].get("resources") or {}).get("limits", {})
        data = {"namespace": ns, "name": name, "token": token, "secret": False, "warm": True}
        data.update(
            uid=pod.metadata.uid,
            created_rv=pod.metadata.resource_version,
            launched_at=rt._clock(),
            memory_limit=limits.get("memory"),
        )
        handle = SandboxHandle(id=f"{ns}/{name}", runtime=rt.name, labels=dict(spec.labels), data=data)
        w = WarmPod(self, key, handle, token)
        lost = weakened(pod, rt.options.runtime_class, rt.options.read_only_root_filesystem)
        if lost:
            self._delete_pod(w)
            raise LaunchError(
                f"the API server did not keep the warm pod's security settings ({'; '.join(lost)})"
            )
        return w


def start_for(cfg: Any, runtime: KubernetesRuntime, conduit: Conduit) -> WarmPods | None:
    """The runner's warm pods (None: ``warm_pool`` unset or 0, or they cannot serve: said why)."""
    size = cfg.warm_pool or 0
    if size <= 0:
        return None
    if conduit.kind != "s3":
        log.warning("warm_pool=%d ignored: warm pods need an S3 conduit", size)
        return None
    if runtime.options.store_role_arn:
        log.warning(
            "warm_pool=%d ignored: store credentials are minted per node (store_role_arn), and a "
            "pod started ahead of its node cannot have its node's",
            size,
        )
        return None
    pool = WarmPods(
        runtime,
        conduit,
        size=size,
        host_lost_after=cfg.host_lost_after,
        host_heartbeat_interval=cfg.host_heartbeat_interval,
    )
    pool.want(
        PodKey(image=cfg.image or runtime.image, resources=cfg.resources, runtime_class=runtime.runtime_class)
    )
    return pool


def inventory(runtime: KubernetesRuntime) -> dict[str, Any]:
    """What ``prefect-resoluto doctor`` says of warm pods: the settings, and the warm pods the
    API server holds in the runtime's namespace per pool, key and state (one LIST)."""
    api, ns = runtime._api, runtime.namespace
    core, t = api.core(), api.timeout()
    selector = f"{MANAGED_BY_LABEL}={MANAGED_BY},{LABEL_POOL}"
    pods = api.call(
        "list",
        "pods",
        "",
        lambda: core.list_namespaced_pod(ns, label_selector=selector, _request_timeout=t),
    ).items
    pools: dict[str, dict[str, dict[str, int]]] = {}
    for p in pods:
        labels = p.metadata.labels or {}
        per_key = pools.setdefault(labels.get(LABEL_POOL, "?"), {}).setdefault(labels.get(LABEL_KEY, "?"), {})
        state = labels.get(LABEL_WARM, "?")
        per_key[state] = per_key.get(state, 0) + 1
    return {
        "namespace": ns,
        "settings": (
            f"warm_pool=N: up to N idle pods per key (image, resources, RuntimeClass) per runner, "
            f"at most {TOTAL_CAP} per runner, {MAX_STARTING} starting at once; claimed by "
            "resourceVersion; needs an S3 conduit and no store_role_arn; nodes with secrets run cold"
        ),
        "pools": pools,
    }
