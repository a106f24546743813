"""The ``scale`` figure: what one host pays per node as nodes, pods and time grow.

Four parts, each its own module with the figure interface (``run``/``rows``/``targets``):

* ``scale_k8s``   Kubernetes API requests per pod (one watch per runner vs a GET per poll)
                  at 10 and 100 concurrent pods, against the genuine kube-apiserver.
* ``scale_s3``    S3 requests per idle node-minute by type, and dollars per 1 000
                  node-hours at S3's list prices, before (LIST per poll) and after.
* ``scale_host``  the flow process at 50/200/500 in-flight nodes on ``process`` next to
                  ``ThreadPoolTaskRunner`` on the same sleeping tasks; a 1 000-task map on
                  gVisor (host RSS slope from node 100 to 1 000).
* ``scale_death`` the host killed with SIGKILL mid-flow: seconds until its last sandbox
                  is gone, per runtime.

A part that cannot run here reports why instead of failing the others.
"""

from __future__ import annotations

import importlib
import traceback
from typing import Any

from common import Target, log

PARTS = ("scale_k8s", "scale_s3", "scale_host", "scale_death")


def run(quick: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in PARTS:
        try:
            mod = importlib.import_module(part)
            out[part] = mod.run(quick)
        except Exception as e:  # one part's failure is reported, the others still run
            log(f"scale: {part} FAILED:\n{traceback.format_exc()}")
            out[part] = {"failed": f"{type(e).__name__}: {e}"}
    return out


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for part in PARTS:
        r = res.get(part)
        if r is None:
            continue
        if "failed" in r:
            out.append((part, f"FAILED: {r['failed']}"))
            continue
        out += importlib.import_module(part).rows(r)
    return out


def targets(res: dict[str, Any]) -> list[Target]:
    out: list[Target] = []
    for part in PARTS:
        r = res.get(part)
        if r is None or "failed" in r:
            continue
        out += importlib.import_module(part).targets(r)
    return out
