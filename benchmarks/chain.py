"""Figure: chain, a flow of 8 dependent trivial tasks (each takes the previous result)
under ThreadPoolTaskRunner and under ResolutoTaskRunner on gVisor with the warm pool on
(its default), interleaved round by round in one child on Prefect's ephemeral API (see
``_chain_child.py``). The figure is the median over rounds of (gVisor wall − ThreadPool
wall of the same round) / 8: what a sandbox adds to each task on the flow's critical path.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from common import BENCH, Target, log, median, prefect_child_env, scratch

from prefect_resoluto.runtimes import get_runtime

TARGET_MS = 150.0


def run(quick: bool) -> dict[str, Any]:
    if not get_runtime("gvisor").availability().ok:
        return {"available": False}
    n, rounds = 8, (3 if quick else 5)
    with scratch("chain") as work:
        out_path = work / "chain.json"
        log(f"chain: {n} dependent tasks, threadpool vs gvisor (pool on), {rounds} rounds interleaved")
        cmd = [sys.executable, str(BENCH / "_chain_child.py"), "--n", str(n), "--rounds", str(rounds)]
        cmd += ["--out", str(out_path)]
        with open(work / "child.log", "wb") as child_log:
            res = subprocess.run(
                cmd, env=prefect_child_env(work), stdout=child_log, stderr=subprocess.STDOUT, timeout=1200
            )
        if res.returncode != 0:
            tail = (work / "child.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"chain benchmark child failed (exit {res.returncode}):\n{tail}")
        child = json.loads(out_path.read_text())
    walls = child["wall_s"]
    added = [(g - t) / n * 1000 for t, g in zip(walls["threadpool"], walls["gvisor"], strict=True)]
    return {
        "available": True,
        "n": n,
        "rounds": rounds,
        "wall_s": walls,
        "added_per_task_ms_samples": [round(a, 1) for a in added],
        "gvisor_added_per_task_ms": round(median(added), 1),
        "ratio": round(median(walls["gvisor"]) / median(walls["threadpool"]), 2),
    }


def targets(res: dict[str, Any]) -> list[Target]:
    if not res.get("available"):
        return [
            Target("chain", "gVisor chain of 8: added per task", f"<= +{TARGET_MS:g} ms", "unavailable", None)
        ]
    added = res["gvisor_added_per_task_ms"]
    return [
        Target(
            "chain",
            f"gVisor chain of {res['n']} dependent tasks: added per task over ThreadPool",
            f"<= +{TARGET_MS:g} ms",
            f"+{added} ms",
            added <= TARGET_MS,
        )
    ]


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    if not res.get("available"):
        return [("chain", "gVisor unavailable")]
    w = res["wall_s"]
    return [
        (
            f"chain of {res['n']} dependent tasks",
            f"threadpool {median(w['threadpool']):.3f} s, gvisor (pool on) {median(w['gvisor']):.3f} s; "
            f"+{res['gvisor_added_per_task_ms']} ms a task (rounds {res['added_per_task_ms_samples']})",
        )
    ]
