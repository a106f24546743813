"""Figure 8, worker: per-flow-run overhead of the ``resoluto`` worker next to Prefect's
own ``process`` worker, on the same trivial flow, the same API, one run at a time.

Both workers are real ``prefect worker start`` processes (in a child with Prefect's
ephemeral API). The figure is the flow run's *startup*: Pending (the worker accepted
it) to Running (the flow body starts), from the server's own state timestamps. It
holds the infrastructure (a process, or a sandbox + conduit + guest runner) and
Prefect's engine start-up, and leaves out the worker's poll delay, which both share.
gVisor flow runs need the egress proxy to reach the API; without it the figure says so.
``resoluto-gvisor`` runs behind the per-run API gateway (issue 20); ``resoluto-gvisor-direct``
is the forward of before it (a worker with RESOLUTO_UNSAFE_DIRECT_API=1: the sandbox dials
the API with the worker's credential), the gateway's cost side by side.
``resoluto-gvisor`` flow runs are restored from the worker's snapshot of Prefect's imported
engine (issue 24; the warm-up run has the image made, and the measured runs wait for it);
``resoluto-gvisor-booted`` is a worker with ``RESOLUTO_WARM_SNAPSHOTS=0``: every sandbox
booted, as before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from common import BENCH, Target, log, median, prefect_child_env, r3, scratch

from prefect_resoluto.runtimes import get_runtime
from prefect_resoluto.worker.plan import egress_forwarding_supported


def run(quick: bool) -> dict[str, Any]:
    n = 3 if quick else 10
    variants = ["process", "resoluto-process"]
    gvisor_note = ""
    if not get_runtime("gvisor").availability().ok:
        gvisor_note = "gVisor unavailable here"
    elif not egress_forwarding_supported():
        gvisor_note = "egress forwarding (issue 10) not on this branch"
    else:
        variants += ["resoluto-gvisor", "resoluto-gvisor-booted", "resoluto-gvisor-direct"]
    with scratch("worker") as work:
        out_path = work / "worker.json"
        env = prefect_child_env(work)
        log(f"worker: {n} flow runs each on {', '.join(variants)} (real workers; ephemeral Prefect server)")
        cmd = [
            sys.executable,
            str(BENCH / "_worker_child.py"),
            "--n",
            str(n),
            "--variants",
            ",".join(variants),
            "--out",
            str(out_path),
        ]
        with open(work / "child.log", "wb") as child_log:
            res = subprocess.run(cmd, env=env, stdout=child_log, stderr=subprocess.STDOUT, timeout=1800)
        if res.returncode != 0:
            tail = (work / "child.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"worker benchmark child failed (exit {res.returncode}):\n{tail}")
        child = json.loads(out_path.read_text())
        samples = child["samples"]
    out: dict[str, Any] = {"n": n, "gvisor": gvisor_note or "measured", "images": child.get("images", [])}
    for v, runs in samples.items():
        out[v] = {k: r3(median(r[k] for r in runs)) for k in ("startup_s", "body_s", "e2e_s")}
    base = out["process"]["startup_s"]
    out["added_startup_ms"] = {
        v: round((out[v]["startup_s"] - base) * 1000) for v in samples if v != "process"
    }
    out["startup_ratio"] = {v: r3(out[v]["startup_s"] / base) for v in samples if v != "process" and base > 0}
    if "resoluto-gvisor-direct" in samples:  # the API gateway against the forward of before it
        gw, direct = out["resoluto-gvisor"], out["resoluto-gvisor-direct"]
        out["gateway_vs_direct"] = {
            k: r3(gw[k] / direct[k]) if direct[k] else None for k in ("startup_s", "body_s", "e2e_s")
        }
    out["load"] = [round(x, 2) for x in os.getloadavg()]
    return out


def targets(res: dict[str, Any]) -> list[Target]:
    r = res.get("startup_ratio", {}).get("resoluto-process")
    out = [Target("worker", "resoluto(process)/process flow-run startup", "reported", f"{r} x", None)]
    g = res.get("startup_ratio", {}).get("resoluto-gvisor")
    if g is not None:  # issue 24: restored from a snapshot, no slower to start than a process
        out.append(
            Target(
                "worker",
                "resoluto(gvisor, restored)/process flow-run startup",
                "<= 1.0 x",
                f"{g} x",
                g <= 1.0,
            )
        )
    return out


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for v in (
        "process",
        "resoluto-process",
        "resoluto-gvisor",
        "resoluto-gvisor-booted",
        "resoluto-gvisor-direct",
    ):
        if v in res:
            m = res[v]
            out.append(
                (
                    f"worker {v}",
                    f"startup {m['startup_s']} s, body {m['body_s']} s, "
                    f"submit->final {m['e2e_s']} s (median of {res['n']})",
                )
            )
    added = ", ".join(
        f"{v} {ms:+d} ms ({res['startup_ratio'].get(v)} x)" for v, ms in res["added_startup_ms"].items()
    )
    out.append(("worker added startup vs process", added))
    if "gateway_vs_direct" in res:
        g = res["gateway_vs_direct"]
        out.append(
            (
                "worker gvisor: API gateway / direct forward",
                f"startup {g['startup_s']} x, body {g['body_s']} x, submit->final {g['e2e_s']} x "
                f"(load {res.get('load')})",
            )
        )
    for img in res.get("images", []):
        out.append(
            (
                "worker gvisor flow-run snapshot image",
                f"template boot {img['template_boot_s']} s, checkpoint {img['checkpoint_s']} s, "
                f"{(img['bytes'] or 0) / 2**20:.0f} MiB",
            )
        )
    if res["gvisor"] != "measured":
        out.append(("worker resoluto-gvisor", f"n/a: {res['gvisor']}"))
    return out
