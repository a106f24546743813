"""The workload runs as another, unprivileged user than the runner.

The runner holds what the workload must not have: the conduit's credentials (removed
from the workload's environment, but still in the runner's), and the conduit directory
itself (events, result, manifest: the host's evidence). Removing a variable from a
child's environment is not enough when the child runs as the same user: it can read
``/proc/<runner>/environ`` and ``/proc/<runner>/mem``, ptrace the runner, or write
into the conduit directory. So, with ``RESOLUTO_WORKLOAD_USER=<uid>:<gid>`` (set by the
local runtimes):

* the runner's initial environment block (what ``/proc/<pid>/environ`` shows; gVisor
  serves that file to every user, mode 0444) is overwritten with zeros once the
  runner has its own copy, so no credential is left there to read;
* the runner itself gets ``no_new_privs``, an empty capability bounding set (nothing
  it starts can gain a capability) and is made non-dumpable (its ``/proc`` files and
  memory belong to root, and no other user may ptrace it);
* every process the node starts for the user — setup, workload, cleanup, a warm
  sandbox's pre-started call process — runs as that uid/gid, supplementary groups
  cleared; a uid change from root clears every capability;
* the workspace is given to that user after the inputs are staged;
* with ``RESOLUTO_WORKLOAD_PIDNS=1`` (the sandbox is its own PID namespace, so every
  process of that user is the node's) whatever a phase left running is killed when
  it ends, in whatever session or process group it put itself: the setup's before
  the workload starts, the workload's before the runner reads its outputs (so
  nothing can swap a file for a link while the runner reads it). Without a user of its
  own but as its PID namespace's init (pid 1: a Kubernetes pod's container), the runner
  kills every other process there at the same points.

Without the variable nothing changes (the reference runner's behaviour; Kubernetes
pods and Solari VMs start the runner as a non-root user already). A variable the runner
cannot honour (not root, no CAP_SETUID) fails the node before anything runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Dict, Mapping, Optional, Tuple

from guest_runner.wire import ENV_WORKLOAD_PIDNS, ENV_WORKLOAD_USER

USER_ENV = ENV_WORKLOAD_USER
PIDNS_ENV = ENV_WORKLOAD_PIDNS
#: The conventional unprivileged account (``nobody``/``nogroup`` in the host's /etc/passwd).
DEFAULT_USER = (65534, 65534)

_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_GET_NO_NEW_PRIVS = 39
_CAP_CHOWN, _CAP_SETGID, _CAP_SETUID = 0, 6, 7

_user: Optional[Tuple[int, int]] = None
_pidns = False
_hardened = False  # this process's hardening is done (it is permanent: never twice)
_libc: Any = None


class PrivsepError(RuntimeError):
    """The workload cannot be run as the configured user."""


def parse(env: Mapping[str, str]) -> Optional[Tuple[int, int]]:
    raw = env.get(USER_ENV, "")
    if not raw:
        return None
    try:
        uid_s, _, gid_s = raw.partition(":")
        uid, gid = int(uid_s), int(gid_s or uid_s)
    except ValueError:
        raise PrivsepError(f"{USER_ENV} must be '<uid>:<gid>', got {raw[:40]!r}") from None
    if uid <= 0 or gid <= 0:
        raise PrivsepError(f"{USER_ENV} must name an unprivileged uid and gid (> 0), got {raw!r}")
    return uid, gid


def _c() -> Any:
    """libc, loaded once (a warm guest hardens at boot and reads its node's settings later)."""
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _prctl(option: int, arg: int = 0) -> int:
    import ctypes

    rc = int(_c().prctl(option, arg, 0, 0, 0))
    if rc < 0:
        raise OSError(ctypes.get_errno(), f"prctl({option})")
    return rc


def _effective_caps() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return 0


def configure(env: Mapping[str, str]) -> Optional[Tuple[int, int]]:
    """Read the workload user from ``env`` and harden this (the runner's) process.
    Idempotent. Raises PrivsepError when the user is set but cannot be switched to."""
    global _user, _pidns, _hardened
    user = parse(env)
    _pidns = env.get(PIDNS_ENV) == "1"
    if user is None:
        _user = None
        return None
    if _hardened:  # a warm guest at its assignment: every step below is already in force
        _user = user
        return user
    if os.geteuid() != 0:
        raise PrivsepError(
            f"{USER_ENV}={user[0]}:{user[1]} but the runner is not root (uid {os.geteuid()}): "
            "it cannot start the workload as another user"
        )
    caps = _effective_caps()
    missing = [
        n
        for n, c in (("CAP_SETUID", _CAP_SETUID), ("CAP_SETGID", _CAP_SETGID), ("CAP_CHOWN", _CAP_CHOWN))
        if not caps >> c & 1
    ]
    if missing:
        raise PrivsepError(
            f"{USER_ENV} is set but the runner lacks {', '.join(missing)}: it cannot start the "
            "workload as another user (the sandbox's capabilities are too few)"
        )
    try:
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)
        if _prctl(_PR_GET_NO_NEW_PRIVS) != 1:
            raise OSError("no_new_privs did not stick")
        _prctl(_PR_SET_DUMPABLE, 0)
    except (OSError, AttributeError, ImportError) as e:
        raise PrivsepError(f"cannot harden the runner before starting the workload: {e}") from None
    _drop_bounding_set()
    _clear_inheritable()
    _scrub_initial_environ()
    _user = user
    _hardened = True
    return user


def _clear_inheritable() -> None:
    """No inheritable (hence no ambient) capability: none can pass to what the runner starts."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [
            ("effective", ctypes.c_uint32),
            ("permitted", ctypes.c_uint32),
            ("inheritable", ctypes.c_uint32),
        ]

    libc = _c()
    hdr = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    data = (Data * 2)()
    if libc.capget(ctypes.byref(hdr), data) != 0:
        raise PrivsepError(f"capget failed (errno {ctypes.get_errno()})")
    if not (data[0].inheritable or data[1].inheritable):
        return
    data[0].inheritable = data[1].inheritable = 0
    if libc.capset(ctypes.byref(hdr), data) != 0:
        raise PrivsepError(f"cannot clear the runner's inheritable capabilities (errno {ctypes.get_errno()})")


def _scrub_initial_environ() -> None:
    """Zero the block the kernel copied the environment into at exec (after libc's
    ``environ`` has been pointed at heap copies, so ``getenv`` keeps working)."""
    import ctypes

    try:
        with open("/proc/self/environ", "rb") as f:
            block = f.read()
    except OSError:
        return
    if not block.strip(b"\0"):
        return
    libc = _c()
    array = ctypes.c_void_p.in_dll(libc, "environ").value
    if not array:
        raise PrivsepError("cannot find the runner's environment to scrub it")
    pointers = []
    entry = ctypes.cast(array, ctypes.POINTER(ctypes.c_void_p))
    i = 0
    while entry[i]:
        pointers.append(int(entry[i]))
        i += 1
    start = min(pointers) if pointers else 0
    if not start or ctypes.string_at(start, len(block)) != block:
        raise PrivsepError("the runner's environment is not where the kernel says: cannot scrub it")
    for k, v in os.environ.items():
        os.putenv(k, v)  # a heap copy: libc's environ no longer points into the block
    i = 0
    while entry[i]:
        if start <= int(entry[i]) < start + len(block):
            raise PrivsepError("an environment entry is still in the exec block: cannot scrub it")
        i += 1
    ctypes.memset(start, 0, len(block))


def _drop_bounding_set() -> None:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read().strip())
    except (OSError, ValueError):
        last = 40
    for cap in range(last + 1):
        try:
            _prctl(_PR_CAPBSET_DROP, cap)
        except OSError:
            return  # no CAP_SETPCAP: the runtime's own bounding set stands (gVisor: the runner's few)


def hardened() -> bool:
    """Whether this process has been hardened (by :func:`configure`)."""
    return _hardened


def user() -> Optional[Tuple[int, int]]:
    return _user


def popen_kwargs() -> Dict[str, Any]:
    """What ``subprocess.Popen`` needs to start a process as the workload user (done in
    the child between fork and exec, by CPython's C code: no Python runs there)."""
    if _user is None:
        return {}
    return {"user": _user[0], "group": _user[1], "extra_groups": []}


def drop_now() -> None:
    """Become the workload user in this process (a fork of the runner that will run the
    workload's code itself: a warm sandbox's call process). No way back: a uid change
    from root clears every capability."""
    if _user is None:
        return
    uid, gid = _user
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getgroups() not in ([], [gid]):
        os._exit(70)  # never run the workload with any privilege left
    try:
        _prctl(_PR_SET_DUMPABLE, 1)  # as an exec'd process would be: its own /proc is its own
    except OSError:
        pass


def give(path: str) -> None:
    """Hand ``path`` and everything under it to the workload user (links themselves,
    never followed). The tree is the runner's own at this point: staged inputs."""
    if _user is None:
        return
    uid, gid = _user
    os.chown(path, uid, gid, follow_symlinks=False)
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, gid, follow_symlinks=False)


def kill_leftovers() -> None:
    """Kill every process of the workload user (only in a sandbox that is its own PID
    namespace, where that is exactly what the phase that just ended left running: a
    ``setsid()`` or a new process group changes nothing)."""
    if _user is None or not _pidns:
        if os.getpid() == 1:
            _kill_all_but_init()
            _wait_dead(None)
        return
    if _only_this_process():
        # Nothing else runs in this PID namespace, so nothing of the workload's can start
        # again (only a running process creates one): no process to start for the kill.
        return
    # kill(-1) from a process of that user: every process it may signal but itself.
    try:
        _kill_all_as_user()
    except OSError as e:  # the outputs are not read while something of the workload may run
        raise PrivsepError(f"cannot stop what the phase left running: {e}") from None
    _wait_dead(_user[0])


#: Seconds the runner waits for the killed processes to be gone before the next phase.
DEAD_WITHIN = 5.0


def _wait_dead(uid: Optional[int]) -> None:
    """kill(2) returns once the signal is sent, not once its targets are gone: one still on
    a CPU shows as running for a moment. Wait until every other process of this PID
    namespace (of ``uid``, when given) is a zombie or gone, so the next phase never sees one
    (bounded: a process the kernel is slow to take down does not hold the node)."""
    import time

    me = os.getpid()
    end = time.monotonic() + DEAD_WITHIN
    while _any_alive(me, uid) and time.monotonic() < end:
        time.sleep(0.001)  # the kernel's exit path, a few scheduler ticks at most


def _any_alive(me: int, uid: Optional[int]) -> bool:
    from guest_runner.procs import live

    for pid in live():
        if pid == me:
            continue
        try:
            if uid is not None and os.stat(f"/proc/{pid}").st_uid != uid:
                continue
        except OSError:
            continue  # gone meanwhile
        return True
    return False


def _kill_all_but_init() -> None:
    """The runner is its PID namespace's init (a Kubernetes pod's container, which runs the
    workload as the runner's own user): every other process here is the node's, and
    kill(-1) from init reaches each of them but init itself."""
    import signal

    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass  # nothing else runs here
    except OSError as e:
        raise PrivsepError(f"cannot stop what the phase left running: {e}") from None


def _only_this_process() -> bool:
    """True when /proc lists no process but this one (its threads are not listed there).
    Any doubt (no /proc, an unreadable listing) is False: the kill then runs as before."""
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except (OSError, ValueError):
        return False
    return pids == [os.getpid()]


def _kill_all_as_user() -> None:
    # A shell's kill builtin: far cheaper than an interpreter start in gVisor.
    argv = (
        ["/bin/sh", "-c", "kill -9 -1 2>/dev/null; exit 0"]
        if os.path.exists("/bin/sh")
        else [sys.executable, "-S", "-I", "-c", "import os\ntry: os.kill(-1, 9)\nexcept OSError: pass"]
    )
    subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={"PATH": "/usr/bin:/bin"},
        check=False,
        **popen_kwargs(),
    )
