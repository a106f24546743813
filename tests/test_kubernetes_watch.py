"""The Kubernetes runtime's pod watch against the genuine kube-apiserver (issue 32).

One LIST and one WATCH per runtime instead of a GET per pod per status check; faults are
done to the watch stream itself by the loopback proxy (tests/support/k8s_fault_proxy.py):
a 410 ERROR event mid-stream, a connection reset mid-stream, a line that is no event, a
storm of 429s with Retry-After; and pods are deleted behind the runner's back. Every node
must end with the right state and no pod may be left.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from support.k8s_cluster import CONTEXT, Cluster
from support.k8s_fault_proxy import FaultProxy
from support.k8s_node_agent import NodeAgent
from support.polling import wait_for
from test_kubernetes_cluster import (
    IMAGE,
    STORE_SECRET,
    core,
    make_runtime,
    make_spec,
    names,
    py,
    store_secret,
)

from prefect_resoluto.runtimes.kubernetes import KubernetesRuntime
from prefect_resoluto.runtimes.kubernetes.watch import WATCH_LABEL

pytestmark = pytest.mark.k8s

ROOT = Path(__file__).resolve().parents[1]
FLOWS = ROOT / "tests" / "flows"
SLEEPER = "import time; print('up', flush=True); time.sleep({s})"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    for var in ("RESOLUTO_SANDBOX_NAMESPACE", "RESOLUTO_SANDBOX_IMAGE", "RESOLUTO_SANDBOX_KUBECONTEXT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))


@pytest.fixture
def proxy(k8s_cluster: Cluster) -> Any:
    with FaultProxy(k8s_cluster.server, k8s_cluster.ca) as p:
        yield p


@pytest.fixture
def rt(k8s_cluster: Cluster, k8s_ns: str, proxy: FaultProxy) -> Any:
    runtime = make_runtime(k8s_cluster, k8s_ns, via=proxy)
    yield runtime
    runtime.close()


def status_until(rt: KubernetesRuntime, h: Any, cond: Any, what: str, timeout: float = 120) -> Any:
    return wait_for(lambda: s if cond(s := rt.status(h)) else None, timeout=timeout, what=what)


def terminal(rt: KubernetesRuntime, h: Any) -> Any:
    return status_until(rt, h, lambda s: s.terminal, "the pod to finish")


def running(rt: KubernetesRuntime, h: Any) -> None:
    status_until(rt, h, lambda s: s.phase == "running", "the pod to run")


def no_pods_left(cluster: Cluster, ns: str) -> None:
    wait_for(lambda: names(cluster, ns, "pods") == [], timeout=60, what="every pod gone")


def finish(rt: KubernetesRuntime, handles: list[Any], cluster: Cluster, ns: str) -> None:
    for h in handles:
        rt.destroy(h)
    no_pods_left(cluster, ns)
    w = rt.pod_watch()  # the last node's end stops the watch: its thread winds down by itself
    wait_for(lambda: not w.running, timeout=30, what="the pod watch's thread to end")


def watch_open(proxy: FaultProxy) -> None:
    wait_for(lambda: proxy.open_watches >= 1, timeout=30, what="the pod watch to be streaming")


@pytest.mark.sandbox
def test_one_watch_serves_every_pod_without_a_get(
    k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent, proxy: FaultProxy, rt: KubernetesRuntime
) -> None:
    handles = [rt.launch(make_spec(command=py(f"print({i})"))) for i in range(3)]
    for h in handles:
        st = terminal(rt, h)
        assert (st.phase, st.exit_code) == ("succeeded", 0)
    pod = core(k8s_cluster).read_namespaced_pod(handles[0].data["name"], k8s_ns)
    assert pod.metadata.labels[WATCH_LABEL] == rt.pod_watch().id
    assert proxy.calls("get", "pods") == []  # every status came from the watch
    assert proxy.calls("list", "pods") == [200]
    assert proxy.calls("watch", "pods") == [200]
    finish(rt, handles, k8s_cluster, k8s_ns)


@pytest.mark.sandbox
def test_a_pod_tracked_while_the_watch_stops_is_watched(
    k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent, proxy: FaultProxy, rt: KubernetesRuntime
) -> None:
    """A pod tracked just as the watch was told to stop (the last node released, the next one
    launched) gets a watch of its own: the stopping thread ends without looking for it."""
    h = rt.launch(make_spec(command=py(SLEEPER.format(s=4))))
    running(rt, h)
    watch_open(proxy)
    w = rt.pod_watch()
    w.close()
    w.track(h.data["name"])
    assert w.running
    st = terminal(rt, h)
    assert (st.phase, st.exit_code) == ("succeeded", 0)
    assert proxy.calls("get", "pods") == []  # from the new watch, not the GET fallback
    assert proxy.calls("watch", "pods") == [200, 200]
    finish(rt, [h], k8s_cluster, k8s_ns)


@pytest.mark.sandbox
def test_a_watch_that_expires_mid_run_lists_again(
    k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent, proxy: FaultProxy, rt: KubernetesRuntime
) -> None:
    h = rt.launch(make_spec(command=py(SLEEPER.format(s=4))))
    running(rt, h)
    watch_open(proxy)
    proxy.expire_watch()
    w = rt.pod_watch()
    wait_for(lambda: w.stats.expired == 1, timeout=30, what="the 410 to be read")
    st = terminal(rt, h)
    assert (st.phase, st.exit_code) == ("succeeded", 0)
    assert proxy.calls("list", "pods") == [200, 200]  # the resync after the 410
    assert proxy.calls("get", "pods") == []
    finish(rt, [h], k8s_cluster, k8s_ns)


@pytest.mark.sandbox
def test_a_dropped_watch_resumes_from_its_resource_version(
    k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent, proxy: FaultProxy, rt: KubernetesRuntime
) -> None:
    h = rt.launch(make_spec(command=py(SLEEPER.format(s=4))))
    running(rt, h)
    watch_open(proxy)
    proxy.cut_watch()
    w = rt.pod_watch()
    wait_for(lambda: w.stats.dropped >= 1, timeout=30, what="the reset to be seen")
    st = terminal(rt, h)
    assert (st.phase, st.exit_code) == ("succeeded", 0)
    assert proxy.calls("list", "pods") == [200]  # resumed, not listed again
    assert len(proxy.calls("watch", "pods")) >= 2
    assert proxy.calls("get", "pods") == []
    finish(rt, [h], k8s_cluster, k8s_ns)


@pytest.mark.sandbox
def test_a_bad_event_is_skipped_and_the_watch_goes_on(
    k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent, proxy: FaultProxy, rt: KubernetesRuntime
) -> None:
    h = rt.launch(make_spec(command=py(SLEEPER.format(s=3))))
    running(rt, h)
    watch_open(proxy)
    proxy.garble_watch()
    proxy.garble_watch(b'{"type": "SURPRISE", "object": {"metadata": {}}}\n')
    proxy.garble_watch(b'{"type": "MODIFIED", "object": {"metadata": {"name": 7}, "spec": 1}}\n')
    w = rt.pod_watch()
    wait_for(lambda: w.stats.bad_events == 3, timeout=30, what="the bad events to be read")
    st = terminal(rt, h)
    assert (st.phase, st.exit_code) == ("succeeded", 0)
    assert proxy.calls("watch", "pods") == [200]  # the same stream all along
    assert proxy.calls("get", "pods") == []
    finish(rt, [h], k8s_cluster, k8s_ns)


@pytest.mark.sandbox
def test_a_429_storm_pauses_every_caller_and_every_node_still_ends(
    k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent, proxy: FaultProxy, rt: KubernetesRuntime
) -> None:
    proxy.fail("watch", "pods", 429, times=6, retry_after=1)
    proxy.fail("create", "pods", 429, times=3, retry_after=1)
    proxy.fail("list", "pods", 429, times=2, retry_after=1)
    handles: list[Any] = []
    errors: list[BaseException] = []

    def launch(i: int) -> None:
        try:
            handles.append(rt.launch(make_spec(command=py(f"print({i})"))))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=launch, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    # A node still running keeps the watch wanted through the whole storm (the others may end
    # on GETs while it is refused, and the last release would stop it).
    keeper = rt.launch(make_spec(command=py(SLEEPER.format(s=600))))
    for h in handles:
        assert terminal(rt, h).phase == "succeeded"
    limiter = rt._api.limiter
    assert limiter.pauses >= 1 and limiter.waited_s >= 1.0  # Retry-After held every caller back
    assert proxy.calls("create", "pods").count(429) == 3
    watch_open(proxy)  # it sat out every refusal and came back
    assert proxy.calls("watch", "pods").count(429) == 6
    finish(rt, [*handles, keeper], k8s_cluster, k8s_ns)


@pytest.mark.sandbox
def test_pods_deleted_behind_the_runners_back_end_their_nodes(
    k8s_cluster: Cluster, k8s_ns: str, k8s_agent: NodeAgent, proxy: FaultProxy, rt: KubernetesRuntime
) -> None:
    handles = [rt.launch(make_spec(command=py(SLEEPER.format(s=600)))) for _ in range(3)]
    for h in handles:
        running(rt, h)
    c = core(k8s_cluster)
    c.delete_namespaced_pod(handles[0].data["name"], k8s_ns, grace_period_seconds=0)  # forced
    c.delete_namespaced_pod(handles[1].data["name"], k8s_ns, grace_period_seconds=2)  # kubectl delete
    # The third goes while the watch is broken off: the resync must notice.
    watch_open(proxy)
    proxy.fail("watch", "pods", 503, times=3)
    proxy.expire_watch()
    c.delete_namespaced_pod(handles[2].data["name"], k8s_ns, grace_period_seconds=0)
    for h in handles:
        st = status_until(rt, h, lambda s: s.gone, "the pod to be seen gone")
        assert st.infrastructure and "deleted from outside" in st.reason, st
    assert proxy.calls("get", "pods") == []
    no_pods_left(k8s_cluster, k8s_ns)
    finish(rt, handles, k8s_cluster, k8s_ns)


def test_a_pod_the_watch_has_not_shown_is_pending_not_gone(
    k8s_cluster: Cluster, k8s_ns: str, proxy: FaultProxy
) -> None:
    """No node: the pod stays Pending. With the watch refused, a fresh pod is never
    reported gone; once overdue it is looked up by one GET, then the watch answers."""
    rt = make_runtime(k8s_cluster, k8s_ns, via=proxy, node_selector={"resoluto.io/none": "x"})
    clock = [0.0]
    rt._clock = lambda: clock[0]
    proxy.fail("list", "pods", 503, times=1000)
    h = rt.launch(make_spec())
    st = rt.status(h)
    assert (st.phase, st.gone) == ("pending", False) and "not yet in the pod watch" in st.reason
    assert proxy.calls("get", "pods") == []
    clock[0] += 11
    st = rt.status(h)
    assert (st.phase, st.gone) == ("pending", False) and st.reason != "created; not yet in the pod watch"
    assert proxy.calls("get", "pods") == [200]  # one GET for the overdue pod
    rt.status(h)
    assert proxy.calls("get", "pods") == [200]  # and not one per check
    rt.destroy(h)
    no_pods_left(k8s_cluster, k8s_ns)
    rt.close()


@pytest.mark.prefect
@pytest.mark.sandbox
def test_a_cancelled_flow_run_deletes_its_pods(
    k8s_cluster: Cluster,
    k8s_ns: str,
    k8s_agent: NodeAgent,
    moto_server: Any,
    s3_bucket: str,
    tmp_path: Path,
    prefect: Any,
) -> None:
    """A deployment's run (served, as a user serves one) whose tasks run in pods is cancelled
    from the API: Prefect's runner stops the flow's process, the task runner deletes the
    pods on its way out, and none is left running."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling
    from support.prefect_cli import cli_env

    store_secret(k8s_cluster, k8s_ns)
    options = {
        "namespace": k8s_ns,
        "context": CONTEXT,
        "runtime_class": "gvisor",
        "image": IMAGE,
        "store_credentials_secret": STORE_SECRET,
    }
    log = tmp_path / "served.log"
    with open(log, "wb") as out:
        served = subprocess.Popen(
            [sys.executable, str(FLOWS / "k8s_cancel_flow.py")],
            env=cli_env(
                KUBECONFIG=k8s_cluster.kubeconfig,
                RESOLUTO_TEST_K8S_OPTIONS=json.dumps(options),
                RESOLUTO_TEST_CONDUIT=f"s3://{s3_bucket}/cancel?endpoint_url={moto_server.endpoint_url}",
                PYTHONPATH=str(ROOT),
            ),
            cwd=str(tmp_path),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        with get_client(sync_client=True) as c:

            def deployment() -> Any:
                assert served.poll() is None, log.read_text(errors="replace")[-4000:]
                try:
                    return c.read_deployment_by_name("k8s-cancellable/cancel-me")
                except Exception:
                    return None

            wait_for(deployment, timeout=180, what="the served deployment", max_delay=0.5)
            run = run_deployment("k8s-cancellable/cancel-me", parameters={"count": 2}, timeout=0)

            def both_running() -> bool:
                assert served.poll() is None, log.read_text(errors="replace")[-4000:]
                pods = core(k8s_cluster).list_namespaced_pod(k8s_ns).items
                return sum(1 for p in pods if p.status.phase == "Running") == 2

            wait_for(both_running, timeout=240, what="the run's two pods running", max_delay=0.5)
            c.set_flow_run_state(run.id, Cancelling(), force=True)

            def ended() -> Any:
                fr = c.read_flow_run(run.id)
                return (
                    fr
                    if fr.state.type in (StateType.CANCELLED, StateType.CRASHED, StateType.FAILED)
                    else None
                )

            fr = wait_for(ended, timeout=120, what="the run to be cancelled", max_delay=0.5)
        assert fr.state.type == StateType.CANCELLED, fr.state
        no_pods_left(k8s_cluster, k8s_ns)
        wait_for(
            lambda: not any(r.startswith(f"{k8s_ns}/") for r in k8s_agent.running()),
            timeout=60,
            what="the sandboxes stopped on the node",
        )
        assert names(k8s_cluster, k8s_ns, "networkpolicies") == []
    finally:
        served.terminate()
        try:
            served.wait(timeout=30)
        except subprocess.TimeoutExpired:
            served.kill()


def test_a_watch_that_times_out_is_resumed_without_a_new_list(
    k8s_cluster: Cluster, k8s_ns: str, proxy: FaultProxy
) -> None:
    """The server ends each watch after ``watch_timeout_s``: the runtime resumes from the last
    resourceVersion it saw (an event's or a bookmark's), never listing again."""
    rt = make_runtime(
        k8s_cluster, k8s_ns, via=proxy, watch_timeout_s=2, node_selector={"resoluto.io/none": "x"}
    )
    h = rt.launch(make_spec())
    w = rt.pod_watch()
    # This server sends no bookmark before so short a timeout: one is put into the stream.
    bookmark = {"type": "BOOKMARK", "object": {"kind": "Pod", "apiVersion": "v1"}}
    bookmark["object"]["metadata"] = {"resourceVersion": h.data["created_rv"]}
    proxy.garble_watch(json.dumps(bookmark).encode() + b"\n")
    wait_for(lambda: w.stats.bookmarks == 1, timeout=30, what="the bookmark to be read")
    wait_for(lambda: w.stats.watches >= 3, timeout=60, what="two watches ended by the server and resumed")
    assert rt.status(h).phase == "pending"
    assert proxy.calls("list", "pods") == [200] and proxy.calls("get", "pods") == []
    assert w.stats.dropped == 0 and w.stats.expired == 0 and w.stats.bad_events == 0
    rt.destroy(h)
    no_pods_left(k8s_cluster, k8s_ns)
    # The last release tells the thread to stop; it ends once its stream is shut.
    wait_for(lambda: not w.running, timeout=30, what="the watch to stop with no pod left to watch")
