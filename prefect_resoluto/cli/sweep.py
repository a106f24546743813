"""``prefect-resoluto sweep``: reap orphaned sandboxes by label, runtime by runtime."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from prefect_resoluto.cli.common import EXIT_FAILED, EXIT_OK, UsageError, known_runtimes, parse_pairs
from prefect_resoluto.cli.output import BAD, DIM, OK, STRONG, Out

if TYPE_CHECKING:
    from prefect_resoluto.runtimes.base import SandboxRuntime


def main(args: argparse.Namespace) -> int:
    from prefect_resoluto import runtimes

    labels = parse_pairs(args.label, "--label")
    names: list[str] = list(dict.fromkeys(args.runtime or []))
    explicit = bool(names)
    for name in names:
        if name not in runtimes.RUNTIMES:
            raise UsageError(f"unknown runtime {name!r}; known runtimes: {', '.join(known_runtimes())}")
    if not explicit:  # remote runtimes (kubernetes) only when named: their sweep is a cluster call
        names = [n for n in runtimes.RUNTIMES if runtimes.RUNTIMES[n].capabilities.on_host]
    chosen: list[tuple[str, SandboxRuntime | None, str]] = []
    for name in names:
        try:
            rt = runtimes.get_runtime(name)
            avail = rt.availability()
            chosen.append((name, rt, "") if avail.ok else (name, None, avail.why))
        except Exception as e:
            chosen.append((name, None, f"cannot be configured: {e}"))
    if explicit:
        for name, found, why in chosen:
            if found is None:
                raise UsageError(f"runtime {name!r} is unavailable here: {why}")
    report: dict[str, Any] = {"labels": labels, "reaped": {}, "images": {}, "skipped": {}, "errors": {}}
    for name, picked, why in chosen:
        if picked is None:
            report["skipped"][name] = why
            continue
        try:
            report["reaped"][name] = picked.sweep(labels)
            if not labels and picked.capabilities.snapshots:
                # Warm-sandbox images hold no node, but are the runtime's state: a full sweep clears it.
                from prefect_resoluto.warm import snapshots

                report["images"][name] = snapshots.remove_all(picked)
        except Exception as e:
            report["errors"][name] = f"{type(e).__name__}: {e}"
    if args.json:
        print(json.dumps(report))
    else:
        out = Out(sys.stdout)
        what = " ".join(f"{k}={v}" for k, v in labels.items()) or "every prefect-resoluto sandbox"
        out.line(("sweep", STRONG), f" ({what}):")
        for name, n in report["reaped"].items():
            images = report["images"].get(name)
            more = f", removed {images} warm-sandbox image(s)" if images else ""
            out.line(f"  {name}: ", (f"reaped {n} sandbox(es){more}", OK if n else ""))
        for name, why in report["skipped"].items():
            out.line(f"  {name}: ", (f"skipped, unavailable: {why}", DIM))
        for name, problem in report["errors"].items():
            out.line(f"  {name}: ", (f"error: {problem}", BAD))
    return EXIT_FAILED if report["errors"] else EXIT_OK
