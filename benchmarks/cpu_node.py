"""Sandbox CPU of one node (``cpu per node``): what a sandbox's cgroup ``cpuacct`` counted
from its start (boot or restore) to its destroy, for the whole sandbox (runsc, gofer,
sentry and every guest process); the host's own share (Prefect's engine, the driver, a
restored sandbox's reaper) is not in it.

Used by ``_pool_child.py``, which runs the trivial task through ResolutoTaskRunner: every
gVisor sandbox is read just before ``destroy`` (its cgroup outlives runsc's own, see
``runtimes/_cgroup.py``), labelled cold / warm (assigned) / idle; and by ``bare_cpu`` for
``runsc run python -c pass`` of the runtime's own bundle in a cgroup made for it.
"""

from __future__ import annotations

import subprocess
import threading
import uuid
from pathlib import Path
from typing import Any

from common import TRIVIAL

from prefect_resoluto.runtimes import _cgroup
from prefect_resoluto.runtimes._guest_layout import SandboxRecord, sandbox_dir
from prefect_resoluto.runtimes.base import LaunchSpec, Resources
from prefect_resoluto.warm.pool import LABEL_WARM

#: (sandbox id, "cold" | "assigned" | "idle", CPU seconds), in destroy order.
RECORDED: list[tuple[str, str, float]] = []
_LOCK = threading.Lock()


def usage_s(cgroup_name: str) -> float | None:
    cg = _cgroup.existing(cgroup_name)
    for d in cg.dirs if cg else []:
        for name, scale in (("cpuacct.usage", 1e-9), ("cpu.stat", 1e-6)):
            p = Path(d) / name
            if not p.exists():
                continue
            text = p.read_text()
            if name == "cpu.stat":  # v2; v1's cpu controller has a cpu.stat without usage
                fields = dict(line.split()[:2] for line in text.splitlines() if line.strip())
                if "usage_usec" in fields:
                    return int(fields["usage_usec"]) * scale
                continue
            return int(text) * scale
    return None


def record_destroys() -> None:
    """From now on, note every gVisor sandbox's CPU just before it is destroyed."""
    from prefect_resoluto.runtimes.gvisor import GVisorRuntime

    original = GVisorRuntime._destroy

    def _destroy(self: GVisorRuntime, sandbox_id: str) -> None:
        rec = SandboxRecord.load(sandbox_dir(self.state, sandbox_id))
        cpu = usage_s(self._cgroup_name(sandbox_id))
        if rec is not None and cpu is not None:
            kind = rec.labels.get(LABEL_WARM, "cold")
            with _LOCK:
                RECORDED.append((sandbox_id, kind, cpu))
        original(self, sandbox_id)

    GVisorRuntime._destroy = _destroy  # type: ignore[method-assign]


def mark() -> int:
    with _LOCK:
        return len(RECORDED)


def since(start: int, kind: str) -> list[float]:
    with _LOCK:
        return [cpu for _, k, cpu in RECORDED[start:] if k == kind]


def bare_cpu(rt: Any, work: Path, n: int) -> list[float]:
    """CPU seconds of ``n`` bare ``runsc run python -c pass`` (the runtime's bundle), each in
    a fresh cgroup of its own."""
    out = []
    for i in range(n + 1):
        spec = LaunchSpec(sandbox_id=f"bare-cpu-{uuid.uuid4().hex[:8]}", env={}, command=list(TRIVIAL))
        d = work / spec.sandbox_id
        d.mkdir(parents=True)
        name = rt._cgroup_name(spec.sandbox_id)
        _cgroup.create(name, Resources())
        try:
            prep = rt._prepare(spec, d)
            res = subprocess.run(
                prep.argv, env=prep.env, cwd=prep.cwd, stdin=subprocess.DEVNULL, capture_output=True
            )
            if res.returncode != 0:
                raise RuntimeError(f"bare runsc run failed: {res.stderr.decode(errors='replace')[-400:]}")
            cpu = usage_s(name)
        finally:
            cg = _cgroup.existing(name)
            if cg is not None:
                cg.remove()
        if i and cpu is not None:  # the first pays first-run costs
            out.append(cpu)
    return out
