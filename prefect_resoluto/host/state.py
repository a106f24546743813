"""Process identity and per-sandbox state records: what survives the launching process.

A leaf module (stdlib only, plus :mod:`prefect_resoluto.host.paths` and
:mod:`prefect_resoluto.host.remove`): the local runtimes
(:mod:`prefect_resoluto.runtimes`) and the egress network namespaces
(:mod:`prefect_resoluto.egress.netns`) both keep records here and both signal a recorded
pid only while it still belongs to the process they started; neither may import the other
for it (``runtimes.base`` consults ``egress``, so a helper living under ``runtimes`` closed
an import circle through ``egress.netns``).

A sandbox's directory is made with its record in one step (:func:`make_sandbox_dir`) and
removed by renaming it out of the way first (:func:`discard`), so a sweep can tell garbage
from a sandbox without labels: a directory being removed, or one without a record
(:func:`sweep_leftovers`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guest_runner.conduit.local import make_dirs
from prefect_resoluto.host.remove import remove_tree as remove_tree

log = logging.getLogger("prefect_resoluto.host.state")

STATE_ENV = "RESOLUTO_STATE_DIR"
RECORD_NAME = "sandbox.json"
#: A runtime state directory's lock: shared while a sandbox's directory is made and its
#: first record written, exclusive while a sweep looks for directories without a record.
LOCK_NAME = ".lock"
#: A sandbox directory being removed is first renamed to this prefix + its id + a nonce.
TRASH_PREFIX = ".removing-"


def state_dir(runtime: str, override: str | os.PathLike[str] | None = None) -> Path:
    """``$RESOLUTO_STATE_DIR/<runtime>`` or ``<cache dir>/sandboxes/<runtime>``."""
    env = os.environ
    # Asked several times a node: worked out and made once for what it depends on
    # (make_sandbox_dir remakes it if it goes).
    key = (
        runtime,
        os.fspath(override) if override else "",
        env.get(STATE_ENV),
        env.get("XDG_CACHE_HOME"),
        env.get("HOME"),
    )
    d = _MADE.get(key)
    if d is not None:
        return d
    if override:
        base = Path(override)
    elif env.get(STATE_ENV):
        base = Path(env[STATE_ENV])
    else:
        from prefect_resoluto.host.paths import cache_dir

        base = cache_dir() / "sandboxes"
    d = base / runtime
    make_dirs(d, 0o700)
    _MADE[key] = d
    return d


_MADE: dict[tuple[str | None, ...], Path] = {}


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[19])


def same_process(pid: int | None, start_time: int | None) -> bool:
    """Whether ``pid`` is still the process we started (guards against pid reuse)."""
    if not pid:
        return False
    current = process_start_time(pid)
    if current is None:
        return False
    return start_time is None or current == start_time


def kill_group(pid: int | None, start_time: int | None, sig: int = signal.SIGKILL) -> bool:
    """Signal the process group led by ``pid`` if it is still ours; True if it was signalled."""
    if not same_process(pid, start_time):
        return False
    assert pid is not None
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        os.kill(pid, sig)
    return True


@dataclass
class SandboxRecord:
    """What survives the launching process: enough for ``sweep`` and forensics."""

    id: str
    runtime: str
    labels: dict[str, str]
    dir: str
    pid: int | None = None
    start_time: int | None = None
    created: float = field(default_factory=time.time)
    exit_code: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def save(self) -> None:
        path = os.path.join(self.dir, RECORD_NAME)
        # A temporary name of this writer's own: two threads saving one record at once (the
        # node's status poll and the reaper's both remember an exit) shared one ".tmp", and
        # the second rename found it gone (FileNotFoundError failed a flow run).
        tmp = os.path.join(self.dir, f".sandbox.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps(self.__dict__, sort_keys=True))
        os.replace(tmp, path)  # a concurrent sweep never reads half a record

    @classmethod
    def load(cls, sandbox_dir: Path) -> SandboxRecord | None:
        try:
            data = json.loads((sandbox_dir / RECORD_NAME).read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError):
            return None


def sandbox_dir(runtime_state: Path, sandbox_id: str) -> Path:
    # A leading dot is the state directory's own (its lock, directories being removed).
    if "/" in sandbox_id or "\0" in sandbox_id or sandbox_id.startswith(".") or not sandbox_id:
        raise ValueError(f"sandbox id {sandbox_id!r} cannot be used as a directory name")
    return runtime_state / sandbox_id


def records(runtime_state: Path) -> list[SandboxRecord]:
    out = []
    for d in sorted(runtime_state.iterdir()) if runtime_state.is_dir() else []:
        rec = SandboxRecord.load(d) if d.is_dir() and not d.name.startswith(".") else None
        if rec is not None:
            out.append(rec)
    return out


@contextlib.contextmanager
def state_lock(runtime_state: Path, *, exclusive: bool) -> Iterator[None]:
    """The state directory's lock (:data:`LOCK_NAME`), across processes."""
    fd = os.open(runtime_state / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


def make_sandbox_dir(record: SandboxRecord) -> Path:
    """Create the sandbox's directory (FileExistsError if there is one) with its record in
    it, as one step for :func:`sweep_leftovers`: a directory without a record is garbage."""
    d = Path(record.dir)
    try:
        return _make_recorded(d, record)
    except FileNotFoundError:  # the state directory went since state_dir() made it
        make_dirs(d.parent, 0o700)
        return _make_recorded(d, record)


def _make_recorded(d: Path, record: SandboxRecord) -> Path:
    with state_lock(d.parent, exclusive=False):
        d.mkdir(mode=0o700)
        try:
            record.save()
        except BaseException:
            d.rmdir()
            raise
    return d


def discard(d: Path) -> bool:
    """Remove a sandbox's directory: renamed first to a name every sweep removes (a host
    killed half-way through leaves nothing a later sweep cannot find), then removed. True
    when nothing is left."""
    trash = d.with_name(f"{TRASH_PREFIX}{d.name}.{uuid.uuid4().hex[:8]}")
    try:
        os.rename(d, trash)
    except FileNotFoundError:
        return True
    except OSError as e:
        log.warning("cannot rename %s for its removal (%s): removing it in place", d, e.strerror)
        trash = d
    if remove_tree(trash):
        return True
    log.warning("could not remove all of %s: a later sweep retries", trash)
    return False


def sweep_leftovers(runtime_state: Path, keep: frozenset[str] = frozenset()) -> int:
    """Remove what dead or half-removed sandboxes left in ``runtime_state``: directories
    being removed, and directories without a record (a removal that lost the record first,
    a host killed between making a directory and recording it). ``keep``: the runtime's
    own entries, never a sandbox's. Returns how many went."""
    if not runtime_state.is_dir():
        return 0
    found: list[Path] = []
    with state_lock(runtime_state, exclusive=True), os.scandir(runtime_state) as it:
        for entry in it:
            name = entry.name
            if name.startswith(TRASH_PREFIX):
                found.append(Path(entry.path))
            elif name.startswith(".") or name in keep or not entry.is_dir(follow_symlinks=False):
                continue
            elif not os.path.lexists(os.path.join(entry.path, RECORD_NAME)):
                # Out of the way under the lock: a new sandbox may take the name at once.
                trash = runtime_state / f"{TRASH_PREFIX}{name}.{uuid.uuid4().hex[:8]}"
                with contextlib.suppress(OSError):
                    os.rename(entry.path, trash)
                    found.append(trash)
    return sum(1 for p in found if remove_tree(p))


def labels_match(have: dict[str, str], want: dict[str, str]) -> bool:
    return all(have.get(k) == v for k, v in want.items())
