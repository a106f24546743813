"""Figure: Prefect calls in a task (``prefect_calls``, issue 34). A flow whose tasks
create artifacts and read an allowed variable and Secret block, on gVisor next to
ThreadPoolTaskRunner (Prefect's ephemeral API, in a child process).

The target: the gVisor wall time within 2 x the ThreadPool one plus the sandboxes' own
cost, that cost being what the same map of a task that calls nothing takes on gVisor
beyond ThreadPool. Met only when the sandboxed runs made the same artifacts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from common import BENCH, Target, log, prefect_child_env, r3, scratch

from prefect_resoluto.runtimes import get_runtime


def run(quick: bool) -> dict[str, Any]:
    n = 4 if quick else 8
    if not get_runtime("gvisor").availability().ok:
        return {"n": n, "gvisor": "gVisor unavailable here"}
    with scratch("prefect-calls") as work:
        out_path = work / "calls.json"
        env = prefect_child_env(work)
        log(f"prefect_calls: {n}-way map of an artifact + variable + secret task, threadpool and gvisor")
        cmd = [sys.executable, str(BENCH / "_prefect_calls_child.py"), "--n", str(n), "--out", str(out_path)]
        if quick:
            cmd += ["--repeat", "1"]
        with open(work / "child.log", "wb") as child_log:
            res = subprocess.run(cmd, env=env, stdout=child_log, stderr=subprocess.STDOUT, timeout=1800)
        if res.returncode != 0:
            tail = (work / "child.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"prefect_calls benchmark child failed (exit {res.returncode}):\n{tail}")
        out: dict[str, Any] = json.loads(out_path.read_text())
    w = out["wall_s"]
    own = max(0.0, w["gvisor_plain"] - w["threadpool_plain"])
    out["sandbox_cost_s"] = r3(own)
    out["bound_s"] = r3(2 * w["threadpool_calls"] + own)
    out["gvisor"] = "measured"
    return out


def targets(res: dict[str, Any]) -> list[Target]:
    what = "gvisor wall <= 2 x threadpool + sandboxes' own cost, same artifacts"
    if res.get("gvisor") != "measured":
        return [Target("prefect_calls", what, "<= bound", "n/a", None)]
    g = res["wall_s"]["gvisor_calls"]
    met = g <= res["bound_s"] and bool(res["same_artifacts"])
    return [Target("prefect_calls", what, f"<= {res['bound_s']} s", f"{g} s", met)]


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    if res.get("gvisor") != "measured":
        return [("prefect_calls", f"n/a: {res.get('gvisor')}")]
    w = res["wall_s"]
    differ = res.get("differ")
    return [
        *([("prefect_calls artifacts DIFFER", json.dumps(differ)[:2000])] if differ else []),
        (
            "prefect_calls wall (artifacts + variable + secret)",
            f"threadpool {w['threadpool_calls']} s, gvisor {w['gvisor_calls']} s "
            f"({res['n']}-way map, median of {res['repeat']})",
        ),
        (
            "prefect_calls sandboxes' own cost",
            f"plain task: threadpool {w['threadpool_plain']} s, gvisor {w['gvisor_plain']} s "
            f"(+{res['sandbox_cost_s']} s); bound 2 x {w['threadpool_calls']} + {res['sandbox_cost_s']} "
            f"= {res['bound_s']} s",
        ),
        (
            "prefect_calls artifacts",
            f"{res['artifacts']} per run, the same on gvisor: {res['same_artifacts']}",
        ),
    ]
