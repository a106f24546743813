"""ProcessRuntime: a plain child process, launched, observed and reaped for real."""

from __future__ import annotations

import json
import os
import select
from pathlib import Path

import pytest
from support.polling import wait_for
from support.runtime_contract import RuntimeContract, check_egress_refused, require, spec, wait_terminal

from prefect_resoluto.runtimes import _cgroup
from prefect_resoluto.runtimes.base import IsolationLevel, Resources
from prefect_resoluto.runtimes.process import ProcessRuntime


@pytest.fixture
def rt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ProcessRuntime:
    monkeypatch.setenv("RESOLUTO_STATE_DIR", str(tmp_path / "state"))
    return require(ProcessRuntime())  # type: ignore[return-value]


class TestProcessContract(RuntimeContract):
    def unavailable(self) -> ProcessRuntime:
        return ProcessRuntime(python="/nonexistent/bin/python3")

    def after_sweep(self, rt: ProcessRuntime) -> None:
        assert rt.list_ids() == []


def test_isolation_is_none(rt: ProcessRuntime) -> None:
    assert rt.isolation == IsolationLevel.NONE and rt.name == "process"


def test_egress_refused(rt: ProcessRuntime) -> None:
    check_egress_refused(rt)


def test_clean_environment_and_scratch_cwd(
    rt: ProcessRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RSL_HOST_ONLY", "leak")
    code = "import os, json; print('ENV ' + json.dumps({'env': dict(os.environ), 'cwd': os.getcwd()}))"
    s = spec(code, env={"RESOLUTO_WORKSPACE_DIR": "/workspace"}, secret_env={"RSL_SECRET": "s3cr3t"})
    h = rt.launch(s)
    try:
        assert wait_terminal(rt, h).phase == "succeeded"
        line = next(ln for ln in rt.logs(h).splitlines() if ln.startswith("ENV "))
        got = json.loads(line[4:])
    finally:
        rt.destroy(h)
    env = got["env"]
    assert "RSL_HOST_ONLY" not in env
    assert env["RSL_SECRET"] == "s3cr3t"
    # The runtime owns the workspace: never the host's /workspace.
    assert env["RESOLUTO_WORKSPACE_DIR"] == got["cwd"] != "/workspace"
    assert set(env) <= {"PATH", "HOME", "LANG", "PWD", "PYTHONPATH", "RESOLUTO_WORKSPACE_DIR", "RSL_SECRET"}


def test_memory_limit_oom_is_infrastructure(rt: ProcessRuntime) -> None:
    if _cgroup.detect() is None:
        pytest.skip("no writable cgroup hierarchy here: memory limits fall back to RLIMIT_DATA")
    hog = "x = []\nwhile True: x.append(bytearray(16 << 20))"
    h = rt.launch(spec(hog, resources=Resources(memory_bytes=96 << 20)))
    try:
        st = wait_terminal(rt, h)
        assert st.phase == "failed" and st.infrastructure and "OOM" in st.reason, st
    finally:
        rt.destroy(h)
    assert _cgroup.existing(f"process-{h.id}") is None  # destroy removed the cgroup


def test_status_from_another_process_uses_the_record(rt: ProcessRuntime) -> None:
    h = rt.launch(spec("import time; print('ready', flush=True); time.sleep(60)"))
    try:
        fresh = ProcessRuntime()  # shares the state dir, not the Popen
        from prefect_resoluto.runtimes import _local

        proc = _local._CHILDREN.pop(("process", h.id))
        try:
            assert fresh.status(h).phase == "running"
        finally:
            _local._CHILDREN[("process", h.id)] = proc
        assert os.path.isdir(h.data["dir"])
    finally:
        rt.destroy(h)


@pytest.mark.parametrize("limits", ["none", "cgroup"])
def test_stragglers_die_with_the_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limits: str
) -> None:
    """A workload that backgrounds a child must not leave it running after the sandbox ends."""
    if limits == "cgroup" and _cgroup.detect() is None:
        pytest.skip("no writable cgroup hierarchy here")
    monkeypatch.setenv("RESOLUTO_STATE_DIR", str(tmp_path / "state"))
    rt = require(ProcessRuntime(limits=limits))
    code = "import subprocess; p = subprocess.Popen(['sleep', '60']); print('CHILD', p.pid, flush=True)"
    h = rt.launch(spec(code))
    try:
        assert wait_terminal(rt, h).phase == "succeeded"
        child = int(next(ln for ln in rt.logs(h).splitlines() if ln.startswith("CHILD")).split()[1])

        def gone() -> bool:
            try:
                state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                return True
            return state == "Z"

        wait_for(gone, timeout=10, what="the backgrounded child to be killed")
    finally:
        rt.destroy(h)


# Where a root workload parks a process: nested cgroups under its own, in every controller,
# entered by descriptor (so deeper than a path can name), one name per level.
_NEST = """
import os, subprocess
p = subprocess.Popen(['sleep', '600'], start_new_session=True)
for line in open('/proc/self/cgroup'):
    _, ctrl, path = line.strip().split(':', 2)
    for c in ctrl.split(',') if path.startswith('/resoluto/') else ():
        if not os.path.isdir(f'/sys/fs/cgroup/{c}{path}'):
            continue
        fd = os.open(f'/sys/fs/cgroup/{c}{path}', os.O_RDONLY)
        for _ in range(DEPTH):
            os.mkdir(NAME, dir_fd=fd)
            nxt = os.open(NAME, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        procs = os.open('cgroup.procs', os.O_WRONLY, dir_fd=fd)
        os.write(procs, str(p.pid).encode())
print('HIDDEN', p.pid, flush=True)
"""


@pytest.mark.parametrize(
    "depth, name",
    [(2, "hide"), (20, "x" * 250), (1000, "y")],
    ids=["two-deep", "past-PATH_MAX", "a-thousand-deep"],
)
def test_a_cgroup_the_workload_made_inside_its_own_cannot_keep_a_process_alive(
    rt: ProcessRuntime, depth: int, name: str
) -> None:
    """Root in a process sandbox can make cgroups under its own and move a process there, out
    of the sandbox's ``cgroup.procs`` and, with its own session, out of its process group:
    destroy still kills it and removes every cgroup (before, both were left for good), however
    deep (past PATH_MAX, past Python's recursion limit)."""
    if _cgroup.detect() != "v1":
        pytest.skip(f"needs a writable cgroup v1 hierarchy (this machine: {_cgroup.detect()})")
    if os.geteuid() != 0:
        pytest.skip("the workload needs root to make cgroups")
    code = f"DEPTH = {depth}\nNAME = {name!r}\n" + _NEST
    h = rt.launch(spec(code, resources=Resources(memory_bytes=256 << 20, pids=64)))
    try:
        assert wait_terminal(rt, h).phase == "succeeded", rt.logs(h)
        hidden = int(next(ln for ln in rt.logs(h).splitlines() if ln.startswith("HIDDEN")).split()[1])
        assert Path(f"/proc/{hidden}").exists()  # alive, in a cgroup of its own making
    finally:
        rt.destroy(h)

    def gone() -> bool:
        try:
            return Path(f"/proc/{hidden}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            return True

    assert gone()
    assert _cgroup.existing(f"process-{h.id}") is None


def test_a_process_parked_behind_more_nested_cgroups_than_a_round_walks_still_dies(
    rt: ProcessRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walk that removes nested cgroups is bounded per round (``MAX_NESTED``, here 40 so
    the tree stays small): a process parked in a cgroup that readdir lists after a wider
    sibling was never reached, and outlived destroy (an outside attack: 11 000 siblings per
    controller). It is found from /proc instead, however many cgroups hide it."""
    if _cgroup.detect() != "v1":
        pytest.skip(f"needs a writable cgroup v1 hierarchy (this machine: {_cgroup.detect()})")
    if os.geteuid() != 0:
        pytest.skip("the workload needs root to make cgroups")
    monkeypatch.setattr(_cgroup, "MAX_NESTED", 40)
    code = """
import os, subprocess
p = subprocess.Popen(['sleep', '600'], start_new_session=True)
for line in open('/proc/self/cgroup'):
    _, ctrl, path = line.strip().split(':', 2)
    for c in ctrl.split(',') if path.startswith('/resoluto/') else ():
        base = f'/sys/fs/cgroup/{c}{path}'
        if not os.path.isdir(base):
            continue
        os.mkdir(base + '/d1')
        os.mkdir(base + '/d2')
        first = next(e.name for e in os.scandir(base) if e.is_dir())  # the walk's first
        for i in range(60):
            os.mkdir(f'{base}/{first}/c{i}')
        park = 'd2' if first == 'd1' else 'd1'
        with open(f'{base}/{park}/cgroup.procs', 'w') as f:
            f.write(str(p.pid))
print('HIDDEN', p.pid, flush=True)
"""
    h = rt.launch(spec(code, resources=Resources(memory_bytes=256 << 20, pids=64)))
    try:
        assert wait_terminal(rt, h).phase == "succeeded", rt.logs(h)
        hidden = int(next(ln for ln in rt.logs(h).splitlines() if ln.startswith("HIDDEN")).split()[1])
        exited = os.pidfd_open(hidden)  # readable once it has exited: the event waited on
        try:
            cg = _cgroup.existing(f"process-{h.id}")
            assert cg is not None
            cg.remove()  # one round of destroy's removal: its walk stops at MAX_NESTED
            assert select.select([exited], [], [], 60)[0], "the hidden process outlived the round"
        finally:
            os.close(exited)
    finally:
        rt.destroy(h)
    assert _cgroup.existing(f"process-{h.id}") is None
