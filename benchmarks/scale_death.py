"""Part ``scale_death`` of the ``scale`` figure: a host killed with SIGKILL mid-flow, seconds
until its last sandbox is gone, per runtime.

For each local runtime (process, bubblewrap, gVisor, container) a host process drives N
nodes at once (quick: 2, full: 5), each a workload that sleeps ten minutes; once every
node's workload runs, the host gets SIGKILL and the sandboxes are watched from outside
(each sandbox's process group on this host, ``runsc list``, ``podman ps``) until the last is
gone. Side by side, on the same run, a second host per runtime with the heartbeat off
(``host_lost_after=0``: what every runtime did before) is killed at the same moment: its
sandboxes are still running at the end, and only a sweep clears them. Kubernetes (the
genuine apiserver the tests build, its node agent running pods in gVisor, moto S3): the
same with N pods, until every pod is Succeeded or Failed. Solari (the loopback gateway
stand-in): the VM's bound is its session timeout, which the gateway enforces.

Full: the default bound (``host_lost_after`` 60 s, heartbeat every 5 s; Solari's session
timeout set to the same 60 s, its default being 300 s); quick: 6 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common import ROOT, Target, log, scratch

from prefect_resoluto.node import heartbeat

LOCAL = ("process", "bubblewrap", "gvisor", "container")
REMOTE = ("kubernetes", "solari")

#: A host driving ``n`` nodes at once; argv: runtime setup (JSON), conduit URL, n, bound, tag.
HOST = """
import json, sys, threading
from guest_runner.conduit.registry import conduit_from_url
from prefect_resoluto.node import heartbeat
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes import get_runtime

setup, url, n, bound, tag = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
kw = setup.get("options", {})
if setup.get("k8s"):
    from kubernetes.client import ApiClient, Configuration
    cfg = Configuration(host=setup["k8s"]["server"])
    cfg.ssl_ca_cert = setup["k8s"]["ca"]
    cfg.api_key["BearerToken"] = setup["k8s"]["token"]
    cfg.api_key_prefix["BearerToken"] = "Bearer"
    kw["api_client"] = ApiClient(cfg)
rt = get_runtime(setup["runtime"], **kw)
conduit = conduit_from_url(url)
lock = threading.Lock()
def say(*words):
    with lock:
        print(*words, flush=True)
def one(i):
    work = "import time; print('working', flush=True); time.sleep(600)"
    spec = NodeSpec(
        run_id="run-" + tag, node_id=f"n{i}", argv=[setup.get("python", "python3"), "-c", work],
        labels={"death": tag}, host_lost_after=bound,
        host_heartbeat_interval=min(heartbeat.DEFAULT_INTERVAL, bound / 4) if bound else heartbeat.DEFAULT_INTERVAL,
    )
    def event(ev):
        if "working" in str(ev.get("data")):
            say("WORKING", i)
    drive_node(spec, conduit, rt, min_isolation="none", on_event=event, silence_window=900,
               on_launch=lambda h: say("LAUNCHED", i, h.data.get("name") or h.id))
threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


class Host:
    """One host process driving ``n`` nodes; its lines read on a thread."""

    def __init__(self, setup: dict[str, Any], url: str, n: int, bound: float, env: dict[str, str]) -> None:
        self.n, self.tag = n, uuid.uuid4().hex[:8]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOST, json.dumps(setup), url, str(n), str(bound), self.tag],
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def working(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError("the host exited early:\n" + "".join(self.lines[-30:]))
        return sum(ln.startswith("WORKING ") for ln in self.lines) >= self.n

    def sandboxes(self) -> list[str]:
        return [ln.split()[2] for ln in self.lines if ln.startswith("LAUNCHED ")]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(
                self.proc.pid, signal.SIGKILL
            )  # the host and nothing else: sandboxes have their own sessions
        self.proc.wait(30)


def _wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def _groups() -> set[int]:
    """The process groups with a live (not zombie) process on this host."""
    out: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        if fields[0] != b"Z":
            out.add(int(fields[2]))
    return out


def _local_running(rt: Any) -> Callable[[list[str]], set[str]]:
    """Which of these sandboxes still run, seen from this process (not their launcher)."""
    from prefect_resoluto.host.state import SandboxRecord, sandbox_dir

    def running(ids: list[str]) -> set[str]:
        groups = _groups()
        alive = set()
        for sid in ids:
            rec = SandboxRecord.load(sandbox_dir(rt.state, sid))
            if rec is not None and rec.pid is not None and rec.pid in groups:
                alive.add(sid)
        if rt.name == "gvisor":
            alive |= {c["id"] for c in rt.containers() if c.get("status") == "running"} & set(ids)
        if rt.name == "container":
            ps = rt._run_engine("ps", "--format", "{{.Names}}", timeout=60)
            alive |= set(ps.stdout.split()) & set(ids)
        return alive

    return running


def _measure(
    hosts: dict[str, tuple[Host, Host]],
    running: dict[str, Callable[[list[str]], set[str]]],
    bound: float,
    start_timeout: float,
) -> dict[str, dict[str, Any]]:
    """Wait until every host's nodes work, kill them all at once, and time each runtime's
    last sandbox with the heartbeat; then what is left of those without it."""
    for name, (with_beat, without) in hosts.items():
        _wait(
            lambda a=with_beat, b=without: a.working() and b.working(),  # type: ignore[misc]
            start_timeout,
            f"{name}'s nodes to work",
        )
    for with_beat, without in hosts.values():
        with_beat.kill()
        without.kill()
    killed = time.monotonic()
    gone: dict[str, float] = {}
    limit = bound * 3 + 60
    while len(gone) < len(hosts) and time.monotonic() - killed < limit:
        for name, (with_beat, _) in hosts.items():
            if name not in gone and not running[name](with_beat.sandboxes()):
                gone[name] = round(time.monotonic() - killed, 1)
        time.sleep(0.1)
    # Those without a heartbeat: looked at once twice the bound has passed.
    while time.monotonic() - killed < 2 * bound:
        time.sleep(0.2)
    waited = round(time.monotonic() - killed, 1)
    out: dict[str, dict[str, Any]] = {}
    for name, (with_beat, without) in hosts.items():
        out[name] = {
            "n": with_beat.n,
            "gone_s": gone.get(name),
            "without_left": len(running[name](without.sandboxes())),
            "without_n": without.n,
            "watched_s": waited,
        }
    return out


def _local(quick: bool, bound: float, n: int) -> dict[str, Any]:
    from prefect_resoluto.runtimes import get_runtime

    out: dict[str, Any] = {}
    with scratch("death") as d:
        env = {"RESOLUTO_STATE_DIR": str(d / "state")}
        os.environ.update(env)  # this process reads the same records
        runtimes = {}
        for name in LOCAL:
            rt = get_runtime(name)
            avail = rt.availability()
            if avail.ok:
                runtimes[name] = rt
            else:
                out[name] = {"unavailable": avail.why}
        url = (d / "conduit").as_uri()
        hosts = {
            name: (
                Host({"runtime": name}, url, n, bound, env),
                Host({"runtime": name}, url, n, 0.0, env),
            )
            for name in runtimes
        }
        try:
            out.update(_measure(hosts, {k: _local_running(rt) for k, rt in runtimes.items()}, bound, 300))
        finally:
            for name, rt in runtimes.items():
                for h in hosts[name]:
                    h.kill()
                    rt.sweep({"death": h.tag})
    return out


def _solari(bound: float, n: int) -> dict[str, Any]:
    from support.solari_gateway import SolariGateway

    from prefect_resoluto.runtimes.solari.request import SANDBOX_ID_KEY

    with scratch("death-solari") as d:
        os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
        gw = SolariGateway(d / "gateway", executor="process").start()
        try:
            url = (d / "conduit").as_uri()
            setup = {
                "runtime": "solari",
                "python": sys.executable,
                "options": {
                    "base_url": gw.base_url,
                    "api_key": gw.api_key,
                    "template": "base",
                    "session_timeout_s": bound,
                },
            }
            old = {
                "runtime": "solari",
                "python": sys.executable,
                "options": {**setup["options"], "session_timeout_s": 3600},
            }  # type: ignore[dict-item]
            hosts = {"solari": (Host(setup, url, n, 0.0, {}), Host(old, url, n, 0.0, {}))}

            def running(ids: list[str]) -> set[str]:
                return set(ids) & {s.metadata.get(SANDBOX_ID_KEY, "") for s in gw.live()}

            res = _measure(hosts, {"solari": running}, bound, 300)
            res["solari"]["session_timeout_s"] = bound
            return res
        finally:
            gw.stop()


@contextmanager
def _cluster(d: Path) -> Iterator[tuple[Any, Any]]:
    """The genuine control plane, its node agent and moto S3, as the tests' fixtures make them."""
    import logging

    from support import k8s_cluster
    from support.k8s_node_agent import NodeAgent
    from support.s3_fixtures import serve_s3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log per request

    script = k8s_cluster.SCRIPT
    if subprocess.run(["bash", str(script), "status"], capture_output=True).returncode != 0:
        raise RuntimeError("no Kubernetes build here (scripts/k8s-local-cluster.sh build)")
    try:
        cluster = k8s_cluster.start_cluster(d)
        agent = NodeAgent(cluster.api_client(), work_dir=Path("/tmp") / f"rsl-agent-{uuid.uuid4().hex[:8]}")
        agent.start()
        try:
            with serve_s3() as (proxy, _):
                yield cluster, proxy
        finally:
            agent.stop()
    finally:
        subprocess.run(["bash", str(script), "down", str(d)], capture_output=True, timeout=120)


def _kubernetes(bound: float, n: int) -> dict[str, Any]:
    import boto3
    from kubernetes.client import CoreV1Api
    from support import k8s_cluster

    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "NO_PROXY": "127.0.0.1,localhost",
    }.items():
        os.environ.setdefault(k, v)
    with scratch("death-k8s") as d, _cluster(d / "cluster") as (cluster, s3):
        bucket = f"death-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=s3.endpoint_url).create_bucket(Bucket=bucket)
        core = CoreV1Api(cluster.api_client())
        ns = k8s_cluster.make_namespace(cluster, "rsl-death")
        core.create_namespaced_secret(
            ns,
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "resoluto-store"},
                "stringData": {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")},
            },
        )
        setup = {
            "runtime": "kubernetes",
            "k8s": {"server": cluster.server, "ca": cluster.ca, "token": cluster.token},
            "options": {
                "namespace": ns,
                "image": "python:3.12-slim",
                "runtime_class": "gvisor",
                "guest_source": "bundle",
                "store_credentials_secret": "resoluto-store",
                "delete_grace_s": 2,
            },
        }
        url = f"s3://{bucket}/base?endpoint_url={s3.endpoint_url}"
        hosts = {"kubernetes": (Host(setup, url, n, bound, {}), Host(setup, url, n, 0.0, {}))}

        def running(pods: list[str]) -> set[str]:
            listed = core.list_namespaced_pod(ns).items
            return {p.metadata.name for p in listed if p.status.phase not in ("Succeeded", "Failed")} & set(
                pods
            )

        try:
            return _measure(hosts, {"kubernetes": running}, bound, 600)
        finally:
            for h in hosts["kubernetes"]:
                h.kill()


def run(quick: bool) -> dict[str, Any]:
    bound = 6.0 if quick else heartbeat.DEFAULT_LOST_AFTER
    n = 2 if quick else 5
    out: dict[str, Any] = {"bound_s": bound, "poll_s": round(bound / 6, 2)}
    log(f"scale_death: local runtimes, {n} nodes each, bound {bound:g}s")
    out["local"] = _local(quick, bound, n)
    for name, fn in (("solari", _solari), ("kubernetes", _kubernetes)):
        log(f"scale_death: {name}")
        try:
            out[name] = fn(bound, n)[name]
        except Exception as e:  # noqa: BLE001 - one runtime that cannot run here is reported
            out[name] = {"unavailable": f"{type(e).__name__}: {e}"}
    return out


def _per_runtime(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {**res.get("local", {}), **{k: res[k] for k in REMOTE if k in res}}


def _line(name: str, r: dict[str, Any], bound: float) -> str:
    if "unavailable" in r:
        return f"unavailable: {r['unavailable']}"
    gone = "not gone" if r["gone_s"] is None else f"{r['gone_s']} s"
    before = (
        f"without a heartbeat {r['without_left']}/{r['without_n']} still running after {r['watched_s']} s"
        if name != "solari"
        else f"with the session timeout at 3600 s {r['without_left']}/{r['without_n']} still running after {r['watched_s']} s"
    )
    return f"last of {r['n']} sandboxes gone {gone} after SIGKILL (bound {bound:g} s); {before}"


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    bound = res["bound_s"]
    return [(f"host death: {name}", _line(name, r, bound)) for name, r in _per_runtime(res).items()]


def targets(res: dict[str, Any]) -> list[Target]:
    bound = res["bound_s"]
    # Documented: the bound, one read of the heartbeat, and the runtime's teardown.
    limit = bound + res["poll_s"] + 15
    out = []
    for name, r in _per_runtime(res).items():
        if "unavailable" in r:
            out.append(Target("scale", f"host death: {name}", f"<= {limit:g} s", "unavailable", None))
            continue
        gone = r["gone_s"]
        out.append(
            Target(
                "scale",
                f"host death: {name}, last sandbox gone after SIGKILL",
                f"<= {limit:g} s (bound {bound:g} s + a poll + teardown)",
                "not gone" if gone is None else f"{gone} s",
                gone is not None and gone <= limit,
            )
        )
    return out
