"""A base for runtimes whose sandbox is one child process of the host (plain process,
bubblewrap, gVisor's ``runsc run``): its exit is the sandbox's exit.

The child is started in its own session, so destroy can kill the whole tree with one
``killpg``; its stdout+stderr go to ``output.log`` in the sandbox's state directory; a
JSON record there (pid + kernel start time + labels) lets ``sweep`` in a later process
reap it without ever signalling a recycled pid.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from abc import abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, ClassVar

from prefect_resoluto import egress
from prefect_resoluto.host import state as host_state
from prefect_resoluto.runtimes import slot

from . import _cgroup
from ._guest_layout import (
    LOG_NAME,
    SandboxRecord,
    kill_group,
    labels_match,
    open_log,
    process_start_time,
    records,
    same_process,
    sandbox_dir,
    state_dir,
    tail_file,
)
from .base import (
    Availability,
    LaunchError,
    LaunchSpec,
    NotWaiting,
    Resources,
    SandboxHandle,
    SandboxRuntime,
    SandboxStatus,
)

if TYPE_CHECKING:
    from prefect_resoluto.egress import SandboxNetwork

# Children are shared by every instance in this process: get_runtime() may hand out a
# new instance per call, and status() must still see the Popen (and so the exit code).
_CHILDREN: dict[tuple[str, str], subprocess.Popen[bytes]] = {}
# Terminal statuses already worked out (an exit is read, recorded and judged once).
_TERMINAL: dict[tuple[str, str], SandboxStatus] = {}
# Status of sandboxes destroyed by this process: the last terminal status, if seen. The
# newest DESTROYED_KEPT only (oldest out first): a long-lived host destroys without end, and
# only a node still being driven asks about its sandbox after destroying it.
_DESTROYED: dict[tuple[str, str], SandboxStatus | None] = {}
DESTROYED_KEPT = 4096
_LOCK = threading.Lock()
# Sandboxes with an egress network, by (runtime, sandbox id) -> run id.
_NETWORKS: dict[tuple[str, str], str] = {}
# Warm sandboxes' stdin, kept open until their assignment (or destroy) closes it.
_STDIN: dict[tuple[str, str], IO[bytes]] = {}
# Output looked through by said(), per sandbox and line: how far, and the last bytes of it (a
# line may arrive in two pieces between two looks).
_SAID: dict[tuple[str, str, str], tuple[int, bytes]] = {}
#: The most of a sandbox's new output one look of said() reads (the ready line is its last).
SAID_WINDOW = 1 << 16

log = logging.getLogger(__name__)

LIMIT_MODES = ("auto", "cgroup", "rlimit", "none")


@dataclasses.dataclass
class Prepared:
    """What a subclass builds for one launch."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    #: Extra record fields (the runtime's own ids, bundle paths ...).
    extra: dict[str, object] = dataclasses.field(default_factory=dict)
    #: Whether host-side limits (cgroup / rlimit) should wrap argv; False when the
    #: sandbox tool enforces resources itself (gVisor).
    host_limits: bool = True
    #: Written to the child's stdin, then closed (secrets for runtimes whose config is a file).
    stdin_data: bytes | None = None
    #: Descriptors the child inherits (closed here once it has started).
    pass_fds: tuple[int, ...] = ()


class LocalChildRuntime(SandboxRuntime):
    """Shared launch/status/destroy/sweep/logs for child-process sandboxes."""

    #: Entries of the state directory that are the runtime's own, not sandboxes' (a sweep
    #: removes any other directory without a record): warm-sandbox images
    #: (``prefect_resoluto.warm.snapshots.DIR_NAME``).
    own_entries: ClassVar[frozenset[str]] = frozenset({"snapshots"})

    def __init__(self, *, state_dir: str | os.PathLike[str] | None = None, limits: str = "auto") -> None:
        if limits not in LIMIT_MODES:
            raise ValueError(f"limits must be one of {LIMIT_MODES}, got {limits!r}")
        self._state_override = state_dir
        self.limits = limits
        self._availability: Availability | None = None

    # ----------------------------------------------------------------- subclass hooks

    @abstractmethod
    def _check(self) -> Availability:
        """Probe the machine once (cached by availability())."""

    @abstractmethod
    def _prepare(self, spec: LaunchSpec, sandbox: Path, net: SandboxNetwork | None = None) -> Prepared:
        """Argv, env and cwd of the child for ``spec``; may write files under ``sandbox``.
        With ``net`` the child must run in ``net.netns`` (see :func:`network_layout`)."""

    def _before_start(self, spec: LaunchSpec) -> None:
        """Host-side set-up right before the child starts (its record already exists)."""

    def _teardown(self, sandbox_id: str, record: SandboxRecord | None, exit_code: int | None) -> None:
        """Runtime-specific cleanup before the state directory is removed. ``exit_code`` is
        the child's, if it has exited (negative: killed by that signal)."""

    def _after_teardown(self, sandbox_id: str) -> None:
        """Runtime-specific cleanup once every process of the sandbox is gone (none can make a
        file any more), before its state directory is removed."""

    def _interpret(self, handle: SandboxHandle, code: int) -> SandboxStatus | None:
        """A runtime-specific reading of a child exit code, or None for the default."""
        return None

    # ----------------------------------------------------------------- helpers

    @property
    def state(self) -> Path:
        return state_dir(self.name, self._state_override)

    def availability(self) -> Availability:
        if self._availability is None:
            self._availability = self._check()
        return self._availability

    def _limit_mode(self) -> str:
        if self.limits != "auto":
            return self.limits
        if _cgroup.detect():
            return "cgroup"
        return "rlimit" if shutil.which("prlimit") else "none"

    def limits_detail(self) -> str:
        mode = self._limit_mode()
        if mode == "cgroup":
            return f"limits: cgroup {_cgroup.detect()} (memory, pids, cpu)"
        if mode == "rlimit":
            return "limits: RLIMIT_DATA per process via prlimit (no pids/cpu limit; no writable cgroup)"
        return "limits: none"

    def _cgroup_name(self, sandbox_id: str) -> str:
        return f"{self.name}-{sandbox_id}"

    def _wrap_limits(self, argv: list[str], sandbox_id: str, r: Resources) -> tuple[list[str], bool]:
        mode = self._limit_mode()
        wants = bool(r.memory_bytes or r.pids or r.cpus)
        if mode == "cgroup" and wants:
            try:
                cg = _cgroup.create(self._cgroup_name(sandbox_id), r)
            except OSError as e:
                raise LaunchError(f"cannot create a cgroup for sandbox {sandbox_id!r}: {e}") from e
            if cg is None:
                raise LaunchError("limits='cgroup' but no writable cgroup hierarchy was found")
            return cg.enter_argv(argv), True
        if mode == "rlimit" and r.memory_bytes:
            prlimit = shutil.which("prlimit") or "prlimit"
            return [prlimit, f"--data={r.memory_bytes}:{r.memory_bytes}", "--", *argv], False
        return argv, False

    # ----------------------------------------------------------------- the seam

    def launch(self, spec: LaunchSpec) -> SandboxHandle:
        self.check_spec(spec)
        self.require_available()
        d = sandbox_dir(self.state, spec.sandbox_id)
        rec = SandboxRecord(id=spec.sandbox_id, runtime=self.name, labels=dict(spec.labels), dir=str(d))
        try:
            # With its record from the start: a sweep removes a directory without one.
            host_state.make_sandbox_dir(rec)
        except FileExistsError:
            raise LaunchError(f"a sandbox named {spec.sandbox_id!r} already exists in {self.state}") from None
        except OSError as e:
            raise LaunchError(
                f"{self.name}: cannot make the state of sandbox {spec.sandbox_id!r}: {e}"
            ) from e
        key = (self.name, spec.sandbox_id)
        try:
            request, net = self._attach_network(spec)
            prep = self._prepare(spec, d, net)
            if net is not None:
                prep.extra["egress"] = {
                    "run_id": request.run_id if request else "",
                    "netns": net.netns,
                    "env": dict(net.env),  # no secret: the proxy's address and the canary's targets
                }
            argv, cgrouped = prep.argv, False
            if prep.host_limits:
                argv, cgrouped = self._wrap_limits(argv, spec.sandbox_id, spec.resources)
            rec.extra = {**prep.extra, "cgroup": cgrouped}
            if prep.extra:
                # Before the child exists: what a sweep needs to undo the runtime's own set-up
                # after a crash right after launch. Without it the first record suffices (the
                # cgroup is found by its name): a save is a file made and renamed, per node.
                rec.save()
            self._before_start(spec)
            proc = self._start(spec, d, prep, argv)
        except (OSError, ValueError, LaunchError) as e:
            self._cleanup_failed_launch(spec.sandbox_id, d)
            if isinstance(e, LaunchError):
                raise
            raise LaunchError(f"{self.name}: could not start sandbox {spec.sandbox_id!r}: {e}") from e
        with _LOCK:
            _CHILDREN[key] = proc
            _DESTROYED.pop(key, None)
            _TERMINAL.pop(key, None)
        rec.pid, rec.start_time = proc.pid, process_start_time(proc.pid)
        rec.save()
        return SandboxHandle(
            id=spec.sandbox_id,
            runtime=self.name,
            labels=dict(spec.labels),
            data={"pid": proc.pid, "start_time": rec.start_time, "dir": str(d), **prep.extra},
        )

    def _attach_network(self, spec: LaunchSpec) -> tuple[egress.NetworkRequest | None, SandboxNetwork | None]:
        """The node's egress network, attached (None without a request)."""
        request = network_request_of(spec)
        if request is None:
            return None, None
        try:
            net = egress.attach(request, spec.sandbox_id)
        except (egress.netns.NetnsError, OSError) as e:
            raise LaunchError(
                f"{self.name}: cannot give sandbox {spec.sandbox_id!r} its egress network: {e}"
            ) from e
        with _LOCK:
            _NETWORKS[(self.name, spec.sandbox_id)] = request.run_id
        return request, net

    def _start(self, spec: LaunchSpec, d: Path, prep: Prepared, argv: list[str]) -> subprocess.Popen[bytes]:
        """The sandbox's child process, its stdin held open (a warm sandbox) or fed and closed."""
        with open_log(d / LOG_NAME) as log, _closing(prep.pass_fds):
            proc = subprocess.Popen(
                argv,
                env=prep.env,
                cwd=prep.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE
                if spec.hold_stdin or prep.stdin_data is not None
                else subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
                pass_fds=prep.pass_fds,
                # A container's umask whatever the host's (0 in some images): a guest must not
                # leave world-writable files the host then refuses as a sandbox's, nor its own
                # runtime's state be made open to every user of the host.
                umask=0o022,
            )
        if proc.stdin is not None and spec.hold_stdin:
            with _LOCK:
                _STDIN[(self.name, spec.sandbox_id)] = proc.stdin
        elif proc.stdin is not None:
            _feed(proc.stdin, prep.stdin_data or b"")
        return proc

    def network_env(self, handle: SandboxHandle) -> dict[str, str]:
        egress = handle.data.get("egress")
        env = egress.get("env") if isinstance(egress, dict) else None
        return {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {}

    def assign(self, handle: SandboxHandle, data: bytes, labels: dict[str, str] | None = None) -> None:
        key = (self.name, handle.id)
        with _LOCK:
            pipe = _STDIN.pop(key, None)
        if pipe is None:
            raise NotWaiting(
                f"sandbox {handle.id!r} is not a warm sandbox waiting for an assignment "
                "(destroyed, or assigned already)"
            )
        st = self.status(handle)
        if st.terminal or st.gone:
            # Asked before writing: a process of it still holding the pipe's other end would
            # take the line, and the node would wait on a sandbox that had already ended.
            with contextlib.suppress(OSError):
                pipe.close()
            raise NotWaiting(
                f"warm sandbox {handle.id!r} ended before its assignment ({st.reason or st.phase})"
            )
        if labels:  # sweep by flow run finds it from now on
            rec = SandboxRecord.load(sandbox_dir(self.state, handle.id))
            if rec is not None:
                rec.labels.update(labels)
                rec.save()
            handle.labels.update(labels)
        try:
            pipe.write(data)
            pipe.close()
        except OSError as e:
            raise NotWaiting(
                f"warm sandbox {handle.id!r} did not take its assignment (it has exited: "
                f"{self.status(handle).reason or e})"
            ) from e

    def _cleanup_failed_launch(self, sandbox_id: str, d: Path) -> None:
        self._detach_network(sandbox_id, None)
        cg = _cgroup.existing(self._cgroup_name(sandbox_id))
        if cg:
            _drain_cgroup(cg)
        slot.release(d / slot.SLOT_NAME)
        host_state.discard(d)

    def exit_fd(self, handle: SandboxHandle) -> int | None:
        """A pidfd of the sandbox's child (its exit is the sandbox's); None when this process
        did not start it, it has been reaped already, or the kernel has no pidfds."""
        with _LOCK:
            proc = _CHILDREN.get((self.name, handle.id))
        # An unreaped child's pid cannot be reused: the pidfd names this very child.
        if proc is None or proc.returncode is not None or not hasattr(os, "pidfd_open"):
            return None
        try:
            fd = os.pidfd_open(proc.pid)
        except OSError:
            return None
        if proc.returncode is not None:  # reaped meanwhile (a destroy): the pid is not pinned
            os.close(fd)
            return None
        return fd

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        key = (self.name, handle.id)
        with _LOCK:
            destroyed = key in _DESTROYED
            final = _DESTROYED.get(key)
            proc = _CHILDREN.get(key)
            known = _TERMINAL.get(key)
        if known is not None:
            return known
        if destroyed:
            if final is not None:
                return dataclasses.replace(final, gone=True)
            return SandboxStatus("failed", reason="sandbox was destroyed before it finished", gone=True)
        if proc is not None:
            code = _poll_and_kill_stragglers(proc)
            if code is None:
                return self._running_status(handle)
            st = self._exit_status(handle, code)
            self._remember_exit(sandbox_dir(self.state, handle.id), code)
            with _LOCK:
                _TERMINAL[key] = st
            return st
        d = sandbox_dir(self.state, handle.id)
        rec = SandboxRecord.load(d)
        if rec is None:
            return SandboxStatus("failed", reason=f"no sandbox {handle.id!r} in {self.state}", gone=True)
        if rec.exit_code is not None:
            return self._exit_status(handle, rec.exit_code)
        if same_process(rec.pid, rec.start_time):
            return self._running_status(handle)
        # Launched by another process that is gone: the exit code went with it.
        return SandboxStatus(
            "failed",
            reason="the sandbox process ended and its launcher did not record an exit status",
            infrastructure=True,
        )

    #: Whether an OOM kill in the sandbox's cgroup leaves the sandbox unable to go on while
    #: its processes live (gVisor: the host's OOM killer may take a platform stub process
    #: holding the guest's memory, and the task hangs while the guest runner still beats).
    oom_breaks_a_running_sandbox: ClassVar[bool] = False

    def _running_status(self, handle: SandboxHandle) -> SandboxStatus:
        if self.oom_breaks_a_running_sandbox:
            if _cgroup.oom_killed(self._cgroup_name(handle.id)):
                return SandboxStatus(
                    "failed",
                    reason="OOM-killed: a process of the sandbox was killed at its memory limit, "
                    "and the sandbox cannot go on without it",
                    infrastructure=True,
                    memory_exhausted=True,
                )
        return SandboxStatus("running")

    def _remember_exit(self, d: Path, code: int) -> None:
        rec = SandboxRecord.load(d)
        if rec is not None and rec.exit_code is None:
            rec.exit_code = code
            try:
                rec.save()
            except FileNotFoundError:
                pass  # destroyed meanwhile (the reaper's thread): its record went with it

    def _exit_status(
        self, handle: SandboxHandle, code: int, cg: _cgroup.Cgroup | None | bool = True
    ) -> SandboxStatus:
        """``cg``: the sandbox's cgroup when the caller has looked it up (True: ask its one
        file that counts OOM kills, found by the cgroup's name, not its directories)."""
        special = self._interpret(handle, code)
        if special is not None:
            return special
        name = self._cgroup_name(handle.id)

        def oom() -> bool:
            if cg is True:
                return _cgroup.oom_killed(name)
            return isinstance(cg, _cgroup.Cgroup) and cg.oom_killed()

        if code != 0 and oom():
            return SandboxStatus(
                "failed",
                reason="OOM-killed: the sandbox exceeded its memory limit",
                exit_code=code,
                infrastructure=True,
                memory_exhausted=True,
            )
        if code == 0:
            return SandboxStatus("succeeded", exit_code=0, memory_exhausted=oom())
        if code < 0:
            return SandboxStatus(
                "failed",
                reason=f"sandbox process killed by {_signame(-code)}",
                exit_code=code,
                infrastructure=True,
            )
        if code == 128 + signal.SIGKILL:
            # The guest runner reports user failures itself; a SIGKILL means the memory
            # limit or someone outside.
            return SandboxStatus(
                "failed",
                reason="guest killed by SIGKILL (out of memory or killed from outside)",
                exit_code=code,
                infrastructure=True,
            )
        return SandboxStatus("failed", reason=f"exit code {code}", exit_code=code)

    def destroy(self, handle: SandboxHandle) -> None:
        self._destroy(handle.id)

    def _destroy(self, sandbox_id: str) -> None:
        key = (self.name, sandbox_id)
        d = sandbox_dir(self.state, sandbox_id)
        with _LOCK:
            proc = _CHILDREN.pop(key, None)
            final: SandboxStatus | None = _TERMINAL.pop(key, None)
            pipe = _STDIN.pop(key, None)
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass
        rec = SandboxRecord.load(d)
        code = proc.poll() if proc is not None else rec.exit_code if rec is not None else None
        # An exited sandbox's cgroups are all there now; a running one's are looked up after the kill.
        cg = _cgroup.named(self._cgroup_name(sandbox_id)) if code is not None else None
        if final is None and code is not None:  # judge it now, before the evidence is removed
            final = self._exit_status(SandboxHandle(id=sandbox_id, runtime=self.name), code, cg)
        self._teardown(sandbox_id, rec, code)
        if proc is not None:
            if proc.poll() is None:
                _killpg(proc.pid)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        elif rec is not None:
            kill_group(rec.pid, rec.start_time)
        if code is None:
            cg = _cgroup.existing(self._cgroup_name(sandbox_id))
        if cg is not None:
            _drain_cgroup(cg)
        self._after_teardown(sandbox_id)
        self._detach_network(sandbox_id, rec)
        slot.release(d / slot.SLOT_NAME)  # a warm sandbox's slot, mounted in its state directory
        host_state.discard(d)  # the record goes with the rest, or the rest stays a sweep's to find
        with _LOCK:
            for said in [k for k in _SAID if k[:2] == key]:  # a look racing this destroy included
                del _SAID[said]
            # Keep the first destroy's verdict: a second destroy has nothing left to read.
            if key not in _DESTROYED and (proc is not None or rec is not None):
                _DESTROYED[key] = final
                while len(_DESTROYED) > DESTROYED_KEPT:
                    del _DESTROYED[next(iter(_DESTROYED))]

    def _detach_network(self, sandbox_id: str, rec: SandboxRecord | None) -> None:
        with _LOCK:
            run_id = _NETWORKS.pop((self.name, sandbox_id), None)
        recorded = (rec.extra.get("egress") if rec is not None else None) or {}
        if run_id is None and recorded:
            run_id = str(recorded.get("run_id", ""))
        if run_id is not None:
            egress.detach(run_id, sandbox_id)

    def sweep(self, labels: dict[str, str]) -> int:
        n = 0
        for rec in records(self.state):
            if labels_match(rec.labels, labels):
                self._destroy(rec.id)
                n += 1
        if self.capabilities.egress_allowlist:
            egress.sweep()  # namespaces of hosts that died before they could destroy
        slot.sweep_orphans()  # conduit slots of hosts that died mid-node (before their directories go)
        host_state.sweep_leftovers(self.state, self.own_entries)  # half-removed, record or not
        return n

    def list_ids(self) -> list[str]:
        """Sandboxes this runtime still holds state for (for tests and ``doctor``)."""
        return [r.id for r in records(self.state)]

    def logs(self, handle: SandboxHandle, tail: int = 200) -> str:
        return tail_file(sandbox_dir(self.state, handle.id) / LOG_NAME, tail)

    def said(self, handle: SandboxHandle, line: str) -> bool:
        """Whether ``handle``'s output so far holds ``line``. Only what the sandbox wrote since
        the last look is read: the warm pool asks every READY_LOOK for each sandbox starting,
        and a log that has not grown costs one ``stat``."""
        key = (self.name, handle.id, line)
        path = os.path.join(str(handle.data.get("dir") or sandbox_dir(self.state, handle.id)), LOG_NAME)
        with _LOCK:
            seen, carry = _SAID.get(key, (0, b""))
        try:
            size = os.stat(path).st_size
            if size == seen:
                return False
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return False  # not there (yet, or any more): nothing said
        try:
            size = os.fstat(fd).st_size
            start = seen if seen <= size else 0  # shorter than before: a new file, read afresh
            if size - start > SAID_WINDOW:
                start, carry = size - SAID_WINDOW, b""
            data = os.pread(fd, size - start, start)
        except OSError:
            return False
        finally:
            os.close(fd)
        want = line.encode()
        text = (carry if start == seen else b"") + data
        found = want in text
        with _LOCK:
            if found or (self.name, handle.id) in _DESTROYED:
                _SAID.pop(key, None)
            else:
                _SAID[key] = (start + len(data), text[-(len(want) - 1) :] if len(want) > 1 else b"")
        return found


def network_request_of(spec: LaunchSpec) -> egress.NetworkRequest | None:
    """The spec's network request; a bare ``egress`` list (a runtime used directly) becomes one."""
    if spec.network is not None or not spec.egress:
        return spec.network
    try:
        return egress.network_request(
            spec.run_id or spec.sandbox_id, spec.node_id or spec.sandbox_id, egress=spec.egress
        )
    except egress.EgressPolicyError as e:
        raise LaunchError(str(e)) from None


@contextlib.contextmanager
def _closing(fds: tuple[int, ...]) -> Iterator[None]:
    try:
        yield
    finally:
        for fd in fds:
            os.close(fd)


def _feed(pipe: IO[bytes], data: bytes) -> None:
    # A thread, so a child that never reads (failed start) cannot block launch().
    def write() -> None:
        try:
            pipe.write(data)
        except OSError:
            pass  # the child died first; its exit status tells why
        finally:
            try:
                pipe.close()
            except OSError:
                pass

    threading.Thread(target=write, name="resoluto-stdin", daemon=True).start()


def _poll_and_kill_stragglers(proc: subprocess.Popen[bytes]) -> int | None:
    """The child's exit code, or None while it runs. When it has exited, first kill what it
    left behind in its process group (a backgrounded workload of the plain process runtime):
    the un-reaped zombie still holds the pid, so the group id cannot have been reused."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        exited = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped elsewhere (Popen.wait in destroy): nothing pins the pid
        return proc.poll()
    if not exited:
        return None
    _killpg(proc.pid)
    return proc.poll()


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _drain_cgroup(cg: _cgroup.Cgroup, timeout: float = 5.0) -> None:
    if cg.remove_empty():  # an exited sandbox's, almost always: nothing to read or kill
        return
    deadline = time.monotonic() + timeout
    # One read of the members per round, the kill aimed at what it found: an exited
    # sandbox's cgroup is almost always empty, and reading cgroup.procs of every
    # controller twice (kill_all's read, then the check) was a quarter of destroy's CPU.
    # The removal is retried too: a directory left here is never looked for again (the
    # sandbox's record goes next), and empty cgroups piled up under resoluto/.
    while True:
        pids = cg.pids()
        if pids:
            _cgroup.kill(pids)
        elif cg.remove(deadline):
            return
        if time.monotonic() > deadline:
            log.warning("cgroup %s still busy after %.0fs; left in place", cg.dirs, timeout)
            return
        time.sleep(0.01)  # poll: killed processes leave the cgroup asynchronously


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
