"""What runs listing their big sub-flows make the worker hold (issue 39, finding 2).

A `prefect server` with an auth string and a real `resoluto` worker on it (both processes
on 127.0.0.1, as the tests start them: tests/support). Each flow run of the pool is the
``hoarder`` of tests/flows/gateway_flows.py on the `process` runtime, at the issue's sizes:
60 sub-flow runs of its own flow of ~2 MB each (500 KB of parameters, 1.4 MiB of context,
under the gateway's 2 MiB body cap), then 8 concurrent ``POST /flow_runs/filter`` of their
60 ids (~117 MB an answer). The worker's resident memory is read once every run has made
its sub-flows, and its peak (VmHWM, reset then) while the listings run, with 1 and with 3
runs of the pool at once.

Variants: ``bounded`` is the worker as shipped (32 MiB per answer: each listing is refused
by its declared length, unread). ``before`` is the tree before issue 39 (commit 051bf12,
``git archive``-d into scratch space and first on the worker's PYTHONPATH): every answer
read whole in the worker. A cap and budget set huge on today's tree are no stand-in for
it: today's listings stream, so they would measure flat. ``before`` runs with 1 run only
unless asked (``--before-runs 1,3``): 3 runs of it want ~6 GB of the machine.

``.venv/bin/python benchmarks/gateway_memory.py [--runs 1,3] [--before-runs 1]`` (~20 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common import ROOT, log, scratch
from support.polling import wait_for
from support.prefect_cli import cli_env, prefect_server
from test_worker import create_pool, deploy, final_run, run_logs, schedule

MIB = 1 << 20
#: The tree before issue 39's bounds (main before gw-bounded was merged).
BEFORE = "051bf12"
SIZES = {
    "count": 60,
    "param_bytes": 500_000,
    "context_bytes": 1_468_006,  # 1.4 MiB
    "at_once": 8,
    "ids_per_listing": 60,
}


class _Worker:
    """`prefect worker start` on ``pool`` with ``pythonpath`` first (test_worker.Worker's, whose
    PYTHONPATH is fixed)."""

    def __init__(self, pool: str, work: Path, pythonpath: str) -> None:
        env = cli_env(
            RESOLUTO_STATE_DIR=str(work / "state"),
            RESOLUTO_CACHE_DIR=str(work / "cache"),
            RESOLUTO_WARM_SNAPSHOTS="0",
            PREFECT_WORKER_QUERY_SECONDS="1",
            PREFECT_WORKER_PREFETCH_SECONDS="5",
            PREFECT_HOME=str(work / "worker-home"),
            PYTHONPATH=pythonpath,
        )
        self.log_path = work / "worker.log"
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool],
                env=env,
                cwd=str(work),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


@contextmanager
def _worker(pool: str, work: Path, pythonpath: str) -> Iterator[_Worker]:
    w = _Worker(pool, work, pythonpath)
    try:
        yield w
    finally:
        w.stop()


def _kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def _final(run_id: Any) -> bool:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        state = c.read_flow_run(run_id).state
    return state is not None and state.is_final()


def _measure(variant: str, runs: int, work: Path, pythonpath: str) -> dict[str, Any]:
    from prefect.variables import Variable

    log(f"gateway memory: {variant}, {runs} run(s) of the pool at once")
    pool = create_pool(cli=False)
    release = f"release_{uuid.uuid4().hex[:6]}"
    with _worker(pool, work, pythonpath) as worker:
        dep = deploy(
            pool,
            "gateway_flows.py:hoarder",
            work / "conduit",
            runtime="process",
            min_isolation="none",
            allowed_variables=[release],
        )
        made = [schedule(dep, release=release, **SIZES) for _ in range(runs)]
        for run in made:
            wait_for(
                lambda: any(m.startswith("MADE ") for m in run_logs(run.id)) or _final(run.id),  # noqa: B023
                timeout=3600,
                what="the run's sub-flow runs",
                max_delay=2,
            )
            if _final(run.id):
                raise RuntimeError(f"{variant}: a run ended early:\n{worker.output()[-4000:]}")
        pid = worker.proc.pid
        before = _kib(pid, "VmRSS")
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # VmHWM from here on
        Variable.set(release, "go")
        states = [final_run(run.id, worker, timeout=3600).state.type.value for run in made]  # type: ignore[arg-type]
        peak = _kib(pid, "VmHWM")
    answers: dict[str, int] = {}
    for run in made:
        listed = wait_for(
            lambda: (
                len(got := [m[7:] for m in run_logs(run.id) if m.startswith("LISTED ")]) == 8  # noqa: B023
                and got
            ),
            timeout=300,
            what="the listings' answers",
        )
        for a in listed:
            answers[a.split(" ", 1)[0]] = answers.get(a.split(" ", 1)[0], 0) + 1
    return {
        "variant": variant,
        "runs": runs,
        "rss_before_mib": round(before / 1024),
        "rss_peak_mib": round(peak / 1024),
        "growth_mib": round((peak - before) / 1024),
        "answers": answers,
        "states": states,
    }


def run(runs: list[int], before_runs: list[int], repo: Path = ROOT) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with scratch("gateway-memory") as work:
        old = work / "before"
        old.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(repo), "archive", BEFORE, "prefect_resoluto", "guest_runner"],
            capture_output=True,
            check=True,
        )
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
        with prefect_server(work, auth_string="resoluto-admin:" + secrets.token_hex(16)):
            plan = [("bounded", n, str(ROOT)) for n in runs]
            plan += [("before", n, f"{old}{os.pathsep}{ROOT}") for n in before_runs]
            plan.sort(key=lambda p: p[1])  # one run of each first: the figure side by side
            for variant, n, pythonpath in plan:
                d = work / f"{variant}-{n}"
                d.mkdir()
                out.append(_measure(variant, n, d, pythonpath))
                log(json.dumps(out[-1]))
    return out


def _ints(raw: str) -> list[int]:
    return [int(x) for x in raw.split(",") if x]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="1,3")
    ap.add_argument("--before-runs", default="1")
    ap.add_argument(
        "--repo", type=Path, default=ROOT, help="the git repository the tree before is taken from"
    )
    args = ap.parse_args()
    rows = run(_ints(args.runs), _ints(args.before_runs), args.repo)
    print(f"{'variant':<8} {'runs':>4} {'RSS before':>11} {'peak':>7} {'growth':>7}  answers")
    for r in rows:
        print(
            f"{r['variant']:<8} {r['runs']:>4} {r['rss_before_mib']:>8} MiB {r['rss_peak_mib']:>4} MiB "
            f"{r['growth_mib']:>4} MiB  {r['answers']} {r['states']}"
        )
    print(json.dumps(rows))
