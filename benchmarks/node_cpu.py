"""Figure ``node cpu profile``: where the sandbox CPU of a warm trivial gVisor node goes.

A warm trivial node is what the task runner does for ``noop.submit(1)`` with a ready warm
sandbox: the pool boots ``python -m guest_runner.warm`` (its call process forked and
waiting), then ``drive_node`` assigns a Python call of the benchmarks' ``noop`` task. Its
sandbox CPU is read from the sandbox's own cgroup (``cpuacct.usage``: ``runsc``'s sandbox
and gofer processes and everything inside) at three moments: when the sandbox reports
ready (the *boot*), when the node's outcome is back (boot + *node*), and just before the
sandbox is destroyed (boot + node + the guest's *exit*). Next to it: a bare ``runsc run``
of ``python -c pass`` from the runtime's own bundle, read the same way once it exited.
Interleaved, N rounds (quick: 4), medians.

Separately from the ``cpu per node`` figure (``pool_cost``): this one splits a node into
its phases, for the before -> after of the node's own path (issue 24).

Beside them, the **restore floor** (issue 42): a template that is nothing but
``python -c`` printing a line and waiting on stdin, checkpointed once, then restored and
woken to exit, read the same way. No node of ours can be restored for less: it is what
``runsc restore`` costs before any guest code runs. The warm node's boot over it is what our
guest's image adds to a restore; its node phase, what our node path costs in a restored
sandbox.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from common import BENCH, Target, log, median, ms, scratch

from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes import _cgroup, get_runtime
from prefect_resoluto.task_runner import call_spec
from prefect_resoluto.warm.pool import WarmPool, key_for

CPUACCT = Path("/sys/fs/cgroup/cpuacct")


def _usage(rt: Any, sandbox_id: str) -> float | None:
    """Seconds of CPU the sandbox's cgroup has used (cgroup v1 ``cpuacct``; v2 ``cpu.stat``)."""
    name = rt._cgroup_name(sandbox_id)
    for path, scale in (
        (CPUACCT / _cgroup.PARENT / name / "cpuacct.usage", 1e-9),
        (_cgroup.CGROUP_FS / _cgroup.PARENT / name / "cpu.stat", 1e-6),
    ):
        try:
            text = path.read_text()
        except OSError:
            continue
        if path.name == "cpu.stat":
            for line in text.splitlines():
                k, _, v = line.partition(" ")
                if k == "usage_usec":
                    return int(v) * scale
            continue
        return int(text) * scale
    return None


def _keep_cpuacct(rt: Any) -> None:
    """Pre-create each sandbox's ``cpuacct`` cgroup (v1) as the runtime pre-creates its
    memory, pids and cpu ones: runsc deletes only the cgroups it created itself, so the
    sandbox's CPU stays readable after its last process exited."""
    if not (CPUACCT / "cgroup.procs").exists() or getattr(rt, "_bench_cpuacct", False):
        return
    before = rt._before_start

    def before_start(spec: Any) -> None:
        (CPUACCT / _cgroup.PARENT / rt._cgroup_name(spec.sandbox_id)).mkdir(parents=True, exist_ok=True)
        before(spec)

    rt._before_start = before_start
    rt._bench_cpuacct = True


def _drop_cpuacct(rt: Any, sandbox_id: str) -> None:
    try:
        (CPUACCT / _cgroup.PARENT / rt._cgroup_name(sandbox_id)).rmdir()
    except OSError:
        pass


def _workspace(work: Path) -> Path:
    ws = work / "ws"
    ws.mkdir(exist_ok=True)
    (ws / "bench_tasks.py").write_bytes((BENCH / "_bench_tasks.py").read_bytes())
    return ws


def _call_spec(ws: Path, node_id: str, env: dict[str, str] | None = None) -> NodeSpec:
    """The node the task runner drives for ``bench_tasks.noop.submit(1)``."""
    ref = {"file": "bench_tasks.py", "qualname": "noop"}
    return NodeSpec(
        run_id="bench-node-cpu",
        node_id=node_id,
        argv=call_spec.guest_argv(sys.executable),
        workspace=ws,
        output_paths=list(call_spec.RESULT_PATHS),
        extra_inbox={call_spec.CALL_ARCHIVE: call_spec.call_archive(ref, {"x": 1})},
        env=dict(env or {}),
    )


def warm_node(
    rt: Any, conduit: LocalConduit, ws: Path, env: dict[str, str] | None = None
) -> dict[str, float]:
    """One warm trivial node: the CPU at ready, at the outcome, and before destroy (seconds)."""
    spec = _call_spec(ws, f"warm-{uuid.uuid4().hex[:8]}", env)
    key = key_for(spec)
    # The pool checks the conduit's filesystem first; the last node's cleanup took the
    # directory with its own, empty by then.
    conduit.root.mkdir(parents=True, exist_ok=True)
    pool = WarmPool(rt, conduit, size=1)
    if not pool.enabled:
        raise RuntimeError(f"no warm pool: {pool.why_not}")
    try:
        pool.want(key, idle=1)
        deadline = time.monotonic() + 120
        while not pool.ready_count(key):
            if key in pool._broken or time.monotonic() > deadline:
                raise RuntimeError("the warm sandbox ended (or hung) before it was ready")
            time.sleep(0.01)  # polling the pool's readiness, outside every measurement
        w, _ = pool.take(key)
        assert w is not None
        with pool._lock:  # no replacement boots beside the measured node
            pool._wanted.clear()
            pool._floor.clear()
        sid = w.handle.id
        boot = _usage(rt, sid)
        seen: dict[str, float] = {}

        def reap(handle: Any) -> None:
            seen["outcome"] = _usage(rt, sid) or 0.0
            deadline = time.monotonic() + 30
            while not rt.status(handle).terminal and time.monotonic() < deadline:
                time.sleep(0.005)  # the guest's exit, read as it happens
            seen["end"] = _usage(rt, sid) or 0.0
            type(rt).destroy(rt, handle)
            _drop_cpuacct(rt, sid)

        def destroy(handle: Any) -> None:
            # The driver destroys the sandbox itself when it saw it exit before the node's
            # last object was read (a race the exit can win): read the CPU just before.
            if handle.id == sid and "end" not in seen:
                seen["end"] = seen["outcome"] = _usage(rt, sid) or 0.0
            type(rt).destroy(rt, handle)

        rt.destroy = destroy
        try:
            out = drive_node(spec, conduit, rt, warm=w, reap=reap)
        finally:
            del rt.destroy
        if not out.ok:
            raise RuntimeError(f"warm trivial node failed: {out.describe()}")
        if "end" not in seen:
            raise RuntimeError("the node's sandbox was neither reaped nor destroyed")
    finally:
        pool.close()
    if boot is None:
        raise RuntimeError("no cgroup CPU accounting for gVisor sandboxes here")
    return {
        "boot_s": boot,
        "node_s": seen["outcome"] - boot,
        "exit_s": seen["end"] - seen["outcome"],
        "total_s": seen["end"],
    }


def bare_run(rt: Any, work: Path) -> float:
    """CPU of one bare ``runsc run`` of ``python -c pass`` (the runtime's own bundle)."""
    from prefect_resoluto.runtimes.base import LaunchSpec

    sid = f"bare-{uuid.uuid4().hex[:8]}"
    spec = LaunchSpec(sandbox_id=sid, env={}, command=[sys.executable, "-c", "pass"])
    d = work / sid
    d.mkdir()
    rt._before_start(spec)  # the cgroup runsc joins, pre-created as for a node
    prep = rt._prepare(spec, d)
    # The cgroups are pre-created (_keep_cpuacct), so they outlive runsc's exit until read.
    res = subprocess.run(prep.argv, env=prep.env, cwd=prep.cwd, stdin=subprocess.DEVNULL, capture_output=True)
    if res.returncode != 0:
        raise RuntimeError(
            f"bare runsc run failed ({res.returncode}): {res.stderr.decode(errors='replace')[-800:]}"
        )
    used = _usage(rt, sid)
    _drop_cpuacct(rt, sid)
    cg = _cgroup.existing(rt._cgroup_name(sid))
    if cg is not None:
        cg.remove()
    if used is None:
        raise RuntimeError("no cgroup CPU accounting for the bare run")
    return used


#: The restore floor's template: a line when it is ready, then a wait on stdin, then exit.
FLOOR_PROGRAM = "import sys; print('ready', flush=True); sys.stdin.readline()"


def _floor_spec(sandbox_id: str) -> Any:
    from prefect_resoluto.runtimes.base import LaunchSpec

    return LaunchSpec(
        sandbox_id=sandbox_id, env={}, command=[sys.executable, "-c", FLOOR_PROGRAM], hold_stdin=True
    )


def _until_exit(rt: Any, handle: Any) -> None:
    deadline = time.monotonic() + 60
    while not rt.status(handle).terminal:
        if time.monotonic() > deadline:
            raise RuntimeError("the restore floor's sandbox never exited")
        time.sleep(0.005)  # polling its exit, outside the sandbox's own CPU


def floor_image(rt: Any, work: Path) -> Path:
    """A checkpoint of :data:`FLOOR_PROGRAM`, taken once it said it is ready."""
    tpl = rt.launch(_floor_spec(f"floor-tpl-{uuid.uuid4().hex[:8]}"))
    try:
        deadline = time.monotonic() + 60
        while not rt.said(tpl, "ready"):
            if rt.status(tpl).terminal or time.monotonic() > deadline:
                raise RuntimeError(f"the restore floor's template never got ready: {rt.logs(tpl)[-400:]}")
            time.sleep(0.01)
        image = work / f"floor-image-{uuid.uuid4().hex[:6]}"
        rt.checkpoint(tpl, image)
    finally:
        rt.destroy(tpl)
    return image


def floor_restore(rt: Any, image: Path) -> float:
    """CPU of one restore of the floor's image, woken, until it exited (seconds)."""
    sid = f"floor-{uuid.uuid4().hex[:8]}"
    handle = rt.restore(_floor_spec(sid), image, wake=b"go\n")
    try:
        _until_exit(rt, handle)
        used = _usage(rt, sid)
    finally:
        rt.destroy(handle)
        _drop_cpuacct(rt, sid)
    if used is None:
        raise RuntimeError("no cgroup CPU accounting for the restored floor")
    return used


def run(quick: bool) -> dict[str, Any]:
    rt = get_runtime("gvisor")
    avail = rt.availability()
    if not avail.ok:
        return {"available": False, "why": avail.why}
    n = 4 if quick else 10
    _keep_cpuacct(rt)
    log(
        f"node cpu profile: {n} warm trivial gVisor nodes, {n} bare runsc runs and {n} restores "
        "of a bare template, interleaved"
    )
    warm: list[dict[str, float]] = []
    bare: list[float] = []
    floor: list[float] = []
    with scratch("node-cpu") as work:
        conduit = LocalConduit(Path(rt.state) / f"bench-node-cpu-{uuid.uuid4().hex[:6]}")
        try:
            ws = _workspace(work)
            warm_node(rt, conduit, ws)  # warm-up: page cache, first-run costs
            bare_run(rt, work)
            image = floor_image(rt, work)
            floor_restore(rt, image)
            for _ in range(n):
                warm.append(warm_node(rt, conduit, ws))
                bare.append(bare_run(rt, work))
                floor.append(floor_restore(rt, image))
        finally:
            shutil.rmtree(conduit.root, ignore_errors=True)
    med = {k: median(x[k] for x in warm) for k in ("boot_s", "node_s", "exit_s", "total_s")}
    return {
        "available": True,
        "n": n,
        "warm_ms": {k[:-2]: ms(v) for k, v in med.items()},
        "bare_ms": ms(median(bare)),
        "restore_floor_ms": ms(median(floor)),
        "samples": {"warm": warm, "bare": bare, "restore_floor": floor},
    }


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    if not res.get("available"):
        return [("node cpu profile", f"unavailable: {res.get('why')}")]
    w = res["warm_ms"]
    return [
        (
            "node cpu profile (gVisor)",
            f"warm trivial node {w['total']} ms of sandbox CPU = boot {w['boot']} + node {w['node']} "
            f"+ exit {w['exit']} ms; bare runsc run python -c pass {res['bare_ms']} ms "
            f"(x{round(w['total'] / res['bare_ms'], 2)}; medians of {res['n']})",
        ),
        (
            "restore floor (gVisor)",
            f"restore of a bare python -c template, woken to exit: {res['restore_floor_ms']} ms "
            f"(x{round(res['restore_floor_ms'] / res['bare_ms'], 2)} of bare runsc run); a warm node's "
            f"boot (its restore) {w['boot']} ms, its node {w['node']} ms",
        ),
    ]


# Before issue 24 (the tree at 74e49cc, interleaved with the change, docs/performance.md):
# a warm trivial node's sandbox CPU after its assignment (node + exit), and boot to end.
NODE_PATH_BEFORE_MS = 168.0
TOTAL_BEFORE_MS = 589.0


def targets(res: dict[str, Any]) -> list[Target]:
    if not res.get("available"):
        return [Target("node cpu profile", "warm node's own path", "measured", "unavailable", None)]
    w = res["warm_ms"]
    path = round(w["node"] + w["exit"], 1)
    return [
        Target(
            "node cpu profile",
            "warm trivial node: CPU after its assignment (node + exit)",
            f"<= 0.5 x before ({NODE_PATH_BEFORE_MS:g} ms)",
            f"{path} ms (x{round(path / NODE_PATH_BEFORE_MS, 2)})",
            path <= 0.5 * NODE_PATH_BEFORE_MS,
        ),
        Target(
            "node cpu profile",
            "warm trivial node: CPU boot to end",
            f"<= 0.5 x before ({TOTAL_BEFORE_MS:g} ms)",
            f"{w['total']} ms (x{round(w['total'] / TOTAL_BEFORE_MS, 2)}; bare runsc run {res['bare_ms']} ms)",
            w["total"] <= 0.5 * TOTAL_BEFORE_MS,
        ),
    ]


def samples(k: int) -> list[dict[str, float]]:
    """``k`` warm trivial nodes after one not counted (for A/B runs of two trees)."""
    rt = get_runtime("gvisor")
    _keep_cpuacct(rt)
    out = []
    with scratch("node-cpu") as work:
        conduit = LocalConduit(Path(rt.state) / f"bench-node-cpu-{uuid.uuid4().hex[:6]}")
        try:
            ws = _workspace(work)
            for i in range(k + 1):
                got = warm_node(rt, conduit, ws)
                if i:
                    out.append(got)
        finally:
            shutil.rmtree(conduit.root, ignore_errors=True)
    return out


if __name__ == "__main__":
    if "--samples" in sys.argv:
        print(json.dumps(samples(int(sys.argv[sys.argv.index("--samples") + 1]))))
    else:
        print(json.dumps(run("--quick" in sys.argv), indent=1))
