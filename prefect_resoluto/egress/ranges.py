"""The addresses a sandbox's connection is never dialled to, whatever the allowlist says.

Checked on the address a name resolved to, right before dialling it, so a name on the
allowlist that resolves (or re-resolves) inward is still refused. The ranges are those of
the IANA IPv4 and IPv6 special-purpose address registries (RFC 6890 and its updates),
multicast and the reserved blocks, each refused with its own reason. Forms that carry an
IPv4 address inside an IPv6 one are judged by what they lead to:

* ``::ffff:a.b.c.d`` (IPv4-mapped) *is* that IPv4 address to the socket API: judged as it;
* ``64:ff9b::a.b.c.d`` (the well-known NAT64 prefix) reaches the embedded IPv4 address
  through a NAT64 gateway: refused when that address is (a public one is how an IPv6-only
  host with DNS64 reaches the IPv4 internet);
* ``64:ff9b:1::/48`` (local-use NAT64), 6to4 ``2002::/16``, Teredo ``2001::/32`` and
  IPv4-compatible ``::/96`` lead to gateways or relays of someone's network: always refused.

One exemption, in one place: :data:`PINNED_ONLY`, RFC 2544's benchmarking range, is
refused like the others *unless* the address came from the node's own ``egress_resolve``
pin. The flow author wrote that pin; the tests' hosts live there (tests/support/egress_net.py).

Pure functions; nothing here opens a socket.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Refused unless the node's ``egress_resolve`` pins a name to an address in it.
PINNED_ONLY = ipaddress.ip_network("198.18.0.0/15")
PINNED_ONLY_WHY = "benchmarking (RFC 2544), dialled only when egress_resolve pins a name to it"


def _nets(*pairs: tuple[str, str]) -> tuple[tuple[Network, str], ...]:
    return tuple((ipaddress.ip_network(net), why) for net, why in pairs)


# First match wins: a more specific block comes before the block that holds it.
_V4 = _nets(
    ("0.0.0.0/8", "unspecified / 'this network' (RFC 791)"),
    ("10.0.0.0/8", "RFC 1918 private"),
    ("100.64.0.0/10", "CGNAT shared address space (RFC 6598)"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local (cloud metadata, IMDS)"),
    ("172.16.0.0/12", "RFC 1918 private"),
    ("192.0.0.0/24", "IETF protocol assignments (RFC 6890: DS-Lite, NAT64 discovery, ...)"),
    ("192.0.2.0/24", "documentation TEST-NET-1 (RFC 5737)"),
    ("192.88.99.0/24", "6to4 relay anycast (deprecated, RFC 7526)"),
    ("192.168.0.0/16", "RFC 1918 private"),
    ("198.51.100.0/24", "documentation TEST-NET-2 (RFC 5737)"),
    ("203.0.113.0/24", "documentation TEST-NET-3 (RFC 5737)"),
    ("224.0.0.0/4", "multicast"),
    ("255.255.255.255/32", "limited broadcast"),
    ("240.0.0.0/4", "reserved (RFC 1112)"),
)
_V6 = _nets(
    ("::/128", "IPv6 unspecified"),
    ("::1/128", "IPv6 loopback"),
    ("::/96", "IPv4-compatible IPv6 (deprecated, RFC 4291)"),
    ("64:ff9b:1::/48", "local-use NAT64 (RFC 8215): translated by a gateway of this network"),
    ("100::/64", "IPv6 discard-only (RFC 6666)"),
    ("100:0:0:1::/64", "IPv6 dummy prefix (RFC 9780)"),
    ("2001::/32", "Teredo tunnelling (RFC 4380): relayed by someone's Teredo server"),
    ("2001:2::/48", "IPv6 benchmarking (RFC 5180)"),
    ("2001:10::/28", "ORCHID (deprecated, RFC 4843)"),
    ("2001:20::/28", "ORCHIDv2 (RFC 7343)"),
    ("2001::/23", "IETF protocol assignments (RFC 2928)"),
    ("2001:db8::/32", "IPv6 documentation (RFC 3849)"),
    ("2002::/16", "6to4 (deprecated, RFC 7526): relayed to the IPv4 address it embeds"),
    ("3fff::/20", "IPv6 documentation (RFC 9637)"),
    ("5f00::/16", "SRv6 segment identifiers (RFC 9602)"),
    ("fc00::/7", "IPv6 unique local (ULA)"),
    ("fe80::/10", "IPv6 link-local"),
    ("fec0::/10", "IPv6 site-local (deprecated, RFC 3879)"),
    ("ff00::/8", "IPv6 multicast"),
)
_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_6TO4 = ipaddress.ip_network("2002::/16")


def refusal(address: str, own: Iterable[str] = (), *, pinned: bool = False) -> str | None:
    """Why ``address`` may never be dialled for a sandbox, or None if it may. ``own``: the
    host's addresses; ``pinned``: the address came from the node's ``egress_resolve``."""
    try:
        ip: IPAddress = ipaddress.ip_address(address)
    except ValueError:
        return "not an IP address"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            why = refusal(str(ip.ipv4_mapped), own, pinned=pinned)
            return None if why is None else f"IPv4-mapped {ip.ipv4_mapped}: {why}"
        if ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
            why = refusal(str(embedded), own)
            return None if why is None else f"NAT64 (64:ff9b::/96) of {embedded}: {why}"
        if ip in _6TO4:
            relay = ipaddress.IPv4Address((int(ip) >> 80) & 0xFFFFFFFF)
            return f"6to4 (2002::/16, deprecated by RFC 7526): relayed by way of {relay}"
    for net, why in _V4 if ip.version == 4 else _V6:
        if ip in net:
            return why
    if str(ip) in set(own):
        return "an address of this host"
    if ip in PINNED_ONLY:
        return None if pinned else PINNED_ONLY_WHY
    if isinstance(ip, ipaddress.IPv6Address) and ip not in _GLOBAL_UNICAST:
        return "not IPv6 global unicast (outside 2000::/3)"
    if not ip.is_global:
        return "not globally reachable (IANA special-purpose registry)"
    return None
