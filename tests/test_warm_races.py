"""A warm sandbox the pool loses between its pick and its assignment is the pool's own race:
the node goes to the pool's next ready sandbox or boots one, within its own launch, and is
never a failed task. What fails after the assignment is the node's and is reported as before.

Real gVisor warm sandboxes (restored from the key's image), a real pool, a local conduit:
each way a sandbox is lost is done to it for real, right where the race lands (after the
pool's pick, before the node's assignment).
"""

from __future__ import annotations

import logging
import os
import threading

import pytest
from support.polling import wait_for
from test_pool import _no_sandboxes, _ready_pool, _take

from guest_runner import wire
from prefect_resoluto.node import drive as drive_mod
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.warm.pool import WarmSandbox, key_for

pytestmark = pytest.mark.sandbox

#: Reads the file the host staged in the node's inbox: the node's own, whichever sandbox ran it.
READS_INBOX = ["python3", "-c", "print(open('data/in.txt').read().strip())"]


def _spec(tmp_path, node: str) -> NodeSpec:
    src = tmp_path / f"src-{node}"
    (src / "data").mkdir(parents=True, exist_ok=True)
    (src / "data" / "in.txt").write_text(f"staged for {node}\n")
    return NodeSpec(run_id="run-race", node_id=node, argv=READS_INBOX, workspace=src)


def _lose(gvisor, w: WarmSandbox, how: str) -> None:
    """Lose ``w`` the way the pool's race does, for real."""
    if how == "destroyed":  # reaped after the pick: the pool's close, a sweep of its label
        gvisor.destroy(w.handle)
    elif how == "handed over":  # its one assignment went already (an empty one: it just leaves)
        gvisor.assign(w.handle, b"\n")
        wait_for(lambda: not w.alive(), timeout=60, what="the handed-over sandbox to leave")
    elif how == "ended":  # died while idle (killed, out of memory); the host has not looked since
        gvisor._runsc("kill", w.handle.id, "KILL")
        wait_for(lambda: not w.alive(), timeout=60, what="the killed sandbox to end")
    else:
        raise AssertionError(how)


def _lines(out: list[str]):
    return lambda ev: out.append((ev.get("data") or {}).get("line", ""))


def _once(gvisor, how: str, lost: list[str]):
    """A ``before_assign`` hook: the first sandbox about to be assigned is lost ``how``."""

    def hook(w: WarmSandbox) -> None:
        if not lost:
            lost.append(w.handle.id)
            _lose(gvisor, w, how)

    return hook


@pytest.mark.parametrize("how", ["destroyed", "handed over", "ended"])
def test_a_warm_sandbox_lost_before_its_assignment_hands_the_node_to_the_next(
    gvisor, local_conduit, tmp_path, caplog, how
):
    spec = _spec(tmp_path, "n1")
    key = key_for(spec)
    pool = _ready_pool(gvisor, local_conduit, key, n=2)
    lost: list[str] = []
    try:
        pool.before_assign = _once(gvisor, how, lost)
        lines: list[str] = []
        with caplog.at_level(logging.WARNING, logger="prefect_resoluto.node.drive"):
            o = drive_node(spec, local_conduit, gvisor, warm=_take(pool, key), on_event=_lines(lines))
    finally:
        pool.close()
    assert lost, "the race was never run"
    assert o.ok and o.warm, o.describe()  # the pool's other ready sandbox ran it
    assert o.sandbox_id != lost[0]
    assert "staged for n1" in lines  # the inbox went with the node to its new sandbox
    assert f"warm sandbox {lost[0]} cannot take node n1" in caplog.text
    _no_sandboxes(gvisor)
    prefix = wire.node_prefix("run-race", "n1")
    files = [
        p.relative_to(local_conduit.root).as_posix() for p in local_conduit.root.rglob("*") if p.is_file()
    ]
    assert all(f.startswith((prefix + "/", wire.HOSTS + "/")) for f in files), files
    assert not os.path.ismount(local_conduit.root / prefix)  # the lost sandbox's slot is not left bound


def test_a_warm_sandbox_reaped_before_its_slot_is_placed_hands_the_node_to_the_next(
    gvisor, local_conduit, tmp_path
):
    spec = _spec(tmp_path, "n1")
    key = key_for(spec)
    pool = _ready_pool(gvisor, local_conduit, key, n=2)
    try:
        lost = _take(pool, key)
        gvisor.destroy(lost.handle)  # its state directory, slot and all, went with it
        lines: list[str] = []
        o = drive_node(spec, local_conduit, gvisor, warm=lost, on_event=_lines(lines))
    finally:
        pool.close()
    assert o.ok and o.warm and o.sandbox_id != lost.handle.id, o.describe()
    assert "staged for n1" in lines
    _no_sandboxes(gvisor)


def test_a_lost_warm_sandbox_with_none_other_ready_boots_the_node(gvisor, local_conduit, tmp_path):
    spec = _spec(tmp_path, "n1")
    key = key_for(spec)
    pool = _ready_pool(gvisor, local_conduit, key, n=1)
    lost: list[str] = []
    try:
        w = _take(pool, key)
        pool.before_assign = _once(gvisor, "destroyed", lost)
        lines: list[str] = []
        o = drive_node(spec, local_conduit, gvisor, warm=w, on_event=_lines(lines))
    finally:
        pool.close()
    assert lost == [w.handle.id]
    assert o.ok and not o.warm, o.describe()
    assert "staged for n1" in lines
    _no_sandboxes(gvisor)


def test_a_node_tries_at_most_warm_tries_lost_sandboxes_then_boots(gvisor, local_conduit, tmp_path):
    spec = _spec(tmp_path, "n1")
    key = key_for(spec)
    pool = _ready_pool(gvisor, local_conduit, key, n=drive_mod.WARM_TRIES + 1)
    lost: list[str] = []

    def reaped(w: WarmSandbox) -> None:  # every one: a reaper lands before each assignment
        lost.append(w.handle.id)
        gvisor.destroy(w.handle)

    try:
        pool.before_assign = reaped
        o = drive_node(spec, local_conduit, gvisor, warm=_take(pool, key))
        left = pool.ready_count(key)
    finally:
        pool.close()
    assert o.ok and not o.warm, o.describe()
    assert len(lost) == drive_mod.WARM_TRIES, lost  # bounded: a ready one was left untried
    assert left >= 1
    _no_sandboxes(gvisor)


def test_a_warm_sandbox_that_ends_after_its_assignment_fails_its_node_as_before(
    gvisor, local_conduit, tmp_path
):
    spec = NodeSpec(run_id="run-race", node_id="n1", argv=["sleep", "30"])
    key = key_for(spec)
    pool = _ready_pool(gvisor, local_conduit, key, n=2)
    try:
        w = _take(pool, key)
        other = {x.handle.id for x in pool._idle[key] if x.ready()}  # the other ready one
        assert other and w.handle.id not in other
        # Killed once it holds its node: the node's own sandbox failing, not the pool's race.
        o = drive_node(
            spec,
            local_conduit,
            gvisor,
            warm=w,
            on_launch=lambda h: gvisor._runsc("kill", h.id, "KILL"),
        )
        # The other ready one is still idle (the refill may have added more beside it).
        untouched = other & set(pool.idle_ids())
    finally:
        pool.close()
    assert not o.ok and o.infrastructure_failure, o.describe()
    assert o.sandbox_id == w.handle.id and o.warm  # no other sandbox was given the node
    assert untouched == other
    _no_sandboxes(gvisor)


def test_concurrent_nodes_against_a_small_pool_whose_picks_are_reaped_all_succeed(
    gvisor, local_conduit, tmp_path
):
    """Many nodes take at once from a pool of two while it refills; every other sandbox taken
    is reaped right before its assignment (a reaper forced into the race's window): every
    node succeeds."""
    spec = _spec(tmp_path, "n0")
    key = key_for(spec)
    pool = _ready_pool(gvisor, local_conduit, key, n=2)
    lock = threading.Lock()
    picks: list[str] = []
    reaped: list[str] = []

    def every_other_reaped(w: WarmSandbox) -> None:
        with lock:
            picks.append(w.handle.id)
            if not len(picks) % 2:
                return
            reaped.append(w.handle.id)
        gvisor.destroy(w.handle)

    outcomes: dict[str, object] = {}

    def node(name: str) -> None:
        w, _ = pool.take(key)
        outcomes[name] = drive_node(_spec(tmp_path, name), local_conduit, gvisor, warm=w)

    try:
        pool.before_assign = every_other_reaped
        threads = [threading.Thread(target=node, args=(f"n{i}",)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not any(t.is_alive() for t in threads)
    finally:
        pool.close()
    assert len(outcomes) == 6
    failed = {k: o.describe() for k, o in outcomes.items() if not o.ok}  # type: ignore[attr-defined]
    assert failed == {}, failed
    assert reaped, "no pick was reaped: the race was never run"
    _no_sandboxes(gvisor)
