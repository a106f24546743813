"""ProcessRuntime: a plain child process, launched, observed and reaped for real."""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import subprocess
from collections.abc import Iterator
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


def test_said_reads_only_new_output_and_finds_a_line_written_in_two_pieces(rt: ProcessRuntime) -> None:
    # The warm pool asks every READY_LOOK whether a starting sandbox has printed its ready
    # line; each look reads only what was written since the last one (issue 42: re-reading
    # the log's tail at every look was most of the pool's CPU in a 50-way gVisor map).
    from prefect_resoluto.runtimes import _local

    line = "resoluto warm: ready"
    code = (
        "import sys\n"
        "sys.stdout.write('booting\\n' + 'resoluto warm: re'); sys.stdout.flush()\n"
        "sys.stdin.readline()\n"
        "sys.stdout.write('ady\\n'); sys.stdout.flush()\n"
        "sys.stdin.readline()\n"
    )
    h = rt.launch(spec(code, hold_stdin=True))
    log = Path(h.data["dir"]) / "output.log"
    try:
        wait_for(lambda: log.read_bytes().endswith(b"resoluto warm: re"), what="the first half of the line")
        assert not rt.said(h, line)
        # What was read already is not read again: blanked in place (same size), the ready
        # line's first half is still known from the look before.
        log.write_bytes(b"x" * log.stat().st_size)
        rt.assign(h, b"go\n")
        wait_for(lambda: rt.said(h, line), what="the ready line, completed")
        assert not rt.said(h, "never printed")  # a line it did not write is not found
    finally:
        rt.destroy(h)
    assert not [k for k in _local._SAID if k[:2] == (rt.name, h.id)]  # destroy forgets what was read
    assert not rt.said(h, line)  # nothing to read any more: not said


def test_said_reads_a_log_that_was_replaced_by_a_shorter_one_afresh(rt: ProcessRuntime) -> None:
    h = rt.launch(
        spec(
            "import sys; sys.stdout.write('x' * 5000 + '\\n'); sys.stdout.flush(); sys.stdin.readline()",
            hold_stdin=True,
        )
    )
    log = Path(h.data["dir"]) / "output.log"
    try:
        wait_for(lambda: log.stat().st_size >= 5000, what="the first output")
        assert not rt.said(h, "resoluto warm: ready")
        tmp = log.with_name("output.new")
        tmp.write_bytes(b"resoluto warm: ready\n")
        os.replace(tmp, log)
        assert rt.said(h, "resoluto warm: ready")
    finally:
        rt.destroy(h)


def test_a_running_sandboxs_oom_kills_are_read_from_the_memory_controller_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The status of a running gVisor sandbox asks for OOM kills at every look (the warm pool
    # looks several times a second): one read of the memory controller's file, found by name.
    roots = {c: tmp_path / c / _cgroup.PARENT for c in ("cpu,cpuacct", "memory", "pids")}
    for root in roots.values():
        (root / "gvisor-rsl-x").mkdir(parents=True)
    monkeypatch.setattr(_cgroup, "detect", lambda: "v1")
    monkeypatch.setattr(_cgroup, "_v1_roots", lambda: tuple(str(r) for r in roots.values()))
    _cgroup._oom_parent.cache_clear()
    try:
        (roots["pids"] / "gvisor-rsl-x" / "memory.oom_control").write_text("oom_kill 2\n")
        assert not _cgroup.oom_killed("gvisor-rsl-x")  # not the memory controller's
        (roots["memory"] / "gvisor-rsl-x" / "memory.oom_control").write_text(
            "oom_kill_disable 0\noom_kill 0\n"
        )
        assert not _cgroup.oom_killed("gvisor-rsl-x")
        (roots["memory"] / "gvisor-rsl-x" / "memory.oom_control").write_text(
            "oom_kill_disable 0\noom_kill 1\n"
        )
        assert _cgroup.oom_killed("gvisor-rsl-x")
        assert not _cgroup.oom_killed("gvisor-rsl-gone")  # no such cgroup: no OOM kill
    finally:
        _cgroup._oom_parent.cache_clear()


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a read-only bind mount (where a ``resoluto`` parent may sit), or a skip
    saying why there is none."""
    ro = tmp_path / "ro"
    (ro / "resoluto").mkdir(parents=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("a read-only bind mount needs root and mount(8)")
    made = subprocess.run(["mount", "--bind", str(ro), str(ro)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {made.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True, capture_output=True)
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], check=True, capture_output=True)


def test_a_cgroup_path_that_is_not_there_is_not_waited_for_however_its_removal_fails(
    tmp_path: Path, read_only_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # An exited sandbox's cgroup is removed by an rmdir of each directory it may have (no
    # lookup first). A path that is not there fails with ENOENT, but also with ENOTDIR (a file
    # where a hierarchy was: a root workload can make one under /sys/fs/cgroup) or EROFS (a
    # read-only mount): none of them is a busy cgroup, to be drained for 5 s (outside attack).
    from prefect_resoluto.runtimes._local import _drain_cgroup

    (tmp_path / "a-file").write_text("")
    real = tmp_path / "real"
    real.mkdir()
    cg = _cgroup.Cgroup(
        dirs=[str(tmp_path / "a-file" / "resoluto" / "x"), str(read_only_dir / "resoluto" / "x"), str(real)],
        version=1,
    )
    with caplog.at_level(logging.WARNING):
        _drain_cgroup(cg)
    assert cg.dirs == [] and not real.exists()
    assert "still busy" not in caplog.text
