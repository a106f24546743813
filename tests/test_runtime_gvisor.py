"""GVisorRuntime: real gVisor sandboxes (runsc run on a generated OCI bundle)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.runtime_contract import ConfinedRuntimeContract, require, spec, wait_terminal

from prefect_resoluto.runtimes import _cgroup
from prefect_resoluto.runtimes._guest_layout import guest_layout, guest_runner_dir, python_paths, system_binds
from prefect_resoluto.runtimes.base import IsolationLevel, Resources
from prefect_resoluto.runtimes.gvisor import LABEL_PREFIX, GVisorRuntime


@pytest.fixture
def rt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> GVisorRuntime:
    monkeypatch.setenv("RESOLUTO_STATE_DIR", str(tmp_path / "state"))
    return require(GVisorRuntime())  # type: ignore[return-value]


def _ids(rt: GVisorRuntime) -> list[str]:
    return sorted(set(rt.list_ids()) | {c["id"] for c in rt.containers()})


class TestGVisorContract(ConfinedRuntimeContract):
    launch_marks = (pytest.mark.sandbox,)

    def unavailable(self) -> GVisorRuntime:
        return GVisorRuntime(runsc="/nonexistent/bin/runsc")

    def list_ids(self, rt: GVisorRuntime) -> list[str]:
        return _ids(rt)

    def after_sweep(self, rt: GVisorRuntime) -> None:
        assert rt.containers() == [] and rt.list_ids() == []

    def running(self, rt: GVisorRuntime, sandbox_id: str) -> bool:
        # runsc's own view too: a container it still lists as running
        listed = any(c["id"] == sandbox_id and c.get("status") == "running" for c in rt.containers())
        return listed or super().running(rt, sandbox_id)


@pytest.mark.sandbox
def test_isolation_and_platform(rt: GVisorRuntime) -> None:
    assert rt.isolation == IsolationLevel.USER_KERNEL and rt.name == "gvisor"
    detail = rt.availability().detail
    assert "platform systrap" in detail or "platform ptrace" in detail, detail
    print("gvisor:", detail)


@pytest.mark.sandbox
def test_bundle_config(rt: GVisorRuntime, tmp_path: Path) -> None:
    s = spec(
        "print(1)",
        tmp_path / "c",
        labels={"flow": "f1"},
        secret_env={"RSL_SECRET": "x"},
        resources=Resources(memory_bytes=256 << 20, cpus=0.5, pids=64),
    )
    cfg = rt.bundle_config(s, guest_layout(s))
    assert cfg["root"] == {"path": "rootfs", "readonly": True}
    assert cfg["process"]["cwd"] == "/workspace"
    assert cfg["annotations"] == {LABEL_PREFIX + "flow": "f1"}
    res = cfg["linux"]["resources"]
    assert res["memory"] == {"limit": 256 << 20, "swap": 256 << 20}
    assert res["pids"] == {"limit": 64} and res["cpu"] == {"quota": 50_000, "period": 100_000}
    mounts = {m["destination"]: m for m in cfg["mounts"]}
    assert mounts["/conduit/run/r1/nodes/n1"]["options"] == ["rbind", "rw"]
    assert mounts["/usr"]["options"] == ["rbind", "ro"]
    assert mounts["/tmp"]["type"] == mounts["/workspace"]["type"] == "tmpfs"
    # Bound from the host: system dirs, the interpreter's paths, guest_runner, the conduit: no more.
    allowed = (
        {src for src, _ in system_binds()[0]}
        | set(python_paths())
        | {str(guest_runner_dir()), str(tmp_path / "c" / "run/r1/nodes/n1")}
    )
    assert {m["source"] for m in cfg["mounts"] if m["type"] == "bind"} <= allowed
    assert "RSL_SECRET" not in json.dumps(cfg)  # secrets travel through stdin, not the spec file


@pytest.mark.sandbox
def test_secret_env_reaches_guest_but_no_file(rt: GVisorRuntime) -> None:
    secret = "s3 cr'et $(touch /tmp/pwned)"
    h = rt.launch(
        spec(
            "import os; print('SECRET=' + os.environ['RSL_SECRET'], flush=True)",
            secret_env={"RSL_SECRET": secret},
            env={"PLAIN": "1"},
        )
    )
    try:
        st = wait_terminal(rt, h)
        assert st.phase == "succeeded", (st, rt.logs(h))
        assert f"SECRET={secret}" in rt.logs(h)
        bundle = Path(h.data["bundle"])
        assert secret not in (bundle / "config.json").read_text()
        assert all(
            secret not in p.read_text(errors="replace")
            for p in Path(rt.state, "runsc-root").rglob("*")
            if p.is_file()
        )
    finally:
        rt.destroy(h)


@pytest.mark.sandbox
def test_memory_limit_oom_is_infrastructure(rt: GVisorRuntime) -> None:
    if _cgroup.detect() is None:
        pytest.skip("no writable cgroup hierarchy: gVisor runs with --ignore-cgroups, no memory limit")
    hog = "x = []\nwhile True: x.append(bytearray(16 << 20))"
    h = rt.launch(spec(hog, resources=Resources(memory_bytes=128 << 20)))
    try:
        st = wait_terminal(rt, h)
        assert st.phase == "failed" and st.infrastructure and "OOM" in st.reason, st
    finally:
        rt.destroy(h)
    assert _cgroup.existing(f"gvisor-{h.id}") is None


@pytest.mark.sandbox
def test_memory_committed_in_bulk_past_the_limit_ends_a_sandbox_whose_parent_lives(rt: GVisorRuntime) -> None:
    """A child committing memory in bulk (MAP_POPULATE) past the limit, its parent alive (as
    the guest runner is, beating, beside a task): the host's OOM killer takes the systrap stub
    holding the child's memory, runsc lives on and the child hangs. The sandbox is then
    failed as OOM-killed (infrastructure), not left running for good."""
    if _cgroup.detect() is None:
        pytest.skip("no writable cgroup hierarchy: gVisor runs with --ignore-cgroups, no memory limit")
    hog = (
        "import mmap\nx = []\nflags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE\n"
        "while True: x.append(mmap.mmap(-1, 16 << 20, flags=flags))"
    )
    parent = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {hog!r}])\nwhile True: time.sleep(1)"
    h = rt.launch(spec(parent, resources=Resources(memory_bytes=128 << 20)))
    try:
        st = wait_terminal(rt, h)
        assert st.phase == "failed" and st.infrastructure and st.memory_exhausted, st
        assert "OOM-killed" in (st.reason or ""), st
    finally:
        rt.destroy(h)
    assert _cgroup.existing(f"gvisor-{h.id}") is None


@pytest.mark.sandbox
def test_unstartable_sandbox(rt: GVisorRuntime, tmp_path: Path) -> None:
    """runsc refusing the bundle (here: a bind source that vanished) is infrastructure."""
    gone = tmp_path / "vanishing"
    gone.mkdir()
    bad = GVisorRuntime(extra_ro_paths=[str(gone)])
    s = spec("print(1)")
    orig = bad._prepare

    def prepare_then_remove(sp, d, net=None):  # type: ignore[no-untyped-def]
        prep = orig(sp, d, net)
        gone.rmdir()
        return prep

    bad._prepare = prepare_then_remove  # type: ignore[method-assign]
    h = bad.launch(s)
    try:
        st = wait_terminal(bad, h)
        assert st.phase == "failed" and st.infrastructure and st.unstartable, (st, bad.logs(h))
    finally:
        bad.destroy(h)


@pytest.mark.sandbox
def test_debug_logs_only_when_asked(rt: GVisorRuntime) -> None:
    h = rt.launch(spec("print('quiet')"))
    assert wait_terminal(rt, h).phase == "succeeded"
    rt.destroy(h)
    assert not (rt.state / "debug").exists()
    loud = GVisorRuntime(debug=True)
    h = loud.launch(spec("print('loud')"))
    try:
        assert wait_terminal(loud, h).phase == "succeeded"
    finally:
        loud.destroy(h)
    assert list((loud.state / "debug" / h.id).glob("runsc.log.*"))  # survives destroy


def test_a_snapshot_image_made_before_the_sandboxes_mounts_changed_is_not_restored(monkeypatch):
    """A restored sandbox keeps its template's mount tree whatever the bundle now says: an
    image made before /dev/shm was mounted restored a sandbox without it. The mounts'
    shape is part of the image's fingerprint (prefect_resoluto.warm.snapshots)."""
    from prefect_resoluto.runtimes import gvisor

    rt = GVisorRuntime(runsc="runsc-not-installed")  # the fingerprint, not a sandbox
    now = rt.snapshot_fingerprint()
    assert "/dev/shm" in now
    real = gvisor._oci_mounts
    monkeypatch.setattr(
        gvisor, "_oci_mounts", lambda lay, r: [m for m in real(lay, r) if m["destination"] != "/dev/shm"]
    )
    assert rt.snapshot_fingerprint() != now
