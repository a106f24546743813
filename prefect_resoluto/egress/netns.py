"""Network namespaces and veth pairs for sandboxes, and their sweep.

Per run there is one *proxy namespace*; per sandbox one *sandbox namespace*. A veth pair
joins them and nothing else: both ends are created directly inside their namespaces, so
the host's own namespace never holds a link of ours, and the proxy namespace has no
uplink, no route out and forwarding off. The proxy's listening sockets are created in
the proxy namespace (a socket keeps the namespace it was made in) while it dials from
the host's. Whatever root inside a sandbox does to its own routes, the only thing it
can reach is the proxy — no firewall rules needed, so none are left behind either.

Every namespace made here is recorded under ``$RESOLUTO_STATE_DIR/egress/`` with the
pid and start time of the process that owns it; ``sweep`` deletes those whose owner is
gone, and only those: never a namespace this module did not create.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect_resoluto.host.availability import Availability
from prefect_resoluto.host.state import process_start_time, same_process, state_dir

NETNS_DIR = Path("/run/netns")
PROXY_PREFIX = "rsl-p-"
SANDBOX_PREFIX = "rsl-s-"
SANDBOX_IFACE = "eth0"
CLONE_NEWNET = 0x40000000
# Each sandbox gets a /30 out of this block, inside its own pair of namespaces only.
SUBNET = ipaddress.ip_network("172.30.0.0/16")

_libc = ctypes.CDLL(None, use_errno=True)
_SYSCTLS = (
    "net.ipv4.ip_forward=0",
    "net.ipv4.conf.all.rp_filter=1",
    "net.ipv4.conf.default.rp_filter=1",
    "net.ipv6.conf.all.disable_ipv6=1",
    "net.ipv6.conf.default.disable_ipv6=1",
)


class NetnsError(RuntimeError):
    """A namespace or link could not be made."""


def _ip(*args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], input=stdin, capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {res.stderr.strip() or res.returncode}")
    return res


def available() -> Availability:
    """Whether network namespaces can be made here, and if not why."""
    if os.geteuid() != 0:
        return Availability.refused("creating network namespaces needs root")
    try:
        subprocess.run(["ip", "-V"], capture_output=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return Availability.refused("the 'ip' command (iproute2) is missing")
    return Availability(True)


def exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def list_namespaces() -> list[str]:
    try:
        return sorted(p.name for p in NETNS_DIR.iterdir())
    except FileNotFoundError:
        return []


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextmanager
def entered(name: str | None) -> Iterator[None]:
    """Run the body with *this thread* in namespace ``name`` (None: stay). setns(2) is
    per thread, so other threads of the process are unaffected."""
    if not name:
        yield
        return
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(target)
        os.close(own)


def socket_in(
    name: str | None, family: int = socket.AF_INET, kind: int = socket.SOCK_STREAM
) -> socket.socket:
    """A socket that lives in namespace ``name`` however it is used afterwards."""
    with entered(name):
        return socket.socket(family, kind)


def is_local(name: str | None, address: str) -> bool:
    """Whether ``address`` is one of namespace ``name``'s own addresses *now* (None: the
    host's), as its kernel judges it: binding a socket to an address succeeds only for a
    local one (``EADDRNOTAVAIL`` otherwise). An address gained after start (DHCP, a VPN,
    an IPv6 privacy address) is local from that moment. Where the namespace lets any
    address be bound (``ip_nonlocal_bind``) this cannot tell, and says False: the caller's
    check of the connected socket (:func:`connected_to_self`) still holds there."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with entered(name):
        if _nonlocal_bind(family):
            return False
        s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((address, 0))
    except OSError as e:
        # Anything but "not an address of mine" is a doubt, and a doubt refuses.
        return e.errno != errno.EADDRNOTAVAIL
    finally:
        s.close()
    return True


def _nonlocal_bind(family: int) -> bool:
    """``net.ipv{4,6}.ip_nonlocal_bind`` of the calling thread's namespace (read in it)."""
    path = f"/proc/sys/net/{'ipv6' if family == socket.AF_INET6 else 'ipv4'}/ip_nonlocal_bind"
    try:
        with open(path) as f:
            return f.read().strip() != "0"
    except OSError:
        return family == socket.AF_INET  # no IPv6 in the namespace: nothing binds there anyway


def connected_to_self(s: socket.socket) -> bool:
    """Whether a connected socket reached its own namespace: the kernel picks the
    destination itself as the source of a connection to a local address (race free, and
    true whatever ``ip_nonlocal_bind`` says)."""
    try:
        return bool(s.getsockname()[0] == s.getpeername()[0])
    except OSError:
        return True


def addresses(name: str | None = None) -> set[str]:
    """Every address configured in namespace ``name`` (None: the host's)."""
    res = _ip(*(["-n", name] if name else []), "-j", "addr", "show", check=False)
    try:
        data = json.loads(res.stdout or "[]")
    except ValueError:
        return set()
    return {a["local"] for link in data for a in link.get("addr_info", []) if a.get("local")}


# --------------------------------------------------------------------------- records


def _records_dir() -> Path:
    return state_dir("egress")


def _record(name: str, kind: str, run_id: str, extra: dict[str, object] | None = None) -> None:
    pid = os.getpid()
    data = {
        "name": name,
        "kind": kind,
        "run_id": run_id,
        "pid": pid,
        "start_time": process_start_time(pid),
        "created": time.time(),
        **(extra or {}),
    }
    path = _records_dir() / f"{name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _forget(name: str) -> None:
    try:
        (_records_dir() / f"{name}.json").unlink()
    except FileNotFoundError:
        pass


def records() -> list[dict[str, object]]:
    out = []
    for p in sorted(_records_dir().glob("*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return out


# --------------------------------------------------------------------------- namespaces


def create_proxy_namespace(run_id: str) -> str:
    name = f"{PROXY_PREFIX}{_short(run_id)}-{os.getpid()}-{os.urandom(3).hex()}"
    _record(name, "proxy", run_id)  # first, so a crash mid-creation is still swept
    try:
        _ip("netns", "add", name)
        _ip("-n", name, "link", "set", "lo", "up")
        _sysctl(name)
    except Exception:
        delete(name)
        raise
    return name


def _sysctl(name: str) -> None:
    res = subprocess.run(
        ["ip", "netns", "exec", name, "sysctl", "-q", "-w", *_SYSCTLS],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if res.returncode != 0:
        raise NetnsError(f"sysctl in {name}: {res.stderr.strip()}")


def slot_addresses(slot: int) -> tuple[str, str]:
    """(proxy side, sandbox side) of the /30 numbered ``slot``."""
    base = int(SUBNET.network_address) + 4 * slot
    if base + 3 > int(SUBNET.broadcast_address):
        raise NetnsError("too many sandboxes on one run's proxy")
    return str(ipaddress.ip_address(base + 1)), str(ipaddress.ip_address(base + 2))


def create_sandbox_namespace(run_id: str, sandbox_id: str, proxy_ns: str, slot: int) -> tuple[str, str, str]:
    """A namespace for ``sandbox_id`` wired to ``proxy_ns``; returns (name, gateway, address)."""
    name = f"{SANDBOX_PREFIX}{sandbox_id}"
    gateway, addr = slot_addresses(slot)
    # Interface names are at most 15 bytes; the proxy side carries the slot, unique in its namespace.
    host_if = f"rsv{slot}"
    # Names are machine-wide: one already taken (another session's sandbox of that id) fails
    # this launch here, before anything is recorded or cleaned up under it -- the clean-up
    # below would delete the other sandbox's namespace. Recorded right after, so a crash
    # mid-wiring is still swept.
    _ip("netns", "add", name)
    _record(name, "sandbox", run_id, {"proxy": proxy_ns, "sandbox_id": sandbox_id})
    try:
        _ip(
            "link",
            "add",
            host_if,
            "netns",
            proxy_ns,
            "type",
            "veth",
            "peer",
            "name",
            SANDBOX_IFACE,
            "netns",
            name,
        )
        _sysctl(name)
        _ip(
            "-n",
            proxy_ns,
            "-batch",
            "-",
            stdin=f"addr add {gateway}/30 dev {host_if}\nlink set {host_if} up\n",
        )
        _ip(
            "-n",
            name,
            "-batch",
            "-",
            stdin=f"addr add {addr}/30 dev {SANDBOX_IFACE}\nlink set {SANDBOX_IFACE} up\nlink set lo up\n",
        )
    except Exception:
        delete(name)
        raise
    return name, gateway, addr


def delete(name: str) -> None:
    """Delete a namespace of ours (its veth end goes with it) and its record."""
    if exists(name):
        _ip("netns", "del", name, check=False)
    _forget(name)


def wait_gone(names: list[str], timeout: float = 5.0) -> bool:
    """The peer of a deleted namespace's veth disappears asynchronously: wait for it."""
    deadline = time.monotonic() + timeout
    while any(exists(n) for n in names):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def sweep(run_id: str | None = None, include_live: bool = False) -> int:
    """Delete recorded namespaces whose owning process is gone (or all of ``run_id``'s
    when ``include_live``); sandbox namespaces first, then proxies."""
    n = 0
    recs = sorted(records(), key=lambda r: r.get("kind") != "sandbox")
    for rec in recs:
        if not include_live and same_process(rec.get("pid"), rec.get("start_time")):  # type: ignore[arg-type]
            continue  # its host is alive: it destroys its own
        if run_id is not None and rec.get("run_id") != run_id:
            continue
        delete(str(rec["name"]))
        n += 1
    return n


def _short(run_id: str) -> str:
    import hashlib

    return hashlib.sha256(run_id.encode()).hexdigest()[:8]
