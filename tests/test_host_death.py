"""A host that dies leaves nothing running for long: the host's heartbeat and the guest's watch.

The per-runtime checks (a host killed with SIGKILL mid-node, its sandbox gone within the
bound) are the runtime contract's ``test_host_death_ends_the_sandbox`` (process,
bubblewrap, gVisor, container) and the Kubernetes and Solari tests in their modules. Here:
the guest's side as a program (``python -m guest_runner``, never in this process: its kill
reaches every process below it) and the host's writer.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from support.counting_conduit import CountingConduit
from support.guest import PY, ROOT, guest_env
from support.polling import wait_for

from guest_runner import hostwatch, wire
from guest_runner.conduit import ConduitUnavailable, LocalConduit
from prefect_resoluto.node import heartbeat
from prefect_resoluto.runtimes import slot

KEY = wire.host_beat_key("h-test")
NODE = "run/r1/nodes/n1"

#: A workload that starts a child, says both pids, then waits for a file (or ten minutes).
WORK = (
    "import os, subprocess, sys, time\n"
    "child = subprocess.Popen(['sleep', '600'])\n"
    "print('pids', os.getpid(), child.pid, flush=True)\n"
    "deadline = time.monotonic() + 600\n"
    "while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:\n"
    "    time.sleep(0.05)\n"
    "child.kill()\n"
)


def _guest(root: Path, release: Path, **extra: str) -> subprocess.Popen[bytes]:
    env = guest_env(root, "r1", "n1", [PY, "-c", WORK, str(release)], **extra)
    return subprocess.Popen([PY, "-m", "guest_runner"], env=env, cwd=str(ROOT), stderr=subprocess.PIPE)


def _pids(root: Path) -> list[int]:
    """The workload's and its child's pids, once its first line reached the conduit."""
    for chunk in sorted((root / NODE).glob("events-*.jsonl")):
        for line in chunk.read_text().splitlines():
            msg = str(json.loads(line).get("data", {}).get("line", ""))
            if msg.startswith("pids "):
                return [int(p) for p in msg.split()[1:]]
    return []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != b"Z"


def _result(root: Path) -> dict[str, object]:
    return json.loads((root / NODE / wire.RESULT).read_text())  # type: ignore[no-any-return]


def test_a_guest_whose_host_stops_beating_kills_its_work_and_exits(tmp_path: Path) -> None:
    root = tmp_path / "conduit"
    LocalConduit(root).put(KEY, b"1 100\n")  # one beat, then the host "dies"
    guest = _guest(root, tmp_path / "never", **{wire.ENV_HOST_BEAT_KEY: KEY, wire.ENV_HOST_LOST_AFTER: "1"})
    try:
        pids = wait_for(lambda: _pids(root), 30, "the workload to start")
        rc = guest.wait(timeout=60)
    finally:
        if guest.poll() is None:
            guest.kill()
    stderr = guest.stderr.read().decode() if guest.stderr else ""
    assert rc != 0, stderr
    assert "host stopped driving this node" in stderr
    result = _result(root)
    assert result["status"] == "failure"
    assert "host stopped driving this node" in str(result["reason"])
    assert (root / NODE / wire.MANIFEST).exists()  # the node's record is complete
    wait_for(lambda: not any(_alive(p) for p in pids), 10, "the workload and its child to be gone")


def test_a_slow_host_within_the_bound_keeps_its_nodes(tmp_path: Path) -> None:
    """Beats late by 40% of the bound (a busy host) for over twice the bound: the node lives."""
    root, release = tmp_path / "conduit", tmp_path / "release"
    conduit = LocalConduit(root)
    conduit.put(KEY, b"0\n")
    stop = threading.Event()

    def slow_host() -> None:
        n = 0
        while not stop.wait(0.8):  # the host's own (late) rhythm, not a synchronisation
            n += 1
            conduit.put(KEY, f"{n}\n".encode())
            if n == 6:  # 4.8 s without a kill, the bound being 2 s: let the workload finish
                release.touch()

    beats = threading.Thread(target=slow_host, daemon=True)
    beats.start()
    guest = _guest(root, release, **{wire.ENV_HOST_BEAT_KEY: KEY, wire.ENV_HOST_LOST_AFTER: "2"})
    try:
        rc = guest.wait(timeout=120)
    finally:
        stop.set()
        if guest.poll() is None:
            guest.kill()
    assert rc == 0, guest.stderr.read().decode() if guest.stderr else ""
    assert _result(root)["status"] == "success"


@pytest.mark.parametrize(
    "extra",
    [
        {},  # a reference host (resoluto-sandbox 0.1.0): no heartbeat at all
        {wire.ENV_HOST_LOST_AFTER: "0.3"},  # a bound but no key: nothing to watch
        {wire.ENV_HOST_BEAT_KEY: KEY},  # a key but no bound
    ],
    ids=["nothing", "no-key", "no-bound"],
)
def test_without_a_heartbeat_to_watch_the_guest_never_gives_up(tmp_path: Path, extra: dict[str, str]) -> None:
    root = tmp_path / "conduit"
    # A workload of five times the bound, with no heartbeat anywhere.
    env = guest_env(root, "r1", "n1", [PY, "-c", "import time; time.sleep(1.5)"], **extra)
    guest = subprocess.run(
        [PY, "-m", "guest_runner"], env=env, cwd=str(ROOT), capture_output=True, timeout=120
    )
    assert guest.returncode == 0, guest.stderr.decode()
    assert _result(root)["status"] == "success"


# ----------------------------------------------------------------------------- the watch


class _Store(LocalConduit):
    """A local conduit that counts reads and may be made unreachable."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.down = False

    def get_stream(self, key: str):  # type: ignore[no-untyped-def]
        if self.down:
            raise ConduitUnavailable("the store is unreachable")
        return super().get_stream(key)


def test_the_watch_reads_a_bounded_prefix_of_the_object(tmp_path: Path) -> None:
    store = _Store(tmp_path)
    store.put(KEY, b"x" * (1 << 20))
    watch = hostwatch.HostWatch(store, KEY, 1.0, lambda idle: None)
    assert watch.read() == b"x" * (wire.MAX_HOST_BEAT_BYTES + 1)


def test_a_beat_that_keeps_changing_is_never_lost(tmp_path: Path) -> None:
    store = _Store(tmp_path)
    lost: list[float] = []
    watch = hostwatch.HostWatch(store, KEY, 0.6, lost.append)
    changer = threading.Event()

    def host() -> None:
        n = 0
        while not changer.wait(0.05):
            n += 1
            store.put(KEY, str(n).encode())

    threading.Thread(target=host, daemon=True).start()
    watch.start()
    try:
        wait_for(lambda: watch.reads >= 24, 30, "four bounds' worth of reads")  # poll = bound / 6
        assert lost == []
    finally:
        changer.set()
        watch.stop()


def test_an_unreachable_store_is_no_news_and_the_bound_holds(tmp_path: Path) -> None:
    store = _Store(tmp_path)
    store.put(KEY, b"1")
    lost: list[float] = []
    watch = hostwatch.HostWatch(store, KEY, 0.5, lost.append)
    store.down = True
    watch.start()
    wait_for(lambda: lost, 30, "the watch to give its host up")
    assert lost[0] >= 0.5


def test_settings_come_from_the_environment_only_when_both_are_set() -> None:
    assert hostwatch.settings({}) is None
    assert hostwatch.settings({wire.ENV_HOST_BEAT_KEY: KEY}) is None
    assert hostwatch.settings({wire.ENV_HOST_BEAT_KEY: KEY, wire.ENV_HOST_LOST_AFTER: "0"}) is None
    assert hostwatch.settings({wire.ENV_HOST_BEAT_KEY: KEY, wire.ENV_HOST_LOST_AFTER: "x"}) is None
    assert hostwatch.settings({wire.ENV_HOST_BEAT_KEY: KEY, wire.ENV_HOST_LOST_AFTER: "60"}) == (KEY, 60.0)


# ----------------------------------------------------------------------------- the host's writer


def test_one_writer_per_process_beats_until_its_last_lease_is_released(tmp_path: Path) -> None:
    conduit = LocalConduit(tmp_path / "conduit")
    first = heartbeat.lease(conduit, 0.05, 0.3)
    second = heartbeat.lease(conduit, 0.05, 0.3)
    assert first.writer is second.writer and first.env == second.env
    key = first.writer.key
    assert key.startswith(wire.HOSTS + "/") and not key.startswith("run/")  # no node's, no run's
    assert first.env[wire.ENV_HOST_BEAT_KEY] == key and first.env[wire.ENV_HOST_LOST_AFTER] == "0.3"
    assert first.local_dir == conduit.local_root / wire.host_beat_dir(first.writer.writer_id)  # type: ignore[operator]
    seen = {conduit.get(key)}  # written before the lease was returned
    wait_for(lambda: seen.add(conduit.get(key)) or len(seen) >= 3, 30, "the beat to change")
    first.release()
    first.release()  # idempotent: one lease, one release
    beats = first.writer.beats
    wait_for(lambda: first.writer.beats > beats + 2, 30, "beats while a lease is held")
    second.release()
    wait_for(lambda: not (conduit.local_root / key).exists(), 30, "the beat to be deleted")  # type: ignore[operator]


def test_a_lease_taken_or_released_writes_no_beat_of_its_own(tmp_path: Path) -> None:
    """Nodes starting and ending (one lease each) cost no store write: beats follow the clock."""
    conduit = CountingConduit(tmp_path / "conduit")
    held = heartbeat.lease(conduit, 3600, 3 * 3600)
    writer = held.writer

    def writer_waiting() -> bool:  # back in its wait: it has looked at what the lease changed
        return len(writer._cond._waiters) == 1  # type: ignore[attr-defined]

    try:
        wait_for(writer_waiting, 30, "the writer to wait for its next beat")
        assert conduit.puts == 1  # the first beat, written before the lease was returned
        for _ in range(20):
            lease = heartbeat.lease(conduit, 3600, 3 * 3600)
            wait_for(writer_waiting, 30, "the writer to look at the new lease")
            lease.release()
            wait_for(writer_waiting, 30, "the writer to look at the release")
        assert conduit.puts == 1 and writer.beats == 1
    finally:
        held.release()
        writer.close()


def test_a_bound_of_fewer_than_three_beats_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 3x"):
        heartbeat.check(5.0, 10.0)
    heartbeat.check(5.0, 15.0)
    heartbeat.check(5.0, 0)  # no heartbeat at all


def test_the_writer_id_is_a_valid_key_segment() -> None:
    wid = heartbeat._writer_id()
    assert wire.check_id(wid, "writer") == wid and str(os.getpid()) in wid


# ----------------------------------------------------------------------------- Kubernetes

#: A host driving one node in a pod of the genuine apiserver's cluster (its node agent runs
#: pods in gVisor), through the moto S3 store; argv: namespace, conduit URL, node id, bound.
#: The cluster's address and token arrive in its environment.
K8S_HOST = """
import os, sys
from kubernetes.client import ApiClient, Configuration
from guest_runner.conduit.registry import conduit_from_url
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes.kubernetes import KubernetesRuntime

ns, url, node, bound = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
cfg = Configuration(host=os.environ["K8S_SERVER"])
cfg.ssl_ca_cert = os.environ["K8S_CA"]
cfg.api_key["BearerToken"] = os.environ["K8S_TOKEN"]
cfg.api_key_prefix["BearerToken"] = "Bearer"
rt = KubernetesRuntime(
    namespace=ns, image="python:3.12-slim", runtime_class="gvisor", guest_source="bundle",
    store_credentials_secret="resoluto-store", api_client=ApiClient(cfg), delete_grace_s=2,
)
work = "import time; print('working', flush=True); time.sleep(600)"
spec = NodeSpec(
    run_id="run-death", node_id=node, argv=["python3", "-c", work],
    host_lost_after=bound, host_heartbeat_interval=bound / 4,
)
def event(ev):
    if "working" in str(ev.get("data")):
        print("WORKING", flush=True)
drive_node(
    spec, conduit_from_url(url), rt, min_isolation="user-kernel", on_event=event, silence_window=120,
    on_launch=lambda h: print("LAUNCHED", h.data["name"], flush=True),
)
"""


def _pod_phase(cluster: Any, ns: str, name: str) -> str:
    from kubernetes.client import CoreV1Api
    from kubernetes.client.exceptions import ApiException

    try:
        return str(CoreV1Api(cluster.api_client()).read_namespaced_pod(name, ns).status.phase)
    except ApiException as e:
        if e.status == 404:
            return "Deleted"
        raise


@pytest.mark.k8s
@pytest.mark.sandbox
def test_a_pod_whose_host_was_killed_ends_within_the_bound(
    k8s_cluster: Any, k8s_ns: str, k8s_agent: Any, s3_conduit: Any
) -> None:
    """SIGKILL of the host while its pod works: the pod's guest sees the heartbeat stop and
    ends, and the pod with it (nobody deletes it: the host is dead)."""
    from kubernetes.client import CoreV1Api

    CoreV1Api(k8s_cluster.api_client()).create_namespaced_secret(
        k8s_ns,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "resoluto-store"},
            "stringData": {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")},
        },
    )
    bound = 3.0
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "K8S_SERVER": k8s_cluster.server,
        "K8S_CA": k8s_cluster.ca,
        "K8S_TOKEN": k8s_cluster.token,
    }
    host = subprocess.Popen(
        [PY, "-c", K8S_HOST, k8s_ns, s3_conduit.url, "n-death", str(bound)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(host.stdout.readline, "")), daemon=True).start()  # type: ignore[union-attr]
    try:
        wait_for(lambda: "WORKING\n" in lines or host.poll() is not None, 180, "the pod's workload to run")
        assert host.poll() is None, "".join(lines)
        pod = next(ln.split()[1] for ln in lines if ln.startswith("LAUNCHED "))
        assert _pod_phase(k8s_cluster, k8s_ns, pod) == "Running"
        host.kill()
        host.wait(30)
        wait_for(
            lambda: _pod_phase(k8s_cluster, k8s_ns, pod) in ("Succeeded", "Failed"),
            15 * bound + 60,
            "the pod to end after its host died",
        )
    finally:
        if host.poll() is None:
            host.kill()
            host.wait(30)
    result = json.loads(s3_conduit.get(wire.result_key(wire.node_prefix("run-death", "n-death"))))
    assert "host stopped driving this node" in result["reason"]


# ----------------------------------------------------------------------------- Solari

#: A host driving one node in a Solari VM of the loopback gateway; argv: gateway URL, key,
#: conduit dir, the session timeout (the VM's bound: the gateway enforces it).
SOLARI_HOST = """
import sys
from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes import get_runtime

url, key, conduit, bound = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
rt = get_runtime("solari", base_url=url, api_key=key, template="base", session_timeout_s=bound)
work = "import time; print('working', flush=True); time.sleep(600)"
spec = NodeSpec(run_id="run-death", node_id="n-death", argv=[sys.executable, "-c", work])
def event(ev):
    if "working" in str(ev.get("data")):
        print("WORKING", flush=True)
drive_node(spec, LocalConduit(conduit), rt, min_isolation="vm", on_event=event, silence_window=120)
"""


@pytest.mark.slow
def test_a_solari_vm_whose_host_was_killed_ends_with_its_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The VM's bound is its session's timeout: only the host's keep-alive renews it, and the
    gateway destroys the VM when it lapses (the relayed VM sees no store to read a heartbeat in)."""
    from support.solari_gateway import SolariGateway

    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    gateway = SolariGateway(tmp_path / "gateway", executor="process").start()
    bound = 3.0
    host = subprocess.Popen(
        [PY, "-c", SOLARI_HOST, gateway.base_url, gateway.api_key, str(tmp_path / "conduit"), str(bound)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(host.stdout.readline, "")), daemon=True).start()  # type: ignore[union-attr]
    try:
        wait_for(lambda: "WORKING\n" in lines or host.poll() is not None, 120, "the VM's workload to run")
        assert host.poll() is None, "".join(lines)
        assert len(gateway.live()) == 1
        host.kill()
        host.wait(30)
        wait_for(lambda: not gateway.live(), 15 * bound + 30, "the VM to end after its host died")
        # The killed host left its node's conduit slot mounted; the next host's sweep settles
        # it (a host without the right to mount made a plain directory, nothing to settle).
        node = tmp_path / "conduit" / "run" / "run-death" / "nodes" / "n-death"
        mounts = os.geteuid() == 0
        assert slot.mounted(node) == mounts
        assert slot.sweep_orphans() == int(mounts)
        assert not slot.mounted(node) and node.is_dir()
    finally:
        if host.poll() is None:
            host.kill()
            host.wait(30)
        slot.sweep_orphans()
        gateway.stop()


def test_a_process_that_ends_deletes_its_beat_at_once(tmp_path: Path) -> None:
    conduit = LocalConduit(tmp_path / "conduit")
    lease = heartbeat.lease(conduit, 0.05, 600)
    path = conduit.local_root / lease.writer.key  # type: ignore[operator]
    assert path.exists()
    heartbeat._close_all()  # what atexit runs
    assert not path.exists()
    lease.release()


# ----------------------------------------------------------------------------- warm sandboxes

#: A host with a warm pool of two: one sandbox assigned a node that sleeps, the other idle;
#: argv: runtime, conduit dir, bound.
WARM_HOST = """
import sys
from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes import get_runtime
from prefect_resoluto.warm.pool import WarmPool, key_for

name, root, bound = sys.argv[1], sys.argv[2], float(sys.argv[3])
rt, conduit = get_runtime(name), LocalConduit(root)
work = "import time; print('working', flush=True); time.sleep(600)"
spec = NodeSpec(
    run_id="run-warm-death", node_id="n1", argv=["python3", "-c", work],
    host_lost_after=bound, host_heartbeat_interval=bound / 4,
)
key = key_for(spec)
pool = WarmPool(rt, conduit, size=2)
assert pool.enabled, pool.why_not
pool.want(key, idle=2)
while pool.ready_count(key) < 2:
    pool._lock.acquire(); pool._lock.wait(0.05); pool._lock.release()
warm, _ = pool.take(key)
assert warm is not None
print("IDS", *pool.idle_ids(), warm.handle.id, flush=True)
def event(ev):
    if "working" in str(ev.get("data")):
        print("WORKING", flush=True)
drive_node(spec, conduit, rt, min_isolation="none", on_event=event, warm=warm)
"""


@pytest.mark.sandbox
@pytest.mark.parametrize("runtime", ["gvisor", "bubblewrap", pytest.param("process", marks=())])
def test_warm_sandboxes_of_a_killed_host_end_idle_or_assigned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runtime: str
) -> None:
    """An assigned warm sandbox reads the heartbeat through the directory bound at its boot
    (outside its slot); an idle one ends when its stdin, a pipe only the host held, closes."""
    from support.runtime_contract import _group_alive

    from prefect_resoluto.runtimes import get_runtime

    monkeypatch.setenv("RESOLUTO_STATE_DIR", str(tmp_path / "state"))
    rt = get_runtime(runtime)
    if not rt.availability().ok:
        pytest.skip(f"{runtime} is not available here: {rt.availability().why}")
    bound = 2.0
    host = subprocess.Popen(
        [PY, "-c", WARM_HOST, runtime, str(tmp_path / "conduit"), str(bound)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(host.stdout.readline, "")), daemon=True).start()  # type: ignore[union-attr]
    from prefect_resoluto.host.state import SandboxRecord, sandbox_dir

    def running() -> list[str]:
        listed = (
            {c["id"] for c in rt.containers() if c.get("status") == "running"}
            if runtime == "gvisor"
            else set()
        )
        out = []
        for sid in rt.list_ids():  # type: ignore[attr-defined]
            rec = SandboxRecord.load(sandbox_dir(rt.state, sid))  # type: ignore[attr-defined]
            if sid in listed or (rec is not None and rec.pid is not None and _group_alive(rec.pid)):
                out.append(sid)
        return out

    try:
        wait_for(lambda: "WORKING\n" in lines or host.poll() is not None, 180, "the warm node's workload")
        assert host.poll() is None, "".join(lines)
        ids = next(ln.split()[1:] for ln in lines if ln.startswith("IDS "))
        assert len(ids) >= 2 and set(ids) <= set(running()), (ids, running())
        host.kill()
        host.wait(30)
        wait_for(lambda: not running(), 15 * bound + 30, "every warm sandbox to end after its host died")
    finally:
        if host.poll() is None:
            host.kill()
            host.wait(30)
        rt.sweep({})
    if runtime != "bubblewrap":  # bwrap's --die-with-parent ends it before its guest can say why
        result = tmp_path / "conduit" / wire.node_prefix("run-warm-death", "n1") / wire.RESULT
        assert "host stopped driving this node" in json.loads(result.read_text())["reason"]
