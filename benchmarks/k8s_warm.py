"""Warm pods on Kubernetes (issue 40): submit -> guest running, cold pod vs warm pod, same run.

Against the genuine kube-apiserver the tests build (``scripts/k8s-local-cluster.sh``), with
the tests' node agent in the kubelet's place running each pod in gVisor, and moto as the S3
conduit; every API request passes the tests' fault proxy, which counts it.

N nodes run one after the other, each ``print('hi')``, first all cold (a pod created for
each), then all warm (``WarmPods(size=2)``: each node claims a ready pod; the pool starts its
replacement in the background, and the next node is submitted once a pod is ready again: the
pool's steady state when it keeps up with demand). *Submit -> guest running* is from the
moment the task asks for its sandbox (before ``take_spec`` for warm, before ``drive_node``
for both) to the timestamp of the guest's first event (this machine's clock on both sides).
*Requests per task* are all Kubernetes API requests of the phase (the pool's replacement
pods, its policy, claims, watches and deletes included) over N.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from common import ROOT, Target, log

SCRIPT = ROOT / "scripts" / "k8s-local-cluster.sh"
IMAGE = "python:3.12-slim"
STORE_SECRET = "resoluto-store"
GOAL_RATIO = 0.3


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _core(cluster: Any) -> Any:
    from kubernetes.client import CoreV1Api

    return CoreV1Api(cluster.api_client())


def _first_event_ts(events: list[dict[str, Any]]) -> float | None:
    ts = [float(e["ts"]) for e in events if isinstance(e.get("ts"), (int, float))]
    return min(ts) if ts else None


def _node(rt: Any, conduit: Any, node_id: str, pool: Any = None) -> dict[str, Any]:
    from prefect_resoluto.node.drive import drive_node
    from prefect_resoluto.node.spec import NodeSpec

    spec = NodeSpec(run_id="bench-warm", node_id=node_id, argv=["python3", "-c", "print('hi')"])
    events: list[dict[str, Any]] = []
    t0 = time.time()
    w, how = pool.take_spec(spec) if pool is not None else (None, "cold")
    out = drive_node(spec, conduit, rt, on_event=events.append, silence_window=120, warm=w)
    first = _first_event_ts(events)
    return {
        "ok": out.ok,
        "warm": out.warm,
        "how": how,
        "running_s": (first - t0) if first is not None else None,
        "total_s": time.time() - t0,
    }


def _phase(rt: Any, conduit: Any, proxy: Any, n: int, warm: bool) -> dict[str, Any]:
    from support.polling import wait_for

    from prefect_resoluto.runtimes.kubernetes.warm import WarmPods

    pool = None
    if warm:
        pool = WarmPods(rt, conduit, size=2)
        from prefect_resoluto.node.spec import NodeSpec

        key = pool.key_for(NodeSpec(run_id="bench-warm", node_id="k", argv=["true"]))
        pool.want(key)
        wait_for(lambda: pool.ready_count(key) >= 2, timeout=300, what="two warm pods ready")
    with proxy._lock:
        proxy.requests.clear()
    runs = []
    for i in range(n):
        if pool is not None:
            wait_for(lambda: pool.ready_count(key) >= 1, timeout=300, what="a warm pod ready")
        runs.append(_node(rt, conduit, f"{'w' if warm else 'c'}{i}", pool))
        log(f"k8s_warm: {'warm' if warm else 'cold'} {i + 1}/{n}: {runs[-1]['running_s']:.2f} s")
    if pool is not None:  # the replacement of the last node's pod is the phase's too
        wait_for(lambda: pool.ready_count(key) >= 2, timeout=300, what="the last replacement ready")
    with proxy._lock:
        reqs = list(proxy.requests)
    if pool is not None:
        pool.close()
    lat = [r["running_s"] for r in runs if r["running_s"] is not None]
    by = Counter(f"{v} {r}" for v, r, _ in reqs)
    return {
        "n": n,
        "ok": sum(1 for r in runs if r["ok"]),
        "warm_hits": sum(1 for r in runs if r["warm"]),
        "running_p50_s": round(_pct(lat, 0.5), 3),
        "running_p99_s": round(_pct(lat, 0.99), 3),
        "total_p50_s": round(_pct([r["total_s"] for r in runs], 0.5), 3),
        "requests": len(reqs),
        "requests_per_task": round(len(reqs) / max(1, n), 2),
        "by_verb": dict(sorted(by.items())),
    }


def run(quick: bool) -> dict[str, Any]:
    import logging

    from support.k8s_cluster import make_namespace, start_cluster, wait_node_ready
    from support.k8s_fault_proxy import FaultProxy
    from support.k8s_node_agent import NodeAgent
    from support.s3_fixtures import serve_s3

    from guest_runner.conduit.s3 import S3Conduit
    from prefect_resoluto.runtimes.kubernetes import KubernetesRuntime

    logging.getLogger("prefect_resoluto").setLevel(logging.ERROR)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    for var, value in (
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
        ("AWS_EC2_METADATA_DISABLED", "true"),
        ("NO_PROXY", "127.0.0.1,localhost"),
    ):
        os.environ[var] = value
    n = 5 if quick else 20
    st = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, text=True)
    if st.returncode != 0:
        raise RuntimeError(
            "no Kubernetes build here (scripts/k8s-local-cluster.sh build; the test session makes it)"
        )
    work = Path(tempfile.mkdtemp(prefix="rsl-bench-k8s-warm-"))
    res: dict[str, Any] = {"n": n, "quick": quick}
    try:
        cluster = start_cluster(work)
        agent = NodeAgent(cluster.api_client(), work_dir=work / "agent").start()
        try:
            wait_node_ready(cluster, agent.name)
            with serve_s3() as (s3, _moto), FaultProxy(cluster.server, cluster.ca) as proxy:
                import boto3

                boto3.client("s3", endpoint_url=s3.endpoint_url, region_name="us-east-1").create_bucket(
                    Bucket="bench-warm"
                )
                conduit = S3Conduit("bench-warm", base_prefix="base", endpoint_url=s3.endpoint_url)
                ns = make_namespace(cluster, "rsl-bench")
                _core(cluster).create_namespaced_secret(
                    ns,
                    {
                        "apiVersion": "v1",
                        "kind": "Secret",
                        "metadata": {"name": STORE_SECRET},
                        "stringData": {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"},
                    },
                )
                rt = KubernetesRuntime(
                    api_client=cluster.api_client(server=proxy.url),
                    namespace=ns,
                    image=IMAGE,
                    runtime_class="gvisor",
                    guest_source="bundle",
                    store_credentials_secret=STORE_SECRET,
                    delete_grace_s=2,
                )
                for way in ("cold", "warm"):
                    log(f"k8s_warm: {n} nodes {way} ...")
                    res[way] = _phase(rt, conduit, proxy, n, way == "warm")
                rt.close()
                conduit.close()
        finally:
            agent.stop()
    finally:
        subprocess.run(["bash", str(SCRIPT), "down", str(work)], capture_output=True, timeout=120)
        shutil.rmtree(work, ignore_errors=True)
    cold, warm = res["cold"], res["warm"]
    res["warm_over_cold_p50"] = round(warm["running_p50_s"] / max(cold["running_p50_s"], 1e-9), 3)
    res["warm_over_cold_p99"] = round(warm["running_p99_s"] / max(cold["running_p99_s"], 1e-9), 3)
    return res


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for way in ("cold", "warm"):
        r = res.get(way)
        if not r:
            continue
        out.append(
            (
                f"k8s {way} pod: submit -> guest running",
                f"p50 {r['running_p50_s']:.2f} s, p99 {r['running_p99_s']:.2f} s (N={r['n']}, "
                f"{r['ok']} ok, {r['warm_hits']} warm), {r['requests_per_task']} API requests/task",
            )
        )
    if "warm_over_cold_p50" in res:
        out.append(
            (
                "k8s warm / cold",
                f"p50 {res['warm_over_cold_p50']:.2f}x, p99 {res['warm_over_cold_p99']:.2f}x",
            )
        )
    return out


def targets(res: dict[str, Any]) -> list[Target]:
    if "warm_over_cold_p50" not in res:
        return []
    ratio = res["warm_over_cold_p50"]
    cold, warm = res["cold"]["requests_per_task"], res["warm"]["requests_per_task"]
    return [
        Target(
            "k8s_warm",
            "submit -> running, warm / cold (p50)",
            f"<= {GOAL_RATIO}",
            f"{ratio:.2f}",
            ratio <= GOAL_RATIO,
        ),
        Target("k8s_warm", "API requests per task, warm vs cold", f"<= {cold}", f"{warm}", warm <= cold),
    ]
