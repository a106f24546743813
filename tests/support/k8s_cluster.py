"""Session fixtures: a genuine Kubernetes control plane on 127.0.0.1 and a node agent.

``scripts/k8s-local-cluster.sh`` (built by the test session itself, ``tests/support/k8s_build.py``) provides kube-apiserver,
kube-controller-manager, kube-scheduler and etcd; the session starts them once on free loopback
ports (``up``) and stops exactly what it started (``down``). ``tests/support/k8s_node_agent.py`` is the
node. Without the build (not Debian bookworm, build failed) the tests that need it skip, saying why;
on CI (``CI`` set, bookworm) they fail instead.

Fixtures (a plugin: tests/conftest.py lists it in ``pytest_plugins``):

- ``k8s_cluster`` (session): a :class:`Cluster` -- kubeconfig with the pinned context
  ``resoluto-local``, the admin token, an admin ``ApiClient``; RuntimeClasses ``gvisor`` and
  ``runsc`` (handler ``runsc``) and ``kata`` (handler ``kata``, emulated by the agent) exist.
- ``k8s_agent`` (session): the running :class:`~k8s_node_agent.NodeAgent`.
- ``k8s_ns``: a fresh namespace per test (deleted afterwards), with its default ServiceAccount.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from support import k8s_build
from support.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "k8s-local-cluster.sh"
CONTEXT = "resoluto-local"

__all__ = ["CONTEXT", "Cluster", "k8s_agent", "k8s_cluster", "k8s_ns", "make_namespace"]


@dataclass
class Cluster:
    dir: Path
    kubeconfig: str
    server: str
    token: str
    ca: str
    start_s: float

    def configuration(self, token: str | None = None, server: str | None = None) -> Any:
        from kubernetes.client import Configuration

        cfg = Configuration(host=server or self.server)
        cfg.ssl_ca_cert = self.ca
        cfg.api_key["BearerToken"] = token or self.token
        cfg.api_key_prefix["BearerToken"] = "Bearer"
        cfg.retries = 0
        return cfg

    def api_client(self, token: str | None = None, server: str | None = None) -> Any:
        from kubernetes.client import ApiClient

        return ApiClient(self.configuration(token, server))

    def write_kubeconfig(
        self,
        path: Path,
        contexts: dict[str, str],
        current: str | None = None,
        token: str | None = None,
        server: str | None = None,
    ) -> str:
        """A kubeconfig whose contexts (name -> namespace) all point at this cluster."""
        import yaml

        c = f"cluster-{path.name}"  # unique per file: merged kubeconfigs resolve names first-wins
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": c, "cluster": {"server": server or self.server, "certificate-authority": self.ca}}
            ],
            "users": [{"name": c, "user": {"token": token or self.token}}],
            "contexts": [
                {"name": n, "context": {"cluster": c, "user": c, "namespace": ns}}
                for n, ns in contexts.items()
            ],
        }
        if current:
            doc["current-context"] = current
        path.write_text(yaml.safe_dump(doc))
        return str(path)


def _why_no_cluster() -> str:
    # The session started the build at collection (support.scheduling); wait for it to exit, not a timer.
    failed = k8s_build.wait()
    if failed:
        return failed
    if shutil.which("runsc") is None:
        return "runsc (gVisor) is not installed, so no node agent can run pods"
    if os.geteuid() != 0:
        return "the node agent runs gVisor sandboxes, which needs root here"
    st = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, text=True)
    if st.returncode != 0:
        return (
            f"no Kubernetes build ({st.stdout.strip() or st.stderr.strip()}); the test session builds it "
            f"unless {k8s_build.wanted_here() or 'it was not started'}; by hand: "
            "'scripts/k8s-local-cluster.sh build' (Debian bookworm's kubernetes source package)"
        )
    return ""


@pytest.fixture(scope="session")
def k8s_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    why = _why_no_cluster()
    if why:
        bookworm = (
            "bookworm" in Path("/etc/os-release").read_text() if Path("/etc/os-release").exists() else False
        )
        if os.environ.get("CI") and bookworm:
            # The session builds it on bookworm: a missing or failed build is a failure on CI.
            pytest.fail(f"genuine kube-apiserver unavailable on a bookworm CI machine: {why}")
        pytest.skip(f"genuine kube-apiserver unavailable: {why}")
    d = tmp_path_factory.mktemp("k8s")
    try:
        cluster = start_cluster(d)
    except Exception as e:
        subprocess.run(["bash", str(SCRIPT), "down", str(d)], capture_output=True, timeout=120)
        pytest.fail(str(e))
    print(f"\nk8s: control plane up in {cluster.start_s:.1f}s at {cluster.server}")
    try:
        yield cluster
    finally:
        subprocess.run(["bash", str(SCRIPT), "down", str(d)], capture_output=True, timeout=120)


def start_cluster(d: Path) -> Cluster:
    """Bring the control plane up in ``d`` and bootstrap it (the caller runs ``down``)."""
    t0 = time.monotonic()
    up = subprocess.run(
        ["bash", str(SCRIPT), "up", str(d)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RESOLUTO_K8S_OWNER_PID": str(os.getpid())},
    )
    if up.returncode != 0:
        raise RuntimeError(f"k8s-local-cluster.sh up failed:\n{up.stderr[-4000:]}")
    env = dict(line.split("=", 1) for line in (d / "env").read_text().splitlines() if "=" in line)
    cluster = Cluster(
        dir=d,
        kubeconfig=env["KUBECONFIG"],
        server=env["RESOLUTO_K8S_SERVER"],
        token=env["RESOLUTO_K8S_TOKEN"],
        ca=env["RESOLUTO_K8S_CA"],
        start_s=time.monotonic() - t0,
    )
    _bootstrap(cluster)
    return cluster


def _bootstrap(cluster: Cluster) -> None:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    api = cluster.api_client()
    node = client.NodeV1Api(api)
    for name, handler in (("gvisor", "runsc"), ("runsc", "runsc"), ("kata", "kata")):
        try:
            node.create_runtime_class(
                {
                    "apiVersion": "node.k8s.io/v1",
                    "kind": "RuntimeClass",
                    "metadata": {"name": name},
                    "handler": handler,
                }
            )
        except ApiException as e:
            if e.status != 409:
                raise
    core = client.CoreV1Api(api)
    # The controller-manager's service-account controller makes kube-node-lease's default SA;
    # until then the namespace's first pods would be refused by the ServiceAccount admission.
    wait_for(lambda: _has_default_sa(core, "default"), timeout=120, what="the controllers to start")


def _has_default_sa(core: Any, ns: str) -> bool:
    from kubernetes.client.exceptions import ApiException

    try:
        core.read_namespaced_service_account("default", ns)
        return True
    except ApiException:
        return False


def wait_node_ready(cluster: Cluster, node: str) -> None:
    """Until the node agent's Node is Ready and untainted (the scheduler then binds pods to it)."""
    from kubernetes import client

    core = client.CoreV1Api(cluster.api_client())

    def ready() -> bool:
        n = core.read_node(node)
        return any(c.type == "Ready" and c.status == "True" for c in (n.status.conditions or [])) and not any(
            t.effect == "NoSchedule" for t in (n.spec.taints or [])
        )

    wait_for(ready, timeout=60, what=f"node {node} Ready and untainted")


@pytest.fixture(scope="session")
def k8s_agent(k8s_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from support.k8s_node_agent import NodeAgent

    agent = NodeAgent(k8s_cluster.api_client(), work_dir=Path("/tmp") / f"rsl-agent-{uuid.uuid4().hex[:8]}")
    agent.start()
    wait_node_ready(k8s_cluster, agent.name)
    try:
        yield agent
    finally:
        agent.stop()
        if agent.errors:
            print(
                f"\nk8s node agent errors ({len(agent.errors)}):\n  "
                + "\n  ".join(e[:300] for e in agent.errors[-10:])
            )
        shutil.rmtree(agent.work, ignore_errors=True)


def make_namespace(cluster: Cluster, prefix: str = "rsl-t") -> str:
    from kubernetes import client

    core = client.CoreV1Api(cluster.api_client())
    ns = f"{prefix}-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    wait_for(lambda: _has_default_sa(core, ns), timeout=60, what=f"namespace {ns}'s default ServiceAccount")
    return ns


@pytest.fixture
def k8s_ns(k8s_cluster: Cluster) -> Iterator[str]:
    from kubernetes import client

    ns = make_namespace(k8s_cluster)
    yield ns
    try:
        client.CoreV1Api(k8s_cluster.api_client()).delete_namespace(ns)
    except Exception:
        pass
