"""What every local runtime does with a sandbox: one test class, run per runtime, and the
helpers its checks and the runtimes' own tests share.

A runtime's test module (process, bubblewrap, gvisor, container) subclasses
:class:`RuntimeContract`, or :class:`ConfinedRuntimeContract` for a runtime that isolates,
once, and gives it (docs/testing.md):

- a module-level ``rt`` fixture: the runtime, or a skip saying why this machine has none
  (:func:`require`); the runtime's own tests use it too;
- :meth:`~RuntimeContract.unavailable`: the runtime with its binary missing;
- ``launch_marks``: the tier of the checks that launch, ``(pytest.mark.sandbox,)`` where
  ``rt`` is a real sandbox.

Every check launches real sandboxes on this machine and synchronises by polling a
condition against a deadline, never by sleeping a fixed time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest

from prefect_resoluto.runtimes.base import (
    LaunchError,
    LaunchSpec,
    Resources,
    RuntimeUnavailable,
    SandboxHandle,
    SandboxRuntime,
    SandboxStatus,
)
from support.polling import wait_for

REPO = Path(__file__).resolve().parents[2]
SUBDIR = "run/r1/nodes/n1"


def require(rt: SandboxRuntime) -> SandboxRuntime:
    avail = rt.availability()
    if not avail.ok:
        pytest.skip(f"{rt.name} is not available on this machine: {avail.why}")
    return rt


def wait_terminal(rt: SandboxRuntime, h: SandboxHandle, timeout: float = 60.0) -> SandboxStatus:
    st: list[SandboxStatus] = []

    def done() -> bool:
        st.append(rt.status(h))
        return st[-1].terminal

    wait_for(done, timeout, f"sandbox {h.id} to finish")
    return st[-1]


def new_id(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def py(code: str) -> list[str]:
    """A command running ``code`` with the host's interpreter (bound into sandboxes)."""
    return [sys.executable, "-c", code]


def spec(code: str, conduit: Path | None = None, **kw: object) -> LaunchSpec:
    return LaunchSpec(
        sandbox_id=str(kw.pop("sandbox_id", new_id())),
        env=dict(kw.pop("env", {})),  # type: ignore[arg-type]
        conduit_root=conduit,
        conduit_subdir=SUBDIR if conduit else "",
        command=py(code),
        **kw,  # type: ignore[arg-type]
    )


# ----------------------------------------------------------------------------- checks


def check_success(rt: SandboxRuntime, tmp_path: Path) -> None:
    conduit = tmp_path / "conduit"
    code = (
        "import os, pathlib\n"
        "d = pathlib.Path(os.environ['RESOLUTO_STORE_ROOT']) / 'run/r1/nodes/n1'\n"
        "(d / 'hello.txt').write_text('from the guest ' + os.environ['GREETING'])\n"
        "print('guest says hello', os.getcwd() == os.environ['RESOLUTO_WORKSPACE_DIR'], flush=True)\n"
    )
    h = rt.launch(
        spec(
            code,
            conduit,
            env={"GREETING": "hi", "RESOLUTO_STORE_ROOT": str(conduit)},
            labels={"suite": "success"},
            resources=Resources(memory_bytes=512 << 20, cpus=1),
        )
    )
    try:
        st = wait_terminal(rt, h)
        assert st.phase == "succeeded", (st, rt.logs(h))
        assert st.exit_code == 0 and not st.infrastructure
        assert (conduit / SUBDIR / "hello.txt").read_text() == "from the guest hi"
        assert "guest says hello True" in rt.logs(h)
    finally:
        rt.destroy(h)


def check_failure(rt: SandboxRuntime) -> None:
    h = rt.launch(spec("import sys; print('about to fail', flush=True); sys.exit(3)"))
    try:
        st = wait_terminal(rt, h)
        assert st.phase == "failed" and st.exit_code == 3, st
        assert not st.infrastructure and not st.unstartable
        assert "about to fail" in rt.logs(h)
    finally:
        rt.destroy(h)


SLEEPER = "import time; print('ready', flush=True); time.sleep(120)"


def check_killed_from_outside(rt: SandboxRuntime, pid_of: Callable[[SandboxHandle], int]) -> None:
    h = rt.launch(spec(SLEEPER))
    try:
        wait_for(lambda: "ready" in rt.logs(h), what="the guest to start")
        assert rt.status(h).phase == "running"
        pid = pid_of(h)
        os.kill(pid, signal.SIGKILL)
        st = wait_terminal(rt, h, timeout=30)
        assert st.phase == "failed", st
        assert st.infrastructure or st.gone, st
        assert st.reason, st
    finally:
        rt.destroy(h)


def check_destroy_idempotent(rt: SandboxRuntime, list_ids: Callable[[], list[str]]) -> None:
    h = rt.launch(spec(SLEEPER))
    wait_for(lambda: "ready" in rt.logs(h), what="the guest to start")
    rt.destroy(h)
    rt.destroy(h)
    st = rt.status(h)
    assert st.gone and st.phase == "failed", st
    assert h.id not in list_ids()


def check_sweep(rt: SandboxRuntime, list_ids: Callable[[], list[str]]) -> None:
    tag = uuid.uuid4().hex[:8]
    mine = [rt.launch(spec(SLEEPER, labels={"sweep": tag, "flow": "a"})) for _ in range(2)]
    other = rt.launch(spec(SLEEPER, labels={"sweep": tag, "flow": "b"}))
    try:
        for h in (*mine, other):
            wait_for(lambda h=h: "ready" in rt.logs(h), what="the guests to start")
        assert rt.sweep({"sweep": tag, "flow": "a"}) == 2
        assert all(rt.status(h).gone for h in mine)
        assert rt.status(other).phase == "running"
        assert other.id in list_ids()
        assert rt.sweep({"sweep": tag, "flow": "zzz"}) == 0
        assert rt.sweep({"sweep": tag}) == 1
        assert not {h.id for h in (*mine, other)} & set(list_ids())
    finally:
        for h in (*mine, other):
            rt.destroy(h)


def check_unavailable(rt: SandboxRuntime) -> None:
    avail = rt.availability()
    assert not avail.ok and avail.why
    with pytest.raises(RuntimeUnavailable):
        rt.launch(spec("print(1)"))


def check_egress_refused(rt: SandboxRuntime) -> None:
    with pytest.raises(LaunchError, match="egress"):
        rt.launch(spec("print(1)", egress=["example.com"]))


PROBE = """
import json, os, socket, sys
port = int(sys.argv[1])
ifaces = [line.split(':')[0].strip() for line in open('/proc/net/dev').read().splitlines()[2:] if ':' in line]
try:
    s = socket.create_connection(('127.0.0.1', port), timeout=3)
    s.sendall(b'escaped')
    connect = 'connected'
except OSError as e:
    connect = type(e).__name__ + ': ' + str(e)
paths = json.loads(sys.argv[2])
seen = {p: (sorted(os.listdir(p)) if os.path.isdir(p) else None) for p in paths}
print('PROBE ' + json.dumps({'ifaces': ifaces, 'connect': connect, 'seen': seen}), flush=True)
"""


def check_confinement(rt: SandboxRuntime) -> None:
    """Only ``lo`` inside, the host's loopback listener unreachable, /root and /work hidden."""
    home, repo = Path.home(), REPO
    look = [str(home), str(repo), str(repo.parent)]
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        s = spec("")
        s.command = [sys.executable, "-c", PROBE, str(port), json.dumps(look)]
        h = rt.launch(s)
        try:
            st = wait_terminal(rt, h)
            out = rt.logs(h)
            assert st.phase == "succeeded", (st, out)
            line = next(ln for ln in out.splitlines() if ln.startswith("PROBE "))
            probe = json.loads(line[len("PROBE ") :])
        finally:
            rt.destroy(h)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing from the sandbox ever reached the host's loopback
    assert probe["ifaces"] == ["lo"], probe
    assert probe["connect"] != "connected", probe
    # What the sandbox may see of these host directories: only the path components of its
    # read-only mounts (the interpreter under ~/.pyenv, the virtualenv in the repo).
    mounted = [os.path.normpath(p) for p in {sys.prefix, sys.base_prefix, os.path.realpath(sys.executable)}]
    for d, names in probe["seen"].items():
        if names is None:
            continue
        allowed = {Path(m).relative_to(d).parts[0] for m in mounted if m.startswith(d.rstrip("/") + "/")}
        hidden = set(os.listdir(d)) - allowed
        assert not hidden & set(names), f"host entries of {d} visible inside: {sorted(hidden & set(names))}"
    assert not (repo / "pyproject.toml").exists() or "pyproject.toml" not in (probe["seen"][str(repo)] or [])


def check_shared_memory(rt: SandboxRuntime, tmp_path: Path) -> None:
    """multiprocessing's locks and queues (POSIX semaphores and shared memory in /dev/shm)
    work for the workload's user, behind the guest runner as a task runs: a
    ProcessPoolExecutor (a data task's usual parallelism) failed with EACCES."""
    from guest_runner.conduit import LocalConduit
    from prefect_resoluto.node.drive import drive_node
    from prefect_resoluto.node.spec import NodeSpec

    code = (
        "import os\n"
        "from concurrent.futures import ProcessPoolExecutor\n"
        "with ProcessPoolExecutor(2) as pool:\n"
        "    got = list(pool.map(abs, [-1, -2, -3]))\n"
        "open('pool.txt', 'w').write(f'{os.getuid()} {got}')\n"
    )
    node = NodeSpec(
        run_id="run-shm",
        node_id=new_id(),
        argv=["python3", "-c", code],
        outputs_dir=tmp_path / "out",
        output_paths=["pool.txt"],
        resources=Resources.from_quantities(memory="512Mi", cpus="1"),
    )
    outcome = drive_node(node, LocalConduit(tmp_path / "conduit"), rt, min_isolation="none")
    assert outcome.ok, outcome.describe()
    uid, got = (tmp_path / "out" / "pool.txt").read_text().split(" ", 1)
    assert got == "[1, 2, 3]"
    assert uid != "0" or os.geteuid() != 0, "the workload ran as root: the check is not of its user"


#: A host that drives one node whose workload (and a child of it) sleeps for ten minutes, and
#: says when the sandbox runs it; argv: conduit dir, node id, labels' tag, the bound.
DEATH_HOST = """
import sys
from {module} import {cls} as Runtime
from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec

conduit, node, tag, bound = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
work = "import subprocess, time; subprocess.Popen(['sleep', '600']); print('working', flush=True); time.sleep(600)"
spec = NodeSpec(
    run_id="run-death", node_id=node, argv=["python3", "-c", work], labels={{"death": tag}},
    host_lost_after=bound, host_heartbeat_interval=bound / 4,
)
def event(ev):
    if "working" in str(ev.get("data")):
        print("WORKING", flush=True)
drive_node(
    spec, LocalConduit(conduit), Runtime(), min_isolation="none", on_event=event,
    on_launch=lambda h: print("LAUNCHED", h.id, flush=True),
)
"""


def _group_alive(pgid: int) -> bool:
    """Any process (not a zombie) of the process group ``pgid`` left on this host."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        if fields[0] != b"Z" and int(fields[2]) == pgid:
            return True
    return False


def check_host_death(rt: SandboxRuntime, tmp_path: Path, running: Callable[[str], bool]) -> float:
    """A host killed with SIGKILL while its node works: the sandbox ends by itself within the
    bound (no sweep, no destroy: nobody is left to call them). Returns the seconds it took."""
    bound, tag = 2.0, uuid.uuid4().hex[:8]
    code = DEATH_HOST.format(module=type(rt).__module__, cls=type(rt).__name__)
    host = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "conduit"), new_id("n"), tag, str(bound)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(host.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        wait_for(lambda: "WORKING\n" in lines or host.poll() is not None, 120, "the node's workload to run")
        assert host.poll() is None, "".join(lines)
        sid = next(ln.split()[1] for ln in lines if ln.startswith("LAUNCHED "))
        assert running(sid), "".join(lines)
        host.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        host.wait(30)
        # A hang detector far above the bound: without the heartbeat it would be ten minutes.
        wait_for(lambda: not running(sid), 15 * bound + 30, f"sandbox {sid} to end after its host died")
        return time.monotonic() - killed
    finally:
        if host.poll() is None:
            host.kill()
            host.wait(30)
        rt.sweep({"death": tag})


# ----------------------------------------------------------------------------- the contract


# The contract's checks that launch a sandbox: they take the subclass's ``launch_marks``.
_LAUNCHING = (
    "test_success_writes_conduit_and_logs",
    "test_failure_exit_code",
    "test_killed_from_outside",
    "test_destroy_idempotent",
    "test_sweep_by_labels",
    "test_only_loopback_and_host_hidden",
    "test_host_death_ends_the_sandbox",
    "test_the_workloads_user_has_shared_memory",
)


class RuntimeContract:
    """The checks every local runtime passes; not collected itself (no ``Test`` prefix)."""

    #: Marks for the checks that launch (not for :meth:`test_unavailable_binary`, which does not).
    launch_marks: ClassVar[tuple[pytest.MarkDecorator, ...]] = ()

    def unavailable(self) -> SandboxRuntime:
        """This runtime with what it runs missing (a binary, an interpreter)."""
        raise NotImplementedError

    def pid_of(self, rt: Any, h: SandboxHandle) -> int:
        """The host process whose death ends the sandbox."""
        return int(h.data["pid"])

    def list_ids(self, rt: Any) -> list[str]:
        """Every sandbox of this runtime the host can still see."""
        return list(rt.list_ids())

    def after_sweep(self, rt: Any) -> None:
        """What must be gone once :meth:`test_sweep_by_labels` has swept its sandboxes."""

    def running(self, rt: Any, sandbox_id: str) -> bool:
        """Whether anything of the sandbox still runs on this host, seen from another process
        than the one that launched it: its child's process group (the runtimes start it in a
        session of its own)."""
        from prefect_resoluto.host.state import SandboxRecord, sandbox_dir

        rec = SandboxRecord.load(sandbox_dir(rt.state, sandbox_id))
        return rec is not None and rec.pid is not None and _group_alive(rec.pid)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        marks = cls.__dict__.get("launch_marks", ())
        for name in _LAUNCHING:
            if marks and hasattr(cls, name):
                setattr(cls, name, _marked(getattr(cls, name), marks))

    def test_success_writes_conduit_and_logs(self, rt: SandboxRuntime, tmp_path: Path) -> None:
        check_success(rt, tmp_path)

    def test_failure_exit_code(self, rt: SandboxRuntime) -> None:
        check_failure(rt)

    def test_killed_from_outside(self, rt: SandboxRuntime) -> None:
        check_killed_from_outside(rt, lambda h: self.pid_of(rt, h))

    def test_destroy_idempotent(self, rt: SandboxRuntime) -> None:
        check_destroy_idempotent(rt, lambda: self.list_ids(rt))

    def test_sweep_by_labels(self, rt: SandboxRuntime) -> None:
        check_sweep(rt, lambda: self.list_ids(rt))
        self.after_sweep(rt)

    def test_host_death_ends_the_sandbox(self, rt: SandboxRuntime, tmp_path: Path) -> None:
        check_host_death(rt, tmp_path, lambda sid: self.running(rt, sid))

    def test_unavailable_binary(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("RESOLUTO_STATE_DIR", str(tmp_path / "state"))
        check_unavailable(self.unavailable())


class ConfinedRuntimeContract(RuntimeContract):
    """The contract of a runtime that isolates: the process runtime confines nothing."""

    def test_only_loopback_and_host_hidden(self, rt: SandboxRuntime) -> None:
        check_confinement(rt)

    def test_the_workloads_user_has_shared_memory(self, rt: SandboxRuntime, tmp_path: Path) -> None:
        check_shared_memory(rt, tmp_path)


def _marked(fn: Any, marks: tuple[pytest.MarkDecorator, ...]) -> Any:
    """A copy of the contract's check ``fn`` carrying ``marks``: marking ``fn`` itself would
    mark it for every runtime (the process runtime's checks are no sandbox)."""
    fn = getattr(fn, "__contract_check__", fn)
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__qualname__, copy.__doc__, copy.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    copy.__contract_check__ = fn  # type: ignore[attr-defined]
    for mark in marks:
        copy = mark(copy)
    return copy
