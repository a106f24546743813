"""Egress allowlists: what a network costs a gVisor node, and what the proxy moves.

* **per-node latency**: trivial gVisor nodes without a network and with
  ``egress=["api.example.test"]`` (a namespace + veth, the run's proxy, the guest's
  fail-closed canary), interleaved; medians side by side and the difference.
* **proxy throughput**: a 100 MB download from a test host, (a) straight from the
  uplink namespace (no proxy: the ceiling), (b) from a sandbox namespace through the
  run's proxy (CONNECT), (c) from inside a gVisor sandbox through the proxy.

Test hosts live in namespaces built here (tests/support/egress_net.py): nothing leaves the machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

from common import TRIVIAL, Target, log, median, r3, scratch
from support import egress_net

from guest_runner.conduit import LocalConduit
from prefect_resoluto import egress
from prefect_resoluto.egress import netns, proxy
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes import get_runtime

MB = 1 << 20


def _node(
    rt: Any,
    conduit: LocalConduit,
    net: egress_net.TestNet,
    i: int,
    allow: bool,
    argv: list[str] | None = None,
) -> tuple[float, Any]:
    spec = NodeSpec(
        run_id=f"bench-egress-{i}",
        node_id=f"{'allow' if allow else 'none'}-{i}",
        argv=argv or TRIVIAL,
        egress=["api.example.test"] if allow else [],
        egress_resolve=net.resolve if allow else {},
    )
    t0 = time.monotonic()
    out = drive_node(spec, conduit, rt, min_isolation="user-kernel")
    took = time.monotonic() - t0
    if not out.ok:
        raise RuntimeError(out.describe())
    return took, out


def _curl(prefix: list[str], url: str, extra: list[str]) -> tuple[float, int]:
    res = subprocess.run(
        [*prefix, "curl", "-sS", "-o", "/dev/null", "-w", "%{time_total} %{size_download}", *extra, url],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if res.returncode != 0:
        raise RuntimeError(f"curl failed: {res.stderr.strip()}")
    t, n = res.stdout.split()
    return float(t), int(n)


def run(quick: bool) -> dict[str, Any]:
    here = netns.available()
    if not here.ok:
        raise RuntimeError(f"cannot build test namespaces here: {here.why}")
    rt = get_runtime("gvisor")
    if not rt.availability().ok:
        raise RuntimeError(f"gVisor is not available: {rt.availability().why}")
    reps = 4 if quick else 10
    size = 100 * MB
    with scratch("egress") as work:
        net = egress_net.build(work, "bench")
        saved = {k: os.environ.get(k) for k in (proxy.UPLINK_ENV, egress.CANARY_ENV)}
        os.environ[proxy.UPLINK_ENV] = net.uplink
        os.environ[egress.CANARY_ENV] = f"{egress_net.HOST2}:7,denied.example.test:443"
        try:
            conduit = LocalConduit(work / "conduit")
            _node(rt, conduit, net, -1, True)  # warm caches (runsc, the seccomp program, imports)
            none_t, allow_t = [], []
            for i in range(reps):
                log(f"egress: node pair {i + 1}/{reps}")
                none_t.append(_node(rt, conduit, net, i, False)[0])
                allow_t.append(_node(rt, conduit, net, i, True)[0])
            url = f"http://api.example.test/bytes/{size}"
            log("egress: 100 MB straight from the uplink namespace")
            direct = _curl(
                ["nsenter", f"--net=/run/netns/{net.uplink}"], f"http://{egress_net.HOST}/bytes/{size}", []
            )
            req = egress.network_request(
                "bench-egress-tp", "tp", egress=["api.example.test"], resolve=net.resolve
            )
            assert req is not None
            sn = egress.attach(req, "rsl-bench-tp")
            try:
                log("egress: 100 MB through the proxy from a sandbox namespace")
                via = _curl(
                    ["nsenter", f"--net=/run/netns/{sn.netns}"],
                    url,
                    ["-p", "-x", f"http://{sn.gateway}:{proxy.PROXY_PORT}"],
                )
            finally:
                egress.detach("bench-egress-tp", "rsl-bench-tp")
            log("egress: 100 MB through the proxy from inside gVisor")
            _, out = _node(
                rt,
                conduit,
                net,
                999,
                True,
                argv=[
                    "sh",
                    "-c",
                    f"curl -sS -p -o /dev/null -w 'CURL %{{time_total}} %{{size_download}}\\n' {url}",
                ],
            )
            line = next(x for x in _lines(conduit, out) if x.startswith("CURL "))
            in_gvisor = (float(line.split()[1]), int(line.split()[2]))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            net.close()
    for _t, n in (direct, via, in_gvisor):
        if n != size:
            raise RuntimeError(f"download was {n} bytes, expected {size}")
    mbs = [size / MB / t for t, _ in (direct, via, in_gvisor)]
    return {
        "reps": reps,
        "none_median_s": r3(median(none_t)),
        "allow_median_s": r3(median(allow_t)),
        "added_ms": round((median(allow_t) - median(none_t)) * 1000, 1),
        "ratio": r3(median(allow_t) / median(none_t)),
        "download_mb": size // MB,
        "direct_mb_s": round(mbs[0], 1),
        "proxy_mb_s": round(mbs[1], 1),
        "gvisor_proxy_mb_s": round(mbs[2], 1),
        "proxy_vs_direct": r3(mbs[1] / mbs[0]),
    }


def _lines(conduit: LocalConduit, out: Any) -> list[str]:
    from prefect_resoluto.cli.events import iter_events, scan_node

    rep = scan_node(conduit, out.run_id, out.node_id)
    return [str((e.get("data") or {}).get("line", "")) for e in iter_events(conduit, rep)]


def targets(res: dict[str, Any]) -> list[Target]:
    return [
        Target(
            "egress",
            "added per-node latency of an allowlisted gVisor node",
            "report (no target)",
            f"+{res['added_ms']} ms ({res['ratio']} x a no-network node)",
            None,
        ),
        Target(
            "egress",
            "proxy throughput, 100 MB from a test host",
            ">= 0.5 x direct",
            f"{res['proxy_mb_s']} MB/s ({res['proxy_vs_direct']} x direct {res['direct_mb_s']} MB/s)",
            res["proxy_vs_direct"] >= 0.5,
        ),
    ]


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (
            "egress latency",
            f"gVisor node, median of {res['reps']}: no network {res['none_median_s']} s, "
            f"allowlisted {res['allow_median_s']} s: +{res['added_ms']} ms (x{res['ratio']})",
        ),
        (
            "egress throughput",
            f"{res['download_mb']} MB: direct {res['direct_mb_s']} MB/s, via proxy "
            f"{res['proxy_mb_s']} MB/s (x{res['proxy_vs_direct']}), from inside gVisor via "
            f"proxy {res['gvisor_proxy_mb_s']} MB/s",
        ),
    ]


if __name__ == "__main__":
    print(run("--quick" in sys.argv))
