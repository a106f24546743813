"""Figure 2, flow: an N-way mapped trivial task under ThreadPoolTaskRunner and under
ResolutoTaskRunner on ``process`` and ``gvisor`` (Prefect's ephemeral API, in a child
process). Also carries the latency-at-the-Prefect-log-API measurement (figure 3b), so
the Prefect server starts once.

The gVisor target is 1.3 x (N x bare launch / effective concurrency). Effective
concurrency is measured, not assumed: N bare gVisor launches (the same bundle as in
figure 1) run through a thread pool as wide as the task runner's, and
``N x median single bare launch / that wall time`` is what 2 cores actually give.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from common import BENCH, Target, log, median, prefect_child_env, r3, scratch, timed
from overhead import bare_launcher

from prefect_resoluto.runtimes import get_runtime


def bare_concurrency(n: int, width: int) -> dict[str, Any]:
    rt = get_runtime("gvisor")
    if not rt.availability().ok:
        return {"available": False}
    with scratch("flow-bare") as work:
        # One bundle (and so one cgroup) per concurrent slot, as the runtime gives each sandbox.
        launchers = [bare_launcher("gvisor", rt, work) for _ in range(width)]
        free: queue.Queue[Callable[[], None]] = queue.Queue()
        for launch, _ in launchers:
            free.put(launch)

        def one(_i: int) -> None:
            launch = free.get()
            try:
                launch()
            finally:
                free.put(launch)

        try:
            launch = launchers[0][0]
            launch()
            singles = [timed(launch)[0] for _ in range(3)]
            with ThreadPoolExecutor(max_workers=width) as pool:
                wall, _ = timed(lambda: list(pool.map(one, range(n))))
        finally:
            for _, cleanup in launchers:
                cleanup()
    single = median(singles)
    return {
        "available": True,
        "single_s": r3(single),
        "wall_s": r3(wall),
        "width": width,
        "effective_concurrency": r3(n * single / wall),
    }


def run(quick: bool, latency_seconds: float) -> dict[str, Any]:
    n = 20 if quick else 50
    runtimes = [r for r in ("process", "gvisor") if get_runtime(r).availability().ok]
    with scratch("flow") as work:
        out_path = work / "flow.json"
        env = prefect_child_env(work)
        log(
            f"flow: {n}-way map on threadpool, {', '.join(runtimes)}; API latency {latency_seconds:g} s "
            "(ephemeral Prefect server, ~20 s to start)"
        )
        cmd = [
            sys.executable,
            str(BENCH / "_flow_child.py"),
            "--n",
            str(n),
            "--runtimes",
            ",".join(runtimes),
            "--latency-seconds",
            str(latency_seconds),
            "--out",
            str(out_path),
        ]
        with open(work / "child.log", "wb") as child_log:
            res = subprocess.run(cmd, env=env, stdout=child_log, stderr=subprocess.STDOUT, timeout=1800)
        if res.returncode != 0:
            tail = (work / "child.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"flow benchmark child failed (exit {res.returncode}):\n{tail}")
        child = json.loads(out_path.read_text())
    walls = child["wall_s"]
    out: dict[str, Any] = {
        "n": n,
        "wall_s": walls,
        "body_s": child.get("body_s", {}),
        "threadpool_max_workers": child["threadpool_max_workers"],
        "resoluto_max_workers": child.get("resoluto_max_workers"),
        "server_warmup_s": child["server_warmup_s"],
    }
    out["added_per_task_ms"] = {
        rt: round((walls[rt] - walls["threadpool"]) / n * 1000, 1) for rt in walls if rt != "threadpool"
    }
    if "gvisor" in runtimes:
        log(f"flow: {n} bare gVisor launches, {out['resoluto_max_workers']} at a time")
        bare = bare_concurrency(n, int(out["resoluto_max_workers"] or 4))
        out["gvisor_bare"] = bare
        if bare.get("available"):
            out["gvisor_target_s"] = r3(1.3 * n * bare["single_s"] / bare["effective_concurrency"])
    out["api_latency"] = child.get("api_latency")
    return out


def targets(res: dict[str, Any]) -> list[Target]:
    if "gvisor" not in res["wall_s"] or "gvisor_target_s" not in res:
        return [
            Target("flow", "gVisor mapped flow wall time", "<= 1.3 x bare/concurrency", "unavailable", None)
        ]
    tgt = res["gvisor_target_s"]
    out = []
    for key, label in (("gvisor", "pool off"), ("gvisor+pool", "pool on")):
        if key in res["wall_s"]:
            wall = res["wall_s"][key]
            out.append(
                Target(
                    "flow",
                    f"gVisor {res['n']}-way mapped flow wall time, {label}",
                    f"<= {tgt} s",
                    f"{wall} s",
                    wall <= tgt,
                )
            )
    for key, label in (("process", "pool off"), ("process+pool", "pool on")):
        if key in res["added_per_task_ms"]:
            added = res["added_per_task_ms"][key]
            out.append(
                Target(
                    "flow",
                    f"process: added per task over ThreadPool, {label}",
                    "<= 50 ms",
                    f"{added} ms",
                    added <= 50,
                )
            )
    return out


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    w = res["wall_s"]
    out = [(f"flow {res['n']}-way map", ", ".join(f"{k} {v} s" for k, v in w.items()))]
    if res.get("body_s"):
        # Reported, not judged: the wall is the figure; Prefect's exit rounds it up.
        out.append(
            (
                f"flow {res['n']}-way map body",
                ", ".join(f"{k} {v} s" for k, v in res["body_s"].items())
                + " (the flow function's entry to return; the wall adds Prefect's start and exit)",
            )
        )
    out.append(
        (
            "flow added per task",
            ", ".join(f"{k} +{v} ms" for k, v in res["added_per_task_ms"].items())
            + f" (resoluto max_workers {res['resoluto_max_workers']})",
        )
    )
    b = res.get("gvisor_bare")
    if b and b.get("available"):
        out.append(
            (
                "flow gVisor bare baseline",
                f"{res['n']} bare launches {b['wall_s']} s at width {b['width']} "
                f"(single {b['single_s']} s, effective concurrency {b['effective_concurrency']})",
            )
        )
    return out
