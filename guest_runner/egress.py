"""The guest's side of an egress allowlist: the fail-closed canary and the phase switch.

The allowlist is enforced outside the sandbox; nothing here can widen it. The canary is
a second opinion from inside: before any user code runs it checks that destinations
outside the allowlist are unreachable — directly (an address, bypassing the proxy), by
name (through the sandbox's DNS) and through the proxy — and if one answers, the node
stops with "egress is not enforced". Standard library only.
"""

from __future__ import annotations

import json
import socket
from typing import List, Mapping, Optional, Tuple

from guest_runner.wire import ENV_EGRESS_CANARY, ENV_EGRESS_PROXY

NOT_ENFORCED = "egress is not enforced"
_TIMEOUT = 3.0


def _targets(env: Mapping[str, str], name: str) -> List[Tuple[str, int]]:
    try:
        raw = json.loads(env.get(name) or "[]")
    except ValueError:
        raw = []
    out = []
    for t in raw if isinstance(raw, list) else []:
        host, _, port = str(t).rpartition(":")
        if host and port.isdigit():
            out.append((host.strip("[]"), int(port)))
    return out


def _is_ip(host: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
            return True
        except OSError:
            pass
    return False


def _connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=_TIMEOUT):
            return True
    except OSError:
        return False


def _proxy_admits(proxy: Tuple[str, int], host: str, port: int) -> bool:
    """Whether the proxy agrees to CONNECT to host:port (a 2xx answer)."""
    try:
        with socket.create_connection(proxy, timeout=_TIMEOUT) as s:
            s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
            status = s.recv(64).split(b" ", 2)
    except OSError:
        return False
    return len(status) > 1 and status[1].startswith(b"2")


def proxy_address(env: Mapping[str, str]) -> Optional[Tuple[str, int]]:
    host, _, port = (env.get(ENV_EGRESS_PROXY) or "").rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def canary(env: Mapping[str, str], name: str = ENV_EGRESS_CANARY) -> Tuple[Optional[str], int]:
    """(why egress is not enforced, or None; how many targets were checked)."""
    proxy = proxy_address(env)
    targets = _targets(env, name)
    for host, port in targets:
        if _is_ip(host):
            if _connects(host, port):
                return f"{NOT_ENFORCED}: {host}:{port} is reachable directly from the sandbox", len(targets)
        else:
            try:
                addrs = {str(ai[4][0]) for ai in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
            except OSError:
                addrs = set()
            for addr in sorted(addrs):
                if _connects(addr, port):
                    return (
                        f"{NOT_ENFORCED}: {host}:{port} resolves in the sandbox ({addr}) and is reachable",
                        len(targets),
                    )
        if proxy is not None and _proxy_admits(proxy, host, port):
            return f"{NOT_ENFORCED}: the proxy admits {host}:{port}, outside the allowlist", len(targets)
    return None, len(targets)


def switch_to_workload(env: Mapping[str, str]) -> Optional[str]:
    """Ask the proxy to drop the setup allowlist; None once it confirmed, else why not."""
    proxy = proxy_address(env)
    if proxy is None:
        return f"{NOT_ENFORCED}: no egress proxy address to switch phases at"
    try:
        with socket.create_connection(proxy, timeout=10) as s:
            s.sendall(
                b"POST /.resoluto/egress/phase/workload HTTP/1.1\r\nHost: proxy\r\n"
                b"Content-Length: 0\r\nConnection: close\r\n\r\n"
            )
            reply = b""
            while b"\r\n\r\n" not in reply:
                chunk = s.recv(4096)
                if not chunk:
                    break
                reply += chunk
    except OSError as e:
        return f"{NOT_ENFORCED}: the proxy did not confirm the switch to the workload allowlist ({e})"
    if not reply.startswith(b"HTTP/1.1 200"):
        return f"{NOT_ENFORCED}: the proxy refused the switch to the workload allowlist"
    return None
