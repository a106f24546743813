"""Runs in its own process with Prefect's ephemeral API (a temporary server on 127.0.0.1).

Starts one real ``prefect worker start`` per variant (Prefect's ``process`` worker, the
``resoluto`` worker on each requested runtime), deploys the same trivial flow on each
pool, then runs the flow ``--n`` times per variant, one run at a time, alternating
variants round by round so load drifts hit all alike. Writes one JSON object to ``--out``.

Per run, from the flow run's own state history (server timestamps):
  startup  = Running - Pending   (worker accepted it -> the flow body starts: infrastructure
                                  + Prefect's engine start-up; the worker's poll delay is
                                  before Pending and so left out)
  body     = Completed - Running
and, observed here: e2e = submit -> final state seen (includes the worker's poll delay).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

QUERY_SECONDS = "1"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--variants", default="process,resoluto-process")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    work = Path(tempfile.mkdtemp(prefix="resoluto-bench-worker-"))

    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        from prefect.settings import PREFECT_API_URL

        api = str(PREFECT_API_URL.value())
        workers: dict[str, subprocess.Popen[bytes]] = {}
        deployments: dict[str, str] = {}
        try:
            for v in variants:
                pool = f"bench-{v}"
                kind, _, runtime = v.partition("-")
                direct, booted = runtime.endswith("-direct"), runtime.endswith("-booted")
                runtime = runtime.removesuffix("-direct").removesuffix("-booted")
                _cli(api, "work-pool", "create", pool, "--type", kind)
                if kind == "resoluto" and runtime == "process":
                    _lower_floor(pool)  # the pool's isolation floor is a floor (issue 29)
                deployments[v] = _deploy(pool, _job_variables(kind, runtime, work))
                workers[v] = _start_worker(api, pool, work, direct=direct, booted=booted)
            for v in variants:  # warm-up: first imports, first sandbox state directories
                _one(deployments[v])
            images = _engine_images(work) if any("gvisor" in v for v in variants) else []
            samples: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
            for _ in range(args.n):
                for v in variants:
                    samples[v].append(_one(deployments[v]))
        finally:
            for p in workers.values():
                p.send_signal(signal.SIGTERM)
            for p in workers.values():
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
    Path(args.out).write_text(json.dumps({"n": args.n, "samples": samples, "images": images}))


def _engine_images(work: Path, timeout: float = 900) -> list[dict[str, Any]]:
    """The flow-run templates' images (made after the warm-up's first gVisor run), once
    committed: the measured runs are then restored, as a worker's are from its second run."""
    root = Path(_env("", work)["RESOLUTO_STATE_DIR"]) / "gvisor" / "snapshots"
    deadline = time.monotonic() + timeout
    while True:
        found = []
        for meta in root.glob("*/meta.json") if root.is_dir() else []:
            try:
                m = json.loads(meta.read_text())
            except (OSError, ValueError):
                continue
            if m.get("key", {}).get("engine"):
                found.append({k: m.get(k) for k in ("template_boot_s", "checkpoint_s", "bytes")})
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)  # the image is committed by the worker's background thread


def _job_variables(kind: str, runtime: str, work: Path) -> dict[str, Any]:
    if kind != "resoluto":
        return {}
    floor = "none" if runtime == "process" else "user-kernel"
    return {
        "runtime": runtime,
        "min_isolation": floor,
        "conduit": {"path": str(work / "conduit")},
        "stream_output": False,
    }


def _env(api: str, work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update(
        PREFECT_API_URL=api,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_WORKER_QUERY_SECONDS=QUERY_SECONDS,
        PREFECT_WORKER_PREFETCH_SECONDS="5",
        PREFECT_HOME=str(work / "worker-home"),
        RESOLUTO_STATE_DIR=os.environ.get("RESOLUTO_STATE_DIR", str(work / "state")),
    )
    return env


def _lower_floor(pool: str) -> None:
    """The operator's choice for a trusted `process` pool: its min_isolation default 'none'."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolUpdate

    with get_client(sync_client=True) as c:
        template = c.read_work_pool(pool).base_job_template
        template["variables"]["properties"]["min_isolation"]["default"] = "none"
        c.update_work_pool(pool, WorkPoolUpdate(base_job_template=template))


def _cli(api: str, *args: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        env=_env(api, Path(tempfile.gettempdir())),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if res.returncode != 0:
        raise RuntimeError(f"prefect {' '.join(args)} failed: {res.stdout}{res.stderr}")


def _start_worker(
    api: str, pool: str, work: Path, *, direct: bool = False, booted: bool = False
) -> subprocess.Popen[bytes]:
    """``direct``: the resoluto worker without its API gateway (the sandbox dials the API
    through the egress forward with the worker's credential, as before issue 20);
    ``booted``: every flow-run sandbox booted, none restored from a snapshot (before issue 24)."""
    log = open(work / f"{pool}.log", "wb")  # noqa: SIM115 - lives as long as the worker
    env = _env(api, work)
    if direct:
        env["RESOLUTO_UNSAFE_DIRECT_API"] = "1"
    if booted:
        env["RESOLUTO_WARM_SNAPSHOTS"] = "0"
    return subprocess.Popen(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _deploy(pool: str, job_variables: dict[str, Any]) -> str:
    from prefect import flow

    source = flow.from_source(source=str(HERE), entrypoint="_worker_flow.py:trivial")
    name = pool
    source.deploy(
        name=name,
        work_pool_name=pool,
        job_variables=job_variables,
        build=False,
        push=False,
        print_next_steps=False,
    )
    return f"{source.name}/{name}"


def _one(deployment: str) -> dict[str, float]:
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    t0 = time.monotonic()
    run = run_deployment(deployment, timeout=0)
    deadline = t0 + 300
    with get_client(sync_client=True) as c:
        while True:
            fr = c.read_flow_run(run.id)
            if fr.state is not None and fr.state.is_final():
                e2e = time.monotonic() - t0
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"flow run {run.id} of {deployment} never finished: {fr.state}")
            time.sleep(0.05)  # polling the API for the final state
        if not fr.state.is_completed():
            raise RuntimeError(f"flow run {run.id} of {deployment} ended {fr.state.type}: {fr.state.message}")
        states = {s.type.value: s.timestamp for s in c.read_flow_run_states(run.id)}
    return {
        "startup_s": (states["RUNNING"] - states["PENDING"]).total_seconds(),
        "body_s": (states["COMPLETED"] - states["RUNNING"]).total_seconds(),
        "e2e_s": e2e,
    }


if __name__ == "__main__":
    main()
