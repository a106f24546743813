"""Figure 7, reference: the same trivial node through resoluto-sandbox 0.1.0's own driver.

The reference needs Python >= 3.12, so it runs in ``.venv-ref`` (``scripts/setup.sh``
makes it when a 3.12 interpreter exists): its ``drive_node`` with its ``LocalConduit``
and a minimal subprocess runtime (``tests/support/reference_node.py``), the reference guest
without its network canary. Next to it, N nodes of ours on the ``process`` runtime.
Both run the same workload (this interpreter, ``-c pass``).
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

from common import ROOT, TRIVIAL, Target, log, median, ms, r3, reference_python, scratch, timed
from overhead import driver_launcher

from prefect_resoluto.runtimes import get_runtime


def run(quick: bool) -> dict[str, Any]:
    n = 3 if quick else 10
    py = reference_python()
    if py is None:
        return {
            "available": False,
            "why": "no .venv-ref with resoluto-sandbox 0.1.0 (needs a Python 3.12; bash scripts/setup.sh)",
        }
    with scratch("reference") as work:
        log(f"reference: {n} trivial nodes through resoluto-sandbox 0.1.0's drive_node")
        res = subprocess.run(
            [
                str(py),
                str(ROOT / "tests" / "support" / "reference_node.py"),
                "bench",
                str(work / "ref"),
                str(n),
                json.dumps(TRIVIAL),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if res.returncode != 0:
            raise RuntimeError(f"reference benchmark failed: {res.stderr[-2000:]}")
        ref = json.loads(res.stdout.strip().splitlines()[-1])["times_s"]
        log(f"reference: {n} trivial nodes through ours (process runtime)")
        ours_run = driver_launcher(get_runtime("process"), work, "ref-ours")
        ours_run()
        ours = [timed(ours_run)[0] for _ in range(n)]
    r, o = median(ref), median(ours)
    return {
        "available": True,
        "n": n,
        "reference_median_ms": ms(r),
        "ours_median_ms": ms(o),
        "speedup": r3(r / o),
        "reference_ms": [ms(x) for x in ref],
        "ours_ms": [ms(x) for x in ours],
    }


def targets(res: dict[str, Any]) -> list[Target]:
    if not res.get("available"):
        return [Target("reference", "per-node time vs resoluto-sandbox 0.1.0", "faster", "unavailable", None)]
    return [
        Target(
            "reference",
            "per-node time vs resoluto-sandbox 0.1.0 (process)",
            "faster",
            f"{res['ours_median_ms']} vs {res['reference_median_ms']} ms (x{res['speedup']} faster)",
            res["ours_median_ms"] < res["reference_median_ms"],
        )
    ]


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    if not res.get("available"):
        return [("reference", f"unavailable: {res['why']}")]
    return [
        (
            "reference (trivial node)",
            f"resoluto-sandbox 0.1.0 {res['reference_median_ms']} ms vs ours "
            f"{res['ours_median_ms']} ms on process: ours x{res['speedup']} faster "
            f"(N={res['n']})",
        )
    ]
