"""Runs in its own process with Prefect's ephemeral API (a temporary server on 127.0.0.1).

Measures, in one server lifetime (its ~20 s start is paid once, before any timing):
the wall time of an N-way mapped trivial task under ThreadPoolTaskRunner and under
ResolutoTaskRunner on each requested runtime, and the latency of sandbox log lines at
the Prefect log API (``created`` of each stored log row minus the print time the guest
wrote into the line). Writes one JSON object to the path given as ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))  # api_requests: the request counter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--runtimes", default="process,gvisor")
    ap.add_argument("--latency-seconds", type=float, default=5.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from common import BODIES, child_workspace, timed_map

    work, ws = child_workspace("flow", "bench_tasks", (HERE / "_bench_tasks.py").read_text())
    import bench_tasks  # noqa: E402  (from the workspace, so the sandbox imports it by file)
    from prefect.task_runners import ThreadPoolTaskRunner

    from prefect_resoluto.task_runner.runner import ResolutoTaskRunner

    logging.getLogger("prefect").setLevel(logging.WARNING)
    logging.getLogger("prefect.task_runs").setLevel(logging.INFO)  # forwarded sandbox lines pass
    out: dict[str, object] = {"n": args.n}

    def resoluto(runtime: str, warm_pool: int | None = 0) -> ResolutoTaskRunner:
        """``warm_pool``: 0 (off, the cold path) or None (the runner's default pool)."""
        return ResolutoTaskRunner(
            runtime=runtime,
            conduit=(work / "conduit").as_uri(),
            workspace=ws,
            outputs_dir=work / "outputs",
            warm_pool=warm_pool,
            min_isolation="none" if runtime == "process" else None,
        )

    def mapped(runner: object, n: int) -> float:
        return timed_map(runner, bench_tasks.noop, n)

    # Warm-up: starts the ephemeral server and imports everything once.
    t0 = time.perf_counter()
    mapped(ThreadPoolTaskRunner(), 2)
    out["server_warmup_s"] = round(time.perf_counter() - t0, 2)
    runtimes = [r for r in args.runtimes.split(",") if r]
    for rt in runtimes:
        mapped(resoluto(rt), 1)
        # The pool's key learned and its snapshot image made (a template boot, seconds), as
        # any flow after a host's first finds them: not the map's to pay (as chain's warm-up).
        mapped(resoluto(rt, None), 2)

    if args.n > 0:  # --n 0: the latency figure alone
        walls: dict[str, float] = {}
        bodies: dict[str, float] = {}
        tp = ThreadPoolTaskRunner()
        walls["threadpool"] = mapped(tp, args.n)
        bodies["threadpool"] = BODIES[-1]
        out["threadpool_max_workers"] = tp._max_workers
        for rt in runtimes:
            runner = resoluto(rt)
            out["resoluto_max_workers"] = runner._max_workers
            walls[rt] = mapped(runner, args.n)
            bodies[rt] = BODIES[-1]
            walls[f"{rt}+pool"] = mapped(resoluto(rt, None), args.n)
            bodies[f"{rt}+pool"] = BODIES[-1]
        out["wall_s"] = {k: round(v, 3) for k, v in walls.items()}
        out["body_s"] = {k: round(v, 3) for k, v in bodies.items()}

    # Latency at the Prefect log API, on the process runtime (the cheapest sandbox, so
    # the figure is the log path's own).
    if args.latency_seconds > 0:
        out["api_latency"] = api_latency(resoluto("process"), bench_tasks, args.latency_seconds, every=0.01)
        # The same at 1 000 lines/s: what a heavy stream costs in API requests.
        out["api_latency"]["at_1000"] = api_latency(
            resoluto("process"), bench_tasks, args.latency_seconds, every=0.001
        )
    Path(args.out).write_text(json.dumps(out))
    shutil.rmtree(work, ignore_errors=True)


def api_latency(runner: object, bench_tasks: object, seconds: float, every: float) -> dict[str, Any]:
    """Latency of each ``tick`` line at the API, and the ``POST /logs/`` requests the whole
    flow run cost (every log of the run: the sandbox's lines and the engine's own)."""
    from prefect import flow, get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.logging.handlers import APILogHandler
    from support.api_requests import counting_api_requests

    # log_prints: the ticker's lines are prints, logged as Prefect logs a thread's prints then
    @flow(task_runner=runner, name="bench-latency", persist_result=False, log_prints=True)
    def bench_latency() -> int:
        return bench_tasks.ticker.submit(seconds, every).result()  # type: ignore[attr-defined]

    # When each line's API row reached the runner's batcher (the forwarder, on the tail's
    # thread): splits the latency into guest + tail (print -> here) and batching + API
    # (here -> stored row). The console and the loggers' other handlers run on another
    # thread since issue 24, so a handler here would time the console, not the API path.
    from prefect_resoluto.task_runner.logs import ApiLogBatcher

    arrived: dict[int, float] = {}
    add, init = ApiLogBatcher.add, ApiLogBatcher.__init__
    batchers: list[Any] = []  # the run's batchers: which of the requests were theirs

    def counted_init(self: Any) -> None:
        init(self)
        batchers.append(self)

    def timed_add(self: Any, log: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        parts = str(log.get("message", "")).split()
        if len(parts) == 3 and parts[0] == "tick":
            arrived.setdefault(int(parts[1]), time.time())
        add(self, log, *args, **kwargs)

    ApiLogBatcher.add = timed_add  # type: ignore[method-assign]
    ApiLogBatcher.__init__ = counted_init  # type: ignore[method-assign]
    APILogHandler().flush()  # earlier flows' queued logs are not this run's requests
    try:
        with counting_api_requests() as count:
            state = bench_latency(return_state=True)
            APILogHandler().flush()
    finally:
        ApiLogBatcher.add = add  # type: ignore[method-assign]
        ApiLogBatcher.__init__ = init  # type: ignore[method-assign]
    printed = state.result()
    flow_run_id = state.state_details.flow_run_id
    lat: list[float] = []
    to_host: list[float] = []
    to_row: list[float] = []
    seen: set[int] = set()
    with get_client(sync_client=True) as client:
        offset = 0
        while True:
            page = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                limit=200,
                offset=offset,
                sort=LogSort.TIMESTAMP_ASC,
            )
            if not page:
                break
            offset += len(page)
            for row in page:
                parts = row.message.split()
                if len(parts) == 3 and parts[0] == "tick":
                    n = int(parts[1])
                    seen.add(n)
                    lat.append(row.created.timestamp() - float(parts[2]))
                    if n in arrived:
                        to_host.append(arrived[n] - float(parts[2]))
                        to_row.append(row.created.timestamp() - arrived[n])
    return {
        "printed": printed,
        "received": len(seen),
        "latencies_s": lat,
        "seconds": seconds,
        "every_s": every,
        "log_posts": count.log_posts,
        "batcher_posts": sum(b.requests for b in batchers),
        "log_post_median_s": count.log_post_median_s(),
        "to_host_s": to_host,
        "to_row_s": to_row,
    }


if __name__ == "__main__":
    main()
