"""A warm guest: ``python -m guest_runner.warm``, started ahead of demand.

It boots with no node, no ids and no credentials: it imports the runner, prepares the
process that will run a Python task's call (:mod:`guest_runner.warmcall`: a fork of this
guest, or its own interpreter when it pre-imports packages), and then blocks on stdin, a pipe only the host holds, for one JSON line, its *assignment*::

    {"env": {...RESOLUTO_* and the user's variables...}, "secret_env": {...}}

From there it is an ordinary node (``runner.main``). Nothing of the assignment touches
the conduit or a file: a warm sandbox that is never assigned (stdin closes, the host
went away) exits without writing anything.

With ``RESOLUTO_WARM_SNAPSHOT`` it is a *template* (prefect_resoluto/warm/snapshots.py): it
prints ``resoluto warm: snapshot-ready`` where it would print that it is ready, and the
host checkpoints it there; every sandbox restored from that image wakes at the same
point, reads one wake line (nothing of a node: ``{"wake": 1}``), renews what must not be
shared between sandboxes (the random state), prints its ready line to its *own* log and
then waits for its assignment like any warm guest. stdin and stdout are the restoring
``runsc restore``'s (runsc hands the new container's stdio to the restored process).

With ``RESOLUTO_WARM_SLOT`` the node's conduit directory is mounted at that fixed path
(the host moves it to the node's canonical key path at assignment); the guest still
writes canonical keys (``run/<run>/nodes/<node>/...``, also inside ``result.json``), which
:class:`SlotConduit` maps into the slot.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from typing import IO, BinaryIO, Dict, List, Optional, Union

from guest_runner import privsep, reseed, runner, threads, wire
from guest_runner.conduit import InvalidKey, LocalConduit

SLOT_ENV = wire.ENV_WARM_SLOT
#: "1": pre-start the call interpreter; "import:<module>,...": and import those installed
#: modules in it (what the task's module imports, or what its earlier nodes did);
#: "engine": pre-start Prefect's flow-run engine instead (a worker's flow run).
CALL_ENV = wire.ENV_WARM_CALL
CALL_MODULE = "guest_runner.call"
ENGINE_MODE = wire.WARM_CALL_ENGINE
#: Set for the pre-started process in engine mode (read by guest_runner.warmcall, which
#: this module does not import: the call's interpreter never needs the runner's modules).
ENGINE_ENV = wire.ENV_WARM_ENGINE
ENGINE_MODULE = wire.WARM_ENGINE_MODULE
READY = wire.WARM_READY
#: "1": a snapshot template (see the module's doc).
SNAPSHOT_ENV = wire.ENV_WARM_SNAPSHOT
SNAPSHOT_READY = wire.WARM_SNAPSHOT_READY
WAKE = wire.WARM_WAKE
#: The runtime's own view of the sandbox, kept over the assignment's.
RUNTIME_OWNED = (wire.ENV_WORKSPACE_DIR, wire.ENV_STORE_ROOT, wire.ENV_HOST_BEAT_KEY)


class SlotConduit(LocalConduit):
    """One node's directory, mounted at ``slot``: canonical keys under ``prefix`` only."""

    def __init__(self, slot: str, prefix: str) -> None:
        super().__init__(slot, sync=False)  # a guest's conduit (see LocalConduit)
        self.prefix = prefix.rstrip("/") + "/"

    def _rel(self, key: str) -> str:
        if not key.startswith(self.prefix):
            raise InvalidKey(f"conduit key {key!r} is outside this node's prefix {self.prefix!r}")
        return key[len(self.prefix) :]

    def put(self, key: str, data: bytes, *, sync: Optional[bool] = None) -> None:
        super().put(self._rel(key), data, sync=sync)

    def get(self, key: str) -> bytes:
        return super().get(self._rel(key))

    def get_stream(self, key: str) -> BinaryIO:
        return super().get_stream(self._rel(key))

    def list_prefix(
        self,
        prefix: str,
        start_after: Optional[str] = None,
        shallow: bool = False,
        limit: Optional[int] = None,
    ) -> List[str]:
        rel = self._rel(prefix)
        after = self._rel(start_after) if start_after is not None else None
        return [self.prefix + k for k in super().list_prefix(rel, after, shallow, limit)]

    def delete_prefix(self, prefix: str) -> int:
        n = 0
        for key in self.list_prefix(prefix):
            try:
                LocalConduit.path_for(self, self._rel(key)).unlink()
                n += 1
            except FileNotFoundError:
                pass
        return n

    @property
    def url(self) -> str:
        return self.root.as_uri()


class _Prestarted:
    """The call's process (a fork of this guest, or its own interpreter), ready at boot,
    before any credential existed here."""

    def __init__(self, mode: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")  # as the runner gives every child
        if mode.startswith(wire.WARM_CALL_IMPORTS):
            env[wire.ENV_WARM_IMPORTS] = mode[len(wire.WARM_CALL_IMPORTS) :]
        self.engine = mode == ENGINE_MODE
        if self.engine:
            env[ENGINE_ENV] = "1"
        self.proc: "Optional[_Call]" = None
        try:
            # A fork saves an interpreter start; but a forked child importing a large package
            # costs more CPU than a fresh interpreter does (the real Prefect: see
            # docs/performance.md), so a call that pre-imports gets its own interpreter.
            own = wire.ENV_WARM_IMPORTS in env or self.engine
            self.proc = _exec_call(env) if own else _fork_call(env)
        except OSError:
            return  # no pre-started call: the workload starts as on a cold node
        assert self.proc.stdout is not None
        # Its READY line says its imports are done; what a pre-import printed before it (a
        # warning) goes to the sandbox's log. EOF: it failed; the workload starts afresh.
        for line in iter(self.proc.stdout.readline, b""):
            if line.strip() == READY.encode():
                return
            sys.stderr.write("resoluto warm call: " + line.decode("utf-8", "replace"))
        self.close()

    def starter(
        self, argv: List[str], cwd: Optional[str], env: Dict[str, str], own_group: bool
    ) -> "subprocess.Popen[bytes]":
        proc, self.proc = self.proc, None
        if proc is None or own_group or not self._serves(argv) or proc.poll() is not None:
            self.close(proc)
            return runner._popen(argv, cwd, env, own_group)
        assert proc.stdin is not None
        try:
            proc.stdin.write((json.dumps({"argv": argv[3:], "cwd": cwd, "env": env}) + "\n").encode())
            proc.stdin.close()
        except OSError:  # it died at boot: a fresh interpreter, as a cold node would
            self.close(proc)
            return runner._popen(argv, cwd, env, own_group)
        return proc  # type: ignore[return-value]  # what the runner uses of a Popen

    def _serves(self, argv: List[str]) -> bool:
        """Whether the pre-started process can become ``argv``: the call, or (engine mode)
        ``<this interpreter> -m prefect.engine``, the command a worker's flow run runs."""
        if not self.engine:
            return argv[1:3] == ["-m", CALL_MODULE]
        return argv[1:3] == ["-m", ENGINE_MODULE] and os.path.realpath(argv[0]) == os.path.realpath(
            sys.executable
        )

    def close(self, proc: "Optional[_Call]" = None) -> None:
        proc = proc or self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def _exec_call(env: Dict[str, str]) -> "subprocess.Popen[bytes]":
    """The call as a second interpreter: ``python -m guest_runner.warmcall``."""
    return subprocess.Popen(
        [sys.executable, "-m", "guest_runner.warmcall"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        bufsize=-1,
        **privsep.popen_kwargs(),  # the workload's user from the start, like every workload process
    )


class _Forked:
    """A forked call process, with what the runner uses of a ``Popen``."""

    def __init__(self, pid: int, stdin: int, stdout: int) -> None:
        self.pid = pid
        self.stdin: Optional[IO[bytes]] = os.fdopen(stdin, "wb")
        self.stdout: Optional[IO[bytes]] = os.fdopen(stdout, "rb")
        self.returncode: Optional[int] = None

    def _reaped(self, status: int) -> int:
        self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._reaped(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self._reaped(os.waitpid(self.pid, 0)[1])
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


_Call = Union["subprocess.Popen[bytes]", _Forked]


def _fork_call(env: Dict[str, str]) -> _Forked:
    """The call as a fork of this guest (a *zygote*): no second interpreter start, and the
    runner's modules already imported. Forked before the assignment is read, so there is
    nothing of a node here yet, let alone a secret: the boot environment holds none (the
    pool puts the conduit's address there, never a credential), stdin is still unread,
    no conduit is open and no thread runs. The child keeps only its own two pipes."""
    spec_r, spec_w = os.pipe()
    out_r, out_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the guest's code
        code = 1
        try:
            os.dup2(spec_r, 0)  # the host's assignment pipe is no longer reachable from here
            os.dup2(out_w, 1)
            os.dup2(out_w, 2)
            os.closerange(3, _max_fd())
            privsep.drop_now()  # the workload's user before any of the workload's code is imported
            os.environ.clear()
            os.environ.update(env)
            _unbuffered_stdio()  # what PYTHONUNBUFFERED gives an interpreter: lines reach the host at once
            from guest_runner import warmcall

            code = warmcall.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    os.close(spec_r)
    os.close(out_w)
    return _Forked(pid, spec_w, out_r)


def _unbuffered_stdio() -> None:
    enc, errors = sys.stdout.encoding, sys.stdout.errors
    sys.stdin = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=enc, errors=errors
    )
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False),
            encoding=enc,
            errors="backslashreplace" if fd == 2 else errors,
            write_through=True,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _max_fd() -> int:
    try:
        return max(int(fd) for fd in os.listdir("/proc/self/fd")) + 1
    except (OSError, ValueError):
        return 1024


def main() -> int:
    mode = os.environ.get(CALL_ENV, "")
    try:
        privsep.configure(os.environ)  # before the call process exists: it starts as the workload's user
    except privsep.PrivsepError:
        mode = ""  # no pre-started call; runner.main reports why the node cannot run
    call = _Prestarted(mode) if mode else None
    # Every Python node stages an inbox: the archive code (tarfile, gzip, shutil ...; ~40 ms
    # of CPU in gVisor) is imported while the sandbox waits, not on its node's path (and
    # after the fork above: the call's process never needs it).
    from guest_runner import archive  # noqa: F401

    # The node's two background threads (the shipper's, the host watch's), started while the
    # sandbox waits and restored with it: after the hardening above, and after the fork.
    threads.prestart(2)
    try:
        if os.environ.get(SNAPSHOT_ENV):
            print(SNAPSHOT_READY, flush=True)  # the host checkpoints the sandbox here
            if sys.stdin.readline().strip() != WAKE.decode().strip():
                return 0  # the template itself is never woken: it is checkpointed and deleted
            reseed.reseed()  # every sandbox restored from one image had the same state
        print(READY, flush=True)
        line = sys.stdin.readline()
        if not line.strip():
            return 0  # never assigned: nothing was written anywhere
        try:
            assigned = wire.decode_assignment(line)
        except ValueError as e:
            print(f"resoluto warm guest: bad assignment: {e}", file=sys.stderr)
            return 3
        boot = {k: v for k, v in os.environ.items() if k not in (SLOT_ENV, CALL_ENV, SNAPSHOT_ENV)}
        env = {**boot, **assigned}
        for k in RUNTIME_OWNED:
            if k in boot:
                env[k] = boot[k]
        if "PYTHONPATH" in assigned and boot.get("PYTHONPATH"):
            env["PYTHONPATH"] = f"{boot['PYTHONPATH']}:{assigned['PYTHONPATH']}"
        conduit = None
        slot = os.environ.get(SLOT_ENV)
        if slot:
            try:
                prefix = env.get(wire.ENV_STORE_PREFIX) or wire.node_prefix(
                    env.get(wire.ENV_RUN_ID, ""), env.get(wire.ENV_NODE_ID, "")
                )
            except wire.WireError as e:
                print(f"resoluto warm guest: {e}", file=sys.stderr)
                return 3
            conduit = SlotConduit(slot, prefix)
        os.environ.clear()
        os.environ.update(env)
        return runner.main(
            env,
            conduit=conduit,
            start=call.starter if call else runner._popen,
            # The host's heartbeat is outside the slot: read through the conduit's root,
            # where the runtime binds its directory read-only.
            beat_conduit=LocalConduit(env[wire.ENV_STORE_ROOT], sync=False)
            if slot and env.get(wire.ENV_STORE_ROOT)
            else None,
        )
    finally:
        if call is not None:
            call.close()


if __name__ == "__main__":
    runner.exit_now(main())
