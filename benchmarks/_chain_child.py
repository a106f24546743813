"""Runs in its own process with Prefect's ephemeral API (a temporary server on 127.0.0.1).

Times a flow of ``--n`` dependent trivial tasks (each takes the previous task's result,
so they run one after another) under ThreadPoolTaskRunner and under
ResolutoTaskRunner(runtime="gvisor") with its default warm pool, interleaved round by
round. ``--profile PATH`` also writes a cProfile of one gVisor chain (the flow process).
Writes one JSON object to the path given as ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runtime", default="gvisor")
    ap.add_argument("--profile", default="")
    ap.add_argument("--timeline", default="", help="write one gVisor chain's per-node timeline here")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from common import child_workspace

    work, ws = child_workspace("chain", "bench_tasks", (HERE / "_bench_tasks.py").read_text())
    import bench_tasks  # noqa: E402  (from the workspace, so the sandbox imports it by file)
    from prefect import flow
    from prefect.task_runners import ThreadPoolTaskRunner

    from prefect_resoluto.task_runner.runner import ResolutoTaskRunner

    logging.getLogger("prefect").setLevel(logging.WARNING)
    if args.timeline:
        import _timeline

        _timeline.install(profile_nodes=True)

    def resoluto() -> ResolutoTaskRunner:
        return ResolutoTaskRunner(
            runtime=args.runtime,
            conduit=(work / "conduit").as_uri(),
            workspace=ws,
            outputs_dir=work / "outputs",
            min_isolation="none" if args.runtime == "process" else None,
        )

    def chain(runner: object, n: int) -> float:
        @flow(task_runner=runner, name="bench-chain", persist_result=False)
        def bench_chain() -> int:
            # Each task waits on the one before: the flow's critical path is the whole chain.
            fut = bench_tasks.noop.submit(0)
            for _ in range(n - 1):
                fut = bench_tasks.noop.submit(fut)
            return fut.result()

        t0 = time.perf_counter()
        res = bench_chain()
        took = time.perf_counter() - t0
        if res != 0:
            raise RuntimeError(f"chain flow returned {res!r}")
        return took

    # Warm-up: the ephemeral server, every import, and the pool's key learned (its
    # template image made), all before any timing.
    t0 = time.perf_counter()
    chain(ThreadPoolTaskRunner(), 2)
    warmup = time.perf_counter() - t0
    chain(resoluto(), 2)

    walls: dict[str, list[float]] = {"threadpool": [], args.runtime: []}
    for _ in range(args.rounds):
        walls["threadpool"].append(chain(ThreadPoolTaskRunner(), args.n))
        walls[args.runtime].append(chain(resoluto(), args.n))
    out: dict[str, object] = {
        "n": args.n,
        "rounds": args.rounds,
        "server_warmup_s": round(warmup, 2),
        "wall_s": {k: [round(x, 4) for x in v] for k, v in walls.items()},
    }
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        chain(resoluto(), args.n)
        prof.disable()
        prof.dump_stats(args.profile)
    if args.timeline:
        import _timeline

        del _timeline.SPANS[:], _timeline.MARKS[:], _timeline.PROFILES[:]
        t_start = time.time()
        took = chain(resoluto(), args.n)
        lines = [f"one {args.runtime} chain of {args.n}: {took * 1000:.1f} ms", *_timeline.report(t_start)]
        Path(args.timeline).write_text("\n".join(lines) + "\n")
        _timeline.dump_profiles(args.timeline + ".prof")
    Path(args.out).write_text(json.dumps(out))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
