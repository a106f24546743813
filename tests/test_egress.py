"""Egress allowlists on local sandboxes, end to end, against test hosts in namespaces.

Every packet stays on this machine: the test hosts live in network namespaces created
here (tests/support/egress_net.py), the proxy dials from the test's uplink namespace
(RESOLUTO_EGRESS_UPLINK_NETNS) and the canary targets are test hosts.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support import egress_net, phase_leftovers
from support.polling import scaled, wait_for

from guest_runner.conduit import LocalConduit
from prefect_resoluto import egress
from prefect_resoluto.egress import netns, proxy
from prefect_resoluto.egress.policy import (
    EgressPolicyError,
    build_policy,
    parse_forward,
    parse_rules,
    refusal,
)
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.outcome import NodeOutcome
from prefect_resoluto.node.spec import NodeSpec, NodeSpecError
from prefect_resoluto.runtimes import get_runtime
from prefect_resoluto.runtimes.base import LaunchError, SandboxRuntime

ROOT = Path(__file__).resolve().parents[1]
CANARY = f"{egress_net.HOST2}:7,denied.example.test:443"
# Sandbox namespaces are named by sandbox id machine-wide: ids of this session's own, so a
# second suite on the machine never meets them (tests/test_egress_names.py).
_OURS = f"{os.getpid()}-{os.urandom(2).hex()}"

pytestmark = pytest.mark.skipif(
    not netns.available().ok, reason=f"egress needs namespaces: {netns.available().why}"
)


# --------------------------------------------------------------------------- policy (pure)


def test_rules_names_wildcards_ports() -> None:
    policy = build_policy(["api.example.com", "*.githubusercontent.com", "git.example.org:8443"])
    assert policy is not None
    assert policy.allows("workload", "api.example.com", 443) and policy.allows(
        "workload", "api.example.com", 80
    )
    assert not policy.allows("workload", "api.example.com", 8443)
    assert policy.allows("workload", "raw.githubusercontent.com", 443)
    assert policy.allows("workload", "a.b.githubusercontent.com", 443)
    assert not policy.allows("workload", "githubusercontent.com", 443)  # the suffix itself is not covered
    assert not policy.allows("workload", "evilgithubusercontent.com", 443)
    assert policy.allows("workload", "git.example.org", 8443) and not policy.allows(
        "workload", "git.example.org", 443
    )
    assert not policy.allows("workload", "api.example.com.evil.test", 443)


@pytest.mark.parametrize(
    "entry, message",
    [
        ("198.18.0.2", "IP address"),
        ("api.example.com:99999", "port"),
        ("*.com", "two labels"),
        ("bad host", "not a host name"),
        ("", "non-empty"),
    ],
)
def test_bad_entries_are_refused_clearly(entry: str, message: str) -> None:
    with pytest.raises(EgressPolicyError, match=message):
        parse_rules([entry])


def test_no_allowlist_means_no_network() -> None:
    assert build_policy([]) is None
    assert egress.network_request("r", "n") is None
    # A setup allowlist without a setup step opens nothing.
    assert build_policy([], ["pypi.org"], has_setup=False) is None


@pytest.mark.parametrize(
    "addr, why",
    [
        ("127.0.0.1", "loopback"),
        ("10.1.2.3", "RFC 1918"),
        ("172.16.0.1", "RFC 1918"),
        ("192.168.1.1", "RFC 1918"),
        ("169.254.169.254", "link-local"),
        ("100.64.0.1", "CGNAT"),
        ("224.0.0.1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("::1", "IPv6 loopback"),
        ("fd00::1", "ULA"),
        ("fe80::1", "IPv6 link-local"),
        ("::ffff:127.0.0.1", "IPv4-mapped 127.0.0.1: loopback"),
        # The IANA special-purpose registries, and the IPv6 forms that lead to IPv4.
        ("192.0.0.9", "IETF protocol assignments"),
        ("192.0.2.1", "TEST-NET-1"),
        ("198.51.100.7", "TEST-NET-2"),
        ("203.0.113.7", "TEST-NET-3"),
        ("192.88.99.1", "6to4 relay anycast"),
        ("240.0.0.1", "reserved"),
        ("255.255.255.255", "broadcast"),
        ("198.18.0.2", "benchmarking (RFC 2544), dialled only when egress_resolve pins"),
        ("64:ff9b::a14:2", "NAT64 (64:ff9b::/96) of 10.20.0.2: RFC 1918"),
        ("64:ff9b::a9fe:a9fe", "NAT64 (64:ff9b::/96) of 169.254.169.254: link-local"),
        ("64:ff9b:1::808:808", "local-use NAT64"),
        ("2002:a14:2::1", "6to4 (2002::/16, deprecated by RFC 7526): relayed by way of 10.20.0.2"),
        ("2001:0:a14:2::1", "Teredo"),
        ("::a14:2", "IPv4-compatible"),
        ("fec0::1", "site-local"),
        ("100::1", "discard-only"),
        ("2001:db8::1", "IPv6 documentation"),
        ("2001:2::1", "IPv6 benchmarking"),
        ("3fff::1", "IPv6 documentation"),
        ("5f00::1", "SRv6"),
        ("4000::1", "not IPv6 global unicast"),
        ("ff02::1", "IPv6 multicast"),
    ],
)
def test_always_refused_ranges(addr: str, why: str) -> None:
    assert why in (refusal(addr) or ""), refusal(addr)


def test_public_addresses_pass_pinned_benchmark_addresses_pass_own_addresses_do_not() -> None:
    for public in ("8.8.8.8", "2606:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"):
        assert refusal(public) is None, public
    # The tests' hosts (198.18.0.0/15) only through the node's own egress_resolve pin.
    assert refusal("198.18.0.2", pinned=True) is None and refusal("::ffff:198.18.0.2", pinned=True) is None
    assert refusal("64:ff9b::c612:2", pinned=True) is not None  # a pin never exempts a translation
    assert refusal("10.20.0.2", pinned=True) == "RFC 1918 private"  # nor any other range
    assert refusal("198.18.0.2", own={"198.18.0.2"}, pinned=True) == "an address of this host"


def test_forward_must_target_host_loopback() -> None:
    assert parse_forward({"prefect-api.resoluto.internal:4200": "127.0.0.1:4200"}) == {
        ("prefect-api.resoluto.internal", 4200): ("127.0.0.1", 4200)
    }
    for bad in (
        {"x.internal": "127.0.0.1:1"},
        {"x.internal:1": "10.0.0.1:1"},
        {"x.internal:1": "localhost:1"},
    ):
        with pytest.raises(EgressPolicyError):
            parse_forward(bad)


def test_node_spec_reports_bad_egress_before_launch(tmp_path: Path) -> None:
    spec = NodeSpec(run_id="r", node_id="n", argv=["true"], egress=["10.0.0.0/8"])
    with pytest.raises(NodeSpecError, match="not a host name|IP address"):
        spec.network_request()


# --------------------------------------------------------------------------- the test internet


@pytest.fixture(scope="module")
def testnet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[egress_net.TestNet]:
    net = egress_net.build(tmp_path_factory.mktemp("testnet"), "eg")
    yield net
    net.close()


@pytest.fixture(autouse=True)
def _point_at_testnet(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if "testnet" in request.fixturenames:
        net = request.getfixturevalue("testnet")
        monkeypatch.setenv(proxy.UPLINK_ENV, net.uplink)
        monkeypatch.setenv(egress.CANARY_ENV, CANARY)


@pytest.fixture(params=["gvisor", "bubblewrap", "container"])
def rt(request: pytest.FixtureRequest) -> SandboxRuntime:
    """Each local runtime that enforces allowlists; ``container`` is podman with runsc."""
    runtime = get_runtime(request.param)
    avail = runtime.availability()
    if not avail.ok:
        pytest.skip(f"{request.param} is not available here: {avail.why}")
    return runtime


@pytest.fixture
def gv(gvisor: SandboxRuntime) -> SandboxRuntime:
    """The session plugin's gVisor runtime (or its skip), under this module's short name."""
    return gvisor


def _workspace(tmp_path: Path, net: egress_net.TestNet, files: dict[str, str] | None = None) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    (ws / "ca.pem").write_bytes(net.cert.read_bytes())
    for name, text in (files or {}).items():
        (ws / name).write_text(textwrap.dedent(text))
    return ws


def run_node(
    rt: SandboxRuntime,
    tmp_path: Path,
    net: egress_net.TestNet,
    argv: list[str],
    *,
    run_id: str = "run-a",
    node_id: str = "n1",
    files: dict[str, str] | None = None,
    **kw: Any,
) -> tuple[NodeOutcome, list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []
    kw.setdefault("egress_resolve", net.resolve)
    env = {"SSL_CERT_FILE": "/workspace/ca.pem", "CURL_CA_BUNDLE": "/workspace/ca.pem", **kw.pop("env", {})}
    spec = NodeSpec(
        run_id=run_id, node_id=node_id, argv=argv, workspace=_workspace(tmp_path, net, files), env=env, **kw
    )
    outcome = drive_node(
        spec,
        LocalConduit(tmp_path / "conduit"),
        rt,
        on_event=events.append,
        min_isolation="namespace",
        silence_window=120,
    )
    return outcome, events


def lines(events: list[dict[str, Any]], kind: str | None = None) -> list[str]:
    return [str((e.get("data") or {}).get("line", "")) for e in events if kind is None or e["kind"] == kind]


def decisions(events: list[dict[str, Any]], decision: str) -> list[dict[str, Any]]:
    return [e["data"] for e in events if e["kind"] == "egress" and e["data"].get("decision") == decision]


def output(events: list[dict[str, Any]]) -> str:
    return "\n".join(lines(events, "log"))


FETCH = """
import json, os, socket, ssl, sys, urllib.request
ctx = ssl.create_default_context()
def proxied(url):
    try:
        return urllib.request.urlopen(url, context=ctx, timeout=20).read().decode()
    except Exception as e:
        return f"ERROR {type(e).__name__}: {e}"
def transparent(name, port=443, path="/t"):
    try:
        s = socket.create_connection((name, port), timeout=10)
        if port == 443:
            s = ctx.wrap_socket(s, server_hostname=name)
        s.sendall(f"GET {path} HTTP/1.1\\r\\nHost: {name}\\r\\nConnection: close\\r\\n\\r\\n".encode())
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return data.decode().split("\\r\\n\\r\\n", 1)[-1]
    except Exception as e:
        return f"ERROR {type(e).__name__}: {e}"
"""


# --------------------------------------------------------------------------- end to end


@pytest.mark.sandbox
def test_allowlisted_name_from_python_proxy_and_transparent(
    rt: SandboxRuntime, tmp_path: Path, testnet: egress_net.TestNet
) -> None:
    code = FETCH + textwrap.dedent("""
        print("P", proxied("https://api.example.test/py-proxy"))
        print("H", proxied("http://api.example.test/py-http"))
        print("T", transparent("api.example.test"))
        print("IF", sorted(n for _, n in socket.if_nameindex()))
    """)
    outcome, events = run_node(
        rt, tmp_path, testnet, [sys.executable, "-c", code], egress=["api.example.test"]
    )
    out = output(events)
    assert outcome.ok, outcome.describe() + out
    assert f"P hello from {egress_net.HOST} host=api.example.test path=/py-proxy" in out
    assert f"H hello from {egress_net.HOST} host=api.example.test path=/py-http" in out
    assert f"T hello from {egress_net.HOST} host=api.example.test path=/t" in out
    assert "IF ['eth0', 'lo']" in out
    allowed = decisions(events, "allowed")
    assert {d["via"] for d in allowed} >= {"CONNECT", "HTTP proxy", "transparent TLS"}
    for d in allowed:
        assert d["host"] == "api.example.test" and d["address"].startswith(egress_net.HOST + ":")
        assert d["bytes_up"] > 0 and d["bytes_down"] > 0 and d["duration"] >= 0


@pytest.mark.sandbox
def test_curl_proxy_aware_and_transparent(
    gv: SandboxRuntime, tmp_path: Path, testnet: egress_net.TestNet
) -> None:
    script = (
        "curl -sS https://api.example.test/c1 && curl -sS --noproxy '*' https://api.example.test/c2 && "
        "curl -sS --noproxy '*' http://api.example.test/c3 && curl -sS http://api.example.test/c4"
    )
    outcome, events = run_node(gv, tmp_path, testnet, ["sh", "-c", script], egress=["api.example.test"])
    out = output(events)
    assert outcome.ok, outcome.describe() + out
    for path in ("c1", "c2", "c3", "c4"):
        assert f"hello from {egress_net.HOST} host=api.example.test path=/{path}" in out
    vias = [d["via"] for d in decisions(events, "allowed")]
    assert sorted(vias) == ["CONNECT", "HTTP proxy", "transparent HTTP", "transparent TLS"]


@pytest.mark.sandbox
def test_name_not_on_the_list_is_refused_in_the_logs(
    rt: SandboxRuntime, tmp_path: Path, testnet: egress_net.TestNet
) -> None:
    before = len(testnet.hits.to(egress_net.HOST2))
    code = FETCH + textwrap.dedent("""
        print("P", proxied("https://other.example.test/x"))
        print("T", transparent("other.example.test"))
    """)
    outcome, events = run_node(
        rt, tmp_path, testnet, [sys.executable, "-c", code], egress=["api.example.test"]
    )
    out = output(events)
    assert outcome.ok, outcome.describe()
    assert "P ERROR" in out and "403" in out
    assert "T ERROR gaierror" in out  # the sandbox's DNS knows allowlisted names only
    refused = [d for d in decisions(events, "refused") if d.get("host") == "other.example.test"]
    assert refused and all(d["level"] == "WARNING" and d["reason"] == "not in the allowlist" for d in refused)
    assert any(
        "egress refused other.example.test:443 via CONNECT: not in the allowlist" in d["line"]
        for d in refused
    )
    assert len(testnet.hits.to(egress_net.HOST2)) == before


@pytest.mark.sandbox
@pytest.mark.parametrize(
    "name, address, why",
    [
        ("private.example.test", egress_net.PRIVATE, "RFC 1918"),
        ("imds.example.test", egress_net.IMDS, "link-local"),
        ("loop.example.test", "127.0.0.1", "loopback"),
    ],
)
def test_allowlisted_name_resolving_inward_is_refused_without_connecting(
    gv: SandboxRuntime, tmp_path: Path, testnet: egress_net.TestNet, name: str, address: str, why: str
) -> None:
    code = FETCH + textwrap.dedent(f"""
        print("P", proxied("https://{name}/rebind"))
        print("H", proxied("http://{name}/rebind"))
        print("T", transparent("{name}"))
    """)
    outcome, events = run_node(gv, tmp_path, testnet, [sys.executable, "-c", code], egress=[name])
    out = output(events)
    assert outcome.ok, outcome.describe()
    assert "hello" not in out
    refused = [d for d in decisions(events, "refused") if d.get("host") == name]
    assert len(refused) == 3
    for d in refused:
        assert d["reason"].startswith(f"resolves to a private address ({address}") and why in d["reason"]
    # Nothing reached the test host listening there (nor the uplink's own loopback).
    assert testnet.hits.to(address) == [] and testnet.loop_hits.seen == []


@pytest.mark.sandbox
def test_direct_ip_raw_udp_and_host_listeners_unreachable(
    rt: SandboxRuntime, tmp_path: Path, testnet: egress_net.TestNet
) -> None:
    # A listener on every address of the host itself: the sandbox must reach none of them.
    host_listener = socket.socket()
    host_listener.bind(("0.0.0.0", 0))
    host_listener.listen(8)
    host_listener.setblocking(False)
    port = host_listener.getsockname()[1]
    host_ips = sorted(a for a in netns.addresses(None) if ":" not in a and not a.startswith("127."))
    udp_before, tcp_before = len(testnet.udp_hits.seen), len(testnet.hits.to(egress_net.HOST))
    code = textwrap.dedent(f"""
        import socket, json
        gw = json.loads(open("/etc/resolv.conf").read().split()[1:2] and '"' + open("/etc/resolv.conf").read().split()[1] + '"')
        res = {{}}
        for host, port in [("{egress_net.HOST}", 443), ("{egress_net.HOST}", 7), ("{egress_net.IMDS}", 80),
                           ("127.0.0.1", {port}), (gw, {port}), (gw, 22)] + [(h, {port}) for h in {host_ips!r}]:
            try:
                socket.create_connection((host, port), timeout=3).close()
                res[f"{{host}}:{{port}}"] = "CONNECTED"
            except OSError as e:
                res[f"{{host}}:{{port}}"] = type(e).__name__
        for host in ["{egress_net.HOST}", gw]:
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            u.settimeout(2)
            try:
                u.sendto(b"ping", (host, 7))
                res[f"udp {{host}}"] = u.recvfrom(100)[0].decode()
            except OSError as e:
                res[f"udp {{host}}"] = type(e).__name__
        print("RES", json.dumps(res))
    """)
    try:
        outcome, events = run_node(
            rt, tmp_path, testnet, [sys.executable, "-c", code], egress=["api.example.test"]
        )
        out = output(events)
        assert outcome.ok, outcome.describe() + out
        res = json.loads(out.split("RES ", 1)[1].splitlines()[0])
        assert res and "CONNECTED" not in res.values(), res
        assert all(not v or v != "ping" for v in res.values())
        with pytest.raises(BlockingIOError):
            host_listener.accept()
    finally:
        host_listener.close()
    assert len(testnet.udp_hits.seen) == udp_before and len(testnet.hits.to(egress_net.HOST)) == tcp_before


@pytest.mark.sandbox
def test_root_in_the_namespace_cannot_widen_it(testnet: egress_net.TestNet) -> None:
    """Stronger than root inside a sandbox: full root (all capabilities) in the sandbox's
    own namespace adds a default route and still reaches nothing but the proxy."""
    req = egress.network_request("run-root", "n1", egress=["api.example.test"], resolve=testnet.resolve)
    assert req is not None
    hits_before = list(testnet.hits.seen)
    net = egress.attach(req, f"rsl-rootwiden-{_OURS}")
    try:

        def sh(cmd: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                ["nsenter", f"--net=/run/netns/{net.netns}", "sh", "-c", cmd],
                capture_output=True,
                text=True,
                timeout=30,
            )

        assert sh(f"ip route add default via {net.gateway}").returncode == 0
        assert sh("ip addr add 198.18.0.77/24 dev eth0").returncode == 0
        for target in (f"http://{egress_net.HOST}/direct", f"http://{egress_net.HOST2}:7/"):
            res = sh(f"curl -sS --noproxy '*' --connect-timeout 3 {target}")
            assert res.returncode != 0, res.stdout
        # The proxy still refuses what the allowlist does not hold.
        res = sh(f"curl -sSf -x http://{net.gateway}:3128 --connect-timeout 3 http://other.example.test/")
        assert res.returncode == 22 and "403" in res.stderr, res.stdout + res.stderr
    finally:
        egress.detach("run-root", f"rsl-rootwiden-{_OURS}")
    assert testnet.hits.seen == hits_before  # no connection reached any test host


@pytest.mark.sandbox
def test_an_address_the_dialling_namespace_gains_after_start_is_refused(testnet: egress_net.TestNet) -> None:
    """Issue 33, finding 2: the proxy took the host's addresses once, at start. An address
    gained later (DHCP, a VPN, an IPv6 privacy address) was dialled for an allowlisted name
    whose DNS the attacker controls, and a service on the host's 0.0.0.0 answered. Now the
    dialling namespace's kernel is asked at dial time."""
    late = "198.18.0.50"
    resolve = {**testnet.resolve, "late.example.test": late}
    req = egress.network_request(
        "run-late", "n1", egress=["late.example.test", "api.example.test"], resolve=resolve
    )
    assert req is not None
    events: list[dict[str, Any]] = []
    egress.listen("run-late", "n1", events.append)
    sid = f"rsl-late-{_OURS}"
    net = egress.attach(req, sid)
    added = False
    try:

        def curl(url: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                ["nsenter", f"--net=/run/netns/{net.netns}", "curl", "-sS", "--cacert", str(testnet.cert)]
                + ["-x", f"http://{net.gateway}:3128", url],
                capture_output=True,
                text=True,
                timeout=scaled(30),
            )

        # After the proxy started, its dialling namespace (the test's uplink, whose lo is
        # served by listeners on 0.0.0.0:80 and :443) gains an address.
        egress_net._ip("-n", testnet.uplink, "addr", "add", f"{late}/32", "dev", "lo")
        added = True
        loop_before = list(testnet.loop_hits.seen)
        plain, tls = curl("http://late.example.test/late"), curl("https://late.example.test/late")
        assert "hello" not in plain.stdout + tls.stdout and "egress refused" in plain.stdout, plain
        assert "403" in tls.stderr, tls.stderr
        # A name pinned to a test host (not local) still goes through.
        assert f"hello from {egress_net.HOST}" in curl("http://api.example.test/still").stdout
    finally:
        if added:
            egress_net._ip("-n", testnet.uplink, "addr", "del", f"{late}/32", "dev", "lo")
        egress.detach("run-late", sid)
        egress.unlisten("run-late", "n1")
    assert testnet.loop_hits.seen == loop_before  # nothing reached the new address
    refused = [d for d in decisions(events, "refused") if d["host"] == "late.example.test"]
    assert len(refused) == 2 and all(
        d["reason"] == f"resolves to a private address ({late}: an address of this host)" for d in refused
    ), refused


@pytest.mark.sandbox
def test_a_connection_that_reached_its_own_namespace_relays_nothing(testnet: egress_net.TestNet) -> None:
    """Where the dialling namespace binds any address (``ip_nonlocal_bind``), the bind test
    cannot tell a local address; the connected socket still does (the kernel made the
    destination its own source): the connection is closed before a byte is relayed."""
    late = "198.18.0.51"
    req = egress.network_request(
        "run-late2", "n1", egress=["late.example.test"], resolve={"late.example.test": late}
    )
    assert req is not None
    events: list[dict[str, Any]] = []
    egress.listen("run-late2", "n1", events.append)
    sid = f"rsl-late2-{_OURS}"
    net = egress.attach(req, sid)
    sysctl = ["ip", "netns", "exec", testnet.uplink, "sysctl", "-q", "-w"]
    try:
        subprocess.run([*sysctl, "net.ipv4.ip_nonlocal_bind=1"], check=True, timeout=30)
        egress_net._ip("-n", testnet.uplink, "addr", "add", f"{late}/32", "dev", "lo")
        assert not netns.is_local(testnet.uplink, "192.0.2.99")  # the bind test cannot tell here
        res = subprocess.run(
            ["nsenter", f"--net=/run/netns/{net.netns}", "curl", "-sS"]
            + ["-x", f"http://{net.gateway}:3128", "http://late.example.test/nonlocal-bind"],
            capture_output=True,
            text=True,
            timeout=scaled(30),
        )
        assert "hello" not in res.stdout and "egress refused" in res.stdout, res
    finally:
        egress_net._ip("-n", testnet.uplink, "addr", "flush", "dev", "lo", "to", f"{late}/32")
        subprocess.run([*sysctl, "net.ipv4.ip_nonlocal_bind=0"], check=True, timeout=30)
        egress.detach("run-late2", sid)
        egress.unlisten("run-late2", "n1")
    assert not [r for r in egress_net.REQUESTS if r[2] == "/nonlocal-bind"]  # no request was relayed
    refused = [d for d in decisions(events, "refused") if d["host"] == "late.example.test"]
    assert [d["reason"] for d in refused] == [
        f"resolves to a private address ({late}: an address of this host)"
    ]


@pytest.mark.sandbox
def test_guest_root_cannot_rewrite_its_dns_or_routes(
    gv: SandboxRuntime, tmp_path: Path, testnet: egress_net.TestNet
) -> None:
    code = textwrap.dedent("""
        import os, socket
        print("UID", os.getuid())
        for path in ("/etc/resolv.conf", "/etc/hosts"):
            try:
                open(path, "a").write("198.18.0.3 api.example.test\\n")
                print("WROTE", path)
            except OSError as e:
                print("RO", path, type(e).__name__)
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
            print("RAW opened")
        except OSError as e:
            print("RAW", type(e).__name__)
    """)
    outcome, events = run_node(
        gv, tmp_path, testnet, [sys.executable, "-c", code], egress=["api.example.test"]
    )
    out = output(events)
    assert outcome.ok, outcome.describe()
    # The workload runs as the unprivileged user (guest_runner/privsep.py); the files are
    # read-only binds and raw sockets need CAP_NET_RAW, which not even the runner keeps.
    assert "UID 65534" in out and "WROTE" not in out and "RAW opened" not in out


# --------------------------------------------------------------------------- canary, phases, forwards


@pytest.mark.sandbox
def test_canary_fails_closed_before_the_workload(
    gv: SandboxRuntime, tmp_path: Path, testnet: egress_net.TestNet, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A canary target the sandbox can reach (the proxy's own port) stands for a broken
    # enforcement: the node must stop before the workload, as an infrastructure failure.
    gateway = netns.slot_addresses(0)[0]
    monkeypatch.setenv(egress.CANARY_ENV, f"{gateway}:{proxy.PROXY_PORT}")
    outcome, events = run_node(
        gv, tmp_path, testnet, ["sh", "-c", "echo WORKLOAD-RAN"], egress=["api.example.test"]
    )
    assert not outcome.ok and outcome.failure == "egress" and outcome.infrastructure_failure
    assert outcome.reason.startswith("egress is not enforced")
    assert "WORKLOAD-RAN" not in output(events)
    assert not [e for e in events if e["kind"] == "workload"]
    from prefect_resoluto.node.outcome import EgressNotEnforced

    with pytest.raises(EgressNotEnforced, match="egress is not enforced"):
        outcome.raise_for_failure()


@pytest.mark.sandbox
def test_canary_passes_and_says_so(gv: SandboxRuntime, tmp_path: Path, testnet: egress_net.TestNet) -> None:
    echo_before = [h for h in testnet.hits.to(egress_net.HOST2) if h[1] == 7]
    outcome, events = run_node(gv, tmp_path, testnet, ["true"], egress=["api.example.test"])
    assert outcome.ok
    assert any(
        "egress canary: 2 destination(s) outside the allowlist unreachable" in line for line in lines(events)
    )
    # It probed the test hosts it was pointed at (direct, by DNS, through the proxy) and reached none.
    probes = [
        d for d in decisions(events, "refused") if d.get("host") in (egress_net.HOST2, "denied.example.test")
    ]
    assert {d["via"] for d in probes} == {"CONNECT", "DNS"}
    # Expected refusals are not warnings: the task's logs keep WARNING for real attempts.
    assert all(
        d["canary"] and d["level"] == "INFO" and "(canary probe, as required)" in d["line"] for d in probes
    )
    assert [h for h in testnet.hits.to(egress_net.HOST2) if h[1] == 7] == echo_before


@pytest.mark.sandbox
def test_setup_phase_has_its_own_allowlist_switched_without_restart(
    gv: SandboxRuntime, tmp_path: Path, testnet: egress_net.TestNet
) -> None:
    setup = [
        "sh",
        "-c",
        "curl -sS https://setup.example.test/in-setup > /workspace/setup.txt; "
        "curl -sS https://api.example.test/api-in-setup || echo API-REFUSED-IN-SETUP",
    ]
    work = (
        "cat /workspace/setup.txt; curl -sS https://setup.example.test/in-workload || echo SETUP-REFUSED; "
        "curl -sS https://api.example.test/in-workload"
    )
    outcome, events = run_node(
        gv,
        tmp_path,
        testnet,
        ["sh", "-c", work],
        setup_argv=setup,
        setup_egress=["setup.example.test"],
        egress=["api.example.test"],
    )
    out = output(events)
    assert outcome.ok, outcome.describe() + out
    assert f"hello from {egress_net.HOST2} host=setup.example.test path=/in-setup" in out
    assert "path=/api-in-setup" not in out and "API-REFUSED-IN-SETUP" in out  # not the setup's names
    assert "SETUP-REFUSED" in out and "path=/in-workload" in out
    phases = [e["data"] for e in events if e["kind"] == "egress" and e["name"] == "phase"]
    assert [p["phase"] for p in phases] == ["setup", "workload"]
    assert "setup connection(s) closed" in phases[1]["line"]
    refused = decisions(events, "refused")
    assert any(d["host"] == "api.example.test" and d["phase"] == "setup" for d in refused)
    assert any(d["host"] == "setup.example.test" and d["phase"] == "workload" for d in refused)


@pytest.mark.sandbox
@pytest.mark.parametrize("phased", [True, False], ids=["setup-egress", "no-network"])
def test_nothing_the_setup_started_runs_into_the_workload(
    gv: SandboxRuntime, tmp_path: Path, testnet: egress_net.TestNet, phased: bool
) -> None:
    """Issue 33, finding 5: only the setup's process group was killed at the phase switch,
    so a process that called setsid() (and double-forked) kept running in the workload
    phase. Now every process the setup's user left in the sandbox's PID namespace ends
    with the setup."""
    outcome, events = run_node(
        gv,
        tmp_path,
        testnet,
        [sys.executable, "-c", phase_leftovers.CHECK],
        setup_argv=[sys.executable, "-c", phase_leftovers.DAEMON],
        **({"setup_egress": ["setup.example.test"], "egress": ["api.example.test"]} if phased else {}),
    )
    out = output(events)
    assert outcome.ok, outcome.describe() + out
    assert phase_leftovers.ESCAPED in out, out
    assert "IN WORKLOAD GONE" in out, out


@pytest.mark.sandbox
def test_phase_switch_is_one_way(testnet: egress_net.TestNet) -> None:
    req = egress.network_request(
        "run-phase",
        "n1",
        egress=[],
        setup_egress=["setup.example.test"],
        resolve=testnet.resolve,
        has_setup=True,
    )
    assert req is not None
    net = egress.attach(req, f"rsl-phase-{_OURS}")
    try:

        def post(phase: str) -> str:
            return subprocess.run(
                [
                    "nsenter",
                    f"--net=/run/netns/{net.netns}",
                    "curl",
                    "-sS",
                    "-X",
                    "POST",
                    f"http://{net.gateway}:3128/.resoluto/egress/phase/{phase}",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout

        assert json.loads(post("workload")) == {"phase": "workload"}
        assert json.loads(post("setup")) == {"phase": "workload"}  # never back
        res = subprocess.run(
            [
                "nsenter",
                f"--net=/run/netns/{net.netns}",
                "curl",
                "-sS",
                "--cacert",
                str(testnet.cert),
                "-x",
                f"http://{net.gateway}:3128",
                "https://setup.example.test/",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert "hello" not in res.stdout
    finally:
        egress.detach("run-phase", f"rsl-phase-{_OURS}")


class _LoopbackAPI:
    """A stand-in for a host service on loopback (the Prefect API, for a worker)."""

    def __init__(self) -> None:
        import http.server

        hits = self.hits = []

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                hits.append(self.path)
                body = f"api says {self.path} host={self.headers.get('Host')}".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.sandbox
def test_forward_reaches_one_loopback_destination_only(
    rt: SandboxRuntime, tmp_path: Path, testnet: egress_net.TestNet
) -> None:
    api = _LoopbackAPI()
    try:
        script = (
            "curl -sS http://prefect-api.resoluto.internal:4200/proxied; echo; "
            "curl -sS -p http://prefect-api.resoluto.internal:4200/tunnel; echo; "
            "curl -sS --noproxy '*' http://prefect-api.resoluto.internal:4200/transparent; echo; "
            "curl -sS --noproxy '*' --connect-timeout 3 http://prefect-api.resoluto.internal:4201/ "
            "|| echo OTHER-PORT-REFUSED; "
            "curl -sSf http://loop.example.test/ || echo LOOPBACK-REFUSED"
        )
        outcome, events = run_node(
            rt,
            tmp_path,
            testnet,
            ["sh", "-c", script],
            egress_forward={"prefect-api.resoluto.internal:4200": f"127.0.0.1:{api.port}"},
        )
        out = output(events)
        assert outcome.ok, outcome.describe() + out
        assert "api says /proxied host=prefect-api.resoluto.internal:4200" in out
        assert "api says /transparent" in out
        assert "OTHER-PORT-REFUSED" in out and "LOOPBACK-REFUSED" in out
        assert "api says /tunnel" in out
        assert api.hits == ["/proxied", "/tunnel", "/transparent"]
        fwd = [d for d in decisions(events, "allowed") if d.get("forward")]
        assert sorted(d["via"] for d in fwd) == ["CONNECT", "HTTP proxy", "transparent"]
        assert all(d["address"] == f"127.0.0.1:{api.port}" for d in fwd)
    finally:
        api.close()


# --------------------------------------------------------------------------- per run, nothing persistent


def _snapshot() -> dict[str, Any]:
    def run(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
        except FileNotFoundError:
            return ""

    ours = [n for n in netns.list_namespaces() if n.startswith((netns.PROXY_PREFIX, netns.SANDBOX_PREFIX))]
    return {
        "netns": ours,
        "links": sorted(line.split(":")[1].strip() for line in run("ip", "-o", "link").splitlines()),
        "nft": run("nft", "list", "ruleset"),
        "iptables": _strip_counters(run("iptables-save")),
        "routes": run("ip", "route", "show", "table", "all"),
    }


def _strip_counters(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


def _mine(snapshot: dict[str, Any], state: Path) -> list[str]:
    """Our namespaces recorded in this test's state dir (other sessions may have theirs)."""
    recorded = {p.stem for p in (state / "egress").glob("*.json")} if (state / "egress").is_dir() else set()
    return [n for n in snapshot["netns"] if n in recorded]


@pytest.mark.sandbox
def test_teardown_leaves_nothing(rt: SandboxRuntime, tmp_path: Path, testnet: egress_net.TestNet) -> None:
    before = _snapshot()
    outcome, events = run_node(
        rt,
        tmp_path,
        testnet,
        ["sh", "-c", "curl -sS https://api.example.test/td"],
        run_id="run-td",
        egress=["api.example.test"],
    )
    assert outcome.ok and "path=/td" in output(events)
    assert proxy.proxy_for("run-td") is None
    after = _snapshot()
    assert after["links"] == before["links"] and after["nft"] == before["nft"]
    assert after["iptables"] == before["iptables"] and after["routes"] == before["routes"]
    assert _mine(after, Path(os.environ["RESOLUTO_STATE_DIR"])) == []
    assert not list((Path(os.environ["RESOLUTO_STATE_DIR"]) / "egress").glob("*.json"))


HOLDER = """
import os, sys, json
from pathlib import Path
sys.path.insert(0, {tests!r})
from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.runtimes import get_runtime
spec = NodeSpec(run_id="run-kill", node_id="n1", argv=["sh", "-c", "curl -sS http://api.example.test/wait/{key}"],
                egress=["api.example.test"], egress_resolve={resolve!r})
drive_node(spec, LocalConduit({conduit!r}), get_runtime({runtime!r}), min_isolation="namespace")
"""


@pytest.mark.sandbox
def test_sigkill_of_the_host_then_sweep_leaves_nothing(
    rt: SandboxRuntime, tmp_path: Path, testnet: egress_net.TestNet
) -> None:
    state = Path(os.environ["RESOLUTO_STATE_DIR"])
    before = _snapshot()
    key = f"kill-{rt.name}-{os.urandom(3).hex()}"
    code = HOLDER.format(
        tests=str(ROOT / "tests"),
        key=key,
        resolve=testnet.resolve,
        conduit=str(tmp_path / "conduit"),
        runtime=rt.name,
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    node_dir = tmp_path / "conduit" / "run" / "run-kill" / "nodes" / "n1"
    host = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        cwd=str(ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for(lambda: key in egress_net.ARRIVED, 90, "the sandboxed task to reach the test host")
        # What sweep must keep: the runner's first chunk (a sandbox may die with its host).
        wait_for(lambda: any(node_dir.glob("events-*.jsonl")), 90, "the runner's first chunk")
        made = _mine(_snapshot(), state)
        assert len(made) == 2, made  # the run's proxy namespace and the sandbox's
        host.send_signal(signal.SIGKILL)
        host.wait(30)
    finally:
        if host.poll() is None:
            host.kill()
        egress_net.GATES.setdefault(key, threading.Event()).set()
    assert _mine(_snapshot(), state) == made  # nobody cleaned up: the host died
    assert os.path.ismount(node_dir) == (os.geteuid() == 0)  # its conduit slot, still mounted
    # Its own run's: podman's containers are the host's, and a sweep of everything would take
    # another test's live container with it.
    swept = get_runtime(rt.name).sweep({"resoluto.run-id": "run-kill"})
    assert swept >= 1
    # The slot was settled: the mount is gone, what the runner wrote stays on the conduit.
    assert not os.path.ismount(node_dir)
    assert list(node_dir.glob("events-*.jsonl")), sorted(p.name for p in node_dir.rglob("*"))
    assert netns.wait_gone(made)
    after = _snapshot()
    assert _mine(after, state) == [] and after["links"] == before["links"]
    assert after["nft"] == before["nft"] and after["iptables"] == before["iptables"]


@pytest.mark.sandbox
def test_concurrent_nodes_share_one_proxy_and_runs_are_apart(
    gv: SandboxRuntime, tmp_path: Path, testnet: egress_net.TestNet
) -> None:
    tag = os.urandom(3).hex()
    plans = [
        ("run-x", "a1", ["api.example.test"], "api.example.test", "other.example.test"),
        ("run-x", "a2", ["api.example.test"], "api.example.test", "other.example.test"),
        ("run-y", "b1", ["other.example.test"], "other.example.test", "api.example.test"),
    ]
    results: dict[str, tuple[NodeOutcome, list[dict[str, Any]]]] = {}

    def one(run_id: str, node_id: str, allow: list[str], mine: str, theirs: str) -> None:
        script = (
            f"curl -sS https://{mine}/wait/{tag}-{node_id} && "
            f"(curl -sS https://{theirs}/leak || echo THEIRS-REFUSED)"
        )
        d = tmp_path / node_id
        d.mkdir()
        results[node_id] = run_node(
            gv, d, testnet, ["sh", "-c", script], run_id=run_id, node_id=node_id, egress=allow
        )

    threads = [threading.Thread(target=one, args=p) for p in plans]
    for t in threads:
        t.start()
    try:
        wait_for(
            lambda: all(f"{tag}-{n}" in egress_net.ARRIVED for n in ("a1", "a2", "b1")),
            120,
            "all three nodes to be running at once",
        )
        px, py_ = proxy.proxy_for("run-x"), proxy.proxy_for("run-y")
        assert px is not None and py_ is not None and px is not py_ and px.netns != py_.netns
        assert sorted(a.node_id for a in px.attached()) == ["a1", "a2"]
        assert [a.node_id for a in py_.attached()] == ["b1"]
    finally:
        for n in ("a1", "a2", "b1"):
            egress_net.GATES.setdefault(f"{tag}-{n}", threading.Event()).set()
        for t in threads:
            t.join(120)
    for outcome, events in results.values():
        out = output(events)
        assert outcome.ok, outcome.describe() + out
        assert "THEIRS-REFUSED" in out and "path=/leak" not in out
    assert proxy.proxy_for("run-x") is None and proxy.proxy_for("run-y") is None


def test_process_runtime_still_refuses_an_allowlist() -> None:
    from prefect_resoluto.runtimes.base import LaunchSpec

    rt = get_runtime("process")
    with pytest.raises(LaunchError, match="cannot enforce an egress allowlist"):
        rt.launch(LaunchSpec(sandbox_id="rsl-proc-egress", env={}, egress=["api.example.test"]))


def test_kubernetes_refuses_per_name_features(local_conduit: LocalConduit) -> None:
    pytest.importorskip("kubernetes")
    from support.k8s_fake import FakeKube

    from prefect_resoluto.runtimes.kubernetes import KubernetesRuntime

    with FakeKube() as fake:
        rt = KubernetesRuntime(
            image="python:3.12-slim",
            store_egress_cidr="10.0.0.5/32",
            store_egress_port=9000,
            guest_source="image",
            api_client=fake.api_client(),
        )
        _refuses_per_name_features(rt, local_conduit)


def _refuses_per_name_features(rt: SandboxRuntime, local_conduit: LocalConduit) -> None:
    for extra in (
        {"egress_forward": {"api.internal:1": "127.0.0.1:1"}},
        {"setup_egress": ["pypi.org"]},
        {"egress_resolve": {"a.example.com": "198.18.0.2"}},
    ):
        spec = NodeSpec(run_id="r", node_id="n", argv=["true"], egress=["10.9.0.0/16:5432"], **extra)
        with pytest.raises(NodeSpecError, match="by address \\(CIDR\\), not by name"):
            drive_node(spec, local_conduit, rt, min_isolation="none")


# --------------------------------------------------------------------------- the CLI


def _cli(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefect_resoluto.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.sandbox
def test_cli_run_with_egress_then_events_shows_the_decisions(
    gv: SandboxRuntime, tmp_path: Path, testnet: egress_net.TestNet
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ws = _workspace(tmp_path, testnet)
    conduit = (tmp_path / "conduit").as_uri()
    res = _cli(
        "run",
        "--runtime",
        "gvisor",
        "--conduit",
        conduit,
        "--workspace",
        str(ws),
        "--run-id",
        "cli-run",
        "--node-id",
        "cli-node",
        "--egress",
        "api.example.test",
        "--egress-resolve",
        f"api.example.test={egress_net.HOST}",
        "--env",
        "CURL_CA_BUNDLE=/workspace/ca.pem",
        "--",
        "sh",
        "-c",
        "curl -sS https://api.example.test/cli && (curl -sS https://other.example.test/ || true)",
        cwd=tmp_path,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    assert f"hello from {egress_net.HOST} host=api.example.test path=/cli" in res.stdout
    assert (
        "egress refused other.example.test:443 via CONNECT: not in the allowlist" in res.stdout + res.stderr
    )
    ev = _cli("events", "--conduit", conduit, "cli-run", "cli-node", cwd=tmp_path, env=env)
    assert ev.returncode == 0, ev.stderr
    assert "egress decisions by the run's proxy" in ev.stdout
    assert "[WARNING resoluto.egress] egress refused other.example.test:443" in ev.stdout
    assert "egress allowed api.example.test:443 -> 198.18.0.2:443 via CONNECT" in ev.stdout
    js = json.loads(
        _cli("events", "--json", "--conduit", conduit, "cli-run", "cli-node", cwd=tmp_path, env=env).stdout
    )
    assert {e["data"]["decision"] for e in js["egress"] if "decision" in e["data"]} == {"allowed", "refused"}


@pytest.mark.sandbox
@pytest.mark.parametrize(
    "args, message",
    [
        (["--egress", "198.18.0.2"], "IP address"),
        (["--egress", "api.example.test", "--egress-resolve", "api.example.test"], "KEY=VALUE"),
        (
            ["--egress", "api.example.test", "--egress-resolve", "api.example.test=not-an-ip"],
            "not an IP address",
        ),
    ],
)
def test_cli_refuses_bad_egress_before_launching(
    gv: SandboxRuntime, tmp_path: Path, args: list[str], message: str
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = _cli(
        "run",
        "--runtime",
        "gvisor",
        "--conduit",
        (tmp_path / "c").as_uri(),
        *args,
        "--",
        "true",
        cwd=tmp_path,
        env=env,
    )
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert gv.list_ids() == []


def test_cli_process_runtime_refuses_egress(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = _cli(
        "run",
        "--runtime",
        "process",
        "--min-isolation",
        "none",
        "--conduit",
        (tmp_path / "c").as_uri(),
        "--egress",
        "api.example.test",
        "--",
        "true",
        cwd=tmp_path,
        env=env,
    )
    assert res.returncode != 0 and "cannot enforce an egress allowlist" in res.stderr, res.stderr


def test_doctor_says_per_runtime_whether_allowlists_are_enforced(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = _cli("doctor", "--json", cwd=tmp_path, env=env)
    rows = {r["label"]: r for r in json.loads(res.stdout)["runtimes"]}
    assert rows["process"]["egress"] == {
        "enforced": False,
        "why": "runtime 'process' cannot enforce an egress allowlist (its sandboxes get no network)",
    }
    if rows["gvisor"]["available"]:
        assert rows["gvisor"]["egress"]["enforced"], rows["gvisor"]["egress"]
        assert "runsc netstack" in rows["gvisor"]["egress"]["detail"]
    text = _cli("doctor", cwd=tmp_path, env=env).stdout
    assert "egress allowlists (--egress), per runtime:" in text


@pytest.mark.sandbox
def test_container_argv_joins_the_prepared_namespace(tmp_path: Path) -> None:
    """nerdctl + Kata cannot run here (no KVM, no dedicated containerd): its argv only.
    podman + runsc runs for real in the ``rt``-parametrized tests above."""
    from prefect_resoluto.runtimes.base import LaunchSpec
    from prefect_resoluto.runtimes.container import ContainerRuntime

    net = egress.SandboxNetwork(
        netns="rsl-s-rsl-argv",
        gateway="172.30.0.1",
        address="172.30.0.2",
        env={"HTTPS_PROXY": "http://172.30.0.1:3128"},
        resolv_conf="nameserver 172.30.0.1\n",
    )
    spec = LaunchSpec(sandbox_id="rsl-argv", env={}, egress=["api.example.test"])
    kata = ContainerRuntime(
        engine="nerdctl",
        address=str(tmp_path / "containerd.sock"),
        oci_runtime="kata",
        state_dir=tmp_path / "state",
    )
    argv = kata.build_run_argv(spec, "python:3.12-slim", net=net)
    assert argv[argv.index("--network") + 1] == "ns:/run/netns/rsl-s-rsl-argv"
    assert argv[argv.index("--runtime") + 1] == "io.containerd.kata.v2"
    assert "HTTPS_PROXY=http://172.30.0.1:3128" in argv
    assert any(a.endswith(":/etc/resolv.conf:ro") for a in argv)
    without = kata.build_run_argv(spec, "python:3.12-slim")
    assert without[without.index("--network") + 1] == "none"
    podman = ContainerRuntime(engine="podman", oci_runtime="runsc", state_dir=tmp_path / "state")
    argv = podman.build_run_argv(spec, "img", net=net)
    wrapper = Path(argv[argv.index("--runtime") + 1])
    assert "--runtime-flag=network=none" not in argv
    assert "nsenter --net=/run/netns/rsl-s-rsl-argv" in wrapper.read_text()


@pytest.mark.sandbox
def test_plain_http_through_the_proxy_is_one_request_per_connection(testnet: egress_net.TestNet) -> None:
    """A kept-alive connection cannot name a second host after the first request."""
    req = egress.network_request(
        "run-ka", "n1", egress=["api.example.test", "other.example.test"], resolve=testnet.resolve
    )
    assert req is not None
    other_before = testnet.hits.to(egress_net.HOST2)
    net = egress.attach(req, f"rsl-keepalive-{_OURS}")
    try:
        client = textwrap.dedent(f"""
            import socket
            s = socket.create_connection(("{net.gateway}", 3128), timeout=10)
            s.sendall(b"GET http://api.example.test/one HTTP/1.1\\r\\nHost: api.example.test\\r\\n\\r\\n"
                      b"GET http://other.example.test/two HTTP/1.1\\r\\nHost: other.example.test\\r\\n\\r\\n")
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            print(data.decode())
        """)
        res = subprocess.run(
            ["nsenter", f"--net=/run/netns/{net.netns}", sys.executable, "-c", client],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        egress.detach("run-ka", f"rsl-keepalive-{_OURS}")
    assert "path=/one" in res.stdout and "path=/two" not in res.stdout, res.stdout + res.stderr
    assert testnet.hits.to(egress_net.HOST2) == other_before


@pytest.mark.sandbox
def test_settings_carry_the_allowlist_everywhere() -> None:
    from prefect_resoluto import ResolutoTaskRunner, sandbox_options
    from prefect_resoluto.blocks import SandboxBlock
    from prefect_resoluto.settings.config import SandboxConfig

    block = SandboxBlock(
        runtime="gvisor",
        egress=["api.example.com"],
        egress_resolve={"api.example.com": "198.18.0.2"},
        setup_egress=["pypi.org"],
        setup_argv=["pip", "install", "x"],
    )
    cfg = block.to_config()
    assert cfg.egress == ["api.example.com"] and cfg.egress_resolve == {"api.example.com": "198.18.0.2"}
    assert cfg.setup_egress == ["pypi.org"] and cfg.setup_argv == ["pip", "install", "x"]
    merged = SandboxConfig(egress_resolve={"a.example.com": "198.18.0.2"}).replace(
        egress_resolve={"b.example.com": "198.18.0.3"}, egress=["b.example.com"]
    )
    assert merged.egress_resolve == {"a.example.com": "198.18.0.2", "b.example.com": "198.18.0.3"}
    runner = ResolutoTaskRunner(
        egress=["api.example.com"],
        egress_resolve={"api.example.com": "198.18.0.2"},
        setup_egress=["pypi.org"],
        setup_argv=["true"],
    )
    assert runner._options["egress_resolve"] == {"api.example.com": "198.18.0.2"}
    with sandbox_options(egress=["other.example.com"], egress_resolve={"other.example.com": "198.18.0.3"}):
        pass
    with pytest.raises(TypeError, match="unknown sandbox option"):
        with sandbox_options(egres=["typo.example.com"]):
            pass


@pytest.mark.sandbox
def test_bad_allowlist_fails_before_anything_is_written(gv: SandboxRuntime, tmp_path: Path) -> None:
    conduit = LocalConduit(tmp_path / "conduit")
    spec = NodeSpec(run_id="r-bad", node_id="n1", argv=["true"], egress=["169.254.169.254"])
    with pytest.raises(NodeSpecError, match="IP address"):
        drive_node(spec, conduit, gv)
    assert conduit.list_prefix("run/") == [] and gv.list_ids() == []


@pytest.mark.sandbox
def test_a_connection_or_dns_flood_is_bounded_and_cannot_hide_an_admitted_connection(
    testnet: egress_net.TestNet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each open connection costs the host threads, each refusal a log line: both capped.
    Past the cap refusals are counted by reason; an admitted connection is always logged."""
    monkeypatch.setattr(proxy, "MAX_CONNECTIONS", 8)
    monkeypatch.setattr(proxy, "MAX_DECISIONS", 20)
    req = egress.network_request("run-flood", "n1", egress=["api.example.test"], resolve=testnet.resolve)
    assert req is not None
    events: list[dict[str, Any]] = []
    egress.listen("run-flood", "n1", events.append)
    sid = f"rsl-flood-{_OURS}"
    net = egress.attach(req, sid)
    try:
        # No timeouts in the probe: every wait is for the proxy's answer (the subprocess's
        # own timeout is the only bound).
        client = textwrap.dedent(f"""
            import select, socket, struct
            gw = "{net.gateway}"
            held = [socket.create_connection((gw, 3128)) for _ in range(9)]
            closed, _, _ = select.select(held, [], [])   # the proxy closes what is over the cap
            print("EXTRA", bool(closed) and all(s.recv(10) == b"" for s in closed))
            for s in held:
                s.close()
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            answered = 0
            for i in range(40):
                q = struct.pack("!HHHHHH", i, 0x0100, 1, 0, 0, 0) + b"\\x05flood\\x07example\\x04test\\x00" + struct.pack("!HH", 1, 1)
                u.sendto(q, (gw, 53))
                answered += u.recvfrom(512)[0][3] & 0x0F == 3   # NXDOMAIN
            print("NX", answered)
            while True:   # until the slots the held connections took are free again
                s = socket.create_connection((gw, 3128))
                s.sendall(b"GET http://api.example.test/after-flood HTTP/1.1\\r\\nHost: api.example.test\\r\\n\\r\\n")
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
                s.close()
                if data:
                    break
            print("AFTER", data.decode().split("\\r\\n\\r\\n", 1)[-1])
        """)
        res = subprocess.run(
            ["nsenter", f"--net=/run/netns/{net.netns}", sys.executable, "-c", client],
            capture_output=True,
            text=True,
            timeout=scaled(120),
        )
        assert "EXTRA True" in res.stdout and "NX 40" in res.stdout, res.stdout + res.stderr
        assert f"AFTER hello from {egress_net.HOST} host=api.example.test path=/after-flood" in res.stdout
        wait_for(lambda: decisions(events, "allowed"), 30, "the admitted connection's decision")
    finally:
        egress.detach("run-flood", sid)
        egress.unlisten("run-flood", "n1")
    refused = decisions(events, "refused")
    assert len(refused) == 20  # one by one up to the cap
    assert refused[0]["reason"] == "more than 8 connections open at once"
    allowed = decisions(events, "allowed")
    assert [(d["host"], d["via"]) for d in allowed] == [("api.example.test", "HTTP proxy")]
    summary = events[-1]["data"]
    assert events[-1]["name"] == "summary" and "more refusal(s) were not logged one by one" in summary["line"]
    logged_dns = len([d for d in refused if d["via"] == "DNS"])
    assert summary["dropped_by_reason"]["not in the allowlist"] == 40 - logged_dns
    assert summary["dropped"] == sum(summary["dropped_by_reason"].values())


FLOOD = r"""
import collections, socket
gw = open("/etc/resolv.conf").read().split()[1]
def ask(head):
    s = socket.create_connection((gw, 3128))
    s.sendall(head)
    data = b""
    while chunk := s.recv(65536):   # the proxy closes every one of these
        data += chunk
    s.close()
    return data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "none"
codes = collections.Counter()
for i in range(3000):   # an allowlisted name on a closed port: each dial fails
    codes["failed " + ask(b"CONNECT api.example.test:9 HTTP/1.1\r\nHost: api.example.test:9\r\n\r\n")] += 1
for i in range(120):
    codes["refused " + ask(b"CONNECT other.example.test:443 HTTP/1.1\r\n\r\n")] += 1
    codes["allowed " + ask(b"GET http://api.example.test/f HTTP/1.1\r\nHost: api.example.test\r\n\r\n")] += 1
print("CODES", dict(sorted(codes.items())))
"""


@pytest.mark.sandbox
def test_every_kind_of_decision_is_capped_and_summarised_the_same_way(
    gv: SandboxRuntime, tmp_path: Path, testnet: egress_net.TestNet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33, finding 3: a failed dial was recorded as an admitted decision and only
    refusals were capped: 6 000 CONNECTs to a closed port gave 6 000 WARNING events and no
    summary. Now admitted, refused and failed are each capped per sandbox and counted in a
    summary of their own, and the node's event list (and what it stores) stays bounded."""
    monkeypatch.setattr(proxy, "MAX_DECISIONS", 50, raising=False)
    outcome, events = run_node(
        gv,
        tmp_path,
        testnet,
        [sys.executable, "-c", FLOOD],
        run_id="run-capped",
        egress=["api.example.test", "api.example.test:9"],
    )
    out = output(events)
    assert outcome.ok, outcome.describe() + out
    assert "CODES {'allowed 200': 120, 'failed 502': 3000, 'refused 403': 120}" in out, out[-2000:]
    egress_events = [e for e in events if e["kind"] == "egress"]
    failed = [e["data"] for e in egress_events if e["name"] == "failed"]
    assert len(failed) == 50 and all(d["decision"] == "failed" for d in failed)
    assert len(decisions(events, "refused")) == 50 and len(decisions(events, "allowed")) == 50
    summaries = {e["data"]["summary_of"]: e["data"] for e in egress_events if e["name"] == "summary"}
    assert set(summaries) == {"allowed", "refused", "failed"}
    assert summaries["failed"]["dropped"] == 3000 - 50
    assert [k for k in summaries["failed"]["dropped_by_reason"] if "Connection refused" in k]
    assert summaries["failed"]["level"] == "WARNING"
    assert "2950 more failed dial(s) were not logged one by one" in summaries["failed"]["line"]
    assert summaries["allowed"]["dropped_by_reason"] == {"api.example.test:80": 120 - 50}
    assert summaries["allowed"]["bytes_down"] > 0 and summaries["allowed"]["level"] == "INFO"
    # Refusals: the canary's probes were logged first, within the same cap.
    assert summaries["refused"]["dropped"] == sum(summaries["refused"]["dropped_by_reason"].values())
    assert len(egress_events) <= proxy.events_bound()
    from prefect_resoluto.node.drive import egress_events_key

    stored = LocalConduit(tmp_path / "conduit").get(egress_events_key("run-capped", "n1")).splitlines()
    assert len(stored) == len(egress_events)


HOLD = r"""
import socket, sys, urllib.request
gw = open("/etc/resolv.conf").read().split()[1]
held = []
for i in range(int(sys.argv[1])):   # every tunnel moves a byte each way, then stays idle
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
urllib.request.urlopen("http://api.example.test/wait/" + sys.argv[2]).read()   # the test measures here
"""


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.sandbox
def test_a_sandbox_cannot_bloat_the_proxy_with_idle_tunnels(
    gv: SandboxRuntime, tmp_path: Path, testnet: egress_net.TestNet
) -> None:
    """Issue 33, finding 4: each tunnel kept two 256 KiB relay buffers for its whole life, so
    one sandbox's 256 idle tunnels held ~145 MiB of the host process, outside the sandbox's
    own memory limit. Now a relay takes a buffer only while data is there to move: all the
    tunnels a sandbox may hold, idle, cost the host under 24 MiB (measured: 8.5 MiB)."""
    key = f"bloat-{os.urandom(3).hex()}"
    tunnels = proxy.MAX_CONNECTIONS - 1  # and the request that says they are all up
    before = _rss_mib()
    result: list[tuple[NodeOutcome, list[dict[str, Any]]]] = []
    node = threading.Thread(
        target=lambda: result.append(
            run_node(
                gv,
                tmp_path,
                testnet,
                [sys.executable, "-c", HOLD, str(tunnels), key],
                run_id="run-bloat",
                egress=["api.example.test", "api.example.test:7"],
            )
        )
    )
    node.start()
    try:
        wait_for(lambda: key in egress_net.ARRIVED or not node.is_alive(), 120, "the tunnels to be held")
        held = _rss_mib()
    finally:
        egress_net.GATES.setdefault(key, threading.Event()).set()
        node.join(120)
    outcome, events = result[0]
    out = output(events)
    assert outcome.ok, outcome.describe() + out
    assert f"HELD {tunnels}" in out
    assert held - before < 24, f"{tunnels} idle tunnels: +{held - before:.1f} MiB"


@pytest.mark.sandbox
def test_an_idle_tunnel_is_closed(
    gv: SandboxRuntime, tmp_path: Path, testnet: egress_net.TestNet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33, finding 4: a tunnel in which neither direction moves is closed after
    proxy.IDLE_TIMEOUT (300 s; 2 s here); before, it was held for the life of the sandbox."""
    monkeypatch.setattr(proxy, "IDLE_TIMEOUT", 2.0, raising=False)
    code = textwrap.dedent(r"""
        import socket, time
        gw = open("/etc/resolv.conf").read().split()[1]
        s = socket.create_connection((gw, 3128))
        s.sendall(b"CONNECT api.example.test:7 HTTP/1.1\r\n\r\n")
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            head += s.recv(1)
        s.sendall(b"x")
        assert s.recv(1) == b"x"
        t0 = time.monotonic()
        s.settimeout(60)
        try:
            print("CLOSED" if s.recv(1) == b"" else "DATA", round(time.monotonic() - t0, 1))
        except socket.timeout:
            print("OPEN after 60 s")
    """)
    outcome, events = run_node(
        gv, tmp_path, testnet, [sys.executable, "-c", code], egress=["api.example.test:7"]
    )
    out = output(events)
    assert outcome.ok, outcome.describe() + out
    closed = [line for line in lines(events, "log") if line.startswith("CLOSED ")]
    assert closed and float(closed[0].split()[1]) < 30, out
    tunnel = [d for d in decisions(events, "allowed") if d["via"] == "CONNECT"]
    assert len(tunnel) == 1 and tunnel[0]["bytes_up"] == 1 and tunnel[0]["bytes_down"] == 1


# --------------------------------------------------------------------------- hostile requests (issue 19)

HOSTILE = r'''
import json, socket, ssl, struct, urllib.request
gw = open("/etc/resolv.conf").read().split()[1]
res = {}
def raw(port, data):
    """Send ``data`` to the proxy and read until it closes (it always does: refusing, or
    after the one request it relays)."""
    s = socket.create_connection((gw, port))
    s.sendall(data)
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    except OSError as e:
        out += f"<{type(e).__name__}>".encode()
    s.close()
    return out.decode("latin-1")
def hello(name):
    sni = b"\x00" + struct.pack("!H", len(name)) + name
    sni = struct.pack("!H", len(sni)) + sni
    exts = struct.pack("!HH", 0, len(sni)) + sni
    body = b"\x03\x03" + b"\x11" * 32 + b"\x00" + b"\x00\x02\x13\x01" + b"\x01\x00" + struct.pack("!H", len(exts)) + exts
    hs = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + struct.pack("!H", len(hs)) + hs
def dns(labels, qid=7):
    q = b"".join(bytes([len(x)]) + x for x in labels) + b"\x00"
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.sendto(struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + q + struct.pack("!HH", 1, 1), (gw, 53))
    answer = u.recvfrom(512)[0]   # the proxy answers every query it can parse
    u.close()
    return {"rcode": answer[3] & 0x0F, "answers": struct.unpack("!H", answer[6:8])[0]}
ctx = ssl.create_default_context()
def proxied(url):
    try:
        return urllib.request.urlopen(url, context=ctx).read().decode()
    except Exception as e:
        return f"ERROR {type(e).__name__}: {e}"

# 3: a NUL (or any other byte) in a name, from every source
res["connect_nul"] = raw(3128, b"CONNECT localhost\x00.wild.example.test:443 HTTP/1.1\r\nHost: x\r\n\r\n")
res["absolute_nul"] = raw(3128, b"GET http://localhost\x00.wild.example.test/ HTTP/1.1\r\n\r\n")
res["host_nul"] = raw(80, b"GET / HTTP/1.1\r\nHost: localhost\x00.wild.example.test\r\n\r\n")
res["sni_nul"] = raw(443, hello(b"localhost\x00.wild.example.test"))
res["dns_nul"] = dns([b"localhost\x00", b"wild", b"example", b"test"])
res["dns_dot"] = dns([b"api.example", b"test"])   # one label holding a dot
# 4: the Host header names another host than the one admitted; a pipelined second request
res["fronted"] = raw(3128, b"GET http://api.example.test/front HTTP/1.1\r\nHost: other.example.test\r\n\r\n")
res["pipelined"] = raw(3128, b"GET http://api.example.test/one HTTP/1.1\r\nHost: api.example.test\r\n\r\n"
                             b"GET http://other.example.test/two HTTP/1.1\r\nHost: other.example.test\r\n\r\n")
res["pipelined_transparent"] = raw(80, b"GET /one-t HTTP/1.1\r\nHost: api.example.test\r\n\r\n"
                                       b"GET /two-t HTTP/1.1\r\nHost: other.example.test\r\n\r\n")
# 5: names pinned to addresses that lead inward by way of IPv6 forms of IPv4
for name in ("nat64", "sixtofour", "teredo", "mapped"):
    res[name] = proxied(f"https://{name}.example.test/pinned")
# 6: names that would forge log lines, then a flood of refusals, then one admitted connection
res["connect_nl"] = raw(3128, b"CONNECT evil\n[WARNING]forged.example.test:443 HTTP/1.1\r\n\r\n")
res["sni_nl"] = raw(443, hello(b"evil\n[WARNING]forged.example.test"))
res["dns_nl"] = dns([b"evil\n[WARNING]forged", b"example", b"test"])
res["flood"] = sum(dns([b"flood", b"example", b"test"], qid=i % 65536)["rcode"] == 3 for i in range(2100))
res["after_flood"] = proxied("https://api.example.test/after-flood")
print("RES", json.dumps(res))
'''

PINS = {
    "nat64.example.test": "64:ff9b::a14:2",  # 10.20.0.2 through a NAT64 gateway
    "sixtofour.example.test": "2002:a14:2::1",  # 6to4 by way of 10.20.0.2
    "teredo.example.test": "2001:0:a14:2::1",
    "mapped.example.test": "::ffff:10.20.0.2",
}


@dataclass
class Hostile:
    """One gVisor node that sent every hostile request of issue 19 (findings 3-6) through
    the real proxy, and the proxy's decisions as the node's events carried them."""

    res: dict[str, Any]
    events: list[dict[str, Any]]
    #: (address reached, Host, path) of every request the test hosts answered meanwhile.
    answered: list[tuple[str, str, str]]

    @property
    def refused(self) -> list[dict[str, Any]]:
        return decisions(self.events, "refused")

    def refusal(self, via: str, reason: str) -> dict[str, Any]:
        found = [d for d in self.refused if d["via"] == via and reason in d["reason"]]
        assert found, (via, reason, [(d["via"], d["reason"]) for d in self.refused])
        return found[0]


@pytest.fixture(scope="module")
def hostile(testnet: egress_net.TestNet, tmp_path_factory: pytest.TempPathFactory) -> Hostile:
    """Run once for the four tests below: one sandbox, every hostile request."""
    runtime = get_runtime("gvisor")
    avail = runtime.availability()
    if not avail.ok:
        pytest.skip(f"gVisor is not available here: {avail.why}")
    before = len(egress_net.REQUESTS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(proxy.UPLINK_ENV, testnet.uplink)
        mp.setenv(egress.CANARY_ENV, CANARY)
        outcome, events = run_node(
            runtime,
            tmp_path_factory.mktemp("hostile"),
            testnet,
            [sys.executable, "-c", HOSTILE],
            egress=["api.example.test", "*.wild.example.test", *PINS],
            egress_resolve={**testnet.resolve, **PINS},
        )
    out = output(events)
    assert outcome.ok, outcome.describe() + out
    res = json.loads(out.split("RES ", 1)[1].splitlines()[0])
    return Hostile(res, events, egress_net.REQUESTS[before:])


@pytest.mark.sandbox
def test_a_name_is_validated_whole_from_every_source(hostile: Hostile) -> None:
    """Finding 3: a NUL (or any byte outside LDH) in a name under an allowlisted wildcard
    is refused as not a host name, from CONNECT, an absolute URI, Host, SNI and DNS; the
    name never reaches a resolver (which would stop at the NUL and resolve 'localhost')."""
    res = hostile.res
    for key, via in (
        ("connect_nul", "CONNECT"),
        ("absolute_nul", "HTTP proxy"),
        ("host_nul", "transparent HTTP"),
        ("sni_nul", "transparent TLS"),
    ):
        d = hostile.refusal(via, "not a host name (the character \\x00 is not allowed")
        assert d["host"] == "localhost\\x00.wild.example.test" and not d["address"], d
        assert "hello" not in res[key]
    assert not [d for d in hostile.refused if "loopback" in d["reason"]]
    assert res["dns_nul"] == {"rcode": 3, "answers": 0} and res["dns_dot"] == {"rcode": 3, "answers": 0}
    hostile.refusal("DNS", "not a host name (the character \\x00 is not allowed")
    hostile.refusal("DNS", "a label holds a '.'")


@pytest.mark.sandbox
def test_the_request_is_for_the_admitted_host_and_one_per_connection(hostile: Hostile) -> None:
    """Finding 4: a Host header naming another host than the absolute URI is refused; a
    pipelined second request (through the proxy, and transparently) is refused, not relayed."""
    res = hostile.res
    assert "403" in res["fronted"] and "host=other.example.test" not in res["fronted"]
    d = hostile.refusal("HTTP proxy", "the Host header names other.example.test:80")
    assert d["host"] == "other.example.test"
    assert "path=/one" in res["pipelined"] and "path=/two" not in res["pipelined"]
    assert "path=/one-t" in res["pipelined_transparent"] and "path=/two-t" not in res["pipelined_transparent"]
    seconds = [d for d in hostile.refused if "a second request on one connection" in d["reason"]]
    assert {(d["via"], d["host"]) for d in seconds} == {
        ("HTTP proxy", "other.example.test"),
        ("transparent HTTP", "other.example.test"),
    }
    # The test hosts answered the admitted requests and nothing for 'other'.
    paths = [r[2] for r in hostile.answered]
    assert "/one" in paths and "/one-t" in paths
    assert not [r for r in hostile.answered if "other" in r[1] or r[2] in ("/two", "/two-t", "/front")]


@pytest.mark.sandbox
def test_ipv6_forms_of_an_inward_ipv4_address_are_refused(
    hostile: Hostile, testnet: egress_net.TestNet
) -> None:
    """Finding 5: names pinned (egress_resolve) to NAT64, 6to4, Teredo and IPv4-mapped
    forms of 10.20.0.2 are refused, each with its reason, without dialling anything."""
    for name, why in (
        ("nat64", "NAT64 (64:ff9b::/96) of 10.20.0.2: RFC 1918 private"),
        ("sixtofour", "6to4 (2002::/16, deprecated by RFC 7526): relayed by way of 10.20.0.2"),
        ("teredo", "Teredo"),
        ("mapped", "IPv4-mapped 10.20.0.2: RFC 1918 private"),
    ):
        assert hostile.res[name].startswith("ERROR"), hostile.res[name]
        found = [d for d in hostile.refused if d["host"] == f"{name}.example.test"]
        pinned = ipaddress.ip_address(PINS[f"{name}.example.test"])
        assert found and found[0]["reason"].startswith(f"resolves to a private address ({pinned}: "), found
        assert why in found[0]["reason"], found[0]
    assert not [e for e in hostile.events if e["kind"] == "egress" and e["name"] == "failed"]
    assert testnet.hits.to(egress_net.PRIVATE) == []


@pytest.mark.sandbox
def test_the_audit_trail_cannot_be_silenced_or_forged(hostile: Hostile) -> None:
    """Finding 6: names with a newline are logged escaped (no forged line); 2 100 refused
    DNS queries do not hide the admitted connection after them; what the cap did not log
    one by one is counted by reason."""
    for e in hostile.events:
        if e["kind"] == "egress":
            for value in e["data"].values():
                assert not isinstance(value, str) or all(" " <= ch <= "~" for ch in value), e["data"]
    lines = "\n".join(d["line"] for d in hostile.refused)
    assert "egress refused evil\\n[WARNING]forged.example.test:443 via transparent TLS" in lines
    assert "egress DNS refused evil\\n[WARNING]forged.example.test" in lines
    assert "CONNECT evil\\n[WARNING]forged.example.test:443" in lines
    assert hostile.res["flood"] == 2100
    assert (
        f"hello from {egress_net.HOST} host=api.example.test path=/after-flood" in hostile.res["after_flood"]
    )
    after = [d for d in decisions(hostile.events, "allowed") if d["via"] == "CONNECT"]
    assert [d["host"] for d in after] == ["api.example.test"] and after[0]["bytes_down"] > 0
    assert len(hostile.refused) == proxy.MAX_DECISIONS
    summary = [e["data"] for e in hostile.events if e["kind"] == "egress" and e["name"] == "summary"]
    assert len(summary) == 1 and summary[0]["summary_of"] == "refused", summary
    logged = len([d for d in hostile.refused if d["via"] == "DNS" and d["host"] == "flood.example.test"])
    assert summary[0]["dropped_by_reason"] == {"not in the allowlist": 2100 - logged}
    assert f"{2100 - logged} x not in the allowlist" in summary[0]["line"]
