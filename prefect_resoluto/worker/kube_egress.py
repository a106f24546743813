"""A flow run's pod reaches the worker's host at its gateway's one address and port, and nowhere else.

The pod's NetworkPolicy is the job's egress allowlist plus ``<gateway address>/32:<port>``
(:func:`prefect_resoluto.worker.plan.sandbox_network`). An allowlist entry wider than the
gateway's address (``0.0.0.0/0``, the host's subnet, ``public_https`` where the host's address
is public) would admit every other port of the worker's host too: the real Prefect API, the
worker's other runs' gateways, whatever else listens there. So every entry's address block is
cut around the gateway's address before it becomes a rule: the rule set itself cannot name
that address except in the gateway's own rule, whatever the job asks for.

The host answers on its other addresses too (a second NIC, docker0, a CNI bridge), where a
server listening on 0.0.0.0 (the real Prefect API) is as reachable as on the gateway's; so
every address of the host's own (:func:`host_networks`) is cut out the same way.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence

IPv4 = ipaddress.IPv4Network
#: The kernel's routes, its local table included: every address this host answers on.
FIB_TRIE = "/proc/net/fib_trie"


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


def host_networks(fib_trie: str = FIB_TRIE) -> list[IPv4]:
    """This host's own IPv4 addresses but loopback (a pod never reaches it): the kernel's local
    routes on Linux (every address of every device, secondary ones too), else what the host's
    name resolves to."""
    try:
        with open(fib_trie, encoding="ascii", errors="replace") as f:
            return _local_routes(f.read())
    except OSError:
        pass
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        return []
    nets = {ipaddress.ip_network(f"{i[4][0]}/32") for i in infos}
    return sorted((n for n in nets if isinstance(n, IPv4) and not n.is_loopback), key=str)


def _local_routes(text: str) -> list[IPv4]:
    """The ``host LOCAL`` entries of ``/proc/net/fib_trie`` (an address line, then its prefix)."""
    nets: set[IPv4] = set()
    address = ""
    for line in text.splitlines():
        word = line.strip()
        if word.startswith("|-- "):
            address = word[4:].strip()
        elif address and word.startswith("/") and word.endswith("host LOCAL"):
            try:
                net = ipaddress.ip_network(f"{address}{word.split()[0]}", strict=False)
            except ValueError:
                continue
            if isinstance(net, IPv4) and not net.is_loopback:
                nets.add(net)
    return sorted(nets, key=str)


def check_infrastructure_rules(
    rules: Sequence[dict[str, object]], host: Sequence[IPv4], *, store_derived: bool
) -> None:
    """The pod's DNS rule (``dns_cidr``) and its store rule, unless derived from the endpoint
    the worker itself writes to, admit no address of the worker's host: a sandbox block's
    ``store_egress_cidr``/``store_egress_port`` or ``dns_cidr`` would open the host's real API
    port past every cut of the allowlist (GatewayAddressRefused names the option)."""
    dns, store = rules[0], rules[1]
    checked = [("dns_cidr", dns)] + (
        [] if store_derived else [("store_egress_cidr/store_egress_port", store)]
    )
    for option, rule in checked:
        peers = rule.get("to") or []
        assert isinstance(peers, list)
        for peer in peers:
            block = peer.get("ipBlock")
            hit = next((h for h in host if block is not None and _admits(block, h)), None)
            if hit is not None:
                raise GatewayAddressRefused(
                    f"the sandbox's kubernetes {option} ({block['cidr']}) admits {hit}, an address of the "
                    "worker's host, which a flow run's pod reaches at its gateway only; name the "
                    "store or resolver by addresses that are not the worker's (or leave "
                    "store_egress_cidr/port unset: the store's endpoint is then reached as the worker reaches it)"
                )


def allowlist_without(
    entries: Iterable[str], gateway: ipaddress.IPv4Address, host: Sequence[IPv4] = ()
) -> list[str]:
    """``entries`` (the runtime's syntax: CIDR[:port] or public_https) with ``gateway`` and the
    host's other addresses ``host`` cut out of each: an entry that admits any of them becomes
    the blocks around them, same port."""
    from prefect_resoluto.runtimes.kubernetes.manifests import parse_egress_entry

    holes = [ipaddress.IPv4Network(f"{gateway}/32"), *host]
    out: list[str] = []
    for entry in entries:
        rule = parse_egress_entry(entry)  # refuses what the runtime would refuse, in its words
        ports = [p["port"] for p in rule.get("ports", [])]
        blocks = [peer["ipBlock"] for peer in rule["to"]]
        if not any(_admits(block, hole) for block in blocks for hole in holes):
            out.append(entry)
            continue
        suffix = f":{ports[0]}" if ports else ""
        for block in blocks:
            out += [f"{net}{suffix}" for net in _carved(block, holes)]
    return out


def _admits(block: dict[str, object], hole: IPv4) -> bool:
    """Whether ``block`` admits any address of ``hole``."""
    net = ipaddress.ip_network(str(block["cidr"]))
    if not isinstance(net, IPv4) or not net.overlaps(hole):
        return False
    excepts = block.get("except") or []
    assert isinstance(excepts, list)
    inside = hole if hole.subnet_of(net) else net
    return not any(inside.subnet_of(ipaddress.ip_network(str(e))) for e in excepts)  # type: ignore[arg-type]


def _carved(block: dict[str, object], cut: Sequence[IPv4]) -> list[IPv4]:
    """The block's addresses (its ``except`` ranges and ``cut`` left out) as CIDRs."""
    net = ipaddress.ip_network(str(block["cidr"]))
    assert isinstance(net, IPv4)
    excepts = block.get("except") or []
    assert isinstance(excepts, list)
    holes = [ipaddress.ip_network(str(e)) for e in excepts] + list(cut)
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
