"""ContainerRuntime: real podman (+ runsc) containers here; nerdctl + Kata by argv only."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from support.runtime_contract import ConfinedRuntimeContract, require, spec, wait_terminal

from prefect_resoluto.runtimes.base import IsolationLevel, LaunchSpec, Resources, SandboxHandle
from prefect_resoluto.runtimes.container import (
    MARKER_LABEL,
    SKELETON_IMAGE,
    ContainerRuntime,
    isolation_of,
    skeleton_tar,
    status_from_state,
)

SOCK = "/run/resoluto-local/containerd/containerd.sock"


@pytest.fixture
def rt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ContainerRuntime:
    monkeypatch.setenv("RESOLUTO_STATE_DIR", str(tmp_path / "state"))
    return require(ContainerRuntime())  # type: ignore[return-value]


def _pid(rt: ContainerRuntime, h: object) -> int:
    info = rt.inspect(h.id)  # type: ignore[attr-defined]
    assert info is not None
    return int(info["State"]["Pid"])


# ----------------------------------------------------------------------------- real podman


class TestContainerContract(ConfinedRuntimeContract):
    launch_marks = (pytest.mark.sandbox,)

    def unavailable(self) -> ContainerRuntime:
        return ContainerRuntime(engine_path="/nonexistent/bin/podman")

    def pid_of(self, rt: ContainerRuntime, h: SandboxHandle) -> int:
        return _pid(rt, h)

    def running(self, rt: ContainerRuntime, sandbox_id: str) -> bool:
        info = rt.inspect(sandbox_id)  # the engine's view: its container runs detached
        return bool(info and info.get("State", {}).get("Running"))


@pytest.mark.sandbox
def test_isolation_follows_oci_runtime(rt: ContainerRuntime) -> None:
    assert rt.isolation == IsolationLevel.USER_KERNEL  # podman + runsc by default
    print("container:", rt.availability().detail)


@pytest.mark.sandbox
def test_image_python3_and_secret_env_file(rt: ContainerRuntime, tmp_path: Path) -> None:
    """The image's own python3 runs guest_runner from /opt/resoluto; secrets via env-file."""
    rt.ensure_skeleton_image()
    # The skeleton + the host's /usr stands in for "an image with python3" offline.
    img = ContainerRuntime(
        image=SKELETON_IMAGE,
        host_python=False,
        extra_run_args=["-v", "/usr:/usr:ro", "-v", "/etc/ld.so.cache:/etc/ld.so.cache:ro"],
    )
    code = (
        "import os, sys, guest_runner; print('IMG', sys.executable, guest_runner.__file__, "
        "os.environ['RSL_SECRET'], flush=True)"
    )
    s = spec(code, secret_env={"RSL_SECRET": "s3cr3t"})
    s.command = ["python3", "-c", code]
    h = img.launch(s)
    try:
        st = wait_terminal(img, h)
        out = img.logs(h)
        assert st.phase == "succeeded", (st, out)
        assert "IMG /usr/bin/python3 /opt/resoluto/guest_runner/__init__.py s3cr3t" in out
        assert not list(Path(img.state).glob("*.env"))  # the env-file is gone after launch
    finally:
        img.destroy(h)


@pytest.mark.sandbox
def test_default_command_is_guest_runner(rt: ContainerRuntime) -> None:
    s = LaunchSpec(sandbox_id="x", env={})
    argv = rt.build_run_argv(s, "img:1", None, host_python=False)
    assert argv[-4:] == ["img:1", "python3", "-m", "guest_runner"]


# ----------------------------------------------------------------------------- argv only


def _kata() -> ContainerRuntime:
    return ContainerRuntime(
        engine="nerdctl",
        engine_path="/opt/nerdctl/bin/nerdctl",
        address=SOCK,
        namespace="resoluto",
        oci_runtime="kata",
        image="localhost:5000/resoluto-base:0.1.0",
    )


def test_nerdctl_kata_argv(tmp_path: Path) -> None:
    rt = _kata()
    assert rt.isolation == IsolationLevel.VM
    s = LaunchSpec(
        sandbox_id="rsl-abc",
        env={"RESOLUTO_RUN_ID": "r1", "RESOLUTO_STORE_ROOT": "/host/conduit"},
        secret_env={"API_KEY": "k"},
        conduit_root=tmp_path,
        conduit_subdir="run/r1/nodes/n1",
        resources=Resources(memory_bytes=1 << 30, cpus=2, pids=512),
        labels={"flow": "f", "task": "t"},
    )
    argv = rt.build_run_argv(s, "localhost:5000/resoluto-base:0.1.0", "/state/rsl-abc.env")
    assert argv[:5] == ["/opt/nerdctl/bin/nerdctl", "--address", SOCK, "--namespace", "resoluto"]
    i = argv.index("run")
    assert argv[i : i + 4] == ["run", "-d", "--name", "rsl-abc"]
    pairs = list(zip(argv, argv[1:], strict=False))
    assert ("--runtime", "io.containerd.kata.v2") in pairs
    assert ("--network", "none") in pairs and ("--workdir", "/workspace") in pairs
    assert ("--memory", str(1 << 30)) in pairs and ("--memory-swap", str(1 << 30)) in pairs
    assert ("--cpus", "2") in pairs and ("--pids-limit", "512") in pairs
    assert ("--label", "flow=f") in pairs and ("--label", "task=t") in pairs
    assert ("--label", f"{MARKER_LABEL}=true") in pairs
    assert ("-e", "RESOLUTO_STORE_ROOT=/conduit") in pairs and ("-e", "RESOLUTO_RUN_ID=r1") in pairs
    assert ("-e", "PYTHONPATH=/opt/resoluto") in pairs
    assert ("--env-file", "/state/rsl-abc.env") in pairs
    assert not any("API_KEY" in a for a in argv)  # secrets never on argv
    assert ("-v", f"{tmp_path}/run/r1/nodes/n1:/conduit/run/r1/nodes/n1:rw") in pairs
    assert any(a.endswith(":/opt/resoluto/guest_runner:ro") for a in argv)
    assert (
        "--read-only" in argv and ("--tmpfs", f"/workspace:rw,mode=1777,size={1 << 30}") in pairs
    )  # sized: counts against memory
    assert not any(a.startswith("--runtime-flag") or a == "--ulimit" for a in argv)  # podman-only
    assert not any(a.startswith("/usr:") for a in argv)  # the image brings its own Python
    assert argv[-4:] == ["localhost:5000/resoluto-base:0.1.0", "python3", "-m", "guest_runner"]


def test_nerdctl_requires_dedicated_address() -> None:
    with pytest.raises(ValueError, match="address"):
        ContainerRuntime(engine="nerdctl")


def test_nerdctl_unavailable_without_socket(tmp_path: Path) -> None:
    rt = ContainerRuntime(engine="nerdctl", engine_path="/bin/true", address=str(tmp_path / "nope.sock"))
    avail = rt.availability()
    assert not avail.ok and "socket" in avail.why


@pytest.mark.sandbox
def test_podman_runsc_and_runc_argv(tmp_path: Path) -> None:
    s = LaunchSpec(sandbox_id="p1", env={}, labels={"a": "b"})
    runsc = ContainerRuntime(engine_path="/usr/bin/podman", oci_runtime="runsc").build_run_argv(
        s, "img", None
    )
    assert "--runtime-flag=network=none" in runsc[: runsc.index("run")]
    assert "nofile=1024:1024" in runsc and "nproc=4096:4096" in runsc
    runc_rt = ContainerRuntime(engine_path="/usr/bin/podman", oci_runtime="runc")
    assert runc_rt.isolation == IsolationLevel.NAMESPACE
    runc = runc_rt.build_run_argv(s, "img", None)
    assert not any(a.startswith("--runtime-flag") for a in runc)
    assert ("--network", "none") in list(zip(runc, runc[1:], strict=False))


@pytest.mark.parametrize(
    ("name", "level"),
    [
        pytest.param("kata", IsolationLevel.VM, marks=pytest.mark.sandbox),
        ("io.containerd.kata.v2", IsolationLevel.VM),
        ("/usr/bin/kata-runtime", IsolationLevel.VM),
        pytest.param("runsc", IsolationLevel.USER_KERNEL, marks=pytest.mark.sandbox),
        ("io.containerd.runsc.v1", IsolationLevel.USER_KERNEL),
        ("runc", IsolationLevel.NAMESPACE),
        ("crun", IsolationLevel.NAMESPACE),
    ],
)
def test_isolation_of(name: str, level: IsolationLevel) -> None:
    assert isolation_of(name) == level


@pytest.mark.parametrize(
    ("state", "phase", "infra"),
    [
        ({"Status": "created"}, "pending", False),
        ({"Status": "running"}, "running", False),
        ({"Status": "exited", "ExitCode": 0}, "succeeded", False),
        ({"Status": "exited", "ExitCode": 2}, "failed", False),
        ({"Status": "exited", "ExitCode": 137, "OOMKilled": True}, "failed", True),
        ({"Status": "stopped", "ExitCode": 137}, "failed", True),
        ({"Status": "exited", "ExitCode": 127, "Error": "executable file not found"}, "failed", True),
    ],
)
def test_status_from_state(state: dict, phase: str, infra: bool) -> None:
    st = status_from_state(state)
    assert st.phase == phase and st.infrastructure == infra


def test_oom_reason() -> None:
    st = status_from_state({"Status": "exited", "ExitCode": 137, "OOMKilled": True})
    assert "OOM" in st.reason and st.exit_code == 137


def test_skeleton_tar_is_mount_points_only() -> None:
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(skeleton_tar())) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert all(m.isdir() or m.issym() for m in members.values())
    assert members["bin"].linkname == "usr/bin" and "workspace" in members
    assert len(skeleton_tar()) < 64 * 1024


@pytest.mark.sandbox
def test_duplicate_name_refused_without_harm(rt: ContainerRuntime) -> None:
    """A second launch under a live name is refused by the engine, not silently merged."""
    sid = f"dup-{uuid.uuid4().hex[:8]}"
    h = rt.launch(spec("import time; time.sleep(60)", sandbox_id=sid))
    try:
        from prefect_resoluto.runtimes.base import LaunchError

        with pytest.raises(LaunchError):
            rt.launch(spec("print(1)", sandbox_id=sid))
        assert rt.status(h).phase == "running"  # the refused twin did not reap the original
    finally:
        rt.destroy(h)
    assert sid not in rt.list_ids()
