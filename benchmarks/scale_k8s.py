"""Scale part ``k8s``: Kubernetes API requests per pod, one watch per runtime vs a GET per poll.

Against the genuine kube-apiserver the tests build (``scripts/k8s-local-cluster.sh``:
apiserver, controller-manager, scheduler, etcd on 127.0.0.1), with the tests' node agent
in the kubelet's place running each pod as a plain process (``NodeAgent(plain=True)``: the
figure is about the API, not the sandbox). Every request the runtime sends passes the
tests' fault proxy (``tests/support/k8s_fault_proxy.py``), which records it as
``(verb, resource, status)``: that is the count.

N pods (10, then 100) are launched at once; each lives ``life`` seconds (a sleep), and a
thread per pod does what the driver does: ``status`` every ``status_interval`` until the
pod is terminal, then ``destroy``. Two ways, same run, same cluster:

* ``poll`` -- today's path before issue 32: ``status`` is one ``GET pod`` (the runtime's
  ``status_by_get``, main's ``status`` unchanged) every 2 s (main's ``status_interval``),
  and no client-side rate limit (main had none);
* ``watch`` -- the runtime as it is: one LIST + one WATCH for all its pods, ``status``
  from the watch's cache every 1 s, every request through the 20 QPS / burst 30 limit.

Reported per way and N: requests per pod over its life (launch to destroy) and per
pod-minute, by verb; LIST and WATCH requests; the peak request rate.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from common import ROOT, Target, log

SCRIPT = ROOT / "scripts" / "k8s-local-cluster.sh"
IMAGE = "python:3.12-slim"
SIZES = (10, 100)
POLL_INTERVAL_S = 2.0  # main's KubernetesRuntime.status_interval


def _env(i: int) -> dict[str, str]:
    return {
        "RESOLUTO_STORE_KIND": "s3",
        "RESOLUTO_STORE_BUCKET": "bucket",
        "RESOLUTO_STORE_ENDPOINT": "http://127.0.0.1:9",
        "RESOLUTO_STORE_REGION": "us-east-1",
        "RESOLUTO_RUN_ID": "bench-run",
        "RESOLUTO_NODE_ID": f"n{i}",
        "RESOLUTO_STORE_PREFIX": f"base/run/bench-run/nodes/n{i}",
        "RESOLUTO_WORKSPACE_DIR": "/workspace",
    }


def _runtimes(cluster: Any, ns: str, proxy: Any) -> dict[str, Any]:
    from prefect_resoluto.runtimes.kubernetes import KubernetesRuntime

    class _NoWatch:
        """Stands in for the pod watch in the ``poll`` way: nothing is watched."""

        id = "none"
        running = False

        def track(self, name: str) -> None: ...
        def release(self, name: str) -> None: ...
        def close(self) -> None: ...

    class PollingRuntime(KubernetesRuntime):
        """Main's status path: a GET per pod per check, every 2 s, no rate limit."""

        status_interval = POLL_INTERVAL_S

        def pod_watch(self) -> Any:
            return _NoWatch()

        def status(self, handle: Any) -> Any:
            return self.status_by_get(handle)

    common = dict(
        namespace=ns,
        image=IMAGE,
        runtime_class="gvisor",
        store_egress_cidr="127.0.0.1/32",
        store_egress_port=9,
        guest_source="image",
        delete_grace_s=2,
    )
    return {
        "poll": lambda: PollingRuntime(
            api_client=cluster.api_client(server=proxy.url), api_qps=1e6, api_burst=10**6, **common
        ),
        "watch": lambda: KubernetesRuntime(api_client=cluster.api_client(server=proxy.url), **common),
    }


def _one_pod(rt: Any, i: int, life: float, out: list[dict[str, Any]], go: threading.Event) -> None:
    from prefect_resoluto.runtimes.base import LaunchSpec

    spec = LaunchSpec(
        sandbox_id=f"rsl-bench-{i}",
        env=_env(i),
        labels={"resoluto.flow-run-id": "bench"},
        command=["python3", "-c", f"import time; time.sleep({life})"],
    )
    go.wait()
    t0 = time.monotonic()
    h = rt.launch(spec)
    checks = 0
    while True:
        st = rt.status(h)
        checks += 1
        if st.terminal or st.gone:
            break
        time.sleep(rt.status_interval)  # the driver's status clock
    rt.destroy(h)
    out.append({"life_s": time.monotonic() - t0, "phase": st.phase, "checks": checks})


def _measure(make: Any, proxy: Any, n: int, life: float, cluster: Any, ns: str) -> dict[str, Any]:
    rt = make()
    rt._core()  # connect before the clock starts
    with proxy._lock:
        proxy.requests.clear()
    stamps: list[float] = []
    stop = threading.Event()

    def sample() -> None:  # requests seen, once a second: the peak rate
        while not stop.wait(1.0):
            with proxy._lock:
                stamps.append(len(proxy.requests))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out: list[dict[str, Any]] = []
    go = threading.Event()
    threads = [threading.Thread(target=_one_pod, args=(rt, i, life, out, go)) for i in range(n)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    go.set()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    stop.set()
    rt.close()
    with proxy._lock:
        reqs = list(proxy.requests)
    by = Counter(f"{v} {r}" for v, r, _ in reqs)
    pod_min = sum(p["life_s"] for p in out) / 60
    rates = [b - a for a, b in zip([0, *stamps], stamps, strict=False)]
    left = _left(cluster, ns)
    return {
        "pods": n,
        "ended": len(out),
        "succeeded": sum(1 for p in out if p["phase"] == "succeeded"),
        "wall_s": round(wall, 1),
        "pod_minutes": round(pod_min, 2),
        "requests": len(reqs),
        "per_pod": round(len(reqs) / max(1, n), 2),
        "per_pod_minute": round(len(reqs) / max(pod_min, 1e-9), 2),
        # What watching the pods costs, apart from creating and deleting them (6 requests a pod).
        "status_per_pod_minute": round(
            (by.get("get pods", 0) + by.get("list pods", 0) + by.get("watch pods", 0)) / max(pod_min, 1e-9), 2
        ),
        "by_verb": dict(sorted(by.items())),
        "lists": by.get("list pods", 0),
        "watches": by.get("watch pods", 0),
        "gets": by.get("get pods", 0),
        "peak_rps": max(rates or [0]),
        "errors": sum(1 for _, _, s in reqs if s >= 500 or s == 429),
        "pods_left_after": len(left),
    }


def _left(cluster: Any, ns: str) -> list[str]:
    """The pods still in ``ns`` once deletions had their grace period (and a margin) to finish."""
    deadline = time.monotonic() + 60
    while True:
        left = [p.metadata.name for p in _core(cluster).list_namespaced_pod(ns).items]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)  # polling the API for the deletions to finish


def _core(cluster: Any) -> Any:
    from kubernetes.client import CoreV1Api

    return CoreV1Api(cluster.api_client())


def _cluster_up(work: Path) -> Any:
    from support.k8s_cluster import start_cluster

    st = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, text=True)
    if st.returncode != 0:
        raise RuntimeError(
            "no Kubernetes build here (scripts/k8s-local-cluster.sh build; the test session makes it)"
        )
    return start_cluster(work)


def run(quick: bool) -> dict[str, Any]:
    import logging

    from support.k8s_cluster import make_namespace, wait_node_ready
    from support.k8s_fault_proxy import FaultProxy
    from support.k8s_node_agent import NodeAgent

    logging.getLogger("prefect_resoluto").setLevel(logging.WARNING)
    life = 15.0 if quick else 60.0
    work = Path(tempfile.mkdtemp(prefix="rsl-bench-k8s-"))
    res: dict[str, Any] = {"life_s": life, "quick": quick, "runs": {}}
    try:
        cluster = _cluster_up(work)
        agent = NodeAgent(cluster.api_client(), work_dir=work / "agent", plain=True, pods="250").start()
        try:
            wait_node_ready(cluster, agent.name)
            with FaultProxy(cluster.server, cluster.ca) as proxy:
                for n in SIZES:
                    for way in ("poll", "watch"):
                        ns = make_namespace(cluster, "rsl-bench")
                        make = _runtimes(cluster, ns, proxy)[way]
                        log(f"scale_k8s: {n} pods, {way} ...")
                        r = _measure(make, proxy, n, life, cluster, ns)
                        log(
                            f"scale_k8s: {n} pods {way}: {r['per_pod']} req/pod, "
                            f"{r['per_pod_minute']} req/pod-min, {r['watches']} watch(es)"
                        )
                        res["runs"][f"{way}-{n}"] = r
                        _core(cluster).delete_namespace(ns)
        finally:
            agent.stop()
    finally:
        subprocess.run(["bash", str(SCRIPT), "down", str(work)], capture_output=True, timeout=120)
        shutil.rmtree(work, ignore_errors=True)
    return res


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    life = res.get("life_s")
    for key, r in res.get("runs", {}).items():
        way, n = key.split("-")
        out.append(
            (
                f"k8s {way:5} {n:>3} pods ({life:.0f} s each)",
                f"{r['per_pod']} req/pod, {r['per_pod_minute']} req/pod-min "
                f"(status {r['status_per_pod_minute']}), GET {r['gets']}, LIST {r['lists']}, "
                f"WATCH {r['watches']}, peak {r['peak_rps']} req/s, wall {r['wall_s']} s, "
                f"{r['succeeded']}/{r['pods']} ok, {r['pods_left_after']} left",
            )
        )
    return out


def targets(res: dict[str, Any]) -> list[Target]:
    runs = res.get("runs", {})
    w10, w100 = runs.get("watch-10"), runs.get("watch-100")
    if not (w10 and w100):
        return []
    flat = w100["per_pod"] / max(w10["per_pod"], 1e-9)
    return [
        Target(
            "scale",
            "k8s requests per pod, 100 vs 10 concurrent pods (watch)",
            "flat (ratio <= 1.2)",
            f"{w10['per_pod']} -> {w100['per_pod']} (x{flat:.2f})",
            flat <= 1.2,
        ),
        Target(
            "scale",
            "k8s watches per runtime (100 pods)",
            "<= 1",
            str(w100["watches"]),
            w100["watches"] <= 1,
        ),
        Target(
            "scale",
            "k8s pods left after the runs",
            "0",
            str(sum(r["pods_left_after"] for r in runs.values())),
            all(r["pods_left_after"] == 0 for r in runs.values()),
        ),
    ]
