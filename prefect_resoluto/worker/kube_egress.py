"""A flow run's pod reaches the worker's host at its gateway's one address and port, and nowhere else.

The pod's NetworkPolicy is the job's egress allowlist plus ``<gateway address>/32:<port>``
(:func:`prefect_resoluto.worker.plan.sandbox_network`). An allowlist entry wider than the
gateway's address (``0.0.0.0/0``, the host's subnet, ``public_https`` where the host's address
is public) would admit every other port of the worker's host too: the real Prefect API, the
worker's other runs' gateways, whatever else listens there. So every entry's address block is
cut around the gateway's address before it becomes a rule: the rule set itself cannot name
that address except in the gateway's own rule, whatever the job asks for.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

IPv4 = ipaddress.IPv4Network


class GatewayAddressRefused(ValueError):
    """``api_gateway_address`` is no one IPv4 address a pod can dial (plan.py says so at submission)."""


def gateway_destination(address: str) -> ipaddress.IPv4Address:
    """The gateway's address as a pod's rule names it: one IPv4 address a pod can dial."""
    ip = ipaddress.ip_address(address)
    if ip.version != 4:
        raise GatewayAddressRefused(
            f"api_gateway_address {address!r} is IPv6; a kubernetes pod's NetworkPolicy rules here take "
            "IPv4 address:port only: give an IPv4 address of the worker's host"
        )
    if ip.is_unspecified or ip.is_multicast or ip.is_loopback:
        raise GatewayAddressRefused(
            f"api_gateway_address {address!r} is not one address of the worker's host a pod can dial "
            "(unspecified, multicast or loopback): give the host's own IPv4 address"
        )
    return ip


def allowlist_without(entries: Iterable[str], gateway: ipaddress.IPv4Address) -> list[str]:
    """``entries`` (the runtime's syntax: CIDR[:port] or public_https) with ``gateway`` cut out
    of each: an entry that admits it becomes the blocks around it, same port."""
    from prefect_resoluto.runtimes.kubernetes.manifests import parse_egress_entry

    out: list[str] = []
    for entry in entries:
        rule = parse_egress_entry(entry)  # refuses what the runtime would refuse, in its words
        ports = [p["port"] for p in rule.get("ports", [])]
        blocks = [peer["ipBlock"] for peer in rule["to"]]
        if not any(_admits(block, gateway) for block in blocks):
            out.append(entry)
            continue
        suffix = f":{ports[0]}" if ports else ""
        for block in blocks:
            out += [f"{net}{suffix}" for net in _carved(block, gateway)]
    return out


def _admits(block: dict[str, object], ip: ipaddress.IPv4Address) -> bool:
    net = ipaddress.ip_network(str(block["cidr"]))
    if net.version != 4 or ip not in net:
        return False
    excepts = block.get("except") or []
    assert isinstance(excepts, list)
    return not any(ip in ipaddress.ip_network(str(e)) for e in excepts)


def _carved(block: dict[str, object], gateway: ipaddress.IPv4Address) -> list[IPv4]:
    """The block's addresses (its ``except`` ranges and the gateway's address left out) as CIDRs."""
    net = ipaddress.ip_network(str(block["cidr"]))
    assert isinstance(net, IPv4)
    excepts = block.get("except") or []
    assert isinstance(excepts, list)
    holes = [ipaddress.ip_network(str(e)) for e in excepts] + [ipaddress.ip_network(f"{gateway}/32")]
    parts = [net]
    for hole in holes:
        assert isinstance(hole, IPv4)
        next_parts: list[IPv4] = []
        for part in parts:
            if hole.subnet_of(part):
                next_parts += list(part.address_exclude(hole))
            elif not part.subnet_of(hole):
                next_parts.append(part)
        parts = next_parts
    return list(ipaddress.collapse_addresses(parts))
