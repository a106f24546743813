"""Process identity and per-sandbox state records: what survives the launching process.

A leaf module (stdlib only, plus :mod:`prefect_resoluto.host.paths`): the local runtimes
(:mod:`prefect_resoluto.runtimes`) and the egress network namespaces
(:mod:`prefect_resoluto.egress.netns`) both keep records here and both signal a recorded
pid only while it still belongs to the process they started; neither may import the other
for it (``runtimes.base`` consults ``egress``, so a helper living under ``runtimes`` closed
an import circle through ``egress.netns``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STATE_ENV = "RESOLUTO_STATE_DIR"
RECORD_NAME = "sandbox.json"


def state_dir(runtime: str, override: str | os.PathLike[str] | None = None) -> Path:
    """``$RESOLUTO_STATE_DIR/<runtime>`` or ``<cache dir>/sandboxes/<runtime>``."""
    if override:
        base = Path(override)
    elif os.environ.get(STATE_ENV):
        base = Path(os.environ[STATE_ENV])
    else:
        from prefect_resoluto.host.paths import cache_dir

        base = cache_dir() / "sandboxes"
    d = base / runtime
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


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
        path = Path(self.dir) / RECORD_NAME
        # A temporary name of this writer's own: two threads saving one record at once (the
        # node's status poll and the reaper's both remember an exit) shared one ".tmp", and
        # the second rename found it gone (FileNotFoundError failed a flow run).
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(self.__dict__, sort_keys=True))
        os.replace(tmp, path)  # a concurrent sweep never reads half a record

    @classmethod
    def load(cls, sandbox_dir: Path) -> SandboxRecord | None:
        try:
            data = json.loads((sandbox_dir / RECORD_NAME).read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError):
            return None


def sandbox_dir(runtime_state: Path, sandbox_id: str) -> Path:
    if "/" in sandbox_id or sandbox_id in ("", ".", ".."):
        raise ValueError(f"sandbox id {sandbox_id!r} cannot be used as a directory name")
    return runtime_state / sandbox_id


def records(runtime_state: Path) -> list[SandboxRecord]:
    out = []
    for d in sorted(runtime_state.iterdir()) if runtime_state.is_dir() else []:
        rec = SandboxRecord.load(d) if d.is_dir() else None
        if rec is not None:
            out.append(rec)
    return out


def labels_match(have: dict[str, str], want: dict[str, str]) -> bool:
    return all(have.get(k) == v for k, v in want.items())


def remove_tree(path: str | os.PathLike[str]) -> None:
    shutil.rmtree(path, ignore_errors=True)
