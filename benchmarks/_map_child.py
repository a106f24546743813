"""Runs in its own process with Prefect's ephemeral API (a temporary server on 127.0.0.1).

Where a mapped gVisor flow's time and CPU go (issue 42): one ``noop.map(range(N))`` under
``ResolutoTaskRunner(runtime="gvisor")`` with its default pool, after a warm-up that made the
pool's image. Reports the flow's wall time; the CPU of the flow process (its own threads)
and of every sandbox (its cgroup, read just before its destroy: runsc's sandbox and gofer
and everything inside), split into sandboxes that served a node and idle ones discarded at
exit; the machine's idle CPU over the map (is it CPU-bound or waiting?); and per node the
host's phases and the guest's events (``_timeline.py``), summarised as medians, plus how
many nodes ran and how many sandboxes were restoring at each moment.

``python benchmarks/_map_child.py --n 50 --out map.json [--timeline map.txt]``
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def _machine_cpu() -> tuple[float, float]:
    """(busy, idle) jiffies of the whole machine, from /proc/stat."""
    fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, idle


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeline", default="", help="write the last round's per-node timeline here")
    ap.add_argument("--spy", default="", help="py-spy binary: a sampled profile of the timed map")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from common import BODIES, child_workspace, timed_map

    work, ws = child_workspace("map", "bench_tasks", (HERE / "_bench_tasks.py").read_text())
    import _timeline
    import bench_tasks  # noqa: E402  (from the workspace, so the sandbox imports it by file)
    from node_cpu import _keep_cpuacct, _usage
    from prefect.task_runners import ThreadPoolTaskRunner

    from prefect_resoluto.runtimes import get_runtime
    from prefect_resoluto.runtimes.gvisor import GVisorRuntime
    from prefect_resoluto.task_runner.runner import ResolutoTaskRunner

    logging.getLogger("prefect").setLevel(logging.WARNING)
    _timeline.install(profile_nodes=False)

    # Each sandbox's CPU, read just before its destroy (its cgroup is kept past runsc's exit).
    cpu: dict[str, float] = {}
    assigned: set[str] = set()
    destroy, assign = GVisorRuntime.destroy, GVisorRuntime.assign

    def counted_destroy(self: Any, handle: Any) -> Any:
        used = _usage(self, handle.id)
        if used is not None and handle.id not in cpu:
            cpu[handle.id] = used
        return destroy(self, handle)

    def counted_assign(self: Any, handle: Any, *a: Any, **k: Any) -> Any:
        assigned.add(handle.id)
        return assign(self, handle, *a, **k)

    GVisorRuntime.destroy = counted_destroy  # type: ignore[method-assign]
    GVisorRuntime.assign = counted_assign  # type: ignore[method-assign]

    def resoluto() -> ResolutoTaskRunner:
        runner = ResolutoTaskRunner(
            runtime="gvisor", conduit=(work / "conduit").as_uri(), workspace=ws, outputs_dir=work / "outputs"
        )
        _keep_cpuacct(get_runtime("gvisor"))
        return runner

    def mapped(runner: object, n: int) -> float:
        return timed_map(runner, bench_tasks.noop, n)

    mapped(ThreadPoolTaskRunner(), 2)  # the ephemeral server and every import
    mapped(resoluto(), 4)  # the pool's image made, the module's imports learned
    # The same map on Prefect's own runner, accounted the same way: what the API server and
    # Prefect's engine cost per task without any sandbox.
    r0, m0 = resource.getrusage(resource.RUSAGE_SELF), _machine_cpu()
    tp_wall = mapped(ThreadPoolTaskRunner(), args.n)
    r1, m1 = resource.getrusage(resource.RUSAGE_SELF), _machine_cpu()
    tp_own = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    threadpool = {
        "wall_s": round(tp_wall, 3),
        "body_s": round(BODIES[-1], 3),
        "flow_process_cpu_s": round(tp_own, 3),
        "other_cpu_s": round((m1[0] - m0[0]) / os.sysconf("SC_CLK_TCK") - tp_own, 3),
    }
    rounds = []
    for _ in range(args.rounds):
        del _timeline.SPANS[:], _timeline.MARKS[:]
        cpu.clear()
        assigned.clear()
        t_start = time.time()
        spy = _sampler(args.spy)
        r0, m0 = resource.getrusage(resource.RUSAGE_SELF), _machine_cpu()
        c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        wall = mapped(resoluto(), args.n)
        r1, m1 = resource.getrusage(resource.RUSAGE_SELF), _machine_cpu()
        c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait()
        busy, idle = m1[0] - m0[0], m1[1] - m0[1]
        own = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
        kids = c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime
        served = [cpu[s] for s in cpu if s in assigned]
        idle_sb = [cpu[s] for s in cpu if s not in assigned]
        rounds.append(
            {
                "wall_s": round(wall, 3),
                "body_s": round(BODIES[-1], 3),
                "flow_process_cpu_s": round(own, 3),
                # Every process it started and reaped: the sandboxes' runsc processes (in
                # their cgroups) and what runs outside them (runsc's CLI, the restore reaper).
                "children_cpu_s": round(kids, 3),
                # The rest of the machine's busy CPU over the map: Prefect's API server
                # (the ephemeral one, not reaped until exit), the kernel's own threads.
                "other_cpu_s": round(busy / os.sysconf("SC_CLK_TCK") - own - kids, 3),
                "sandboxes_served": len(served),
                "sandbox_cpu_served_s": round(sum(served), 3),
                "sandbox_cpu_median_s": round(statistics.median(served), 3) if served else None,
                "sandboxes_idle_discarded": len(idle_sb),
                "sandbox_cpu_idle_s": round(sum(idle_sb), 3),
                "machine_busy_fraction": round(busy / (busy + idle), 3) if busy + idle else None,
                "load_avg": os.getloadavg()[0],
                "phases_ms": phases(_timeline.SPANS, _timeline.MARKS, t_start),
            }
        )
        if args.timeline:
            lines = [f"one gvisor map of {args.n}: {wall * 1000:.1f} ms", json.dumps(rounds[-1])]
            lines += concurrency(_timeline.SPANS, t_start)
            lines += _timeline.report(t_start)
            Path(args.timeline).write_text("\n".join(lines) + "\n")
    Path(args.out).write_text(json.dumps({"n": args.n, "threadpool": threadpool, "rounds": rounds}))
    shutil.rmtree(work, ignore_errors=True)


def _sampler(spy: str) -> subprocess.Popen[bytes] | None:
    """py-spy sampling this process (every thread, idle ones left out) into ``<spy>.txt``."""
    if not spy:
        return None
    out = f"/tmp/map-spy-{os.getpid()}.txt"
    proc = subprocess.Popen(
        [spy, "record", "-p", str(os.getpid()), "-r", "200", "-f", "raw", "-o", out, "--nonblocking"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)  # py-spy attaches before the map starts (a benchmark child only)
    return proc


def phases(spans: list[Any], marks: list[Any], t_start: float) -> dict[str, float]:
    """Median ms of each host span label over the nodes, and of the guest's first -> last
    event and assigned -> first event per node thread."""
    by: dict[str, list[float]] = defaultdict(list)
    for _th, label, a, b in spans:
        by[label].append((b - a) * 1000)
    out = {label: round(statistics.median(v), 1) for label, v in by.items()}
    out.update({f"{label} (sum s)": round(sum(v) / 1000, 2) for label, v in by.items()})
    guest: dict[str, list[float]] = defaultdict(list)
    host_start: dict[str, float] = {}
    for th, label, a, _b in spans:
        if label == "start_sandbox":
            host_start[th] = a
    for th, label, at in marks:
        if label.startswith("guest "):
            guest[th].append(at)
    firsts = [min(v) - host_start[th] for th, v in guest.items() if th in host_start]
    spans_g = [max(v) - min(v) for v in guest.values()]
    if firsts:
        out["assigned -> guest's first event"] = round(statistics.median(firsts) * 1000, 1)
    if spans_g:
        out["guest first -> last event"] = round(statistics.median(spans_g) * 1000, 1)
    return out


def concurrency(spans: list[Any], t_start: float) -> list[str]:
    """Every 250 ms: nodes running (``node`` spans), sandboxes being restored (``pool
    restore`` is only the start: counted till the take), destroys in flight."""
    end = max((b for _, _, _, b in spans), default=t_start)
    out = ["t(ms) nodes destroys take-waits"]
    t = t_start
    while t < end:
        nodes = sum(1 for _, lab, a, b in spans if lab == "node" and a <= t < b)
        dest = sum(1 for _, lab, a, b in spans if lab == "destroy" and a <= t < b)
        takes = sum(1 for _, lab, a, b in spans if lab == "take warm" and a <= t < b)
        out.append(f"{(t - t_start) * 1000:7.0f} {nodes:3d} {dest:3d} {takes:3d}")
        t += 0.25
    return out


if __name__ == "__main__":
    threading.current_thread().name = "main"
    main()
