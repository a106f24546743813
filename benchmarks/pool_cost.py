"""Figure: the warm pool (``pool latency``, ``pool real-prefect``, ``pool memory``, ``cpu per node``).

Latency: submit -> result of a trivial Python task on gVisor through ResolutoTaskRunner,
one task after another (a child process with Prefect's ephemeral API, see
``_pool_child.py``): cold, warm back to back, warm with a ready sandbox; next to bare
``runsc run`` launches of ``python -c pass`` in the same run. The same for a module that
imports ``prefect.variables``.

Warm sandboxes are restored from the key's snapshot image (the default), and, side by
side, booted (``RESOLUTO_WARM_SNAPSHOTS=0``).

Memory: the pool at its default size (``pool.DEFAULT_CAP`` here, as ``max_workers`` is 4),
every sandbox ready and idle, booted and then restored; RSS and PSS of each sandbox's
process tree (``runsc run`` or the restore reaper with ``runsc restore`` under it, its gofer
and its sentry with the guest inside), from /proc.

CPU per node (``cpu_node.py``): a sandbox's cgroup CPU from start to destroy, for the
trivial task cold, warm booted and warm restored (ready), and a bare ``runsc run``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from common import BENCH, Target, log, median, ms, percentile, prefect_child_env, scratch

from guest_runner.conduit import LocalConduit
from prefect_resoluto.runtimes import get_runtime
from prefect_resoluto.warm import pool as pool_mod


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    return kids


def _tree_kib(pid: int, kids: dict[int, list[int]]) -> tuple[int, int]:
    """(RSS, PSS) in KiB of ``pid`` and its descendants."""
    rss = pss = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        todo += kids.get(p, [])
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1])
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1])
        except OSError:
            pass
    return rss, pss


def memory(snapshots: bool = False) -> dict[str, Any]:
    import time

    rt = get_runtime("gvisor")
    if not rt.availability().ok:
        return {"available": False}
    size = pool_mod.default_size(None, 4)
    with scratch("pool-mem") as work:
        pool = pool_mod.WarmPool(rt, LocalConduit(work / "conduit"), size=size, snapshots=snapshots)
        key = pool_mod.PoolKey()
        pool.want(key, idle=size)  # the whole default size, as a flow with 4 nodes in flight keeps it
        try:
            deadline = time.monotonic() + 180
            while pool.ready_count(key) < size and time.monotonic() < deadline:
                time.sleep(0.05)  # polling readiness; nothing is timed here
            kids = _children()
            with pool._lock:
                pids = [w.handle.data["pid"] for w in pool._idle.get(key, [])]
            per = [_tree_kib(pid, kids) for pid in pids]
        finally:
            pool.close()
    rss = [r / 1024 for r, _ in per]
    pss = [p / 1024 for _, p in per]
    return {
        "available": True,
        "size": size,
        "rss_mib": [round(x, 1) for x in rss],
        "pss_mib": [round(x, 1) for x in pss],
        "rss_median_mib": round(median(rss), 1),
        "pss_median_mib": round(median(pss), 1),
        "total_rss_mib": round(sum(rss), 1),
        "total_pss_mib": round(sum(pss), 1),
    }


def _stats(xs: list[float]) -> dict[str, Any]:
    return {"p50_ms": ms(median(xs)), "p99_ms": ms(percentile(xs, 99)), "n": len(xs)}


def run(quick: bool) -> dict[str, Any]:
    if not get_runtime("gvisor").availability().ok:
        return {"available": False}
    n, pn = (20, 5) if quick else (20, 20)
    log("pool: memory of the default-size pool, booted and restored")
    out: dict[str, Any] = {"available": True, "memory": memory(), "memory_restored": memory(snapshots=True)}
    with scratch("pool") as work:
        out_path = work / "pool.json"
        env = prefect_child_env(work)
        log(f"pool: latency, {n} trivial tasks cold / warm back to back / warm ready; {pn} real-prefect each")
        cmd = [
            sys.executable,
            str(BENCH / "_pool_child.py"),
            "--n",
            str(n),
            "--prefect-n",
            str(pn),
            "--out",
            str(out_path),
        ]
        with open(work / "child.log", "wb") as child_log:
            res = subprocess.run(cmd, env=env, stdout=child_log, stderr=subprocess.STDOUT, timeout=3600)
        if res.returncode != 0:
            tail = (work / "child.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"pool benchmark child failed (exit {res.returncode}):\n{tail}")
        child = json.loads(out_path.read_text())
    out["bare"] = _stats(child["bare_s"])
    out["trivial"] = {k: _stats(v) for k, v in child["trivial"].items()}
    out["real_prefect"] = {k: _stats(v) for k, v in child["real_prefect"].items()}
    out["cpu"] = {k: {"p50_ms": ms(median(v)), "n": len(v)} for k, v in child["cpu_s"].items() if v}
    out["images"] = child.get("images", [])
    out["raw_s"] = child
    return out


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    if not res.get("available"):
        return [("pool", "unavailable: gVisor is not available here")]
    b = res["bare"]
    fmt = lambda s: f"p50 {s['p50_ms']} ms / p99 {s['p99_ms']} ms"  # noqa: E731
    t, p, m = res["trivial"], res["real_prefect"], res["memory"]
    out = [
        (
            "pool latency (trivial, gVisor)",
            f"cold {fmt(t['cold'])}; restored: warm back to back {fmt(t['warm_back_to_back'])}; warm ready "
            f"{fmt(t['warm_ready'])}; booted: warm back to back {fmt(t['warm_back_to_back_booted'])}; warm "
            f"ready {fmt(t['warm_ready_booted'])}; bare runsc run {fmt(b)} (N={t['cold']['n']})",
        ),
        (
            "pool real-prefect (gVisor)",
            f"cold {fmt(p['cold'])}; warm ready restored {fmt(p['warm_ready'])}; warm ready booted "
            f"{fmt(p['warm_ready_booted'])} (N={p['cold']['n']})",
        ),
    ]
    c = res.get("cpu") or {}
    if c:
        bare = c.get("bare", {}).get("p50_ms")
        parts = [
            f"{label} {c[k]['p50_ms']} ms"
            + (f" (x{round(c[k]['p50_ms'] / bare, 2)} of bare)" if bare else "")
            for k, label in (("restored", "warm restored"), ("warm_booted", "warm booted"), ("cold", "cold"))
            if k in c
        ]
        out.append(
            (
                "cpu per node (sandbox cgroup, trivial task)",
                "p50 " + "; ".join(parts) + f"; bare runsc run python -c pass {bare} ms",
            )
        )
    for img in res.get("images") or []:
        out.append(
            (
                "pool snapshot image (per key, once)",
                f"template boot {img.get('template_boot_s')} s + checkpoint {img.get('checkpoint_s')} s, "
                f"{round(img.get('bytes', 0) / 2**20, 1)} MiB",
            )
        )
    for label, mem in (("booted", m), ("restored", res.get("memory_restored") or {})):
        if mem.get("available"):
            out.append(
                (
                    f"pool memory (idle gVisor sandbox, {label})",
                    f"RSS {mem['rss_median_mib']} MiB, PSS {mem['pss_median_mib']} MiB per sandbox; pool of "
                    f"{mem['size']}: RSS {mem['total_rss_mib']} MiB, PSS {mem['total_pss_mib']} MiB",
                )
            )
    return out


def targets(res: dict[str, Any]) -> list[Target]:
    if not res.get("available"):
        return [Target("pool", "warm p50 vs bare runsc run", "<= 0.35 x bare", "unavailable", None)]
    bare = res["bare"]["p50_ms"]
    t, p = res["trivial"], res["real_prefect"]
    warm, b2b = t["warm_ready"]["p50_ms"], t["warm_back_to_back"]["p50_ms"]
    real, real99 = p["warm_ready"]["p50_ms"], p["warm_ready"]["p99_ms"]
    out = [
        Target(
            "pool",
            "latency: warm (ready, restored) p50 vs bare runsc run",
            f"<= {round(0.35 * bare, 1)} ms (0.35 x bare)",
            f"{warm} ms (x{round(warm / bare, 3)} of bare {bare} ms)",
            warm <= 0.35 * bare,
        ),
        Target(
            "pool",
            "latency: warm back to back (restored) p50 vs bare runsc run",
            f"<= {round(0.5 * bare, 1)} ms (0.5 x bare)",
            f"{b2b} ms (x{round(b2b / bare, 3)} of bare {bare} ms)",
            b2b <= 0.5 * bare,
        ),
        Target("pool", "real-prefect: warm (ready, restored) p50", "<= 300 ms", f"{real} ms", real <= 300),
        Target(
            "pool", "real-prefect: warm (ready, restored) p99", "<= 600 ms", f"{real99} ms", real99 <= 600
        ),
    ]
    c = res.get("cpu") or {}
    if "restored" in c and "bare" in c:
        r, bb = c["restored"]["p50_ms"], c["bare"]["p50_ms"]
        out.append(
            Target(
                "cpu per node",
                "warm restored node's sandbox CPU vs bare runsc run",
                f"<= {round(0.5 * bb, 1)} ms (0.5 x bare)",
                f"{r} ms (x{round(r / bb, 2)} of bare {bb} ms)",
                r <= 0.5 * bb,
            )
        )
    return out
