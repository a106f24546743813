"""Figure 4, throughput: 200 000 lines from one guest, guest -> local conduit -> tail.

The workload writes every line as fast as it can; the host's tail callback checks that
each line arrives exactly once and in order. Lines per second over the streaming window
(the guest's timestamp of the first line to the arrival of the last one) and over the
whole node (launch to finish); the median of three nodes.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from common import Target, log, r3, scratch

from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes import get_runtime

PRODUCER = "import sys\nsys.stdout.write(''.join(f'line {{i:07d}}\\n' for i in range({n})))\n"


def run(quick: bool, n: int = 200_000, reps: int = 3) -> dict[str, Any]:
    """The median of ``reps`` nodes (one node is a few seconds; a busy neighbour skews one)."""
    runs = [one(n) for _ in range(reps)]
    runs.sort(key=lambda r: r["lines_per_s"])
    med = dict(runs[len(runs) // 2])
    med["reps"] = reps
    med["all_lines_per_s"] = [r["lines_per_s"] for r in runs]
    med["complete"] = all(r["complete"] for r in runs)
    return med


def one(n: int) -> dict[str, Any]:
    log(f"throughput: {n} lines through the process runtime and a local conduit")
    state = {"next": 0, "bad": 0, "first_ts": None, "last_arrival": None, "workload": None}

    def on_event(ev: dict[str, Any]) -> None:
        if ev.get("kind") == "workload" and ev.get("event") == "open":
            state["workload"] = ev.get("span_id")
            return
        if ev.get("event") != "log" or ev.get("parent_span_id") != state["workload"]:
            return
        line = (ev.get("data") or {}).get("line")
        if line == f"line {state['next']:07d}":
            if state["next"] == 0:
                state["first_ts"] = ev["ts"]
            state["next"] += 1
            state["last_arrival"] = time.time()
        else:
            state["bad"] += 1

    with scratch("throughput") as work:
        spec = NodeSpec(
            run_id="bench-throughput", node_id="lines", argv=[sys.executable, "-c", PRODUCER.format(n=n)]
        )
        t0 = time.perf_counter()
        out = drive_node(
            spec,
            LocalConduit(work / "conduit"),
            get_runtime("process"),
            on_event=on_event,
            min_isolation="none",
        )
        total = time.perf_counter() - t0
        chunks = len(LocalConduit(work / "conduit").list_prefix("run/bench-throughput/nodes/lines/events-"))
    if not out.ok:
        raise RuntimeError(out.describe())
    complete = state["next"] == n and state["bad"] == 0
    window = (state["last_arrival"] - state["first_ts"]) if state["first_ts"] else float("nan")
    return {
        "lines": n,
        "received_in_order": state["next"],
        "out_of_order_or_unexpected": state["bad"],
        "complete": complete,
        "chunks": chunks,
        "stream_s": r3(window),
        "node_s": r3(total),
        "lines_per_s": round(n / window),
        "lines_per_s_node": round(n / total),
    }


def targets(res: dict[str, Any]) -> list[Target]:
    return [
        Target(
            "throughput",
            "lines/s guest -> local conduit -> tail",
            ">= 50000",
            f"{res['lines_per_s']}",
            res["lines_per_s"] >= 50_000,
        ),
        Target(
            "throughput",
            "completeness (every line, in order)",
            "complete",
            "complete" if res["complete"] else f"{res['received_in_order']}/{res['lines']}",
            res["complete"],
        ),
    ]


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (
            "throughput",
            f"{res['lines_per_s']} lines/s streaming ({res['stream_s']} s; median of "
            f"{res['all_lines_per_s']}), "
            f"{res['lines_per_s_node']} lines/s whole node ({res['node_s']} s), {res['chunks']} chunks, "
            f"{'complete and in order' if res['complete'] else 'INCOMPLETE'}",
        )
    ]
