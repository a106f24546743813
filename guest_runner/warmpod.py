"""A warm pod's guest: started ahead of demand on Kubernetes, assigned through the conduit.

A pod has no stdin the host holds (unlike a local warm sandbox, :mod:`guest_runner.warm`),
so it waits on an object of its own: ``<its prefix>/assign``. Other pods may share the
store's credentials and so could write that object too; an assignment is therefore
authenticated, and one that does not verify ends the pod without running anything.

The key is agreed by Diffie-Hellman (RFC 3526 group 14, stdlib integers): the host's public
value comes in the pod's environment (public, written by the host into the pod spec, so
authentic), the pod's own is put at ``<prefix>/hello`` when it is ready to take a node.
Only the host (its private value) and this pod (its private value, in this process only)
can compute ``K``; the assignment is ``<hex HMAC-SHA256(K, token || body)>\\n<body>``. A
hello replaced by another pod only makes the host's assignment fail to verify here: the
pod ends and its node is relaunched, never run by someone else's word.

While it waits the pod watches its host's heartbeat (:mod:`guest_runner.hostwatch`) and
exits when the host is gone, so its pod ends within the same bound as a node's. Not the
shared beat every node watches: any pod with the store's credentials can rewrite that one and
keep a dead host's idle pods waiting for ever. Its own, ``<prefix>/beat``: ``<count> <tag>``,
the tag an HMAC under a key derived from ``K``; only a higher count with a tag that verifies
counts as the host's, so only the host keeps it waiting. Once
assigned it is an ordinary node (``runner.main``), with the assignment's environment over
its boot one. Assignments carry no secret: the host sends nodes with secrets to cold pods.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import sys
import time
from typing import Dict, Optional, Tuple

from guest_runner import hostwatch, runner, threads, wire
from guest_runner.conduit import Conduit, ConduitError, ObjectNotFound, conduit_from_env

#: The host's public value (hex), and this pod's own object prefix (a full key prefix).
ENV_HOST_KEY = "RESOLUTO_WARM_POD_HOST_KEY"
ENV_PREFIX = "RESOLUTO_WARM_POD_PREFIX"
BOOT_ONLY = (ENV_HOST_KEY, ENV_PREFIX)
HELLO = "hello"
ASSIGN = "assign"
BEAT = "beat"
#: The largest assignment read (the node's non-secret environment).
MAX_ASSIGNMENT_BYTES = 1 << 20
MAX_HELLO_BYTES = 4096
#: The assignment object is polled (GET, never LIST) from FIRST_POLL up to MAX_POLL seconds.
FIRST_POLL = 0.05
MAX_POLL = 0.5
EXIT_BAD_ASSIGNMENT = 3

# RFC 3526, 2048-bit MODP group (14), generator 2.
P = int(
    "FFFFFFFFFFFFFFFFC90FDAA22168C234C4C6628B80DC1CD129024E088A67CC74020BBEA63B139B22514A08798E3404DD"
    "EF9519B3CD3A431B302B0A6DF25F14374FE1356D6D51C245E485B576625E7EC6F44C42E9A637ED6B0BFF5CB6F406B7ED"
    "EE386BFB5A899FA5AE9F24117C4B1FE649286651ECE45B3DC2007CB8A163BF0598DA48361C55D39A69163FA8FD24CF5F"
    "83655D23DCA3AD961C62F356208552BB9ED529077096966D670C354E4ABC9804F1746C08CA18217C32905E462E36CE3B"
    "E39E772C180E86039B2783A2EC07A28FB5C55DF06F4C52C9DE2BCBF6955817183995497CEA956AE515D2261898FA0510"
    "15728E5A8AACAA68FFFFFFFFFFFFFFFF",
    16,
)
G = 2
_LEN = (P.bit_length() + 7) // 8


def keypair() -> Tuple[int, int]:
    """A private exponent (256 random bits) and its public value."""
    x = secrets.randbits(256) | (1 << 255)
    return x, pow(G, x, P)


def public_value(text: str) -> int:
    """A peer's public value, refused unless it is a group element other than 1 and p-1."""
    if not isinstance(text, str) or not 0 < len(text) <= 2 * _LEN:
        raise ValueError("not a public value")
    y = int(text, 16)
    if not 1 < y < P - 1:
        raise ValueError("public value out of range")
    return y


def shared_key(private: int, peer_public: int) -> bytes:
    z = pow(peer_public, private, P)
    return hashlib.sha256(b"resoluto warm pod v1\0" + z.to_bytes(_LEN, "big")).digest()


def mac(key: bytes, token: str, body: bytes) -> str:
    return hmac.new(key, token.encode() + b"\n" + body, hashlib.sha256).hexdigest()


def seal(key: bytes, token: str, body: bytes) -> bytes:
    """The assignment object for ``body`` (what the host writes)."""
    return mac(key, token, body).encode() + b"\n" + body


def open_sealed(key: bytes, token: str, data: bytes) -> bytes:
    """The body of a sealed assignment, or ValueError when it does not verify."""
    tag, sep, body = data.partition(b"\n")
    if not sep or not hmac.compare_digest(tag, mac(key, token, body).encode()):
        raise ValueError("the assignment is not sealed by this pod's host")
    return body


def _beat_key(key: bytes) -> bytes:
    # Its own key: a beat's tag is never an assignment's (nor the reverse).
    return hmac.new(key, b"resoluto warm pod beat v1", hashlib.sha256).digest()


def beat_body(key: bytes, token: str, count: int) -> bytes:
    """The host's beat number ``count`` for the pod of ``token`` (what the host writes)."""
    tag = hmac.new(_beat_key(key), f"{token}\n{count}".encode(), hashlib.sha256).hexdigest()
    return f"{count} {tag}".encode()


class BeatCheck:
    """Whether a beat is the host's and newer than the last one counted (a replay is not)."""

    def __init__(self, key: bytes, token: str) -> None:
        self._key, self._token, self.last = key, token, 0

    def __call__(self, data: bytes) -> bool:
        try:
            count = int(data.decode("ascii").partition(" ")[0])
        except (UnicodeDecodeError, ValueError):
            return False
        if count <= self.last or not hmac.compare_digest(data, beat_body(self._key, self._token, count)):
            return False
        self.last = count
        return True


def hello_body(public: int) -> bytes:
    return json.dumps({"public": format(public, "x")}).encode()


def _read(conduit: Conduit, key: str, limit: int) -> Optional[bytes]:
    """The object's first ``limit + 1`` bytes, or None while it does not exist."""
    try:
        with conduit.get_stream(key) as f:
            return bytes(f.read(limit + 1))
    except ObjectNotFound:
        return None


def _wait_for_assignment(conduit: Conduit, key: str) -> bytes:
    delay = FIRST_POLL
    while True:
        try:
            data = _read(conduit, key, MAX_ASSIGNMENT_BYTES)
        except (ConduitError, OSError) as e:  # the store briefly away: the host watch bounds the wait
            print(f"resoluto warm pod: cannot read the assignment yet: {e}", file=sys.stderr)
            data = None
        if data is not None:
            return data
        time.sleep(delay)  # nothing to be woken by: the store has no notification a pod can hold
        delay = min(MAX_POLL, delay * 1.5)


def _host_lost(after: float) -> None:
    print(f"resoluto warm pod: host heartbeat unchanged for {after:.0f}s; ending unassigned", file=sys.stderr)
    sys.stderr.flush()
    os._exit(0)  # the waiting loop holds nothing: the pod ends, and with it everything it had


def main() -> int:
    boot = dict(os.environ)
    prefix = boot.get(ENV_PREFIX, "").strip("/")
    token = prefix.rsplit("/", 1)[-1]
    try:
        host = public_value(boot.get(ENV_HOST_KEY, ""))
        conduit = conduit_from_env(boot)
    except Exception as e:  # noqa: BLE001 - a pod that cannot wait ends and says why
        print(f"resoluto warm pod: cannot start: {e}", file=sys.stderr)
        return EXIT_BAD_ASSIGNMENT
    private, public = keypair()
    key = shared_key(private, host)
    del private
    watch = None
    beat = hostwatch.settings(boot)
    if beat is not None:  # the bound from the host; the beat, sealed for this pod, its own
        watch = hostwatch.HostWatch(
            conduit, f"{prefix}/{BEAT}", beat[1], _host_lost, accept=BeatCheck(key, token)
        ).start()
    # The node's two background threads, started while the pod waits (guest_runner/threads.py;
    # a pod's runner is hardened, if ever, at its assignment, which lets them go).
    threads.prestart(2)
    conduit.put(f"{prefix}/{HELLO}", hello_body(public))
    print(wire.WARM_READY, flush=True)
    data = _wait_for_assignment(conduit, f"{prefix}/{ASSIGN}")
    if watch is not None:
        watch.stop()  # the node's runner watches the same heartbeat from here on
    try:
        if len(data) > MAX_ASSIGNMENT_BYTES:
            raise ValueError(f"larger than {MAX_ASSIGNMENT_BYTES} bytes")
        assigned = wire.decode_assignment(open_sealed(key, token, data).decode())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        print(f"resoluto warm pod: refused an assignment: {e}", file=sys.stderr)
        return EXIT_BAD_ASSIGNMENT
    env: Dict[str, str] = {k: v for k, v in boot.items() if k not in BOOT_ONLY}
    env.update(assigned)
    for k in (wire.ENV_HOST_BEAT_KEY, wire.ENV_HOST_LOST_AFTER):  # the host's, as it launched the pod
        if k in boot:
            env[k] = boot[k]
    if "PYTHONPATH" in assigned and boot.get("PYTHONPATH"):  # the bundle the bootstrap unpacked first
        env["PYTHONPATH"] = f"{boot['PYTHONPATH']}:{assigned['PYTHONPATH']}"
    os.environ.clear()
    os.environ.update(env)
    return runner.main(env, conduit=conduit)


if __name__ == "__main__":
    runner.exit_now(main())
