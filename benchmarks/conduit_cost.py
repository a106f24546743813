"""Figure 5, conduit cost: S3 requests of a quiet node, counted at the endpoint.

moto's S3 server runs on 127.0.0.1 behind the tests' counting proxy
(``tests/support/s3_fixtures.py``), which counts every request that reaches it by type and by
the access key id that signed it. The host's conduit signs as ``bench-host``, the
guest's as ``bench-guest``, so host and guest requests are told apart at the endpoint,
not estimated.

* A node on the process runtime (the only local one whose guest can reach a loopback
  endpoint) sleeps for 60 s (``--quick``: 20 s, extrapolated to a minute and marked so).
  Requests are counted over the whole node and over the quiet window (between the
  arrival of the workload's open and close events).
* Requests per tail poll with 10 and with 1 000 chunks already read: idle polls (nothing
  new) and polls that find exactly one new chunk.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from common import Target, log, r3

from guest_runner import wire
from guest_runner.conduit.s3 import S3Conduit
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.node.tail import ChunkTailer
from prefect_resoluto.runtimes import get_runtime

HOST, GUEST = "bench-host", "bench-guest"
STEADY_AFTER = 5.0
SECRET = "bench-secret"


@contextmanager
def s3_endpoint():  # type: ignore[no-untyped-def]
    import logging

    from support.s3_fixtures import serve_s3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log per request
    with serve_s3() as served:
        yield served


def _conduit(bucket: str, endpoint: str, key_id: str) -> S3Conduit:
    return S3Conduit(
        bucket, endpoint_url=endpoint, access_key_id=key_id, secret_access_key=SECRET, region="us-east-1"
    )


def quiet_node(proxy: Any, bucket: str, quiet_s: float) -> dict[str, Any]:
    conduit = _conduit(bucket, proxy.endpoint_url, HOST)
    marks: dict[str, tuple[float, dict[str, int], dict[str, int]]] = {}

    def on_event(ev: dict[str, Any]) -> None:
        if ev.get("kind") == "workload" and ev.get("event") in ("open", "close"):
            marks[ev["event"]] = (
                time.monotonic(),
                proxy.counter.snapshot(client=HOST),
                proxy.counter.snapshot(client=GUEST),
            )

    spec = NodeSpec(
        run_id="bench-cost",
        node_id=f"quiet-{uuid.uuid4().hex[:6]}",
        argv=[sys.executable, "-c", f"import time; time.sleep({quiet_s})"],
        env={
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": "/nonexistent",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
            "NO_PROXY": "127.0.0.1",
        },
        secret_env={"AWS_ACCESS_KEY_ID": GUEST, "AWS_SECRET_ACCESS_KEY": SECRET},
    )
    samples: list[tuple[float, int]] = []  # (time, host requests so far), every 0.25 s
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.25):
            samples.append((time.monotonic(), sum(proxy.counter.snapshot(client=HOST).values())))

    proxy.counter.reset()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    try:
        out = drive_node(spec, conduit, get_runtime("process"), on_event=on_event, min_isolation="none")
    finally:
        done.set()
        sampler.join()
    node_s = time.monotonic() - t0
    conduit.close()
    if not out.ok:
        raise RuntimeError(out.describe())
    (ta, host_a, guest_a), (tb, host_b, guest_b) = marks["open"], marks["close"]
    window = tb - ta
    host_w = {k: host_b.get(k, 0) - host_a.get(k, 0) for k in set(host_a) | set(host_b)}
    guest_w = {k: guest_b.get(k, 0) - guest_a.get(k, 0) for k in set(guest_a) | set(guest_b)}
    # Steady state: once the tail has backed off to its slowest cadence (STEADY_AFTER s
    # after the last real event), until the workload's close arrives.
    steady = [(t, n) for t, n in samples if ta + STEADY_AFTER <= t <= tb]
    steady_rate = (
        round((steady[-1][1] - steady[0][1]) / (steady[-1][0] - steady[0][0]) * 60, 1)
        if len(steady) > 1
        else None
    )
    return {
        "quiet_s": quiet_s,
        "host_per_idle_minute_steady": steady_rate,
        "node_s": r3(node_s),
        "host_total": proxy.counter.snapshot(client=HOST),
        "guest_total": proxy.counter.snapshot(client=GUEST),
        "window_s": r3(window),
        "host_window": host_w,
        "guest_window": guest_w,
        "host_per_idle_minute": round(sum(host_w.values()) / window * 60, 1),
        "guest_per_idle_minute": round(sum(guest_w.values()) / window * 60, 1),
        "extrapolated": quiet_s < 60,
    }


def per_poll(proxy: Any, raw: Any, bucket: str, already: int, polls: int = 5) -> dict[str, Any]:
    prefix = wire.node_prefix("bench-cost", f"poll-{already}")
    line = wire.encode_event(wire.make_event("bench-cost", "log", "log", data={"line": "x"}))
    body = wire.encode_chunk([line])

    def put(i: int) -> None:
        raw.put_object(Bucket=bucket, Key=wire.chunk_key(prefix, i), Body=body)

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(put, range(1, already + 1)))
    conduit = _conduit(bucket, proxy.endpoint_url, HOST)
    # The tail's clock held still: its manifest look-ups run on a clock of their own, which
    # would otherwise land in one figure's polls and not the other's.
    tailer = ChunkTailer(conduit, prefix, clock=lambda: 0.0)
    while tailer.delivered < already:
        tailer.poll(lambda ev: None)
    proxy.counter.reset()
    for _ in range(polls):
        tailer.poll(lambda ev: None)
    idle = proxy.counter.snapshot(client=HOST)
    proxy.counter.reset()
    for i in range(polls):
        put(already + 1 + i)
        tailer.poll(lambda ev: None)
    busy = proxy.counter.snapshot(client=HOST)
    conduit.close()
    assert tailer.delivered == already + polls
    return {
        "idle_per_poll": {k: v / polls for k, v in idle.items()},
        "one_new_chunk_per_poll": {k: v / polls for k, v in busy.items()},
    }


def run(quick: bool) -> dict[str, Any]:
    quiet_s = 20.0 if quick else 60.0
    import boto3
    from botocore.config import Config

    with s3_endpoint() as (proxy, moto_url):
        bucket = f"bench-{uuid.uuid4().hex[:10]}"
        raw = boto3.session.Session(
            aws_access_key_id="bench-raw", aws_secret_access_key=SECRET, region_name="us-east-1"
        ).client("s3", endpoint_url=moto_url, config=Config(s3={"addressing_style": "path"}))
        raw.create_bucket(Bucket=bucket)
        log(f"conduit cost: a node quiet for {quiet_s:g} s on S3 (moto on 127.0.0.1)")
        out: dict[str, Any] = {"quiet": quiet_node(proxy, bucket, quiet_s)}
        log("conduit cost: requests per poll at 10 and 1000 chunks already read")
        out["per_poll"] = {str(k): per_poll(proxy, raw, bucket, k) for k in (10, 1000)}
        raw.close()
    return out


def targets(res: dict[str, Any]) -> list[Target]:
    q = res["quiet"]
    if q["extrapolated"]:
        # A short window is dominated by the first seconds' fast polls: judge the steady
        # rate, extrapolated to a minute, and say so.
        rate = q["host_per_idle_minute_steady"]
        note = f" (steady state over {q['window_s'] - STEADY_AFTER:.0f} s, extrapolated)"
    else:
        rate, note = q["host_per_idle_minute"], ""
    p10 = sum(res["per_poll"]["10"]["idle_per_poll"].values())
    p1000 = sum(res["per_poll"]["1000"]["idle_per_poll"].values())
    b10 = sum(res["per_poll"]["10"]["one_new_chunk_per_poll"].values())
    b1000 = sum(res["per_poll"]["1000"]["one_new_chunk_per_poll"].values())
    return [
        Target("conduit cost", "host requests per idle minute", "<= 60", f"{rate}{note}", rate <= 60),
        Target(
            "conduit cost",
            "requests per poll, 10 vs 1000 chunks read",
            "flat",
            f"idle {p10:g} vs {p1000:g}; one new chunk {b10:g} vs {b1000:g}",
            p10 == p1000 and b10 == b1000,
        ),
    ]


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    q = res["quiet"]
    note = (
        f" (extrapolated from a {q['window_s']} s window)"
        if q["extrapolated"]
        else f" ({q['window_s']} s window)"
    )
    out = [
        (
            "conduit cost: quiet node, host",
            f"{q['host_per_idle_minute']} req/idle min{note}, "
            f"{q['host_per_idle_minute_steady']} once backed off; "
            f"whole node {q['host_total']}",
        ),
        (
            "conduit cost: quiet node, guest",
            f"{q['guest_per_idle_minute']} req/idle min; whole node {q['guest_total']}",
        ),
    ]
    for k, v in res["per_poll"].items():
        out.append(
            (
                f"conduit cost: per poll, {k} chunks read",
                f"idle {v['idle_per_poll']}, one new chunk {v['one_new_chunk_per_poll']}",
            )
        )
    return out
