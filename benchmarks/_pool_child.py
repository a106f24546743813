"""Runs in its own process with Prefect's ephemeral API: the ``pool`` figures.

Submit -> result of a trivial Python task on gVisor, one task after another, with the
warm pool off (cold), on (back to back: the next task takes whatever the pool has, a
sandbox still booting included) and on with a ready sandbox (the pool given the time to
boot its replacement between tasks: the warm path itself); the warm runs twice, with
sandboxes restored from the key's snapshot image (the default) and booted
(``RESOLUTO_WARM_SNAPSHOTS=0``). The same for a task module that imports
``prefect.variables``. Interleaved with the same number of bare ``runsc run`` launches of
``python -c pass`` (the runtime's own bundle). Each sandbox's CPU (``cpu_node.py``) is
noted at its destroy. Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--prefect-n", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import common  # noqa: F401
    import cpu_node
    from overhead import bare_launcher

    cpu_node.record_destroys()

    work = Path(tempfile.mkdtemp(prefix="resoluto-bench-pool-"))
    ws = work / "ws"
    ws.mkdir()
    shutil.copy(HERE / "_bench_tasks.py", ws / "bench_tasks.py")
    shutil.copy(HERE / "_bench_prefect_tasks.py", ws / "bench_prefect_tasks.py")
    sys.path.insert(0, str(ws))
    import bench_prefect_tasks  # noqa: E402
    import bench_tasks  # noqa: E402
    from prefect import flow
    from prefect.context import FlowRunContext
    from prefect.task_runners import ThreadPoolTaskRunner

    from prefect_resoluto.runtimes import get_runtime
    from prefect_resoluto.task_runner.runner import ResolutoTaskRunner

    logging.getLogger("prefect").setLevel(logging.WARNING)
    out: dict[str, object] = {}

    def runner(warm_pool: int) -> ResolutoTaskRunner:
        return ResolutoTaskRunner(
            runtime="gvisor",
            conduit=(work / "conduit").as_uri(),
            workspace=ws,
            outputs_dir=work / "outputs",
            warm_pool=warm_pool,
        )

    def wait_ready(timeout: float = 120.0) -> None:
        ctx = FlowRunContext.get()
        pool = getattr(ctx.task_runner, "_pool", None) if ctx else None
        if pool is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with pool._lock:
                keys = list(pool._wanted)
            if keys and all(pool.ready_count(k) for k in keys):
                return
            time.sleep(0.02)  # polling the pool's readiness (not part of any timing)

    cpu: dict[str, list[float]] = {}

    def sequential(
        task: object, warm_pool: int, n: int, ready: bool, snapshots: bool = True, tag: str = ""
    ) -> list[float]:
        os.environ["RESOLUTO_WARM_SNAPSHOTS"] = "1" if snapshots else "0"
        start = cpu_node.mark()
        try:
            return _sequential(task, warm_pool, n, ready)
        finally:
            if tag:
                cpu[tag] = cpu_node.since(start, "assigned" if warm_pool else "cold")

    def _sequential(task: object, warm_pool: int, n: int, ready: bool) -> list[float]:
        @flow(task_runner=runner(warm_pool), name="bench-pool", persist_result=False)
        def one_after_another() -> list[float]:
            times = []
            for i in range(n + 1):  # the first one teaches the pool a new key; not counted
                if ready:
                    wait_ready()
                t0 = time.perf_counter()
                assert task.submit(i).result() == i  # type: ignore[attr-defined]
                times.append(time.perf_counter() - t0)
            return times[1:]

        return one_after_another()

    # Warm-up: the ephemeral server, and the imports, once.
    @flow(task_runner=ThreadPoolTaskRunner(), name="bench-warmup", persist_result=False)
    def warmup() -> int:
        return bench_tasks.noop.submit(1).result()

    warmup()
    rt = get_runtime("gvisor")
    bare, cleanup = bare_launcher("gvisor", rt, work)
    try:
        bare()
        bare_s = []
        for _ in range(args.n):
            t0 = time.perf_counter()
            bare()
            bare_s.append(time.perf_counter() - t0)
        out["bare_s"] = bare_s
        out["trivial"] = {
            "cold": sequential(bench_tasks.noop, 0, args.n, ready=False, tag="cold"),
            "warm_back_to_back": sequential(bench_tasks.noop, 1, args.n, ready=False),
            "warm_ready": sequential(bench_tasks.noop, 1, args.n, ready=True, tag="restored"),
            "warm_back_to_back_booted": sequential(bench_tasks.noop, 1, args.n, ready=False, snapshots=False),
            "warm_ready_booted": sequential(
                bench_tasks.noop, 1, args.n, ready=True, snapshots=False, tag="warm_booted"
            ),
        }
        for _ in range(args.n):  # and after, so drift hits both sides
            t0 = time.perf_counter()
            bare()
            bare_s.append(time.perf_counter() - t0)
        out["bare_s"] = bare_s
        out["real_prefect"] = {
            "cold": sequential(bench_prefect_tasks.noop_real, 0, args.prefect_n, ready=False),
            "warm_ready": sequential(bench_prefect_tasks.noop_real, 1, args.prefect_n, ready=True),
            "warm_ready_booted": sequential(
                bench_prefect_tasks.noop_real, 1, args.prefect_n, ready=True, snapshots=False
            ),
        }
        cpu["bare"] = cpu_node.bare_cpu(rt, work / "bare-cpu", args.n)
        out["cpu_s"] = cpu
        images = Path(rt.state) / "snapshots"  # type: ignore[attr-defined]
        out["images"] = [
            {k: v for k, v in json.loads((d / "meta.json").read_text()).items() if k != "key"}
            for d in sorted(images.iterdir())
            if (d / "meta.json").is_file()
        ]
    finally:
        cleanup()
    Path(args.out).write_text(json.dumps(out))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
