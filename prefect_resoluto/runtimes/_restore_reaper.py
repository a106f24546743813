"""``python -I -S _restore_reaper.py <runsc restore argv> -- <runsc delete argv>``.

Runs ``runsc restore`` and then deletes its container, as ``runsc run`` does by itself.
``runsc restore`` leaves the container (and its gofer process) behind when it exits, and
``runsc delete`` then waits, polling, until the orphaned gofer's zombie is reaped by PID 1:
seconds on machines whose init reaps lazily. So this process is the *child subreaper* of
what it starts: the gofer becomes its child and is reaped the moment it dies, and delete
takes milliseconds. SIGTERM: kill the container (``runsc kill``), then the same path.
Exits with ``runsc restore``'s status. Host side only; standard library only.

Where catatonit is installed (scripts/setup.sh installs it) the same is a shell under it
(``gvisor._REAP_SH``): this interpreter's start was ~12 ms of CPU at every restore.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_CHILD_SUBREAPER = 36


def _spawn(argv: list[str], quiet: bool = False) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            if quiet:
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.execv(argv[0], argv)
        finally:
            os._exit(127)
    return pid


def main() -> None:
    args = sys.argv[1:]
    sep = args.index("--")
    restore, delete = args[:sep], args[sep + 1 :]
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    kill = [*delete[:-3], "kill", delete[-1], "KILL"]  # delete argv ends in: delete --force <id>
    kills: set[int] = set()
    signal.signal(signal.SIGTERM, lambda *_: kills.add(_spawn(kill, quiet=True)))
    child = _spawn(restore)
    code = 1
    while child or kills:  # a kill still running would re-create the container's lock file
        try:
            pid, status = os.wait()
        except InterruptedError:
            continue
        except ChildProcessError:
            break
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            child = 0
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        kills.discard(pid)
    deleter = _spawn(delete, quiet=True)
    while True:  # reap the gofer (and anything else left) while delete waits for it
        try:
            pid, _ = os.wait()
        except InterruptedError:
            continue
        except ChildProcessError:
            break
        if pid == deleter:
            break
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
