"""What one sandbox can make the run's egress proxy hold in the host process (issue 33).

A client in a sandbox namespace opens as many ``CONNECT`` tunnels as the proxy lets one
sandbox hold (``proxy.MAX_CONNECTIONS``), to an echo service on a test host, moves one
byte through each, and keeps them idle. The host process's resident memory is read
before the sandbox is attached and while the tunnels are held: the difference is what
the sandbox holds outside its own memory limit. Then 100 MB through one tunnel against
the same download straight from the uplink namespace (the relay must stay fast).

Test hosts live in namespaces built here (tests/support/egress_net.py): nothing leaves the machine.
Run as root: ``PYTHONPATH=tests python benchmarks/egress_memory.py [tunnels]``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from common import log, scratch
from support import egress_net

from prefect_resoluto import egress
from prefect_resoluto.egress import proxy

MB = 1 << 20

CLIENT = r"""
import socket, sys
gw, n = sys.argv[1], int(sys.argv[2])
held = []
for i in range(n):
    s = socket.create_connection((gw, 3128))
    s.sendall(b"CONNECT api.example.test:7 HTTP/1.1\r\nHost: api.example.test:7\r\n\r\n")
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        head += s.recv(1)
    assert head.startswith(b"HTTP/1.1 200"), head
    s.sendall(b"x")
    assert s.recv(1) == b"x"
    held.append(s)
print("HELD", len(held), flush=True)
sys.stdin.readline()
"""


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _download(prefix: list[str], url: str, extra: list[str]) -> float:
    res = subprocess.run(
        [*prefix, "curl", "-sS", "-o", "/dev/null", "-w", "%{time_total}", *extra, url],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return 100 / float(res.stdout)


def run(tunnels: int | None = None) -> dict[str, Any]:
    n = tunnels or proxy.MAX_CONNECTIONS
    with scratch("egress-memory") as work:
        net = egress_net.build(work, "mem")
        os.environ[proxy.UPLINK_ENV] = net.uplink
        try:
            req = egress.network_request(
                "bench-mem", "m", egress=["api.example.test:7", "api.example.test"], resolve=net.resolve
            )
            assert req is not None
            egress.attach(req, "rsl-bench-mem-warm")  # modules, threads' first stacks
            egress.detach("bench-mem", "rsl-bench-mem-warm")
            before = rss_kib()
            sn = egress.attach(req, "rsl-bench-mem")
            try:
                client = subprocess.Popen(
                    [
                        "nsenter",
                        f"--net=/run/netns/{sn.netns}",
                        sys.executable,
                        "-c",
                        CLIENT,
                        sn.gateway,
                        str(n),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                assert client.stdout is not None and client.stdin is not None
                line = client.stdout.readline()
                if not line.startswith("HELD"):
                    raise RuntimeError(f"the client could not hold {n} tunnels: {line!r}")
                # Every tunnel has moved a byte both ways: both relay threads of each are running.
                held = rss_kib()
                client.stdin.write("\n")
                client.stdin.flush()
                client.wait(60)
                log("egress memory: 100 MB through the proxy and straight")
                url = f"http://api.example.test/bytes/{100 * MB}"
                via = _download(
                    ["nsenter", f"--net=/run/netns/{sn.netns}"],
                    url,
                    ["-p", "-x", f"http://{sn.gateway}:{proxy.PROXY_PORT}"],
                )
                direct = _download(
                    ["nsenter", f"--net=/run/netns/{net.uplink}"],
                    f"http://{egress_net.HOST}/bytes/{100 * MB}",
                    [],
                )
            finally:
                egress.detach("bench-mem", "rsl-bench-mem")
        finally:
            net.close()
    delta = (held - before) / 1024
    return {
        "tunnels": n,
        "rss_before_mib": round(before / 1024, 1),
        "rss_held_mib": round(held / 1024, 1),
        "added_mib": round(delta, 1),
        "per_tunnel_kib": round(delta * 1024 / n, 1),
        "proxy_mb_s": round(via, 1),
        "direct_mb_s": round(direct, 1),
    }


if __name__ == "__main__":
    print(run(int(sys.argv[1]) if len(sys.argv) > 1 else None))
