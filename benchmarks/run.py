"""prefect-resoluto benchmarks: ``python benchmarks/run.py [--quick] [--json] [--only a,b]``.

Prints one human-readable table (every figure, then every target with its measured
value) and, with ``--json``, one JSON object on the last line of stdout. Progress goes
to stderr. ``--quick`` scales counts and durations down to finish in under 3 minutes on
a 2-core machine; the full run takes several minutes more. See docs/performance.md for
what each figure means. Only 127.0.0.1 and test hosts in network namespaces this run
creates (the egress figure) are ever contacted.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Nothing may leave this machine: Prefect's server would try to send usage telemetry.
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (sets sys.path for the project and tests/)
from common import Target, dump_json, log  # noqa: E402

FIGURES = (
    "overhead",
    "flow",
    "chain",
    "latency",
    "throughput",
    "conduit_cost",
    "staging",
    "reference",
    "egress",
    "solari_relay",
    "worker",
    "pool",
    "node_cpu",
    "prefect_calls",
    "scale",
    "k8s_warm",
)


def machine() -> dict[str, Any]:
    runsc = (
        subprocess.run(["runsc", "--version"], capture_output=True, text=True).stdout.splitlines()
        if _which("runsc")
        else []
    )
    return {
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "runsc": runsc[0] if runsc else None,
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _which(name: str) -> bool:
    from shutil import which

    return which(name) is not None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="scaled down, < 3 minutes (what CI may run)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(FIGURES)}")
    args = ap.parse_args()
    only = [f for f in args.only.split(",") if f] or list(FIGURES)
    unknown = set(only) - set(FIGURES)
    if unknown:
        ap.error(f"unknown figure(s) {sorted(unknown)}; choose from {', '.join(FIGURES)}")

    # Sandboxes of this run keep their records in a scratch state directory.
    state = tempfile.mkdtemp(prefix="resoluto-bench-state-")
    os.environ.setdefault("RESOLUTO_STATE_DIR", state)

    import chain
    import conduit_cost
    import egress_cost
    import flow
    import k8s_warm
    import latency
    import node_cpu
    import overhead
    import pool_cost
    import prefect_calls
    import reference
    import scale
    import solari_relay
    import staging
    import throughput
    import worker

    modules = {
        "overhead": overhead,
        "flow": flow,
        "chain": chain,
        "latency": latency,
        "throughput": throughput,
        "conduit_cost": conduit_cost,
        "staging": staging,
        "reference": reference,
        "egress": egress_cost,
        "solari_relay": solari_relay,
        "worker": worker,
        "pool": pool_cost,
        "node_cpu": node_cpu,
        "prefect_calls": prefect_calls,
        "scale": scale,
        "k8s_warm": k8s_warm,
    }
    started = time.monotonic()
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    lat_seconds = 2.0 if args.quick else 5.0
    for name in FIGURES:
        if name not in only:
            continue
        t0 = time.monotonic()
        try:
            if name == "flow":
                results[name] = flow.run(args.quick, lat_seconds if "latency" in only else 0.0)
            else:
                results[name] = modules[name].run(args.quick)
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"
            log(f"{name} FAILED:\n{traceback.format_exc()}")
        log(f"{name}: {time.monotonic() - t0:.1f} s")
    api = results["flow"].pop("api_latency", None) if "flow" in results else None
    if "latency" in results:  # measured by the flow child, which has the Prefect server
        latency.attach_api(results["latency"], api)

    rows: list[tuple[str, str]] = []
    targets: list[Target] = []
    for name in FIGURES:
        if name in results:
            rows += modules[name].rows(results[name])
            targets += modules[name].targets(results[name])
        elif name in errors:
            rows.append((name, f"FAILED: {errors[name]}"))
    elapsed = time.monotonic() - started

    mode = "quick" if args.quick else "full"
    print(f"prefect-resoluto benchmarks ({mode} run, {elapsed:.0f} s, {os.cpu_count()} cores)")
    width = max((len(r[0]) for r in rows), default=10)
    for label, text in rows:
        print(f"  {label:<{width}}  {text}")
    print("targets")
    if targets:
        w1 = max(len(f"{t.figure}: {t.what}") for t in targets)
        w2 = max(len(t.target) for t in targets)
        for t in targets:
            verdict = {True: "met", False: "MISSED", None: "n/a"}[t.met]
            print(f"  {f'{t.figure}: {t.what}':<{w1}}  {t.target:<{w2}}  {t.measured}  [{verdict}]")
    if args.json:
        print(
            dump_json(
                {
                    "mode": mode,
                    "elapsed_s": round(elapsed, 1),
                    "machine": machine(),
                    "figures": results,
                    "errors": errors,
                    "targets": [t.to_json() for t in targets],
                }
            )
        )
    return 1 if errors else 0


if __name__ == "__main__":
    assert common.ROOT.is_dir()
    sys.exit(main())
