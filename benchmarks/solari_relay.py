"""Figure: the Solari relay's cost -- added latency per event and throughput in lines/s.

The same two workloads run side by side in one run, (a) on the process runtime straight
into a local conduit and (b) on the Solari runtime through the loopback gateway stand-in
(tests/support/solari_gateway.py: REST + control WebSocket on 127.0.0.1, every framing hazard on,
commands run as host processes), relayed into a local conduit:

- latency: a guest prints a wall-clock-stamped line every 10 ms; arrival at the tail
  callback minus the print time, p50/p99 for each; the relay's *added* latency is (b)
  minus (a);
- throughput: N lines as fast as the guest can write them, each checked to arrive once
  and in order; lines/s over the streaming window (first line printed to last line
  delivered), and the ratio (b)/(a).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import Target, log, ms, percentile, r3, scratch
from latency import TICKER
from throughput import PRODUCER

from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes import get_runtime


def _runtimes(gw: Any) -> dict[str, Any]:
    return {
        "process": get_runtime("process"),
        "solari": get_runtime("solari", base_url=gw.base_url, api_key=gw.api_key, template="bench"),
    }


def _latency(rt: Any, seconds: float, tag: str) -> dict[str, Any]:
    lat: list[float] = []

    def on_event(ev: dict[str, Any]) -> None:
        parts = str((ev.get("data") or {}).get("line", "")).split()
        if ev.get("event") == "log" and len(parts) == 3 and parts[0] == "tick":
            lat.append(time.time() - float(parts[2]))

    with scratch("solari-latency") as work:
        spec = NodeSpec(
            run_id="bench-solari",
            node_id=f"tick-{tag}",
            argv=["python3", "-c", TICKER.format(seconds=seconds)],
        )
        out = drive_node(spec, LocalConduit(work / "conduit"), rt, on_event=on_event, min_isolation="none")
    if not out.ok:
        raise RuntimeError(out.describe())
    return {"received": len(lat), "p50_ms": ms(percentile(lat, 50)), "p99_ms": ms(percentile(lat, 99))}


def _throughput(rt: Any, n: int, tag: str) -> dict[str, Any]:
    state: dict[str, Any] = {"next": 0, "bad": 0, "first_ts": None, "last": None, "workload": None}

    def on_event(ev: dict[str, Any]) -> None:
        if ev.get("kind") == "workload" and ev.get("event") == "open":
            state["workload"] = ev.get("span_id")
            return
        if ev.get("event") != "log" or ev.get("parent_span_id") != state["workload"]:
            return
        if (ev.get("data") or {}).get("line") == f"line {state['next']:07d}":
            if state["next"] == 0:
                state["first_ts"] = ev["ts"]
            state["next"] += 1
            state["last"] = time.time()
        else:
            state["bad"] += 1

    with scratch("solari-throughput") as work:
        spec = NodeSpec(
            run_id="bench-solari", node_id=f"lines-{tag}", argv=["python3", "-c", PRODUCER.format(n=n)]
        )
        t0 = time.perf_counter()
        out = drive_node(spec, LocalConduit(work / "conduit"), rt, on_event=on_event, min_isolation="none")
        total = time.perf_counter() - t0
    if not out.ok:
        raise RuntimeError(out.describe())
    window = (state["last"] or 0) - (state["first_ts"] or 0)
    return {
        "lines": n,
        "complete": state["next"] == n and state["bad"] == 0,
        "lines_per_s": round(n / window) if window > 0 else None,
        "node_s": r3(total),
    }


def run(quick: bool) -> dict[str, Any]:
    from support.solari_gateway import SolariGateway

    seconds = 2.0 if quick else 5.0
    n = 50_000 if quick else 200_000
    gw = SolariGateway(Path(tempfile.mkdtemp(prefix="resoluto-bench-gw-")), executor="process").start()
    try:
        rts = _runtimes(gw)
        res: dict[str, Any] = {"seconds": seconds, "lines": n, "latency": {}, "throughput": {}}
        for tag, rt in rts.items():
            log(f"solari_relay: {seconds:g} s ticker on {tag}")
            res["latency"][tag] = _latency(rt, seconds, tag)
        for tag, rt in rts.items():
            log(f"solari_relay: {n} lines on {tag}")
            res["throughput"][tag] = _throughput(rt, n, tag)
        lat, thr = res["latency"], res["throughput"]
        res["added_p50_ms"] = round(lat["solari"]["p50_ms"] - lat["process"]["p50_ms"], 1)
        res["added_p99_ms"] = round(lat["solari"]["p99_ms"] - lat["process"]["p99_ms"], 1)
        if thr["solari"]["lines_per_s"] and thr["process"]["lines_per_s"]:
            res["throughput_ratio"] = round(thr["solari"]["lines_per_s"] / thr["process"]["lines_per_s"], 2)
        res["hazards_on_the_wire"] = dict(gw.hazard_counts)
        return res
    finally:
        gw.stop()


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    lat, thr = res["latency"], res["throughput"]
    return [
        (
            "solari relay: tail latency",
            f"p50 {lat['solari']['p50_ms']} ms, p99 {lat['solari']['p99_ms']} ms "
            f"(process runtime: p50 {lat['process']['p50_ms']} ms, p99 "
            f"{lat['process']['p99_ms']} ms)",
        ),
        ("solari relay: added per event", f"p50 +{res['added_p50_ms']} ms, p99 +{res['added_p99_ms']} ms"),
        (
            "solari relay: throughput",
            f"{thr['solari']['lines_per_s']} lines/s vs {thr['process']['lines_per_s']} "
            f"lines/s on process (ratio {res.get('throughput_ratio')}), "
            f"{res['lines']} lines, complete: {thr['solari']['complete']}",
        ),
    ]


def targets(res: dict[str, Any]) -> list[Target]:
    thr = res["throughput"]["solari"]
    return [
        Target(
            "solari_relay",
            "every line relayed once, in order",
            "complete",
            str(thr["complete"]),
            bool(thr["complete"]),
        ),
        Target(
            "solari_relay",
            "added tail p99 per event",
            "<= 250 ms",
            f"+{res['added_p99_ms']} ms",
            res["added_p99_ms"] <= 250,
        ),
    ]


if __name__ == "__main__":
    import json

    out = run("--quick" in sys.argv)
    for label, text in rows(out):
        print(f"{label}: {text}")
    print(json.dumps(out))
