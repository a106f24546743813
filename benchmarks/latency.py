"""Figure 3, latency: a guest prints a wall-clock-stamped line every 10 ms for 5 s.

At the tail callback (``drive_node``'s ``on_event`` on the process runtime and a local
conduit, measured here) and at the Prefect log API (the stored row's ``created``
timestamp, measured by the flow child): arrival time minus the print time written into
the line; p50 and p99. Both sides read the same machine clock.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from common import Target, log, ms, percentile, scratch

from guest_runner.conduit import LocalConduit
from prefect_resoluto.node import NodeSpec, drive_node
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
        spec = NodeSpec(run_id="bench-latency", node_id=f"tick-{runtime}",
                        argv=[sys.executable, "-c", TICKER.format(seconds=seconds)])
        out = drive_node(spec, LocalConduit(work / "conduit"), rt, on_event=on_event, min_isolation="none")
    if not out.ok:
        raise RuntimeError(out.describe())
    return summarise(lat, printed[0])


def summarise(lat: list[float], printed: int) -> dict[str, Any]:
    return {"printed": printed, "received": len(lat), "p50_ms": ms(percentile(lat, 50)),
            "p99_ms": ms(percentile(lat, 99)), "max_ms": ms(max(lat)) if lat else None,
            "latencies_ms": [ms(x) for x in lat]}


def run(quick: bool) -> dict[str, Any]:
    seconds = 2.0 if quick else 5.0
    log(f"latency: ticker for {seconds:g} s at the tail callback (process runtime)")
    return {"seconds": seconds, "tail": tail_latency(seconds)}


def attach_api(res: dict[str, Any], api: dict[str, Any] | None) -> None:
    if api:
        res["prefect_api"] = summarise(api["latencies_s"], api["printed"])


def targets(res: dict[str, Any]) -> list[Target]:
    t = res["tail"]
    return [
        Target("latency", "tail p50", "<= 100 ms", f"{t['p50_ms']} ms", t["p50_ms"] <= 100),
        Target("latency", "tail p99", "<= 500 ms", f"{t['p99_ms']} ms", t["p99_ms"] <= 500),
    ]


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for key, label in (("tail", "latency at tail callback"), ("prefect_api", "latency at Prefect log API")):
        t = res.get(key)
        if t:
            out.append((label, f"p50 {t['p50_ms']} ms, p99 {t['p99_ms']} ms, max {t['max_ms']} ms "
                               f"({t['received']}/{t['printed']} lines)"))
    return out
