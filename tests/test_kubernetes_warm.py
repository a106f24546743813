"""Warm pods (prefect_resoluto/runtimes/kubernetes/warm.py) against the genuine kube-apiserver,
with the tests' node agent running each pod in gVisor and moto as the S3 conduit.

The agent does not enforce NetworkPolicy: what a pod may reach is read back as the policies
the API server stores for it.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support.k8s_cluster import Cluster  # noqa: E402
from support.k8s_fault_proxy import FaultProxy  # noqa: E402
from support.k8s_node_agent import NodeAgent  # noqa: E402
from support.polling import wait_for  # noqa: E402
from test_kubernetes_cluster import STORE_SECRET, core, make_runtime, names, net, store_secret  # noqa: E402

from guest_runner import warmpod, wire  # noqa: E402
from prefect_resoluto.node import heartbeat  # noqa: E402
from prefect_resoluto.node.spec import NodeSpec, launch_spec  # noqa: E402
from prefect_resoluto.runtimes.kubernetes import warm  # noqa: E402

pytestmark = [pytest.mark.k8s, pytest.mark.sandbox]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("RESOLUTO_STORE_EGRESS_CIDR", "RESOLUTO_STORE_EGRESS_PORT", "RESOLUTO_SANDBOX_IMAGE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))


def runtime(cluster: Cluster, ns: str, proxy: FaultProxy | None = None) -> Any:
    return make_runtime(
        cluster,
        ns,
        via=proxy,
        guest_source="bundle",
        store_credentials_secret=STORE_SECRET,
        store_egress_cidr=None,
        store_egress_port=None,
    )


@pytest.fixture
def proxy(k8s_cluster: Cluster) -> Any:
    with FaultProxy(k8s_cluster.server, k8s_cluster.ca) as p:
        yield p


@pytest.fixture
def pools(k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent, s3_conduit: Any) -> Any:
    store_secret(k8s_cluster, k8s_ns)
    made: list[warm.WarmPods] = []

    def make(rt: Any, size: int = 1, **kw: Any) -> warm.WarmPods:
        pool = warm.WarmPods(rt, s3_conduit, size=size, **kw)
        made.append(pool)
        return pool

    yield make
    for p in made:
        p.close()
    # What a test left claimed but never assigned (the race's winner), then this process's
    # heartbeat: nothing may write to the bucket while its fixture empties and deletes it.
    api = core(k8s_cluster)
    for p in made:
        for pod in pool_pods(k8s_cluster, k8s_ns, p):
            try:
                api.delete_namespaced_pod(pod.metadata.name, k8s_ns, grace_period_seconds=0)
            except ApiException as e:
                # Listed while its own deletion (the pool's close) was finishing.
                if e.status != 404:
                    raise
    wait_for(
        lambda: all(pool_pods(k8s_cluster, k8s_ns, p) == [] for p in made), timeout=60, what="warm pods gone"
    )
    heartbeat.writer_for(s3_conduit).close()


def spec_of(node_id: str, argv: list[str] | None = None, **fields: Any) -> NodeSpec:
    return NodeSpec(
        run_id="run-warm", node_id=node_id, argv=argv or ["python3", "-c", "print('hi')"], **fields
    )


def ready(pool: warm.WarmPods, key: warm.PodKey, n: int = 1) -> None:
    pool.want(key)
    wait_for(lambda: pool.ready_count(key) >= n, timeout=180, what=f"{n} warm pod(s) ready")


def pool_pods(cluster: Cluster, ns: str, pool: warm.WarmPods, state: str | None = None) -> list[Any]:
    sel = f"{warm.LABEL_POOL}={pool.id}" + (f",{warm.LABEL_WARM}={state}" if state else "")
    return list(core(cluster).list_namespaced_pod(ns, label_selector=sel).items)


def policies_selecting(cluster: Cluster, ns: str, pod: Any) -> list[Any]:
    labels = pod.metadata.labels or {}
    out = []
    for p in net(cluster).list_namespaced_network_policy(ns).items:
        want = p.spec.pod_selector.match_labels or {}
        if all(labels.get(k) == v for k, v in want.items()):
            out.append(p)
    return out


def stored_egress(cluster: Cluster, ns: str, name: str) -> list[dict[str, Any]]:
    raw = net(cluster).api_client.sanitize_for_serialization(
        net(cluster).read_namespaced_network_policy(name, ns)
    )
    return list(raw["spec"].get("egress") or [])


def test_warm_claim_runs_the_node_in_a_ready_pod(
    pools: Any, k8s_cluster: Cluster, k8s_ns: str, s3_conduit: Any, proxy: FaultProxy, tmp_path: Path
) -> None:
    from prefect_resoluto.node.drive import drive_node

    rt = runtime(k8s_cluster, k8s_ns, proxy)
    pool = pools(rt)
    spec = spec_of("n-warm", ["python3", "-c", "print('in a warm pod', 6 * 7)"])
    ready(pool, pool.key_for(spec))
    idle = pool_pods(k8s_cluster, k8s_ns, pool, "idle")
    assert len(idle) == 1
    creates_before = len(proxy.calls("create", "pods"))

    w, how = pool.take_spec(spec)
    assert w is not None and how.startswith("warm sandbox "), how
    assert w.name == idle[0].metadata.name and pool.key_for(spec).digest() in how
    events: list[dict[str, Any]] = []
    outcome = drive_node(spec, s3_conduit, rt, on_event=events.append, silence_window=120, warm=w)
    text = "\n".join(str(e["data"].get("line", "")) for e in events if e.get("event") == "log")
    assert outcome.ok, outcome.describe() + text
    assert outcome.warm and "in a warm pod 42" in text
    # The node did not create a pod: the only create since is the pool's replacement.
    wait_for(lambda: pool.ready_count(pool.key_for(spec)) == 1, timeout=180, what="the replacement ready")
    assert proxy.calls("create", "pods")[creates_before:] == [201]


def test_warm_two_runners_race_for_one_pod_and_exactly_one_claims_it(
    pools: Any, k8s_cluster: Cluster, k8s_ns: str, proxy: FaultProxy
) -> None:
    rt_a = runtime(k8s_cluster, k8s_ns, proxy)
    pool = pools(rt_a)
    key = pool.key_for(spec_of("n"))
    ready(pool, key)
    (pod,) = pool_pods(k8s_cluster, k8s_ns, pool, "idle")
    name, rv = pod.metadata.name, pod.metadata.resource_version
    # Two hosts (two clients, two identities) both saw the pod idle at the same version.
    racers = [runtime(k8s_cluster, k8s_ns, proxy), runtime(k8s_cluster, k8s_ns, proxy)]
    go = threading.Barrier(2)
    won: dict[str, bool] = {}

    def race(i: int) -> None:
        labels = {warm.LABEL_WARM: "claimed", warm.LABEL_CLAIMED_BY: f"racer-{i}"}
        go.wait()
        won[f"racer-{i}"] = warm.claim(racers[i], name, rv, labels)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(won.values()) == [False, True], won
    winner = next(k for k, v in won.items() if v)
    stored = core(k8s_cluster).read_namespaced_pod(name, k8s_ns).metadata.labels
    assert stored[warm.LABEL_CLAIMED_BY] == winner and stored[warm.LABEL_WARM] == "claimed"
    assert sorted(s for s in proxy.calls("patch", "pods")[-2:]) == [200, 409]
    # The pod's own pool no longer takes it: it is not idle any more.
    w, how = pool.take_spec(spec_of("n2"))
    assert w is None or w.name != name, how


def test_warm_another_runners_pool_never_takes_my_pod(
    pools: Any, k8s_cluster: Cluster, k8s_ns: str, proxy: FaultProxy
) -> None:
    mine = pools(runtime(k8s_cluster, k8s_ns, proxy))
    key = mine.key_for(spec_of("n"))
    ready(mine, key)
    other = pools(runtime(k8s_cluster, k8s_ns, proxy), size=0)  # wants nothing warm of its own
    w, how = other.take_spec(spec_of("n-other"))
    assert w is None and how.startswith("cold sandbox (no warm pod"), how
    assert len(pool_pods(k8s_cluster, k8s_ns, mine, "idle")) == 1


def test_warm_node_with_secrets_runs_cold_and_leaves_the_pod_idle(
    pools: Any, k8s_cluster: Cluster, k8s_ns: str, proxy: FaultProxy
) -> None:
    pool = pools(runtime(k8s_cluster, k8s_ns, proxy))
    spec = spec_of("n-secret", secret_env={"API_TOKEN": "tok"})
    ready(pool, pool.key_for(spec))
    patches = len(proxy.calls("patch", "pods"))
    w, how = pool.take_spec(spec)
    assert w is None and "secret environment never takes a warm pod" in how, how
    assert len(proxy.calls("patch", "pods")) == patches  # not even claimed
    assert len(pool_pods(k8s_cluster, k8s_ns, pool, "idle")) == 1


def test_warm_replacement_starts_in_the_background(
    pools: Any, k8s_cluster: Cluster, k8s_ns: str, proxy: FaultProxy
) -> None:
    pool = pools(runtime(k8s_cluster, k8s_ns, proxy), size=2)
    spec = spec_of("n")
    key = pool.key_for(spec)
    ready(pool, key, 2)
    w, how = pool.take_spec(spec)
    assert w is not None, how
    wait_for(lambda: pool.ready_count(key) == 2, timeout=180, what="two ready again")
    idle = {p.metadata.name for p in pool_pods(k8s_cluster, k8s_ns, pool, "idle")}
    assert len(idle) == 2 and w.name not in idle
    w.discard()


def test_warm_idle_pods_stay_within_the_budget_and_doctor_lists_them(
    pools: Any, k8s_cluster: Cluster, k8s_ns: str, proxy: FaultProxy
) -> None:
    from prefect_resoluto.runtimes.base import Resources

    rt = runtime(k8s_cluster, k8s_ns, proxy)
    pool = pools(rt, size=2, total=3)
    small, big = (spec_of("a"), spec_of("b", resources=Resources(memory_bytes=256 << 20)))
    keys = [pool.key_for(small), pool.key_for(big)]
    assert keys[0] != keys[1]
    for k in keys:
        pool.want(k)
    wait_for(lambda: sum(pool.ready_count(k) for k in keys) == 3, timeout=240, what="three warm pods ready")
    assert len(pool_pods(k8s_cluster, k8s_ns, pool)) == 3  # two keys of two each, but three in all
    assert proxy.calls("create", "pods") == [201] * 3
    seen = warm.inventory(rt)
    assert sum(seen["pools"][pool.id][k.digest()].get("idle", 0) for k in keys) == 3
    assert "warm_pool=N" in seen["settings"] and seen["namespace"] == k8s_ns


def test_warm_pods_are_reaped_when_the_runner_exits(
    pools: Any, k8s_cluster: Cluster, k8s_ns: str, s3_conduit: Any
) -> None:
    pool = pools(runtime(k8s_cluster, k8s_ns), size=2)
    ready(pool, pool.key_for(spec_of("n")), 2)
    assert pool.policy_name in names(k8s_cluster, k8s_ns, "networkpolicies")
    pool.close()
    wait_for(lambda: pool_pods(k8s_cluster, k8s_ns, pool) == [], timeout=60, what="idle pods deleted")
    assert pool.policy_name not in names(k8s_cluster, k8s_ns, "networkpolicies")
    assert s3_conduit.list_prefix(wire.run_prefix(f"warm-{pool.id}") + "/") == []


def test_warm_pod_ends_by_itself_when_the_host_heartbeat_stops(
    pools: Any, k8s_cluster: Cluster, k8s_ns: str, s3_conduit: Any
) -> None:
    pool = pools(runtime(k8s_cluster, k8s_ns), host_lost_after=3.0, host_heartbeat_interval=0.5)
    ready(pool, pool.key_for(spec_of("n")))
    (pod,) = pool_pods(k8s_cluster, k8s_ns, pool, "idle")
    # The host dies: its heartbeat stops, nothing deletes the pod.
    heartbeat.writer_for(s3_conduit).close()

    def ended() -> bool:
        p = core(k8s_cluster).read_namespaced_pod(pod.metadata.name, k8s_ns)
        return p.status.phase in ("Succeeded", "Failed")

    wait_for(ended, timeout=120, what="the waiting pod to end by itself")


def test_warm_claimed_pod_gets_exactly_the_tasks_egress(
    pools: Any, k8s_cluster: Cluster, k8s_ns: str, s3_conduit: Any
) -> None:
    rt = runtime(k8s_cluster, k8s_ns)
    pool = pools(rt)
    # Warmed by a runner whose tasks may reach a whole private range ...
    ready(pool, pool.key_for(spec_of("wide", egress=["10.0.0.0/8"])))
    (idle,) = pool_pods(k8s_cluster, k8s_ns, pool, "idle")
    waiting = policies_selecting(k8s_cluster, k8s_ns, idle)
    assert [p.metadata.name for p in waiting] == [pool.policy_name]
    launch_idle = launch_spec(spec_of("x"), s3_conduit)
    conduit_only = rt.egress_rules(launch_idle)
    assert stored_egress(k8s_cluster, k8s_ns, pool.policy_name) == json.loads(json.dumps(conduit_only))
    # ... the pod is taken by a task that may reach one address only.
    narrow = spec_of("narrow", egress=["10.1.2.3/32:5432"])
    w, how = pool.take_spec(narrow)
    assert w is not None, how
    launch = launch_spec(narrow, s3_conduit)
    w.assign(launch)
    claimed = core(k8s_cluster).read_namespaced_pod(w.name, k8s_ns)
    selecting = sorted(p.metadata.name for p in policies_selecting(k8s_cluster, k8s_ns, claimed))
    assert selecting == sorted([pool.policy_name, w.name])
    own = stored_egress(k8s_cluster, k8s_ns, w.name)
    assert own == json.loads(json.dumps(rt.egress_rules(launch)))
    allowed = own + stored_egress(k8s_cluster, k8s_ns, pool.policy_name)
    blocks = {b["ipBlock"]["cidr"] for r in allowed for b in r["to"] if "ipBlock" in b}
    assert "10.0.0.0/8" not in blocks and "10.1.2.3/32" in blocks
    w.discard()


def test_warm_pod_refuses_an_assignment_forged_by_another_pod(
    pools: Any, k8s_cluster: Cluster, k8s_ns: str, s3_conduit: Any
) -> None:
    """An attacker with the store's credentials (any pod of the namespace) and the docs:
    it reads the waiting pod's hello, seals its own assignment with a key of its own and
    writes it where the pod waits. The pod must end without running it."""
    rt = runtime(k8s_cluster, k8s_ns)
    pool = pools(rt)
    ready(pool, pool.key_for(spec_of("n")))
    (pod,) = pool_pods(k8s_cluster, k8s_ns, pool, "idle")
    token = pod.metadata.labels["resoluto.io/node-id"]
    prefix = warm.pod_prefix(pool.id, token)
    hello = json.loads(s3_conduit.get(f"{prefix}/{warmpod.HELLO}"))
    mine, _ = warmpod.keypair()
    forged_key = warmpod.shared_key(mine, warmpod.public_value(hello["public"]))
    evil = spec_of("evil", ["python3", "-c", "print('attacker code ran')"])
    body = wire.encode_assignment(launch_spec(evil, s3_conduit).env, {})
    s3_conduit.put(f"{prefix}/{warmpod.ASSIGN}", warmpod.seal(forged_key, token, body))

    def ended() -> Any:
        p = core(k8s_cluster).read_namespaced_pod(pod.metadata.name, k8s_ns)
        return p.status.phase in ("Succeeded", "Failed") and p

    done = wait_for(ended, timeout=120, what="the pod to refuse the forged assignment")
    assert done.status.phase == "Failed"
    logs = core(k8s_cluster).read_namespaced_pod_log(pod.metadata.name, k8s_ns)
    assert "refused an assignment" in logs
    assert s3_conduit.list_prefix(wire.node_prefix("run-warm", "evil") + "/") == []


@pytest.mark.prefect
def test_warm_pod_through_the_task_runner_says_so_in_the_task_log(
    k8s_cluster: Cluster,
    k8s_ns: str,
    k8s_agent: NodeAgent,
    s3_conduit: Any,
    proxy: FaultProxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    prefect: Any,
) -> None:
    """``ResolutoTaskRunner(runtime=<kubernetes>, warm_pool=1)``: the second task takes the
    pool's ready pod, and its task run's log line says so with the pool's key and size; a
    the runner's exit leaves no warm pod."""
    import importlib

    from prefect import flow
    from prefect.context import FlowRunContext
    from support.prefect_readback import task_runs
    from test_task_runner import logs_of

    from prefect_resoluto import ResolutoTaskRunner

    ws = tmp_path / "flow_ws"
    ws.mkdir()
    (ws / "k8s_warm_flow_tasks.py").write_text(
        "from prefect import task\n\n\n@task\ndef square(x: int) -> int:\n    return x * x\n"
    )
    monkeypatch.syspath_prepend(str(ws))
    tasks = importlib.import_module("k8s_warm_flow_tasks")
    store_secret(k8s_cluster, k8s_ns)
    rt = runtime(k8s_cluster, k8s_ns, proxy)

    def wait_ready() -> None:
        pool = FlowRunContext.get().task_runner._pool  # type: ignore[union-attr]
        wait_for(
            lambda: any(c["ready"] for c in pool.counts().values()), timeout=180, what="a ready warm pod"
        )

    @flow(
        task_runner=ResolutoTaskRunner(
            runtime=rt, conduit=s3_conduit, warm_pool=1, workspace=ws, outputs_dir=tmp_path / "out"
        )
    )
    def two() -> list[int]:
        wait_ready()
        a = tasks.square.submit(3).result()
        return [a]

    state = two(return_state=True)
    assert state.is_completed(), state
    assert state.result() == [9]
    (run,) = task_runs(state.state_details.flow_run_id)
    lines = [x.message for x in logs_of(run.id) if x.message.startswith("ran in a ")]
    assert lines and lines[-1].startswith("ran in a warm Kubernetes sandbox "), lines
    assert "a warm pod of key " in lines[-1] and "keeps 1 per key" in lines[-1], lines
    wait_for(
        lambda: (
            [
                p
                for p in core(k8s_cluster).list_namespaced_pod(k8s_ns).items
                if warm.LABEL_POOL in (p.metadata.labels or {})
            ]
            == []
        ),
        timeout=60,
        what="no warm pod left after the runner's exit",
    )
