"""Runs in its own process with Prefect's ephemeral API: an N-way mapped task that creates
artifacts and reads an allowed variable and Secret block, under ThreadPoolTaskRunner and
under ResolutoTaskRunner on gVisor, and the same map of a task that does nothing (the
sandboxes' own cost). Each wall time is the median of ``--repeat`` flow runs; the artifacts
of every run are read back, so the figure holds only if the sandbox made the same ones.
Writes one JSON object to ``--out``."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from common import child_workspace

    work, ws = child_workspace("calls", "bench_calls", (HERE / "_bench_prefect_calls.py").read_text())
    import bench_calls  # noqa: E402  (from the workspace, so the sandbox imports it by file)
    from prefect import flow, get_client
    from prefect.blocks.system import Secret
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect.variables import Variable

    from prefect_resoluto.task_runner.runner import ResolutoTaskRunner

    logging.getLogger("prefect").setLevel(logging.WARNING)

    def gvisor() -> ResolutoTaskRunner:
        return ResolutoTaskRunner(
            runtime="gvisor",
            conduit=(work / "conduit").as_uri(),
            workspace=ws,
            outputs_dir=work / "outputs",
            allowed_variables=["bench-region"],
            allowed_blocks=["secret/bench-token"],
        )

    def artifacts(flow_run_id: Any) -> list[tuple[str, str, str]]:
        with get_client(sync_client=True) as c:
            found = c.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])),
                limit=200,
            )
        # The runner's own table of its nodes (resoluto-<flow run>) is not the task's.
        return sorted(
            (str(a.key), str(a.type), str(a.data)) for a in found if not str(a.key).startswith("resoluto-")
        )

    def mapped(runner: Any, fn: Any, n: int) -> tuple[float, list[tuple[str, str, str]]]:
        @flow(task_runner=runner, name="bench-calls", persist_result=False)
        def bench_calls_flow() -> list[str]:
            return [f.result() for f in fn.map(range(n))]

        t0 = time.perf_counter()
        state = bench_calls_flow(return_state=True)
        took = time.perf_counter() - t0
        res = state.result()
        if len(res) != n:
            raise RuntimeError(f"mapped flow returned {res!r}")
        return took, artifacts(state.state_details.flow_run_id)

    Variable.set("bench-region", "eu-bench", overwrite=True)
    Secret(value="bench-secret-value").save("bench-token", overwrite=True)
    mapped(ThreadPoolTaskRunner(), bench_calls.report, 1)  # warm-up: the server, the imports
    mapped(gvisor(), bench_calls.report, 1)

    walls: dict[str, list[float]] = {}
    seen: dict[str, list[tuple[str, str, str]]] = {}
    for _ in range(args.repeat):
        for name, make, fn in (
            ("threadpool_calls", ThreadPoolTaskRunner, bench_calls.report),
            ("threadpool_plain", ThreadPoolTaskRunner, bench_calls.plain),
            ("gvisor_calls", gvisor, bench_calls.report),
            ("gvisor_plain", gvisor, bench_calls.plain),
        ):
            took, arts = mapped(make(), fn, args.n)
            walls.setdefault(name, []).append(took)
            seen[name] = arts
    out = {
        "n": args.n,
        "repeat": args.repeat,
        "wall_s": {k: round(statistics.median(v), 3) for k, v in walls.items()},
        "artifacts": len(seen["threadpool_calls"]),
        "same_artifacts": seen["threadpool_calls"] == seen["gvisor_calls"],
    }
    if not out["same_artifacts"]:
        out["differ"] = {"threadpool": seen["threadpool_calls"], "gvisor": seen["gvisor_calls"]}
    Path(args.out).write_text(json.dumps(out))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
