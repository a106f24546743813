"""Part ``scale_host`` of the ``scale`` figure: what the flow's own process pays per node.

1. **In flight.** A flow maps a sleeping task over N inputs with ``max_workers`` = N, so
   all N are in flight at once: on ``ThreadPoolTaskRunner`` (Prefect's engine per task, the
   yardstick) and on ``ResolutoTaskRunner(runtime="process")`` (warm pool off: every node
   cold), at N = 50, 200, 500 (quick: 20, 50), interleaved. Each configuration is a child
   process (``_scale_host_child.py``) on one ``prefect server`` this part starts on
   127.0.0.1; the child counts its own CPU (``RUSAGE_SELF``: not the sandboxes', not the
   server's), its children's CPU apart, and samples its RSS and threads. Reported per node:
   CPU, peak RSS over the RSS before the flow per task in flight, peak threads likewise;
   and Resoluto's CPU per node over ThreadPool's at the same N.
2. **A 1 000-task map on gVisor** (quick: 100) through the same API, the runner's
   defaults (width, warm pool): every result checked, RSS sampled with the number of tasks
   done, the slope of RSS over tasks done fitted from task 100 to the end (MiB per 100
   tasks), and the sandboxes left afterwards (the runtime's records, ``runsc list``).

Targets (issue #32): CPU per node within 2x of ThreadPool's; per-node CPU, RSS and threads
flat from the smallest N to the largest; the map's RSS slope under 1 MiB per 100 tasks;
every result right; 0 sandboxes left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import BENCH, Target, log, loopback_env, r3, scratch

from prefect_resoluto.runtimes import get_runtime

CHILD = BENCH / "_scale_host_child.py"
#: RSS slope of the long map, MiB per 100 tasks done, under which it counts as flat.
FLAT_MIB_PER_100 = 1.0
#: Per-node figures at the largest N over the smallest: within this, flat.
FLAT_RATIO = 1.5


def run(quick: bool) -> dict[str, Any]:
    sizes = (20, 50) if quick else (50, 200, 500)
    nap = 5.0 if quick else 20.0
    map_n = 100 if quick else 1000
    out: dict[str, Any] = {"quick": quick, "sizes": list(sizes), "nap_s": nap}
    with scratch("scale-host") as work, prefect_api(work) as api:
        out["api"] = "prefect server on 127.0.0.1 (started by this benchmark)"
        inflight: dict[str, dict[str, Any]] = {}
        for n in sizes:
            for runner in ("threadpool", "process"):
                log(f"scale_host: {n} sleeping tasks ({nap:g} s) in flight on {runner}")
                inflight[f"{runner}@{n}"] = summarise(child(work, api, runner, n, nap))
        out["inflight"] = inflight
        if get_runtime("gvisor").availability().ok:
            log(f"scale_host: a {map_n}-task map on gvisor (runner defaults)")
            out["map"] = summarise_map(
                child(work, api, "gvisor", map_n, 0.0, width=-1, pool=True, every=0.25)
            )
        else:
            out["map"] = {"available": False, "why": get_runtime("gvisor").availability().why}
    return out


def prefect_api(work: Path) -> Any:
    from support.prefect_cli import prefect_server

    return prefect_server(work, PREFECT_SERVER_ANALYTICS_ENABLED="false")


def child(
    work: Path,
    api: str,
    runner: str,
    n: int,
    nap: float,
    *,
    width: int = 0,
    pool: bool = False,
    every: float = 0.5,
    profile: bool = False,
    cprofile: bool = False,
    phases: bool = False,
) -> dict[str, Any]:
    out_path = Path(tempfile.mkstemp(dir=work, suffix=".json")[1])
    env = loopback_env(
        {
            "PREFECT_API_URL": api,
            "PREFECT_HOME": str(work / "prefect-home"),
            "PREFECT_LOGGING_LEVEL": "WARNING",
            "RESOLUTO_STATE_DIR": str(work / f"state-{runner}-{n}"),
            "PYTHONPATH": str(BENCH.parent),
        }
    )
    cmd = [sys.executable, str(CHILD), "--runner", runner, "--n", str(n), "--nap", str(nap)]
    cmd += ["--out", str(out_path), "--every", str(every)]
    cmd += ["--width", str(width)]  # 0: N (all in flight); -1: the runner's default
    if pool:
        cmd.append("--pool")
    if profile:
        cmd.append("--profile")
    if cprofile:
        cmd.append("--cprofile")
    if phases:
        cmd.append("--phases")
    log_path = work / f"child-{runner}-{n}.log"
    with open(log_path, "wb") as child_log:
        res = subprocess.run(cmd, env=env, stdout=child_log, stderr=subprocess.STDOUT, timeout=3600)
    if res.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"scale_host child {runner}@{n} failed (exit {res.returncode}):\n{tail}")
    return dict(json.loads(out_path.read_text()))


def summarise(c: dict[str, Any]) -> dict[str, Any]:
    n = c["n"]
    samples = c["samples"]
    peak_rss = max(s[2] for s in samples)
    peak_threads = max(s[3] for s in samples)
    return {
        "n": n,
        "wall_s": c["wall_s"],
        "correct": c["correct"],
        "self_cpu_s": c["self_cpu_s"],
        "children_cpu_s": c["children_cpu_s"],
        "cpu_per_node_ms": round(c["self_cpu_s"] / n * 1000, 1),
        "rss_before_mib": round(c["rss_before_kib"] / 1024, 1),
        "rss_peak_mib": round(peak_rss / 1024, 1),
        "rss_per_node_kib": round((peak_rss - c["rss_before_kib"]) / n, 1),
        "threads_before": c["threads_before"],
        "threads_peak": peak_threads,
        "threads_per_node": r3((peak_threads - c["threads_before"]) / n),
        "left": c.get("left"),
    }


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    k = len(points)
    if k < 2:
        return float("nan")
    mx = sum(x for x, _ in points) / k
    my = sum(y for _, y in points) / k
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else float("nan")


def summarise_map(c: dict[str, Any]) -> dict[str, Any]:
    n = c["n"]
    start = min(100, n // 10)
    pts = [(float(s[1]), s[2] / 1024) for s in c["samples"] if s[1] >= start]
    rss_at = {s[1]: s[2] for s in c["samples"]}
    left = c.get("left") or {}
    return {
        "available": True,
        "n": n,
        "from_task": start,
        "wall_s": c["wall_s"],
        "correct": c["correct"],
        "wrong": c["wrong"],
        "width": c["width"],
        "self_cpu_s": c["self_cpu_s"],
        "cpu_per_node_ms": round(c["self_cpu_s"] / n * 1000, 1),
        "rss_before_mib": round(c["rss_before_kib"] / 1024, 1),
        "rss_from_mib": round(min((v for k, v in rss_at.items() if k >= start), default=0) / 1024, 1),
        "rss_end_mib": round(c["samples"][-1][2] / 1024, 1),
        "rss_peak_mib": round(max(s[2] for s in c["samples"]) / 1024, 1),
        "slope_mib_per_100": round(slope(pts) * 100, 3),
        "threads_peak": max(s[3] for s in c["samples"]),
        "samples": len(pts),
        "left": left,
        "left_total": sum(v for v in left.values() if isinstance(v, int)),
    }


def ratio(res: dict[str, Any], n: int) -> float:
    inf = res["inflight"]
    tp = inf[f"threadpool@{n}"]["cpu_per_node_ms"]
    return round(inf[f"process@{n}"]["cpu_per_node_ms"] / tp, 2) if tp else float("nan")


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    q = " (quick)" if res.get("quick") else ""
    out: list[tuple[str, str]] = []
    for n in res["sizes"]:
        tp, pr = res["inflight"][f"threadpool@{n}"], res["inflight"][f"process@{n}"]
        out.append(
            (
                f"scale host: {n} in flight{q}",
                f"CPU/node process {pr['cpu_per_node_ms']} ms vs threadpool {tp['cpu_per_node_ms']} ms "
                f"(x{ratio(res, n)}); RSS/node {pr['rss_per_node_kib']} vs {tp['rss_per_node_kib']} KiB "
                f"(peak {pr['rss_peak_mib']} vs {tp['rss_peak_mib']} MiB); threads/node "
                f"{pr['threads_per_node']} vs {tp['threads_per_node']} (peak {pr['threads_peak']} vs "
                f"{tp['threads_peak']}); wall {pr['wall_s']} vs {tp['wall_s']} s ({res['nap_s']:g} s naps); "
                f"sandboxes' CPU {pr['children_cpu_s']} s",
            )
        )
    m = res.get("map") or {}
    if not m.get("available"):
        out.append((f"scale host: gVisor map{q}", f"unavailable: {m.get('why')}"))
        return out
    out.append(
        (
            f"scale host: {m['n']}-task gVisor map{q}",
            f"{'all correct' if m['correct'] else str(m['wrong']) + ' WRONG'}; RSS {m['rss_from_mib']} MiB at "
            f"task {m['from_task']} -> {m['rss_end_mib']} MiB at the end (peak {m['rss_peak_mib']}), slope "
            f"{m['slope_mib_per_100']} MiB/100 tasks ({m['samples']} samples); host CPU/node "
            f"{m['cpu_per_node_ms']} ms; wall {m['wall_s']} s at width {m['width']}; left {m['left']}",
        )
    )
    return out


def targets(res: dict[str, Any]) -> list[Target]:
    sizes = res["sizes"]
    inf = res["inflight"]
    out = []
    for n in sizes:
        r = ratio(res, n)
        out.append(
            Target(
                "scale_host", f"host CPU per node vs ThreadPool at {n} in flight", "<= 2x", f"x{r}", r <= 2.0
            )
        )
    lo, hi = inf[f"process@{sizes[0]}"], inf[f"process@{sizes[-1]}"]
    for key, what in (
        ("cpu_per_node_ms", "CPU per node"),
        ("rss_per_node_kib", "RSS per in-flight node"),
        ("threads_per_node", "threads per in-flight node"),
    ):
        a, b = lo[key], hi[key]
        grow = round(b / a, 2) if a else float("nan")
        out.append(
            Target(
                "scale_host",
                f"{what}: {sizes[-1]} in flight over {sizes[0]}",
                f"<= x{FLAT_RATIO}",
                f"x{grow} ({a} -> {b})",
                grow <= FLAT_RATIO,
            )
        )
    m = res.get("map") or {}
    if not m.get("available"):
        out.append(Target("scale_host", "gVisor map", "runs", "unavailable", None))
        return out
    out += [
        Target(
            "scale_host", f"{m['n']}-task gVisor map: results", "all correct", str(m["correct"]), m["correct"]
        ),
        Target(
            "scale_host",
            f"{m['n']}-task gVisor map: RSS slope from task {m['from_task']}",
            f"< {FLAT_MIB_PER_100} MiB/100 tasks",
            f"{m['slope_mib_per_100']} MiB/100",
            abs(m["slope_mib_per_100"]) < FLAT_MIB_PER_100,
        ),
        Target(
            "scale_host",
            f"{m['n']}-task gVisor map: sandboxes left",
            "0",
            str(m["left_total"]),
            m["left_total"] == 0,
        ),
    ]
    return out


if __name__ == "__main__":  # one configuration by hand: scale_host.py RUNNER N NAP [--profile]
    import contextlib

    sys.path.insert(0, str(BENCH))
    with scratch("scale-host-one") as w, contextlib.ExitStack() as stack:
        url = stack.enter_context(prefect_api(w))
        c = child(
            w,
            url,
            sys.argv[1],
            int(sys.argv[2]),
            float(sys.argv[3]),
            width=int(os.environ.get("WIDTH", "0")),
            pool="--pool" in sys.argv,
            profile="--profile" in sys.argv,
            cprofile="--cprofile" in sys.argv,
            phases="--phases" in sys.argv,
        )
        if "phases_ms_per_node" in c:
            print(json.dumps(c.pop("phases_ms_per_node"), indent=1))
        prof = c.pop("profile", None)
        cprof = c.pop("cprofile", None)
        if "main_profile" in c:
            print(c.pop("main_profile"))
        print(json.dumps(summarise(c) if c["runner"] != "gvisor" else summarise_map(c), indent=1))
        if prof:
            print(f"running samples: {prof['running_samples']}")
            for stack_text, count in prof["top"]:
                print(f"{count:6d}  {stack_text}")
        if cprof:
            print(cprof)
