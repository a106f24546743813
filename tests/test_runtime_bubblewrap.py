"""BubblewrapRuntime: real namespace sandboxes on this machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.runtime_contract import ConfinedRuntimeContract, require, spec, wait_terminal

from prefect_resoluto.runtimes import _cgroup
from prefect_resoluto.runtimes.base import IsolationLevel, Resources
from prefect_resoluto.runtimes.bubblewrap import BubblewrapRuntime


@pytest.fixture
def rt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> BubblewrapRuntime:
    monkeypatch.setenv("RESOLUTO_STATE_DIR", str(tmp_path / "state"))
    return require(BubblewrapRuntime())  # type: ignore[return-value]


class TestBubblewrapContract(ConfinedRuntimeContract):
    launch_marks = (pytest.mark.sandbox,)

    def unavailable(self) -> BubblewrapRuntime:
        return BubblewrapRuntime(bwrap="/nonexistent/bin/bwrap")

    def after_sweep(self, rt: BubblewrapRuntime) -> None:
        assert rt.list_ids() == []


@pytest.mark.sandbox
def test_isolation_is_namespace(rt: BubblewrapRuntime) -> None:
    assert rt.isolation == IsolationLevel.NAMESPACE and rt.name == "bubblewrap"
    assert "bubblewrap" in rt.availability().detail


@pytest.mark.sandbox
def test_guest_view(rt: BubblewrapRuntime, tmp_path: Path) -> None:
    """Env is exactly what the runtime gives, no capabilities, read-only system dirs."""
    code = (
        "import os, json\n"
        "caps = [l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0]\n"
        "try:\n    open('/usr/rsl-probe', 'w'); ro = False\nexcept OSError:\n    ro = True\n"
        "print('VIEW ' + json.dumps({'env': dict(os.environ), 'cwd': os.getcwd(), 'caps': caps, 'ro': ro}))\n"
    )
    conduit = tmp_path / "conduit"
    h = rt.launch(
        spec(code, conduit, env={"RESOLUTO_STORE_ROOT": str(conduit)}, secret_env={"RSL_SECRET": "s3 cr'et"})
    )
    try:
        assert wait_terminal(rt, h).phase == "succeeded", rt.logs(h)
        view = json.loads(next(ln for ln in rt.logs(h).splitlines() if ln.startswith("VIEW "))[5:])
    finally:
        rt.destroy(h)
    assert view["cwd"] == "/workspace" and view["caps"] == "0000000000000000" and view["ro"]
    env = view["env"]
    assert env["RSL_SECRET"] == "s3 cr'et"
    assert env["RESOLUTO_STORE_ROOT"] == "/conduit" and env["PYTHONPATH"] == "/opt/resoluto"
    assert set(env) == {
        "PATH",
        "HOME",
        "LANG",
        "PWD",
        "PYTHONPATH",
        "RESOLUTO_WORKSPACE_DIR",
        "RESOLUTO_STORE_ROOT",
        "RSL_SECRET",
    }


@pytest.mark.sandbox
def test_argv_binds(rt: BubblewrapRuntime, tmp_path: Path) -> None:
    s = spec(
        "print(1)",
        tmp_path / "c",
        resources=Resources(disk_bytes=64 << 20),
        secret_env={"RSL_SECRET": "hunter2"},
    )
    argv, env = rt.build_argv(s, tmp_path / "sandbox")
    joined = " ".join(argv)
    # Secrets travel in bwrap's own environment (readable by the same user only), never argv.
    assert "hunter2" not in joined and env["RSL_SECRET"] == "hunter2"
    assert (
        "--unshare-all --unshare-user --disable-userns --cap-drop ALL --die-with-parent --new-session"
        in joined
    )
    assert f"--bind {tmp_path / 'c' / 'run/r1/nodes/n1'} /conduit/run/r1/nodes/n1" in joined
    # /workspace is memory of the node's slot size, never a directory of the host's disk.
    assert "--size 67108864 --tmpfs /workspace" in joined and not any(
        a == "/workspace" and argv[i - 2] == "--bind" for i, a in enumerate(argv)
    )
    assert "--ro-bind /usr /usr" in joined and "--size 67108864 --tmpfs /tmp" in joined
    assert "--chdir /workspace" in joined and "/home" not in argv


@pytest.mark.sandbox
def test_memory_limit_oom_is_infrastructure(rt: BubblewrapRuntime) -> None:
    if _cgroup.detect() is None:
        pytest.skip("no writable cgroup hierarchy here: memory limits fall back to RLIMIT_DATA")
    hog = "x = []\nwhile True: x.append(bytearray(16 << 20))"
    h = rt.launch(spec(hog, resources=Resources(memory_bytes=96 << 20)))
    try:
        st = wait_terminal(rt, h)
        assert st.phase == "failed" and st.infrastructure and "OOM" in st.reason, st
    finally:
        rt.destroy(h)


@pytest.mark.sandbox
def test_pids_limit(rt: BubblewrapRuntime) -> None:
    if _cgroup.detect() is None:
        pytest.skip("no writable cgroup hierarchy here: no per-sandbox pids limit")
    code = (
        "import os, sys\n"
        "n = 0\n"
        "try:\n"
        "    for _ in range(64):\n"
        "        if os.fork() == 0:\n            os.read(os.open('/proc/self/stat', 0), 1); import time; time.sleep(30)\n"
        "        n += 1\n"
        "except OSError as e:\n    print('fork refused after', n, flush=True); os._exit(0)\n"
        "print('forked', n, flush=True); os._exit(1)\n"
    )
    h = rt.launch(spec(code, resources=Resources(pids=16)))
    try:
        st = wait_terminal(rt, h)
        assert st.phase == "succeeded", (st, rt.logs(h))
        assert "fork refused" in rt.logs(h)
    finally:
        rt.destroy(h)
