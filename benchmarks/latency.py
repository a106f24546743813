"""Figure 3, latency: a guest prints a wall-clock-stamped line every 10 ms for 5 s.

At the tail callback (``drive_node``'s ``on_event`` on the process runtime and a local
conduit, measured here) and at the Prefect log API (the stored row's ``created``
timestamp, measured by the flow child, ``_flow_child.py``): arrival time minus the print
time written into the line; p50 and p99. Both sides read the same machine clock. The
flow child also counts the ``POST /logs/`` requests each flow run sent, and runs the
ticker a second time at 1 000 lines/s: what a heavy stream costs in requests.

The flow child runs with the ``flow`` figure when both are asked for (one server start);
otherwise this module starts it for the latency runs alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from common import BENCH, Target, log, ms, percentile, prefect_child_env, scratch

from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes import get_runtime

TICKER = """
import time
every, seconds = 0.01, {seconds}
start = next_at = time.time()
n = 0
while time.time() - start < seconds:
    if time.time() >= next_at:
        print(f"tick {{n}} {{time.time():.6f}}", flush=True)
        n += 1
        next_at += every
    time.sleep(max(0.0, min(every, next_at - time.time())))
print(f"printed {{n}}", flush=True)
"""


def tail_latency(seconds: float, runtime: str = "process") -> dict[str, Any]:
    rt = get_runtime(runtime)
    lat: list[float] = []
    printed = [0]

    def on_event(ev: dict[str, Any]) -> None:
        if ev.get("event") != "log":
            return
        parts = str((ev.get("data") or {}).get("line", "")).split()
        if len(parts) == 3 and parts[0] == "tick":
            lat.append(time.time() - float(parts[2]))
        elif len(parts) == 2 and parts[0] == "printed":
            printed[0] = int(parts[1])

    with scratch("latency") as work:
        spec = NodeSpec(
            run_id="bench-latency",
            node_id=f"tick-{runtime}",
            argv=[sys.executable, "-c", TICKER.format(seconds=seconds)],
        )
        out = drive_node(spec, LocalConduit(work / "conduit"), rt, on_event=on_event, min_isolation="none")
    if not out.ok:
        raise RuntimeError(out.describe())
    return summarise(lat, printed[0])


def summarise(lat: list[float], printed: int) -> dict[str, Any]:
    return {
        "printed": printed,
        "received": len(lat),
        "p50_ms": ms(percentile(lat, 50)),
        "p99_ms": ms(percentile(lat, 99)),
        "max_ms": ms(max(lat)) if lat else None,
        "latencies_ms": [ms(x) for x in lat],
    }


def run(quick: bool) -> dict[str, Any]:
    seconds = 2.0 if quick else 5.0
    log(f"latency: ticker for {seconds:g} s at the tail callback (process runtime)")
    return {"seconds": seconds, "tail": tail_latency(seconds)}


# POST /logs/ per second of a 1 000 lines/s stream before the coalescing batcher (the
# forwarder's 0.5 s flush pacing; 2026-12-01, median of six runs at load 7-30, docs/performance.md).
POSTS_PER_S_AT_1000_BEFORE = 1.4
# Issue 24's bound for the same stream: lines in ~0.5 s, at most 2 requests a second.
POSTS_PER_S_AT_1000_MAX = 2.0


def api_child(seconds: float) -> dict[str, Any]:
    """The flow child for the latency runs alone (no mapped flows)."""
    with scratch("latency-api") as work:
        out_path = work / "latency.json"
        env = prefect_child_env(work)
        log(
            f"latency: ticker for {seconds:g} s at the Prefect log API, at 100 and 1 000 lines/s "
            "(ephemeral Prefect server, ~20 s to start)"
        )
        cmd = [
            sys.executable,
            str(BENCH / "_flow_child.py"),
            "--n",
            "0",
            "--runtimes",
            "",
            "--latency-seconds",
            str(seconds),
            "--out",
            str(out_path),
        ]
        with open(work / "child.log", "wb") as child_log:
            res = subprocess.run(cmd, env=env, stdout=child_log, stderr=subprocess.STDOUT, timeout=900)
        if res.returncode != 0:
            tail = (work / "child.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"latency benchmark child failed (exit {res.returncode}):\n{tail}")
        return json.loads(out_path.read_text())


def attach_api(res: dict[str, Any], api: dict[str, Any] | None) -> None:
    """``api``: the flow child's measurement when the flow figure ran; else one is taken here."""
    if api is None:
        api = api_child(res["seconds"]).get("api_latency")
    if not api:
        return
    for key, got in (("prefect_api", api), ("prefect_api_1000", api.get("at_1000"))):
        if got:
            res[key] = summarise(got["latencies_s"], got["printed"])
            if got.get("to_row_s"):  # print -> the runner's batcher, batcher -> stored row
                res[key]["split_p50_ms"] = {
                    "guest_and_tail": ms(percentile(got["to_host_s"], 50)),
                    "forwarder_and_api": ms(percentile(got["to_row_s"], 50)),
                }
                res[key]["split_p99_ms"] = {
                    "guest_and_tail": ms(percentile(got["to_host_s"], 99)),
                    "forwarder_and_api": ms(percentile(got["to_row_s"], 99)),
                }
            posts = got.get("log_posts")
            if posts is not None:
                res[key].update(
                    log_posts=posts,
                    batcher_posts=got.get("batcher_posts"),
                    posts_per_s=round(posts / got["seconds"], 2),
                    posts_per_1000_lines=round(1000 * posts / max(got["printed"], 1), 2),
                    lines_per_s=round(got["printed"] / got["seconds"]),
                    post_round_trip_p50_ms=ms(got["log_post_median_s"])
                    if got.get("log_post_median_s")
                    else None,
                )


def targets(res: dict[str, Any]) -> list[Target]:
    t = res["tail"]
    out = [
        Target("latency", "tail p50", "<= 100 ms", f"{t['p50_ms']} ms", t["p50_ms"] <= 100),
        Target("latency", "tail p99", "<= 500 ms", f"{t['p99_ms']} ms", t["p99_ms"] <= 500),
    ]
    a = res.get("prefect_api")
    if a:
        out.append(
            Target("latency", "Prefect log API p50", "<= 150 ms", f"{a['p50_ms']} ms", a["p50_ms"] <= 150)
        )
        out.append(
            Target("latency", "Prefect log API p99", "<= 400 ms", f"{a['p99_ms']} ms", a["p99_ms"] <= 400)
        )
    h = res.get("prefect_api_1000")
    if h:
        out.append(
            Target(
                "latency",
                "Prefect log API p50 at 1 000 lines/s",
                "<= 500 ms",
                f"{h['p50_ms']} ms",
                h["p50_ms"] <= 500,
            )
        )
        out.append(
            Target(
                "latency",
                "every line stored at 1 000 lines/s",
                "all",
                f"{h['received']}/{h['printed']}",
                h["received"] == h["printed"] and h["printed"] > 0,
            )
        )
    if h and "posts_per_s" in h:
        out.append(
            Target(
                "latency",
                "POST /logs/ per s at 1 000 lines/s",
                f"<= {POSTS_PER_S_AT_1000_MAX:g}",
                f"{h['posts_per_s']}",
                h["posts_per_s"] <= POSTS_PER_S_AT_1000_MAX,
            )
        )
    return out


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for key, label in (
        ("tail", "latency at tail callback"),
        ("prefect_api", "latency at Prefect log API"),
        ("prefect_api_1000", "Prefect log API at 1 000 lines/s"),
    ):
        t = res.get(key)
        if t:
            text = (
                f"p50 {t['p50_ms']} ms, p99 {t['p99_ms']} ms, max {t['max_ms']} ms "
                f"({t['received']}/{t['printed']} lines)"
            )
            if "posts_per_s" in t:
                text += (
                    f"; POST /logs/ {t['posts_per_s']}/s at {t['lines_per_s']} lines/s "
                    f"({t['log_posts']} in all, {t.get('batcher_posts')} of them the runner's batcher's, "
                    f"{t['posts_per_1000_lines']} per 1 000 lines, "
                    f"round trip p50 {t['post_round_trip_p50_ms']} ms)"
                )
            if "split_p50_ms" in t:
                a50, a99 = t["split_p50_ms"], t["split_p99_ms"]
                text += (
                    f"; print -> host p50 {a50['guest_and_tail']} / p99 {a99['guest_and_tail']} ms, "
                    f"host -> row p50 {a50['forwarder_and_api']} / p99 {a99['forwarder_and_api']} ms"
                )
            out.append((label, text))
    return out
