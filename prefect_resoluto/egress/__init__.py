"""Egress allowlists for local sandboxes: what a runtime asks for when a node has one.

A runtime calls :func:`attach` with the node's :class:`NetworkRequest` and gets a
:class:`SandboxNetwork`: a network namespace to run the sandbox in, the environment
(proxy variables, canary targets) and the ``/etc/resolv.conf`` to give it. It calls
:func:`detach` at destroy. Everything else — the run's proxy, the namespaces and veths,
the policy and the decision events — lives in this package:

* :mod:`.policy`: allowlist entries, wildcards, ports, forwards, resolve pins;
* :mod:`.ranges`: the always-refused addresses;
* :mod:`.names` and :mod:`.parse`: what a sandbox sends, parsed as attacker input;
* :mod:`.netns`: namespaces and veth pairs, their records and sweep;
* :mod:`.proxy`: the per-run proxy (CONNECT, transparent SNI/Host, DNS).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from guest_runner import wire
from prefect_resoluto.host.availability import Availability

from . import netns, proxy, registry
from .policy import EgressPolicyError, NodePolicy, build_policy, is_ip, split_host_port

__all__ = [
    "EgressPolicyError",
    "NetworkRequest",
    "SandboxNetwork",
    "attach",
    "build_policy",
    "detach",
    "listen",
    "unlisten",
    "network_request",
    "available",
    "proxy_for",
    "events_bound",
    "CANARY_ENV",
    "DEFAULT_CANARY",
]

#: The live proxy of a run in this process (``None`` when none of its sandboxes is up).
proxy_for = proxy.proxy_for
#: The most egress events one sandbox produces (each kind of decision is capped).
events_bound = proxy.events_bound

#: Host-side override of the canary targets (comma separated ``host:port``).
CANARY_ENV = wire.ENV_EGRESS_CANARY
#: Targets outside any sane allowlist. With enforcement working a connection to them
#: never leaves the sandbox (no route; the proxy refuses the name without resolving it).
DEFAULT_CANARY = ("1.1.1.1:443", "example.com:443")


@dataclass(frozen=True)
class NetworkRequest:
    """A node's need for a network: who it is and what it may reach."""

    run_id: str
    node_id: str
    policy: NodePolicy
    #: Destinations that must be unreachable before the workload (``host:port``).
    canary: tuple[str, ...] = DEFAULT_CANARY


@dataclass
class SandboxNetwork:
    netns: str
    gateway: str
    address: str
    env: dict[str, str] = field(default_factory=dict)
    resolv_conf: str = ""


def available() -> Availability:
    """Whether allowlists can be enforced on this host (network namespaces), and if not why."""
    return netns.available()


def network_request(
    run_id: str,
    node_id: str,
    *,
    egress: Iterable[str] = (),
    setup_egress: Iterable[str] | None = None,
    resolve: dict[str, str] | None = None,
    forward: dict[str, str] | None = None,
    has_setup: bool = False,
    canary: Iterable[str] | None = None,
) -> NetworkRequest | None:
    """The node's request, or None when it needs no network (then: only ``lo``)."""
    policy = build_policy(egress, setup_egress, resolve, forward, has_setup=has_setup)
    if policy is None:
        return None
    if canary is None:
        env = os.environ.get(CANARY_ENV, "")
        canary = [t.strip() for t in env.split(",") if t.strip()] if env else DEFAULT_CANARY
    targets = []
    for t in canary:
        host, port = split_host_port(t)
        if port is None:
            raise EgressPolicyError(f"egress canary target {t!r} must be HOST:PORT")
        if not is_ip(host) and (
            policy.allows(policy.phases.first, host, port) or policy.allows("workload", host, port)
        ):
            continue  # an allowlisted name is reachable by design
        targets.append(f"{host}:{port}")
    return NetworkRequest(run_id, node_id, policy, tuple(targets))


# --------------------------------------------------------------------------- events

#: A node's egress decisions go to the sink it listens with (the per-run registry holds both).
listen = registry.listen
unlisten = registry.unlisten


# --------------------------------------------------------------------------- the seam


def attach(req: NetworkRequest, sandbox_id: str) -> SandboxNetwork:
    """Start (or join) the run's proxy and wire a namespace for ``sandbox_id`` to it."""
    here = available()
    if not here.ok:
        raise netns.NetnsError(f"egress allowlists cannot be enforced here: {here.why}")
    run_proxy = proxy.acquire(req.run_id)
    try:
        att = run_proxy.attach(
            sandbox_id,
            req.node_id,
            req.policy,
            sink=lambda ev: registry.publish(req.run_id, req.node_id, ev),
            canary=frozenset(split_host_port(t)[0] for t in req.canary),
        )
    except Exception:
        proxy.release(req.run_id)
        raise
    url = att.proxy_url
    no_proxy = "localhost,127.0.0.1,::1"
    env = {
        "HTTPS_PROXY": url,
        "HTTP_PROXY": url,
        "https_proxy": url,
        "http_proxy": url,
        "NO_PROXY": no_proxy,
        "no_proxy": no_proxy,
        wire.ENV_EGRESS_PROXY: f"{att.gateway}:{proxy.PROXY_PORT}",
        wire.ENV_EGRESS_CANARY: json.dumps(list(req.canary)),
        wire.ENV_EGRESS_PHASES: json.dumps(
            ["setup", "workload"] if req.policy.phases.has_setup else ["workload"]
        ),
    }
    setup_only = _setup_only(req.policy)
    if setup_only:
        env[wire.ENV_EGRESS_CANARY_WORKLOAD] = json.dumps(setup_only)
    resolv = f"nameserver {att.gateway}\noptions timeout:2 attempts:2\n"
    return SandboxNetwork(att.netns, att.gateway, att.address, env, resolv)


def _setup_only(policy: NodePolicy) -> list[str]:
    """Names the setup step may reach and the workload may not: checked after the switch."""
    if not policy.phases.has_setup:
        return []
    out = []
    for r in policy.phases.setup:
        if r.pattern.startswith("*."):
            continue
        for p in r.ports:
            if not policy.allows("workload", r.pattern, p) and (r.pattern, p) not in policy.forward:
                out.append(f"{r.pattern}:{p}")
    return out


def detach(run_id: str, sandbox_id: str) -> None:
    """Remove the sandbox's namespace; stops the run's proxy with its last sandbox."""
    run_proxy = proxy.proxy_for(run_id)
    if run_proxy is None or sandbox_id not in {a.sandbox_id for a in run_proxy.attached()}:
        netns.delete(f"{netns.SANDBOX_PREFIX}{sandbox_id}")  # launched by a process now gone
        return
    run_proxy.detach(sandbox_id)
    proxy.release(run_id)


def sweep() -> int:
    """Namespaces left by processes that died (SIGKILL, power loss)."""
    return netns.sweep()
