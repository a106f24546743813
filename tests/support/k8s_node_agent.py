"""A node agent in the kubelet's place, for tests against a genuine kube-apiserver.

It talks to the cluster only through the API -- it never sees the runtime's Python objects:

* registers a ``Node`` (capacity, ``Ready`` condition, InternalIP 127.0.0.1, the port of its
  log endpoint) and keeps it alive with a ``Lease`` in ``kube-node-lease`` and status heartbeats;
* watches the pods the scheduler bound to it (``fieldSelector=spec.nodeName=<node>``);
* honours ``runtimeClassName`` through the real ``RuntimeClass`` object's handler: ``runsc`` /
  ``gvisor`` run the container in a gVisor sandbox on this machine; ``kata`` runs it the same way,
  flagged as emulated (condition ``resoluto.io/EmulatedRuntime``: there is no KVM here);
* resolves ``env[].valueFrom.secretKeyRef`` from the Secrets API (a missing Secret or key is
  ``CreateContainerConfigError`` with the kubelet's message), gives every ``emptyDir`` a fresh
  host directory bind-mounted at its mount path, runs the container's command (or the image's
  entrypoint) as the container's user with its env, cwd and memory/CPU limits (a host cgroup);
* reports status through the ``pods/status`` subresource like a kubelet: ``Pending`` with a
  waiting reason (``ContainerCreating``, ``ErrImagePull`` -> ``ImagePullBackOff``,
  ``CreateContainerConfigError``), ``Running``, ``Succeeded`` / ``Failed`` with containerStatuses
  (exit code; reason ``Completed``, ``Error`` or ``OOMKilled`` when the cgroup OOM-killed it);
* serves ``/containerLogs/<ns>/<pod>/<container>`` over HTTPS, which the apiserver proxies for
  ``kubectl logs`` / ``read_namespaced_pod_log``;
* on a graceful delete (``deletionTimestamp``) stops the sandbox within the grace period and
  finishes the delete (grace 0, uid precondition), as a kubelet does.

On request (test hooks, the way a real node would misbehave): :meth:`NodeAgent.refuse_image`
(pulls fail), :meth:`NodeAgent.evict` (node-pressure eviction: the sandbox is killed and the pod
``Failed`` / ``Evicted``). Images whose registry host ends in ``.invalid`` never pull.

``NodeAgent(..., plain=True)`` runs each container as a plain child process instead (no
sandbox, no image, the container's command and env as given): for figures that need a
hundred pods' life cycles against the real API server, not their isolation
(``benchmarks/scale_k8s.py``).

"Images" are emulated: every image is this machine's ``/usr`` and ``/etc`` plus this interpreter's
prefix (with boto3 and prefect), and ``guest_runner`` at ``/opt/resoluto`` with the entrypoint of
``images/Dockerfile``. NetworkPolicy is not enforced (that is a CNI's job, not a kubelet's): the
sandbox shares the host's loopback so it reaches the test's S3 endpoint.
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import http.server
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

ROOT = Path(__file__).resolve().parents[2]
MERGE = "application/merge-patch+json"
EMULATED_CONDITION = "resoluto.io/EmulatedRuntime"
GVISOR_HANDLERS = {"runsc", "gvisor"}
KATA_PREFIX = "kata"
#: What the emulated image runs when the pod gives no command (images/Dockerfile).
IMAGE_ENTRYPOINT = ["python3", "-m", "guest_runner"]


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def _iso(t: dt.datetime | None = None) -> str:
    return (t or _now()).strftime("%Y-%m-%dT%H:%M:%SZ")


def _quantity_bytes(q: str | None) -> int | None:
    if not q:
        return None
    units = {
        "Ki": 1024,
        "Mi": 1024**2,
        "Gi": 1024**3,
        "Ti": 1024**4,
        "k": 1000,
        "M": 1000**2,
        "G": 1000**3,
        "T": 1000**4,
    }
    for suffix, mult in units.items():
        if q.endswith(suffix):
            return int(float(q[: -len(suffix)]) * mult)
    return int(float(q))


def _quantity_cpus(q: str | None) -> float | None:
    if not q:
        return None
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


@dataclass
class _PodRun:
    namespace: str
    name: str
    uid: str
    dir: Path
    log: Path
    cid: str
    proc: subprocess.Popen[bytes] | None = None
    cgroup: Any = None
    started: str = ""
    stop_reason: str = ""  # "deleted" / "evicted" once the agent stops it on purpose
    plain: bool = False  # a plain child process, not a gVisor sandbox
    done: threading.Event = field(default_factory=threading.Event)


class NodeAgent:
    """One fake-but-honest node: a kubelet's API contract, gVisor sandboxes for containers."""

    def __init__(
        self,
        api_client: client.ApiClient,
        *,
        name: str | None = None,
        work_dir: str | Path,
        runsc: str = "runsc",
        cpu: str = "2",
        memory: str = "8Gi",
        pods: str = "110",
        plain: bool = False,
    ) -> None:
        self.plain = plain
        self.api = api_client
        self.core = client.CoreV1Api(api_client)
        self.name = name or f"resoluto-node-{uuid.uuid4().hex[:6]}"
        self.work = Path(work_dir)
        self.runsc = shutil.which(runsc) or runsc
        self.capacity = {"cpu": cpu, "memory": memory, "pods": pods, "ephemeral-storage": "20Gi"}
        self._refused_images: set[str] = set()
        self._runs: dict[str, _PodRun] = {}  # pod uid -> run
        self._seen: set[str] = set()
        self._deleted: set[str] = set()  # uids being or already deleted: never (re)start them
        self._waiting_why: dict[tuple[str, str], str] = {}  # (ns, pod) -> reason, while not started
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._log_server: http.server.ThreadingHTTPServer | None = None
        self.errors: list[str] = []  # agent-side failures, for a test's post-mortem

    # -- test hooks -------------------------------------------------------------------------

    def refuse_image(self, image: str) -> None:
        """Pulls of ``image`` fail from now on (ErrImagePull, then ImagePullBackOff)."""
        self._refused_images.add(image)

    def evict(
        self, namespace: str, name: str, message: str = "The node was low on resource: memory. "
    ) -> None:
        """Node-pressure eviction of a running pod, as the kubelet's eviction manager does it."""
        run = self._run_of(namespace, name)
        if run is None:
            raise LookupError(f"pod {namespace}/{name} is not running on {self.name}")
        run.stop_reason = "evicted"
        self._status(run.namespace, run.name, {"phase": "Failed", "reason": "Evicted", "message": message})
        self._kill(run, grace=0)

    def running(self) -> list[str]:
        with self._lock:
            return [f"{r.namespace}/{r.name}" for r in self._runs.values() if not r.done.is_set()]

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> NodeAgent:
        self.work.mkdir(parents=True, exist_ok=True)
        port = self._serve_logs()
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": {
                    "kubernetes.io/hostname": self.name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "resoluto.io/node-agent": "true",
                },
            },
        }
        try:
            self.core.create_node(node)
        except ApiException as e:
            if e.status != 409:
                raise
        self._node_status(port)
        self._threads = [
            threading.Thread(
                target=self._heartbeat, args=(port,), daemon=True, name=f"{self.name}-heartbeat"
            ),
            threading.Thread(target=self._watch, daemon=True, name=f"{self.name}-watch"),
        ]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            self._kill(run, grace=0)
        for t in self._threads:
            # The watch (a daemon) sees the stop at its stream's end, up to its 5 s server-side
            # timeout away: waiting for it was most of a test session's teardown.
            t.join(timeout=0.1 if t.name.endswith("-watch") else 10)
        if self._log_server is not None:
            self._log_server.shutdown()
            self._log_server.server_close()
        try:
            self.core.delete_node(self.name)
        except ApiException:
            pass

    def __enter__(self) -> NodeAgent:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- node registration and heartbeats --------------------------------------------------

    def _node_status(self, port: int) -> None:
        now = _iso()
        ready = {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "resoluto node agent is posting ready status",
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        pressure = [
            {
                "type": t,
                "status": "False",
                "reason": f"KubeletHasNo{t}",
                "message": "",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
            for t in ("MemoryPressure", "DiskPressure", "PIDPressure")
        ]
        body = {
            "status": {
                "capacity": self.capacity,
                "allocatable": self.capacity,
                "conditions": [*pressure, ready],
                "addresses": [
                    {"type": "InternalIP", "address": "127.0.0.1"},
                    {"type": "Hostname", "address": self.name},
                ],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": port}},
                "nodeInfo": {
                    "machineID": "",
                    "systemUUID": "",
                    "bootID": "",
                    "kernelVersion": os.uname().release,
                    "osImage": "resoluto node agent",
                    "containerRuntimeVersion": "runsc://gvisor",
                    "kubeletVersion": "v1.20.2",
                    "kubeProxyVersion": "v1.20.2",
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                },
            }
        }
        self.core.patch_node_status(self.name, body, _content_type=MERGE)

    def _heartbeat(self, port: int) -> None:
        """Renew the node's Lease and post its status every 10 s (the node controller's grace is 40 s)."""
        coord = client.CoordinationV1Api(self.api)
        first = True
        while not self._stop.wait(0 if first else 10):
            first = False
            renew = {
                "holderIdentity": self.name,
                "leaseDurationSeconds": 40,
                "renewTime": dt.datetime.now(dt.UTC),
            }
            try:
                # A merge patch needs no resourceVersion (an update would, or fail with a 422).
                coord.patch_namespaced_lease(
                    self.name, "kube-node-lease", {"spec": renew}, _content_type=MERGE
                )
            except ApiException as e:
                if e.status == 404:
                    try:
                        coord.create_namespaced_lease(
                            "kube-node-lease",
                            {
                                "apiVersion": "coordination.k8s.io/v1",
                                "kind": "Lease",
                                "metadata": {"name": self.name, "namespace": "kube-node-lease"},
                                "spec": renew,
                            },
                        )
                    except ApiException as e2:
                        self.errors.append(f"lease: {e2.status} {e2.reason}")
                else:
                    self.errors.append(f"lease: {e.status} {e.reason}")
            except Exception as e:  # the next beat retries
                self.errors.append(f"lease: {type(e).__name__}: {e}")
            try:
                self._node_status(port)
            except Exception as e:
                self.errors.append(f"node status: {type(e).__name__}: {e}")

    # -- watching pods ----------------------------------------------------------------------------

    def _watch(self) -> None:
        rv = ""
        while not self._stop.is_set():
            try:
                if not rv:
                    listing = self.core.list_pod_for_all_namespaces(
                        field_selector=f"spec.nodeName={self.name}"
                    )
                    for pod in listing.items:
                        self._on_pod("ADDED", pod)
                    rv = listing.metadata.resource_version
                w = watch.Watch()
                for ev in w.stream(
                    self.core.list_pod_for_all_namespaces,
                    resource_version=rv,
                    field_selector=f"spec.nodeName={self.name}",
                    timeout_seconds=5,
                    allow_watch_bookmarks=True,
                ):
                    if self._stop.is_set():
                        w.stop()
                        break
                    obj = ev["object"]
                    if ev["type"] == "ERROR":
                        rv = ""
                        break
                    if isinstance(obj, dict):  # a BOOKMARK arrives undecoded: only its resourceVersion counts
                        rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                        continue
                    rv = obj.metadata.resource_version
                    if ev["type"] != "BOOKMARK":
                        self._on_pod(ev["type"], obj)
            except ApiException as e:
                if e.status == 410:  # our resourceVersion was compacted away: list again
                    rv = ""
                    continue
                self.errors.append(f"watch: {e.status} {e.reason}")
                self._stop.wait(0.5)
            except Exception as e:
                self.errors.append(f"watch: {type(e).__name__}: {e}")
                self._stop.wait(0.5)

    def _on_pod(self, kind: str, pod: Any) -> None:
        uid = pod.metadata.uid
        with self._lock:
            run = self._runs.get(uid)
            fresh = uid not in self._seen
            self._seen.add(uid)
        if kind == "DELETED" or pod.metadata.deletion_timestamp is not None:
            with self._lock:
                self._deleted.add(uid)
        if kind == "DELETED":
            if run is not None:
                run.stop_reason = run.stop_reason or "deleted"
                self._kill(run, grace=0)
            return
        if pod.metadata.deletion_timestamp is not None:
            grace = pod.metadata.deletion_grace_period_seconds or 0
            if run is not None and not run.done.is_set():
                run.stop_reason = run.stop_reason or "deleted"
                threading.Thread(target=self._finish_delete, args=(run, pod, grace), daemon=True).start()
            elif fresh or run is None or run.done.is_set():
                self._force_delete(pod)
            return
        if fresh and (pod.status.phase or "Pending") == "Pending":
            threading.Thread(
                target=self._start_pod, args=(pod,), daemon=True, name=f"pod-{pod.metadata.name}"
            ).start()

    def _finish_delete(self, run: _PodRun, pod: Any, grace: int) -> None:
        self._kill(run, grace=grace)
        run.done.wait(grace + 15)
        self._force_delete(pod)

    def _force_delete(self, pod: Any) -> None:
        body = client.V1DeleteOptions(
            grace_period_seconds=0, preconditions=client.V1Preconditions(uid=pod.metadata.uid)
        )
        try:
            self.core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, body=body)
        except ApiException as e:
            if e.status not in (404, 409):
                self.errors.append(f"delete {pod.metadata.name}: {e.status} {e.reason}")

    def _run_of(self, namespace: str, name: str) -> _PodRun | None:
        with self._lock:
            for r in self._runs.values():
                if r.namespace == namespace and r.name == name and not r.done.is_set():
                    return r
        return None

    # -- status reporting ---------------------------------------------------------------------

    def _status(self, namespace: str, name: str, status: dict[str, Any]) -> bool:
        try:
            self.core.patch_namespaced_pod_status(name, namespace, {"status": status}, _content_type=MERGE)
            return True
        except ApiException as e:
            if e.status != 404:
                self.errors.append(f"status {name}: {e.status} {e.reason}: {e.body}")
            return False

    def _conditions(
        self, pod: Any, ready: bool, extra: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        now = _iso()
        flag = "True" if ready else "False"
        conds = [
            {"type": "Initialized", "status": "True", "lastTransitionTime": now},
            {"type": "Ready", "status": flag, "lastTransitionTime": now},
            {"type": "ContainersReady", "status": flag, "lastTransitionTime": now},
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
        ]
        if not ready:
            for c in conds[1:3]:
                c["reason"] = "ContainersNotReady"
                c["message"] = (
                    "containers with unready status: [" + ",".join(c.name for c in pod.spec.containers) + "]"
                )
        return conds + (extra or [])

    def _container_status(
        self, pod: Any, state: dict[str, Any], *, ready: bool = False, cid: str = ""
    ) -> list[dict[str, Any]]:
        c = pod.spec.containers[0]
        st: dict[str, Any] = {
            "name": c.name,
            "image": c.image,
            "imageID": "",
            "ready": ready,
            "restartCount": 0,
            "started": "running" in state,
            "state": state,
        }
        if cid:
            st["containerID"] = f"runsc://{cid}"
            st["imageID"] = f"resoluto-emulated://{c.image}"
        return [st]

    def _waiting(
        self, pod: Any, reason: str, message: str = "", extra: list[dict[str, Any]] | None = None
    ) -> bool:
        waiting: dict[str, Any] = {"reason": reason}
        self._waiting_why[(pod.metadata.namespace, pod.metadata.name)] = reason
        if message:
            waiting["message"] = message
        return self._status(
            pod.metadata.namespace,
            pod.metadata.name,
            {
                "phase": "Pending",
                "hostIP": "127.0.0.1",
                "startTime": _iso(pod.metadata.creation_timestamp),
                "conditions": self._conditions(pod, False, extra),
                "containerStatuses": self._container_status(pod, {"waiting": waiting}),
            },
        )

    # -- running a pod ------------------------------------------------------------------------------

    def _start_pod(self, pod: Any) -> None:
        try:
            self._start_pod_inner(pod)
        except Exception as e:
            self.errors.append(f"pod {pod.metadata.name}: {type(e).__name__}: {e}")
            self._waiting(pod, "RunContainerError", f"node agent: {type(e).__name__}: {e}")

    def _start_pod_inner(self, pod: Any) -> None:
        if len(pod.spec.containers) != 1 or pod.spec.init_containers:
            self._waiting(
                pod, "CreateContainerError", "the resoluto node agent runs single-container pods only"
            )
            return
        c = pod.spec.containers[0]
        if not self._waiting(pod, "ContainerCreating"):
            return
        if self.plain:
            self._start_plain(pod, c)
            return
        # The RuntimeClass's handler decides the sandbox, as the CRI's runtime handler does.
        extra: list[dict[str, Any]] = []
        handler = "runc"
        if pod.spec.runtime_class_name:
            try:
                rc = client.NodeV1Api(self.api).read_runtime_class(pod.spec.runtime_class_name)
                handler = rc.handler
            except ApiException as e:
                self._waiting(
                    pod, "CreateContainerError", f"RuntimeClass {pod.spec.runtime_class_name!r}: {e.reason}"
                )
                return
        if handler.startswith(KATA_PREFIX):
            extra.append(
                {
                    "type": EMULATED_CONDITION,
                    "status": "True",
                    "reason": "NoKVM",
                    "message": f"runtime handler {handler!r} (Kata) emulated with gVisor: no KVM on this node",
                    "lastTransitionTime": _iso(),
                }
            )
        elif handler not in GVISOR_HANDLERS:
            self._waiting(
                pod,
                "CreateContainerError",
                f"no runtime for handler {handler!r} on this node (it runs only gVisor and emulated Kata)",
            )
            return
        if not self._pull(pod, c.image, extra):
            return
        env, why = self._env(pod, c)
        if env is None:
            self._waiting(pod, "CreateContainerConfigError", why, extra)
            return
        run = self._prepare(pod, c, env)
        with self._lock:
            self._runs[pod.metadata.uid] = run
            deleted = pod.metadata.uid in self._deleted
        if deleted:  # deleted while it was being set up: the delete path found no process to stop
            self._cleanup(run)
            run.done.set()
            self._force_delete(pod)
            return
        self._launch(pod, c, run, extra)

    def _start_plain(self, pod: Any, c: Any) -> None:
        """The container's command as a plain child process (``plain=True``)."""
        env, why = self._env(pod, c)
        if env is None:
            self._waiting(pod, "CreateContainerConfigError", why)
            return
        uid = pod.metadata.uid
        pdir = self.work / "pods" / uid
        pdir.mkdir(parents=True, exist_ok=True)
        run = _PodRun(
            pod.metadata.namespace, pod.metadata.name, uid, pdir, pdir / "container.log", "", plain=True
        )
        with self._lock:
            self._runs[uid] = run
            if uid in self._deleted:
                run.done.set()
                self._force_delete(pod)
                return
        argv = list(c.command or IMAGE_ENTRYPOINT) + list(c.args or [])
        argv = [sys.executable if a in ("python3", "python") else a for a in argv[:1]] + argv[1:]
        with open(run.log, "ab") as log:
            run.proc = subprocess.Popen(
                argv,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp", **env},
                cwd="/tmp",
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        run.started = _iso()
        ns, name = run.namespace, run.name
        self._status(
            ns,
            name,
            {
                "phase": "Running",
                "hostIP": "127.0.0.1",
                "podIP": "127.0.0.1",
                "conditions": self._conditions(pod, True),
                "containerStatuses": self._container_status(
                    pod, {"running": {"startedAt": run.started}}, ready=True, cid=f"plain-{uid[:8]}"
                ),
            },
        )
        code = run.proc.wait()
        code = 128 - code if code < 0 else code
        term = {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "startedAt": run.started}
        term["finishedAt"] = _iso()
        status = {
            "phase": "Succeeded" if code == 0 else "Failed",
            "conditions": self._conditions(pod, False),
            "containerStatuses": self._container_status(pod, {"terminated": term}, cid=f"plain-{uid[:8]}"),
        }
        if run.stop_reason != "deleted" or self._exists(pod):
            self._status(ns, name, status)
        run.done.set()

    def _pull(self, pod: Any, image: str, extra: list[dict[str, Any]]) -> bool:
        host = image.split("/")[0] if "/" in image else ""
        if image not in self._refused_images and not host.endswith(".invalid"):
            return True
        self._waiting(
            pod,
            "ErrImagePull",
            f"rpc error: code = Unknown desc = failed to pull and unpack image "
            f'"{image}": failed to resolve reference "{image}": not found',
            extra,
        )
        self._waiting(pod, "ImagePullBackOff", f'Back-off pulling image "{image}"', extra)
        return False

    def _env(self, pod: Any, c: Any) -> tuple[dict[str, str] | None, str]:
        ns = pod.metadata.namespace
        env: dict[str, str] = {}
        secrets: dict[str, Any] = {}
        for e in c.env or []:
            if e.value_from is None:
                env[e.name] = e.value or ""
                continue
            ref = e.value_from.secret_key_ref
            if ref is None:
                fr = e.value_from.field_ref
                if fr is not None and fr.field_path in ("metadata.name", "metadata.namespace"):
                    env[e.name] = pod.metadata.name if fr.field_path == "metadata.name" else ns
                    continue
                return (
                    None,
                    f"the resoluto node agent resolves only secretKeyRef and metadata fieldRefs ({e.name})",
                )
            if ref.name not in secrets:
                try:
                    secrets[ref.name] = self.core.read_namespaced_secret(ref.name, ns)
                except ApiException as ex:
                    if ex.status != 404:
                        return None, f"cannot read secret {ref.name!r}: {ex.status} {ex.reason}"
                    secrets[ref.name] = None
            secret = secrets[ref.name]
            if secret is None:
                if ref.optional:
                    continue
                return None, f'secret "{ref.name}" not found'
            data = secret.data or {}
            if ref.key not in data:
                if ref.optional:
                    continue
                return None, f"couldn't find key {ref.key} in Secret {ns}/{ref.name}"
            env[e.name] = base64.b64decode(data[ref.key]).decode()
        return env, ""

    def _prepare(self, pod: Any, c: Any, env: dict[str, str]) -> _PodRun:
        uid = pod.metadata.uid
        pdir = self.work / "pods" / uid
        cid = f"{pod.metadata.name[:40]}-{uid[:8]}"
        run = _PodRun(pod.metadata.namespace, pod.metadata.name, uid, pdir, pdir / "container.log", cid)
        rootfs = pdir / "bundle" / "rootfs"
        rootfs.mkdir(parents=True)
        run.log.touch()
        psc = pod.spec.security_context
        csc = c.security_context
        uid_ = (csc.run_as_user if csc and csc.run_as_user is not None else None) or (
            psc.run_as_user if psc and psc.run_as_user is not None else 0
        )
        gid_ = (csc.run_as_group if csc and csc.run_as_group is not None else None) or (
            psc.run_as_group if psc and psc.run_as_group is not None else 0
        )
        ro_root = bool(csc and csc.read_only_root_filesystem)
        mounts: list[dict[str, Any]] = [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
            {
                "destination": "/sys",
                "type": "sysfs",
                "source": "sysfs",
                "options": ["nosuid", "noexec", "nodev", "ro"],
            },
        ]
        # The emulated image: the host's system, this interpreter (with boto3 and prefect), the runner.
        image_ro = ["/usr", "/etc", sys.prefix, sys.base_prefix, str(ROOT)]
        for src in dict.fromkeys(image_ro):
            mounts.append({"destination": src, "type": "bind", "source": src, "options": ["rbind", "ro"]})
        mounts.append(
            {
                "destination": "/opt/resoluto/guest_runner",
                "type": "bind",
                "source": str(ROOT / "guest_runner"),
                "options": ["rbind", "ro"],
            }
        )
        volumes = {v.name: v for v in pod.spec.volumes or []}
        for vm in c.volume_mounts or []:
            v = volumes.get(vm.name)
            if v is None or v.empty_dir is None:
                raise RuntimeError(f"volume {vm.name!r}: the node agent provides emptyDir volumes only")
            host = pdir / "volumes" / vm.name
            host.mkdir(parents=True, exist_ok=True)
            os.chown(host, uid_, (psc.fs_group if psc and psc.fs_group is not None else gid_))
            os.chmod(host, 0o2775)
            mounts.append(
                {
                    "destination": vm.mount_path,
                    "type": "bind",
                    "source": str(host),
                    "options": ["rbind", "ro" if vm.read_only else "rw"],
                }
            )
        # Parents before children, as container runtimes order mounts: an emptyDir at /tmp must not
        # hide the emulated image's Python when that lives under /tmp (a checkout in /tmp).
        binds = sorted(mounts[3:], key=lambda m: len(Path(m["destination"]).parts))
        mounts[3:] = binds
        for i, m in enumerate(binds):
            (rootfs / m["destination"].lstrip("/")).mkdir(parents=True, exist_ok=True)
            for outer in reversed(binds[:i]):  # a mount point inside an earlier volume lives in the volume
                rel = os.path.relpath(m["destination"], outer["destination"])
                if not rel.startswith("..") and outer["source"].startswith(str(pdir / "volumes")):
                    Path(outer["source"], rel).mkdir(parents=True, exist_ok=True)
                    break
        for link in ("bin", "lib", "lib64", "sbin"):
            if not (rootfs / link).exists():
                (rootfs / link).symlink_to(f"usr/{link}")
        for d in ("proc", "dev", "sys", "tmp"):
            (rootfs / d).mkdir(exist_ok=True)
        argv = list(c.command or IMAGE_ENTRYPOINT) + list(c.args or [])
        image_env = {
            "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
            "PYTHONPATH": "/opt/resoluto",
            "HOME": "/tmp",
            "HOSTNAME": pod.metadata.name,
        }
        full_env = {**image_env, **env}
        limits = (c.resources.limits if c.resources else None) or {}
        resources: dict[str, Any] = {}
        mem = _quantity_bytes(limits.get("memory"))
        cpus = _quantity_cpus(limits.get("cpu"))
        from prefect_resoluto.runtimes import _cgroup
        from prefect_resoluto.runtimes.base import Resources

        cg_name = f"k8s-agent-{cid}"
        linux: dict[str, Any] = {"namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")]}
        if _cgroup.detect() is not None:
            # Pre-created so its oom_kill count survives the sandbox (runsc keeps what it did not make).
            run.cgroup = _cgroup.create(cg_name, Resources(memory_bytes=mem, cpus=cpus))
            if mem:
                resources["memory"] = {"limit": mem, "swap": mem}
            if cpus:
                resources["cpu"] = {"quota": int(cpus * 100_000), "period": 100_000}
            linux["resources"] = resources
            linux["cgroupsPath"] = f"/{_cgroup.PARENT}/{cg_name}"
        cfg = {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": uid_, "gid": gid_},
                "args": argv,
                "env": [f"{k}={v}" for k, v in full_env.items()],
                "cwd": c.working_dir or "/",
                "capabilities": {"bounding": [], "effective": [], "inheritable": [], "permitted": []},
                "noNewPrivileges": True,
            },
            "root": {"path": "rootfs", "readonly": ro_root},
            "hostname": pod.metadata.name[:63],
            "mounts": mounts,
            "linux": linux,
        }
        (pdir / "bundle" / "config.json").write_text(json.dumps(cfg))
        os.chmod(pdir / "bundle" / "config.json", 0o600)
        return run

    def _runsc(self) -> list[str]:
        from prefect_resoluto.runtimes import _cgroup

        flags = [self.runsc, f"--root={self.work / 'runsc-root'}", "--network=host"]
        if _has_systrap(self.runsc):
            flags.append("--platform=systrap")
        if _cgroup.detect() is None:
            flags.append("--ignore-cgroups")
        return flags

    def _launch(self, pod: Any, c: Any, run: _PodRun, extra: list[dict[str, Any]]) -> None:
        ns, name = run.namespace, run.name
        self._waiting_why.pop((ns, name), None)
        log = open(run.log, "ab")
        try:
            run.proc = subprocess.Popen(
                [*self._runsc(), "run", f"--bundle={run.dir / 'bundle'}", run.cid],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        with self._lock:
            deleted = run.uid in self._deleted
        if deleted:  # the delete arrived between the check above and the start
            run.stop_reason = run.stop_reason or "deleted"
            self._kill(run, grace=0)
        run.started = _iso()
        self._status(
            ns,
            name,
            {
                "phase": "Running",
                "hostIP": "127.0.0.1",
                "podIP": "127.0.0.1",
                "podIPs": [{"ip": "127.0.0.1"}],
                "conditions": self._conditions(pod, True, extra),
                "containerStatuses": self._container_status(
                    pod, {"running": {"startedAt": run.started}}, ready=True, cid=run.cid
                ),
            },
        )
        code = run.proc.wait()
        if code < 0:
            code = 128 - code
        oom = run.cgroup is not None and run.cgroup.oom_killed()
        if oom:
            code, reason = 137, "OOMKilled"
        elif code == 0:
            reason = "Completed"
        else:
            reason = "Error"
        term: dict[str, Any] = {
            "exitCode": code,
            "reason": reason,
            "startedAt": run.started,
            "finishedAt": _iso(),
            "containerID": f"runsc://{run.cid}",
        }
        if code != 0 and c.termination_message_policy == "FallbackToLogsOnError":
            tail = run.log.read_bytes()[-2048:].decode("utf-8", "replace").splitlines()[-80:]
            if tail:
                term["message"] = "\n".join(tail)
        self._cleanup(run)
        if run.stop_reason == "evicted":
            term["reason"] = "Error" if not oom else "OOMKilled"
            status: dict[str, Any] = {"phase": "Failed"}
        else:
            status = {"phase": "Succeeded" if code == 0 else "Failed"}
        status.update(
            {
                "conditions": self._conditions(pod, False, extra),
                "containerStatuses": self._container_status(pod, {"terminated": term}, cid=run.cid),
            }
        )
        if run.stop_reason != "deleted" or self._exists(pod):
            self._status(ns, name, status)
        run.done.set()

    def _exists(self, pod: Any) -> bool:
        try:
            self.core.read_namespaced_pod(pod.metadata.name, pod.metadata.namespace)
            return True
        except ApiException:
            return False

    def _kill(self, run: _PodRun, grace: int) -> None:
        if run.proc is None or run.proc.poll() is not None:
            return
        if run.plain:
            try:
                os.killpg(run.proc.pid, signal.SIGTERM)
                run.proc.wait(timeout=max(0, grace))
            except subprocess.TimeoutExpired:
                os.killpg(run.proc.pid, signal.SIGKILL)
                run.proc.wait(timeout=10)
            except ProcessLookupError:
                pass  # it ended on its own meanwhile
            return
        base = self._runsc()
        subprocess.run([*base, "kill", run.cid, "TERM"], capture_output=True, timeout=30)
        try:
            run.proc.wait(timeout=max(0, grace))
        except subprocess.TimeoutExpired:
            pass
        if run.proc.poll() is None:
            subprocess.run([*base, "kill", "--all", run.cid, "KILL"], capture_output=True, timeout=30)
            try:
                run.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(run.proc.pid, signal.SIGKILL)

    def _cleanup(self, run: _PodRun) -> None:
        subprocess.run([*self._runsc(), "delete", "--force", run.cid], capture_output=True, timeout=30)
        if run.cgroup is not None:
            run.cgroup.kill_all()
            run.cgroup.remove()
        shutil.rmtree(run.dir / "bundle", ignore_errors=True)
        shutil.rmtree(run.dir / "volumes", ignore_errors=True)

    # -- the log endpoint the apiserver proxies to -----------------------------------------------

    def _serve_logs(self) -> int:
        agent = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                pass

            def do_GET(self) -> None:  # noqa: N802
                u = urlparse(self.path)
                parts = u.path.strip("/").split("/")
                if len(parts) != 4 or parts[0] != "containerLogs":
                    self.send_error(404)
                    return
                _, ns, pod, container = parts
                text = agent.log_text(ns, pod)
                why = agent._waiting_why.get((ns, pod))
                if text is None and why:  # the kubelet's answer for a container that never started
                    msg = f'container "{container}" in pod "{pod}" is waiting to start: {why}'.encode()
                    self.send_response(400)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                if text is None:
                    self.send_error(404, f"pod {ns}/{pod} has no container on this node")
                    return
                q = parse_qs(u.query)
                if "tailLines" in q:
                    n = int(q["tailLines"][0])
                    lines = text.splitlines(keepends=True)
                    text = "".join(lines[-n:]) if n > 0 else ""
                data = text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        certs = self.work / "kubelet-tls"
        certs.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-subj",
                f"/CN={self.name}",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
                "-keyout",
                str(certs / "key.pem"),
                "-out",
                str(certs / "cert.pem"),
            ],
            check=True,
            capture_output=True,
        )
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(certs / "cert.pem", certs / "key.pem")
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        srv.daemon_threads = True
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
        self._log_server = srv
        threading.Thread(target=srv.serve_forever, daemon=True, name=f"{self.name}-logs").start()
        return srv.server_address[1]

    def log_text(self, namespace: str, name: str) -> str | None:
        with self._lock:
            runs = [r for r in self._runs.values() if r.namespace == namespace and r.name == name]
        if not runs:
            return None
        try:
            return runs[-1].log.read_text(errors="replace")
        except OSError:
            return None


@functools.lru_cache(maxsize=4)
def _has_systrap(runsc: str) -> bool:
    out = subprocess.run([runsc, "flags"], capture_output=True, text=True)
    return "systrap" in out.stdout + out.stderr
