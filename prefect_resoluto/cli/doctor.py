"""``prefect-resoluto doctor``: which runtimes work here, whether they enforce egress
allowlists, and which one ``run`` picks at each isolation floor.

The report comes from the same probes ``run`` uses, so doctor cannot claim a runtime
works when ``run`` would refuse it. Exit 1 when nothing qualifies at the default floor.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from prefect_resoluto.cli.common import EXIT_FAILED, EXIT_OK
from prefect_resoluto.cli.output import BAD, DIM, ISOLATION_STYLE, OK, STRONG, Out
from prefect_resoluto.host.availability import Availability

if TYPE_CHECKING:
    from rich.table import Table

    from prefect_resoluto.runtimes.base import SandboxRuntime


def doctor_report() -> dict[str, Any]:
    """Every registered runtime (and the variants ``run`` considers), availability, picks."""
    from prefect_resoluto import runtimes
    from prefect_resoluto.runtimes.base import DEFAULT_MIN_ISOLATION, IsolationLevel
    from prefect_resoluto.settings.config import default_conduit_url

    entries: list[tuple[str, dict[str, Any]]] = [(name, {}) for name in runtimes.RUNTIMES]
    defaults: dict[str, SandboxRuntime | None] = {}

    def row(name: str, options: dict[str, Any]) -> dict[str, Any]:
        label = f"{name}({', '.join(f'{k}={v}' for k, v in options.items())})" if options else name
        r: dict[str, Any] = {
            "name": name,
            "options": options,
            "label": label,
            "isolation": None,
            "available": False,
            "why": "",
            "detail": "",
            "local": None,
        }
        try:
            cls = runtimes.RUNTIMES[name]
            r["local"] = cls.capabilities.local_conduit
            rt = cls(**options)
        except Exception as e:  # e.g. kubernetes without a usable configuration
            r["why"] = f"cannot be configured: {type(e).__name__}: {e}"
            if not options:
                defaults[name] = None
            return r
        if not options:
            defaults[name] = rt
        r["isolation"] = rt.isolation.label
        try:
            avail = rt.availability()
        except Exception as e:  # a probe must never take doctor down
            r["why"] = f"probe failed: {type(e).__name__}: {e}"
            return r
        r.update(available=avail.ok, why=avail.why, detail=avail.detail)
        r["egress"] = _egress_row(rt) if avail.ok else {"enforced": False, "why": "runtime not available"}
        return r

    # Side by side: local probes mostly wait on subprocesses (runsc starting a sandbox,
    # podman), remote ones import their client libraries. Rows keep the registry's order.
    with ThreadPoolExecutor(max_workers=len(entries), thread_name_prefix="resoluto-doctor") as pool:
        rows = list(pool.map(lambda entry: row(*entry), entries))
        # The variants best_available() tries (e.g. the container runtime with Kata) when they
        # differ from a runtime's defaults -- so the "why not" of a stronger pick is visible.
        variants = [
            (name, dict(options))
            for name, options in runtimes.candidates()
            if options
            and (base := defaults.get(name)) is not None
            and not all(getattr(base, k, object()) == v for k, v in options.items())
        ]
        rows += pool.map(lambda entry: row(*entry), variants)

    picks: list[dict[str, Any]] = []
    for level in sorted(IsolationLevel, reverse=True):
        rt = runtimes.best_available(level)
        picks.append(
            {
                "floor": level.label,
                "default": level == DEFAULT_MIN_ISOLATION,
                "runtime": rt.name if rt is not None else None,
                "label": rt.display_name if rt is not None else None,
                "isolation": rt.isolation.label if rt is not None else None,
                "why_none": "" if rt is not None else runtimes.why_unavailable(level),
            }
        )
    default = next(p for p in picks if p["default"])
    from prefect_resoluto.worker import gateway as api_gateway

    k8s = next((r for r in rows if r["name"] == "kubernetes" and not r["options"]), None)

    return {
        "api_gateway": api_gateway.probe(),
        "runtimes": rows,
        "warm_pods": _warm_pods(defaults.get("kubernetes") if k8s and k8s["available"] else None),
        "picks": picks,
        "default_floor": DEFAULT_MIN_ISOLATION.label,
        "default_pick": default["runtime"],
        "default_conduit": default_conduit_url(),
        "note": "run picks among local runtimes only; kubernetes and solari (remote runtimes) "
        "are used only when named with --runtime",
    }


def _warm_pods(rt: SandboxRuntime | None) -> dict[str, Any]:
    """The Kubernetes runtime's warm pods: settings, and the pools live in its namespace."""
    if rt is None:
        return {"available": False, "why": "the kubernetes runtime is not available"}
    from prefect_resoluto.runtimes.kubernetes.runtime import KubernetesRuntime
    from prefect_resoluto.runtimes.kubernetes.warm import inventory

    if not isinstance(rt, KubernetesRuntime):
        return {"available": False, "why": "not the kubernetes runtime"}
    try:
        return {"available": True, **inventory(rt)}
    except Exception as e:  # a probe must never take doctor down
        return {"available": False, "why": f"cannot list warm pods: {type(e).__name__}: {e}"}


def _egress_row(rt: SandboxRuntime) -> dict[str, Any]:
    """Whether ``rt`` can enforce an allowlist here, how, and if not why not."""
    try:
        support = rt.egress_support()
    except Exception as e:  # a probe must never take doctor down
        support = Availability.refused(f"probe failed: {type(e).__name__}: {e}")
    if not support.ok:
        return {"enforced": False, "why": support.why}
    if rt.capabilities.egress_by_name:
        how = "by name: per-run proxy (CONNECT + SNI/Host + DNS), host-side; IMDS and private ranges refused"
        detail = f"{how}; {support.detail}" if support.detail else how
    else:
        detail = "by CIDR: a NetworkPolicy per pod (cannot filter by name); IMDS always refused"
    return {"enforced": True, "detail": detail}


def _table(out: Out, *headers: str) -> Table:
    from rich import box
    from rich.table import Table

    # The rule under the header only on a terminal: a pipe gets columns and nothing else.
    table = Table(
        box=box.SIMPLE_HEAD if out.terminal else None, show_edge=False, pad_edge=False, header_style=STRONG
    )
    for i, h in enumerate(headers):
        table.add_column(h, no_wrap=i < len(headers) - 1)  # only the explanation wraps
    return table


def _yes_no(flag: bool, yes: str = "yes") -> tuple[str, str]:
    return (yes, OK) if flag else ("no", BAD)


def main(args: argparse.Namespace) -> int:
    report = doctor_report()
    if args.json:
        print(json.dumps(report))
        return EXIT_OK if report["default_pick"] else EXIT_FAILED
    out = Out(sys.stdout)
    rows = report["runtimes"]
    runtimes = _table(out, "RUNTIME", "ISOLATION", "AVAILABLE", "DETAILS / WHY NOT")
    for r in rows:
        iso = r["isolation"] or "?"
        runtimes.add_row(
            out.text([(r["label"], STRONG)]),
            out.text([(iso, ISOLATION_STYLE.get(iso, DIM))]),
            out.text([_yes_no(r["available"])]),
            out.text([(r["detail"], "") if r["available"] else (r["why"], DIM)]),
        )
    out.show(runtimes)
    out.line()
    out.line(("egress allowlists (--egress), per runtime:", STRONG))
    egress = _table(out, "RUNTIME", "ALLOWLIST", "HOW / WHY NOT")
    for r in rows:
        eg = r.get("egress") or {"enforced": False, "why": r["why"] or "not checked"}
        egress.add_row(
            out.text([(r["label"], STRONG)]),
            out.text([_yes_no(eg["enforced"], "enforced")]),
            out.text([(eg.get("detail", ""), "") if eg["enforced"] else (eg["why"], DIM)]),
        )
    out.show(egress)
    out.line()
    out.line(("`run` picks, by --min-isolation floor:", STRONG))
    for p in report["picks"]:
        mark = (" (default floor)", STRONG) if p["default"] else ""
        if p["runtime"]:
            iso = p["isolation"]
            out.line(
                f"  {p['floor']:<12} -> ",
                (p["label"], OK),
                " (",
                (iso, ISOLATION_STYLE.get(iso, "")),
                ")",
                mark,
            )
        else:
            out.line(f"  {p['floor']:<12} -> ", ("nothing available", BAD), mark)
    out.line()
    gw = report["api_gateway"]
    out.line(
        ("API gateway of the resoluto worker: ", STRONG),
        _yes_no(gw["ok"], "works"),
        " ",
        (gw.get("detail", ""), "") if gw["ok"] else (gw["why"], DIM),
    )
    out.line("  the worker's credential, held by the gateway only: ", gw["credential"])
    warm = report["warm_pods"]
    if warm["available"]:
        out.line(("warm pods (kubernetes): ", STRONG), warm["settings"])
        for pool, keys in sorted(warm["pools"].items()):
            for key, states in sorted(keys.items()):
                counts = ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
                out.line(f"  pool {pool} in {warm['namespace']}, key {key}: {counts}")
        if not warm["pools"]:
            out.line(f"  none in namespace {warm['namespace']} now")
    else:
        out.line(("warm pods (kubernetes): ", STRONG), (warm["why"], DIM))
    out.line(("default conduit: ", STRONG), report["default_conduit"])
    out.line(("note: ", STRONG), report["note"])
    if not report["default_pick"]:
        Out(sys.stderr).line()
        Out(sys.stderr).line(
            (
                f"no runtime qualifies at the default floor {report['default_floor']}; install "
                "gVisor (runsc) or pass --min-isolation namespace to run with bubblewrap",
                BAD,
            )
        )
        return EXIT_FAILED
    return EXIT_OK
