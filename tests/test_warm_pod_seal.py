"""The warm pod's assignment seal (guest_runner/warmpod.py), without a cluster: only the
holder of the host's or the pod's private value can make an assignment the pod accepts."""

from __future__ import annotations

import pytest

from guest_runner import warmpod, wire


def pair() -> tuple[bytes, bytes, int]:
    host_priv, host_pub = warmpod.keypair()
    pod_priv, pod_pub = warmpod.keypair()
    return warmpod.shared_key(host_priv, pod_pub), warmpod.shared_key(pod_priv, host_pub), pod_pub


def test_the_host_and_the_pod_agree_and_the_pod_opens_the_hosts_assignment() -> None:
    host_key, pod_key, _ = pair()
    assert host_key == pod_key
    body = wire.encode_assignment({"RESOLUTO_NODE_ID": "n1"}, {})
    assert warmpod.open_sealed(pod_key, "tok", warmpod.seal(host_key, "tok", body)) == body


def test_an_assignment_sealed_by_anyone_else_is_refused() -> None:
    host_key, pod_key, pod_pub = pair()
    body = wire.encode_assignment({"RESOLUTO_WORKLOAD_ARGV": '["evil"]'}, {})
    # Another pod read the hello (public) and used a key pair of its own.
    mine, _ = warmpod.keypair()
    forged = warmpod.seal(warmpod.shared_key(mine, pod_pub), "tok", body)
    cases = [
        forged,
        body,  # unsealed
        b"\n" + body,
        warmpod.seal(host_key, "another-pod", body),  # another pod's assignment, replayed
        warmpod.seal(host_key, "tok", body).replace(b"evil", b"EVIL"),  # altered after sealing
    ]
    for data in cases:
        with pytest.raises(ValueError):
            warmpod.open_sealed(pod_key, "tok", data)


@pytest.mark.parametrize(
    "text", ["", "0", "1", format(warmpod.P - 1, "x"), format(warmpod.P, "x"), "zz", "f" * 600]
)
def test_a_public_value_outside_the_group_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        warmpod.public_value(text)


def test_only_the_hosts_newer_beat_for_this_pod_counts() -> None:
    """The idle pod's beat: a replay, a higher count with an old tag, another pod's beat, a
    beat under the attacker's own key, or a non-canonical rendering never counts."""
    host_key, pod_key, pod_pub = pair()
    check = warmpod.BeatCheck(pod_key, "tok")
    assert check(warmpod.beat_body(host_key, "tok", 1))
    old = warmpod.beat_body(host_key, "tok", 2)
    assert check(old)
    mine, _ = warmpod.keypair()
    tag = old.partition(b" ")[2]
    for forged in [
        old,  # replayed
        b"3 " + tag,  # a higher count, the old tag
        warmpod.beat_body(host_key, "another-pod", 3),
        warmpod.beat_body(warmpod.shared_key(mine, pod_pub), "tok", 3),
        warmpod.seal(host_key, "tok", b"3"),  # an assignment's tag is not a beat's
        b"+3 " + warmpod.beat_body(host_key, "tok", 3).partition(b" ")[2],
        b"\xff",
        b"",
    ]:
        assert not check(forged), forged
    assert check(warmpod.beat_body(host_key, "tok", 7))
