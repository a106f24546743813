"""What a sandbox may dial: allowlist entries, resolution overrides and forwards (the
address ranges refused whatever the allowlist says are in :mod:`.ranges`).

Pure functions and values; nothing here opens a socket.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .names import BadName, host_name
from .ranges import refusal as refusal  # the always-refused ranges; re-exported for callers

DEFAULT_PORTS = (443, 80)


class EgressPolicyError(ValueError):
    """An allowlist entry, resolution override or forward that cannot be used."""


def normalize_name(name: str) -> str:
    return name.strip().rstrip(".").lower()


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return False
    return True


def _check_name(name: str, entry: str, wildcard_ok: bool) -> str:
    if is_ip(normalize_name(name)):
        raise EgressPolicyError(
            f"egress entry {entry!r} is an IP address; local sandboxes are allowlisted by name only "
            "(a connection to an address is refused; use egress_resolve to pin a name to an address)"
        )
    try:
        # The same validation as every name a sandbox sends: an entry that could never
        # match a valid name is an error now, not a silent no-op later.
        name = host_name(name.strip(), wildcard=wildcard_ok)
    except BadName as e:
        raise EgressPolicyError(
            f"egress entry {entry!r} is not a host name (use e.g. 'api.example.com', "
            f"'*.githubusercontent.com' or 'host:8443'): {e.reason}"
        ) from None
    if name.startswith("*.") and name.count(".") < 2:
        raise EgressPolicyError(f"egress entry {entry!r}: a wildcard needs at least two labels after '*.'")
    return name


def _port(text: str, entry: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise EgressPolicyError(f"egress entry {entry!r}: port must be a number 1-65535")
    return port


def split_host_port(entry: str) -> tuple[str, int | None]:
    head, sep, tail = entry.strip().rpartition(":")
    if sep and head and tail.isdigit():
        return head, _port(tail, entry)
    return entry.strip(), None


@dataclass(frozen=True)
class Rule:
    """``name`` exact, or ``*.suffix`` (any name ending in ``.suffix``, not ``suffix`` itself)."""

    pattern: str
    ports: tuple[int, ...] = DEFAULT_PORTS

    def matches(self, name: str, port: int) -> bool:
        if port not in self.ports:
            return False
        if self.pattern.startswith("*."):
            return name.endswith(self.pattern[1:]) and len(name) > len(self.pattern) - 1
        return name == self.pattern

    def __str__(self) -> str:
        if self.ports == DEFAULT_PORTS:
            return self.pattern
        return ",".join(f"{self.pattern}:{p}" for p in self.ports)


def parse_rules(entries: Iterable[str]) -> tuple[Rule, ...]:
    rules: list[Rule] = []
    for entry in entries:
        if not isinstance(entry, str) or not entry.strip():
            raise EgressPolicyError(f"egress entry {entry!r} must be a non-empty string")
        host, port = split_host_port(entry)
        name = _check_name(host, entry, wildcard_ok=True)
        rules.append(Rule(name, (port,) if port else DEFAULT_PORTS))
    return tuple(rules)


def parse_resolve(mapping: Mapping[str, str] | Iterable[str]) -> dict[str, str]:
    """``{"api.example.test": "198.18.0.2"}`` or ``["api.example.test=198.18.0.2"]``."""
    items = mapping.items() if isinstance(mapping, Mapping) else (_pair(s) for s in mapping)
    out: dict[str, str] = {}
    for host, ip in items:
        name = _check_name(host, f"{host}={ip}", wildcard_ok=False)
        try:
            out[name] = str(ipaddress.ip_address(str(ip).strip().strip("[]")))
        except ValueError:
            raise EgressPolicyError(f"egress_resolve {host!r}: {ip!r} is not an IP address") from None
    return out


def _pair(text: str) -> tuple[str, str]:
    host, sep, ip = str(text).partition("=")
    if not sep:
        raise EgressPolicyError(f"egress_resolve entry {text!r} must look like HOST=IP")
    return host, ip


def parse_forward(mapping: Mapping[str, str]) -> dict[tuple[str, int], tuple[str, int]]:
    """``{"prefect-api.resoluto.internal:4200": "127.0.0.1:4200"}``: one name:port the
    sandbox dials -> one loopback address:port on the host."""
    out: dict[tuple[str, int], tuple[str, int]] = {}
    for src, dst in mapping.items():
        host, port = split_host_port(src)
        if port is None:
            raise EgressPolicyError(f"egress_forward key {src!r} must be NAME:PORT")
        name = _check_name(host, src, wildcard_ok=False)
        dhost, dport = split_host_port(str(dst))
        try:
            addr = ipaddress.ip_address(dhost.strip("[]"))
        except ValueError:
            addr = None
        if addr is None or not addr.is_loopback or dport is None:
            raise EgressPolicyError(
                f"egress_forward {src!r} -> {dst!r}: the destination must be a host loopback "
                "address and port, e.g. 127.0.0.1:4200"
            )
        out[(name, port)] = (str(addr), dport)
    return out


@dataclass(frozen=True)
class Phases:
    """The allowlists of one node: the setup step's and the workload's."""

    setup: tuple[Rule, ...]
    workload: tuple[Rule, ...]
    has_setup: bool = False

    @property
    def first(self) -> str:
        return "setup" if self.has_setup else "workload"

    def rules(self, phase: str) -> tuple[Rule, ...]:
        return self.setup if phase == "setup" else self.workload


@dataclass(frozen=True)
class NodePolicy:
    """Everything the proxy needs to decide for one node."""

    phases: Phases
    resolve: dict[str, str] = field(default_factory=dict)
    forward: dict[tuple[str, int], tuple[str, int]] = field(default_factory=dict)

    def allows(self, phase: str, name: str, port: int) -> bool:
        return any(r.matches(name, port) for r in self.phases.rules(phase))

    def knows_name(self, phase: str, name: str) -> bool:
        """Whether the sandbox's DNS should answer for ``name`` (any allowed port)."""
        if any(n == name for n, _ in self.forward):
            return True
        return any(r.matches(name, p) for r in self.phases.rules(phase) for p in r.ports)

    def ports(self) -> set[int]:
        """Every port a transparent connection may arrive on, across phases."""
        ports = {p for r in self.phases.setup + self.phases.workload for p in r.ports}
        return ports | {p for _, p in self.forward}

    def describe(self, phase: str) -> str:
        rules = ", ".join(str(r) for r in self.phases.rules(phase)) or "nothing"
        return rules


def build_policy(
    egress: Iterable[str] = (),
    setup_egress: Iterable[str] | None = None,
    resolve: Mapping[str, str] | Iterable[str] | None = None,
    forward: Mapping[str, str] | None = None,
    *,
    has_setup: bool = False,
) -> NodePolicy | None:
    """The node's policy, or None when it needs no network at all."""
    workload = parse_rules(egress)
    setup = parse_rules(setup_egress) if setup_egress is not None else workload
    fwd = parse_forward(forward or {})
    res = parse_resolve(resolve or {})
    if not workload and not (has_setup and setup) and not fwd:
        return None
    return NodePolicy(Phases(setup if has_setup else workload, workload, has_setup), res, fwd)
