"""Warm sandboxes restored from a checkpoint image (gVisor), against real sandboxes.

A key's template is checkpointed before any node exists; every restored sandbox serves
one node and is gone, sees nothing of an earlier node, and leaves nothing behind; the
image holds no secret, node id or node file; a stale image is rebuilt, a corrupt one is
discarded with a warning and the key's sandboxes boot.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from support.polling import scaled, wait_for
from test_pool import _files_containing, _no_sandboxes, _ready_pool, _take

from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.warm import snapshots
from prefect_resoluto.warm.pool import WarmPool, key_for

pytestmark = pytest.mark.sandbox


def _images(rt) -> list[Path]:
    root = Path(rt.state) / snapshots.DIR_NAME
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() else []


def _runsc_root_empty(rt) -> None:
    root = Path(rt.state) / "runsc-root"
    assert not root.is_dir() or list(root.iterdir()) == [], list(root.iterdir())


# The workload leaves a marker in /tmp and /workspace and reports what it found of earlier ones.
PROBE = [
    "python3",
    "-c",
    "import os,sys; seen=[p for p in ('/tmp/marker','/workspace/marker') if os.path.exists(p)]; "
    "[open(p,'w').write(os.environ['NODE_MARK']) for p in ('/tmp/marker','/workspace/marker')]; "
    "print('seen', seen); print('len', len(os.environ['API_TOKEN']))",
]


def _run(rt, conduit: LocalConduit, pool: WarmPool, key, node: str, secret: str) -> tuple[object, list[str]]:
    w = _take(pool, key)
    assert w.restored is not None, "a restored sandbox, not a booted one"
    lines: list[str] = []
    spec = NodeSpec(
        run_id="run-snap",
        node_id=node,
        argv=PROBE,
        env={"NODE_MARK": f"mark-{node}"},
        secret_env={"API_TOKEN": secret},
    )
    o = drive_node(
        spec,
        conduit,
        rt,
        warm=w,
        min_isolation="none",
        on_event=lambda ev: lines.append((ev.get("data") or {}).get("line", "")),
    )
    assert o.ok and o.warm, o.describe()  # type: ignore[attr-defined]
    assert w.handle.id not in rt.list_ids()  # served its node and is gone
    return o, lines


def test_restored_sandboxes_serve_one_node_each_see_nothing_earlier_and_the_image_holds_no_node(
    gvisor, local_conduit
):
    key = key_for(NodeSpec(run_id="r", node_id="n", argv=PROBE))
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    node_ids = [f"node-{uuid.uuid4().hex[:10]}" for _ in range(2)]
    pool = _ready_pool(gvisor, local_conduit, key, n=1)
    try:
        (image,) = _images(gvisor)
        ids = []
        for node in node_ids:
            wait_for(lambda: pool.ready_count(key) >= 1, timeout=120, what="a restored sandbox")
            o, lines = _run(gvisor, local_conduit, pool, key, node, secret)
            assert "seen []" in lines, lines  # neither /tmp nor /workspace of an earlier node
            assert f"len {len(secret)}" in lines
            ids.append(o.sandbox_id)  # type: ignore[attr-defined]
        assert len(set(ids)) == 2
        assert _images(gvisor) == [image]  # one image, made once
    finally:
        pool.close()
    _no_sandboxes(gvisor)
    _runsc_root_empty(gvisor)
    # The image was taken before any node existed: nothing of the nodes is in it (uncompressed).
    assert sorted(p.name for p in image.iterdir()) >= [snapshots.IMAGE_FILE, snapshots.META_FILE]
    for needle in (secret, *node_ids, *(f"mark-{n}" for n in node_ids)):
        assert _files_containing([image], needle.encode()) == [], needle
    assert _files_containing([image], b"resoluto warm: ready")  # the scan can find what is there


def test_a_stale_image_is_rebuilt(gvisor, local_conduit, monkeypatch):
    key = key_for(NodeSpec(run_id="r", node_id="n", argv=["true"]))
    pool = _ready_pool(gvisor, local_conduit, key)
    pool.close()
    (old,) = _images(gvisor)
    monkeypatch.setattr(snapshots, "guest_digest", lambda: "a-changed-guest-runner")
    pool = _ready_pool(gvisor, local_conduit, key)
    try:
        (new,) = _images(gvisor)
        assert new != old and not old.exists()
        assert new.name.split("-")[0] == old.name.split("-")[0]  # the same key
        assert json.loads((new / snapshots.META_FILE).read_text())["guest_digest"] == "a-changed-guest-runner"
        assert _take(pool, key).restored == new
    finally:
        pool.close()
    _no_sandboxes(gvisor)


@pytest.mark.parametrize("how", ["bytes changed", "runsc refuses it"])
def test_a_corrupt_image_is_discarded_with_a_warning_and_the_pool_boots(gvisor, local_conduit, caplog, how):
    key = key_for(NodeSpec(run_id="r", node_id="n", argv=["true"]))
    pool = _ready_pool(gvisor, local_conduit, key)
    pool.close()
    (image,) = _images(gvisor)
    state = image / snapshots.IMAGE_FILE
    data = state.read_bytes()
    state.write_bytes(data[: len(data) // 2])  # truncated
    if how == "runsc refuses it":  # the digest agrees: only the restore itself can tell
        meta = json.loads((image / snapshots.META_FILE).read_text())
        meta["sha256"] = snapshots._image_digest(image)
        (image / snapshots.META_FILE).write_text(json.dumps(meta))
    pool = WarmPool(gvisor, local_conduit, size=1)
    try:
        pool.want(key, idle=1)
        wait_for(
            lambda: pool.ready_count(key) >= 1 or key in pool._broken, timeout=120, what="a warm sandbox"
        )
        assert key not in pool._broken
        w = _take(pool, key)
        assert w.restored is None  # booted
        assert "discarding the warm-sandbox image" in caplog.text
        o = drive_node(NodeSpec(run_id="r", node_id="n1", argv=["true"]), local_conduit, gvisor, warm=w)
        assert o.ok, o.describe()
        assert not image.exists()
    finally:
        pool.close()
    _no_sandboxes(gvisor)
    _runsc_root_empty(gvisor)


def test_sweep_removes_the_images(gvisor, local_conduit):
    key = key_for(NodeSpec(run_id="r", node_id="n", argv=["true"]))
    pool = _ready_pool(gvisor, local_conduit, key)
    pool.close()
    assert len(_images(gvisor)) == 1
    assert snapshots.remove_all(gvisor) == 1
    assert _images(gvisor) == []


def test_snapshots_off_boots_every_warm_sandbox(gvisor, local_conduit, monkeypatch):
    monkeypatch.setenv(snapshots.ENV, "0")
    key = key_for(NodeSpec(run_id="r", node_id="n", argv=["true"]))
    pool = _ready_pool(gvisor, local_conduit, key)
    try:
        assert pool.snapshots is None and _take(pool, key).restored is None
        assert _images(gvisor) == []
    finally:
        pool.close()
    _no_sandboxes(gvisor)


@pytest.mark.prefect
def test_python_calls_in_restored_sandboxes_draw_fresh_random_numbers(prefect, gvisor, tmp_path):
    """The call's process (a zygote forked before the checkpoint) is reseeded after restore:
    two tasks restored from one image draw different numbers from ``random``."""
    from flows import pool_tasks as pt
    from prefect import flow
    from test_pool_runner import sandbox_line, wait_ready
    from test_task_runner import no_orphans, runner

    conduit = LocalConduit(tmp_path / "conduit")

    @flow(task_runner=runner(conduit, tmp_path, warm_pool=1))
    def draws() -> list[list[float]]:
        out = []
        for _ in range(3):
            wait_ready()
            out.append(pt.draw.submit().result())
        return out

    state = draws(return_state=True)
    assert state.is_completed(), state
    got = state.result()
    from support.prefect_readback import task_runs

    lines = [sandbox_line(r.id) for r in task_runs(state.state_details.flow_run_id)]
    assert all("warm sandbox rsl-" in line for line in lines), lines
    assert len({d[0] for d in got}) == 3, got  # random: reseeded
    assert len({d[1] for d in got}) == 3, got  # os.urandom: the kernel's, never the image's
    assert len(_images(gvisor)) == 1  # every one was restored from the same image
    no_orphans()


def test_closing_the_pool_while_a_template_boots_leaves_nothing(gvisor, local_conduit):
    """Runner exit, Ctrl-C or cancellation while a key's image is being made."""
    key = key_for(NodeSpec(run_id="r", node_id="n", argv=["true"]))
    pool = WarmPool(gvisor, local_conduit, size=1)
    pool.want(key, idle=1)
    wait_for(lambda: gvisor.list_ids(), timeout=60, what="the template sandbox")
    assert _images(gvisor) == []  # still booting: no image yet
    pool.close()
    _no_sandboxes(gvisor)
    _runsc_root_empty(gvisor)
    tmp = Path(gvisor.state) / snapshots.DIR_NAME
    assert not tmp.is_dir() or [p for p in tmp.iterdir() if p.name.startswith(".tmp-")] == []


def test_a_flows_first_node_takes_the_first_restore_not_a_cold_boot(gvisor, local_conduit, monkeypatch):
    """A runner asks for its key at start and its first task arrives moments later, before
    the refill thread's first restore is in the idle list: the node waits for that restore
    (a fraction of a boot away) instead of booting a sandbox of its own (issue 42)."""
    from prefect_resoluto.warm import pool as pool_mod

    key = key_for(NodeSpec(run_id="r", node_id="n", argv=["true"]))
    _ready_pool(gvisor, local_conduit, key).close()  # the key's image, as an earlier flow left it
    assert len(_images(gvisor)) == 1
    # How long a restore may take is the machine's load, not what is tested here.
    monkeypatch.setattr(pool_mod, "RESTORE_WAIT", scaled(60))
    pool = WarmPool(gvisor, local_conduit, size=1)
    w = None
    try:
        pool.want(key)  # the runner's start ...
        w, _ = pool.take(key)  # ... and its first task, at once
        assert w is not None, "the first node booted its own sandbox"
        assert w.restored is not None and w.ready()
    finally:
        if w is not None:
            w.discard()
        pool.close()
    _no_sandboxes(gvisor)


@pytest.mark.parametrize("subreaper", ["catatonit", "python"])
def test_a_restored_sandbox_is_deleted_when_it_ends_and_when_it_is_terminated(
    gvisor, local_conduit, monkeypatch, subreaper
):
    # A restored sandbox's process runs `runsc restore` under a child subreaper and deletes
    # the container after it (runsc restore leaves it behind): catatonit with a shell where
    # it is installed (a few ms of CPU a restore), else the Python reaper. Both: a node
    # served and its container gone; an idle one sent SIGTERM (destroy's last resort) has
    # its container killed and deleted, and exits as a SIGKILLed sandbox.
    import signal

    from prefect_resoluto.runtimes import _local
    from prefect_resoluto.runtimes import gvisor as gvisor_mod

    if subreaper == "catatonit" and gvisor_mod._catatonit() is None:
        pytest.skip("catatonit is not installed here (scripts/setup.sh installs it)")
    if subreaper == "python":
        monkeypatch.setattr(gvisor_mod, "_catatonit", lambda: None)
    key = key_for(NodeSpec(run_id="r", node_id="n", argv=PROBE))
    pool = _ready_pool(gvisor, local_conduit, key, n=1)
    try:
        o, lines = _run(gvisor, local_conduit, pool, key, f"node-{uuid.uuid4().hex[:10]}", "s3cr3t")
        assert "seen []" in lines, lines
        wait_for(lambda: pool.ready_count(key) >= 1, timeout=120, what="a second restored sandbox")
        w = _take(pool, key)
        proc = _local._CHILDREN[(gvisor.name, w.handle.id)]
        assert (subreaper == "catatonit") == (Path(proc.args[0]).name == "catatonit")
        assert (subreaper == "python") == any(a.endswith("_restore_reaper.py") for a in proc.args)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=scaled(60)) == 128 + signal.SIGKILL
        assert [c for c in gvisor.containers() if c["id"] == w.handle.id] == []
        w.discard()
    finally:
        pool.close()
    _no_sandboxes(gvisor)
    _runsc_root_empty(gvisor)
