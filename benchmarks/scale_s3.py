"""Scale, S3 part: what one host pays S3 per node, before (a LIST per poll) and after (a GET
of the next chunk key), side by side on one endpoint in one run.

moto's S3 server on 127.0.0.1 behind the tests' counting proxy (``conduit_cost.s3_endpoint``)
counts every request by type and by the access key that signed it: the host's conduit signs
as ``bench-host``, the guests' as ``bench-guest``.

* **Before** is the tail of ``BEFORE`` (main before issue #32's S3 part), read from git
  history into a module of its own and put in the driver's place for the "before" runs;
  **after** is this tree's tail. Nothing else differs.
* **Idle**: 10 nodes at once on the process runtime (``--quick``: 4), each sleeping 90 s
  (``--quick``: 30 s), the guest's heartbeat at its production 10 s. Requests are counted over the steady window,
  from ``STEADY_AFTER`` s after the last workload opened to the first workload close, and
  divided by node-minutes: requests per idle node-minute, by type, host and guest apart.
* **Per node**: as many short nodes at once (300 lines of output and one declared output
  file, as a Python task has): the host's requests per node over its whole life, by type,
  and the median time from launch to outcome (the node's end is seen from the manifest).
* **Dollars per 1 000 idle node-hours** at S3 Standard's list prices (us-east-1):
  PUT/COPY/POST/LIST $0.005 per 1 000, GET/HEAD and the rest $0.0004 per 1 000.
"""

from __future__ import annotations

import select
import subprocess
import sys
import threading
import time
import types
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from common import ROOT, Target, log, median, r3
from conduit_cost import GUEST, HOST, SECRET, _conduit, s3_endpoint

from prefect_resoluto.node import drive
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes import get_runtime

BEFORE = "f7f0520e47648418fe937ba6690ff14e10e92d8a"  # main with the tail that LISTed on every poll
STEADY_AFTER = 5.0
CLASS_A = frozenset({"PUT", "COPY", "POST", "LIST"})
PRICE_A, PRICE_B = 0.005 / 1000, 0.0004 / 1000  # dollars per request
GUEST_ENV = {
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": "/nonexistent",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
    "NO_PROXY": "127.0.0.1",
}


def dollars_per_1000_node_hours(per_node_minute: dict[str, float]) -> float:
    per_request = sum(n * (PRICE_A if k in CLASS_A else PRICE_B) for k, n in per_node_minute.items())
    return round(per_request * 60 * 1000, 3)


def _before_tailer() -> type:
    """main's ChunkTailer as it was at BEFORE, loaded from git history."""
    src = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{BEFORE}:prefect_resoluto/node/tail.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    mod = types.ModuleType("_tail_before")
    exec(compile(src, f"{BEFORE}:prefect_resoluto/node/tail.py", "exec"), mod.__dict__)
    old: Any = mod.ChunkTailer

    class Before(old):  # type: ignore[misc, valid-type]
        """What today's driver asks of a tailer, answered as that tail would: it had no
        chunk budget (never behind), its local-conduit watch took no descriptor beside it."""

        behind = False

        @property
        def watching(self) -> bool:
            return getattr(self, "_watch", None) is not None

        def wait(self, timeout: float, also: int | None = None) -> bool:
            if also is None or self.watching:
                return bool(super().wait(timeout))
            select.select([also], [], [], max(0.0, timeout))  # the sandbox's exit wakes it
            return False

    return Before


@contextmanager
def tail_of(variant: str) -> Iterator[None]:
    real = drive.ChunkTailer
    if variant == "before":
        drive.ChunkTailer = _before_tailer()  # type: ignore[misc]
    try:
        yield
    finally:
        drive.ChunkTailer = real  # type: ignore[misc]


def _spec(node_id: str, code: str, outputs: list[str] | None = None) -> NodeSpec:
    return NodeSpec(
        run_id="bench-scale-s3",
        node_id=node_id,
        argv=[sys.executable, "-c", code],
        env=dict(GUEST_ENV),
        secret_env={"AWS_ACCESS_KEY_ID": GUEST, "AWS_SECRET_ACCESS_KEY": SECRET},
        output_paths=outputs or [],
    )


def _diff(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b.get(k, 0) - a.get(k, 0) for k in sorted(set(a) | set(b)) if b.get(k, 0) - a.get(k, 0)}


def _per(counts: dict[str, int], by: float) -> dict[str, float]:
    return {k: round(v / by, 2) for k, v in counts.items()}


def _drive_all(proxy: Any, bucket: str, specs: list[NodeSpec], on_event: Any = None) -> list[Any]:
    conduit = _conduit(bucket, proxy.endpoint_url, HOST)
    try:
        with ThreadPoolExecutor(max_workers=len(specs)) as pool:
            outs = list(
                pool.map(
                    lambda s: drive_node(
                        s,
                        conduit,
                        get_runtime("process"),
                        on_event=(lambda ev, s=s: on_event(s.node_id, ev)) if on_event else None,
                        min_isolation="none",
                    ),
                    specs,
                )
            )
    finally:
        conduit.close()
    bad = [o.describe() for o in outs if not o.ok]
    if bad:
        raise RuntimeError(bad[0])
    return outs


def idle(proxy: Any, bucket: str, variant: str, nodes: int, quiet_s: float) -> dict[str, Any]:
    """``nodes`` sleeping nodes at once: requests per idle node-minute over the steady window."""
    opened: dict[str, float] = {}
    closed: dict[str, float] = {}
    samples: list[tuple[float, dict[str, int], dict[str, int]]] = []
    done = threading.Event()

    def on_event(node_id: str, ev: dict[str, Any]) -> None:
        if ev.get("kind") == "workload" and ev.get("event") in ("open", "close"):
            (opened if ev["event"] == "open" else closed)[node_id] = time.monotonic()

    def sample() -> None:
        while not done.wait(0.25):
            snap = proxy.counter.snapshot
            samples.append((time.monotonic(), snap(client=HOST), snap(client=GUEST)))

    tag = uuid.uuid4().hex[:6]
    specs = [_spec(f"idle-{variant}-{tag}-{i}", f"import time; time.sleep({quiet_s})") for i in range(nodes)]
    proxy.counter.reset()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with tail_of(variant):
            _drive_all(proxy, bucket, specs, on_event)
    finally:
        done.set()
        sampler.join()
    start, end = max(opened.values()) + STEADY_AFTER, min(closed.values())
    window = [s for s in samples if start <= s[0] <= end]
    if len(window) < 2:
        raise RuntimeError(
            f"no steady window: the nodes overlapped quietly for {end - start + STEADY_AFTER:.1f} s"
        )
    (t0, h0, g0), (t1, h1, g1) = window[0], window[-1]
    node_minutes = (t1 - t0) / 60 * nodes
    host_w, guest_w = _diff(h0, h1), _diff(g0, g1)
    host_rate, guest_rate = _per(host_w, node_minutes), _per(guest_w, node_minutes)
    return {
        "nodes": nodes,
        "quiet_s": quiet_s,
        "window_s": r3(t1 - t0),
        "host_window": host_w,
        "host_lists_per_node_in_window": round(host_w.get("LIST", 0) / nodes, 2),
        "host_per_node_minute": host_rate,
        "guest_per_node_minute": guest_rate,
        "host_dollars_per_1000_node_hours": dollars_per_1000_node_hours(host_rate),
        "guest_dollars_per_1000_node_hours": dollars_per_1000_node_hours(guest_rate),
    }


def short(proxy: Any, bucket: str, variant: str, nodes: int) -> dict[str, Any]:
    """``nodes`` short nodes with one output each: the host's requests per node, by type."""
    tag = uuid.uuid4().hex[:6]
    code = "open('out.txt', 'w').write('x'); [print(i) for i in range(300)]"
    specs = [_spec(f"short-{variant}-{tag}-{i}", code, ["out.txt"]) for i in range(nodes)]
    proxy.counter.reset()
    with tail_of(variant):
        outs = _drive_all(proxy, bucket, specs)
    return {
        "nodes": nodes,
        "node_s_median": r3(median(o.timings["finish"] for o in outs)),
        "host_per_node": _per(proxy.counter.snapshot(client=HOST), nodes),
        "guest_per_node": _per(proxy.counter.snapshot(client=GUEST), nodes),
    }


def run(quick: bool) -> dict[str, Any]:
    nodes, quiet_s = (4, 30.0) if quick else (10, 90.0)
    import boto3
    from botocore.config import Config

    out: dict[str, Any] = {}
    with s3_endpoint() as (proxy, moto_url):
        bucket = f"bench-{uuid.uuid4().hex[:10]}"
        raw = boto3.session.Session(
            aws_access_key_id="bench-raw", aws_secret_access_key=SECRET, region_name="us-east-1"
        ).client("s3", endpoint_url=moto_url, config=Config(s3={"addressing_style": "path"}))
        raw.create_bucket(Bucket=bucket)
        raw.close()
        for variant in ("before", "after"):
            log(f"scale s3 ({variant}): {nodes} nodes quiet for {quiet_s:g} s at once")
            res = {"idle": idle(proxy, bucket, variant, nodes, quiet_s)}
            log(f"scale s3 ({variant}): {nodes} short nodes at once")
            res["short"] = short(proxy, bucket, variant, nodes)
            out[variant] = res
    return out


def targets(res: dict[str, Any]) -> list[Target]:
    b, a = res["before"]["idle"], res["after"]["idle"]
    lists = a["host_lists_per_node_in_window"]
    cost_b, cost_a = b["host_dollars_per_1000_node_hours"], a["host_dollars_per_1000_node_hours"]
    return [
        Target(
            "scale s3",
            "host LISTs per idle node in the steady state",
            "<= 1",
            f"{lists} over {a['window_s']:.0f} s x {a['nodes']} nodes (before: {b['host_lists_per_node_in_window']})",
            lists <= 1,
        ),
        Target(
            "scale s3",
            "host $ per 1 000 idle node-hours",
            "below before",
            f"${cost_a} (before ${cost_b}, {cost_b / cost_a:.1f}x)" if cost_a else f"${cost_a}",
            cost_a < cost_b,
        ),
    ]


def _kinds(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(d.items())) or "none"


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for side in ("host", "guest"):
        b, a = res["before"]["idle"], res["after"]["idle"]
        out.append(
            (
                f"scale s3: {side} requests per idle node-minute",
                f"{_kinds(b[f'{side}_per_node_minute'])} -> {_kinds(a[f'{side}_per_node_minute'])} "
                f"({a['nodes']} nodes, {a['window_s']:.0f} s steady window)",
            )
        )
        out.append(
            (
                f"scale s3: {side} $ per 1 000 idle node-hours",
                f"${b[f'{side}_dollars_per_1000_node_hours']} -> ${a[f'{side}_dollars_per_1000_node_hours']}",
            )
        )
    for side in ("host", "guest"):
        b, a = res["before"]["short"], res["after"]["short"]
        out.append(
            (
                f"scale s3: {side} requests per short node (300 lines, 1 output)",
                f"{_kinds(b[f'{side}_per_node'])} -> {_kinds(a[f'{side}_per_node'])}",
            )
        )
    b, a = res["before"]["short"], res["after"]["short"]
    out.append(
        (
            "scale s3: short node, launch to outcome (median)",
            f"{b['node_s_median']} s -> {a['node_s_median']} s ({a['nodes']} at once)",
        )
    )
    return out
