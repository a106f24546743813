"""Runs in its own process: one flow of N sleeping tasks on one task runner, and what it cost
this process (the flow's own), measured from inside.

``--runner threadpool`` is Prefect's ``ThreadPoolTaskRunner``; ``process`` / ``gvisor`` are
``ResolutoTaskRunner`` on that runtime (warm pool off unless ``--pool``). The Prefect API is
the one ``PREFECT_API_URL`` names (the benchmark's own ``prefect server``), else Prefect's
ephemeral one. A warm-up flow of two tasks runs first (imports, the API's first answers),
then the measured flow: ``nap.map(range(N))`` with ``max_workers`` = N unless ``--width``.

Counted: this process's own CPU (``RUSAGE_SELF``, the sandboxes and the API server are other
processes) and its children's (``RUSAGE_CHILDREN``: the sandboxes it waited for) separately;
RSS and threads (``/proc/self/status``) sampled every ``--every`` seconds with the number of
tasks completed so far; the wall time. Writes one JSON object to ``--out``.

Diagnostics (``scale_host.py RUNNER N NAP [--profile|--cprofile|--phases]`` runs one
configuration and prints them): ``--profile`` samples the stacks of the threads ``/proc``
shows running; ``--cprofile`` profiles every thread by thread CPU time; ``--phases`` times
the node's phases (and ``SCALE_HOST_PHASES="module:Class.method,..."``) in thread CPU, per
node, with the CPU of each long-lived thread.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import resource
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

TASKS = '''\
"""Sleeping tasks of the scale benchmark (copied into a scratch workspace)."""
import time

from prefect import task


@task
def nap(x, seconds):
    time.sleep(seconds)
    return x * 2
'''


def proc_status() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "Threads"):
                out[k] = int(v.split()[0])
    return out


def cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


class Sampler:
    """RSS and threads every ``every`` seconds, with the tasks completed so far."""

    def __init__(self, every: float, profile: bool) -> None:
        self.every, self.profile = every, profile
        self.done = 0
        self.samples: list[tuple[float, int, int, int]] = []  # (t, done, rss KiB, threads)
        self.stacks: collections.Counter[str] = collections.Counter()
        self.running_samples = 0
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="scale-sampler", daemon=True)

    def task_done(self, _future: object) -> None:
        with self._lock:
            self.done += 1

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def sample(self) -> None:
        st = proc_status()
        self.samples.append((round(time.monotonic() - self._t0, 3), self.done, st["VmRSS"], st["Threads"]))

    def _loop(self) -> None:
        next_sample = 0.0
        me = threading.get_ident()
        while not self._stop.wait(0.01 if self.profile else self.every):
            if time.monotonic() >= next_sample:
                self.sample()
                next_sample = time.monotonic() + self.every
            if self.profile:
                self._profile(me)

    def _profile(self, me: int) -> None:
        """One sample of the threads that are on a CPU now (state R in /proc)."""
        natives = {t.ident: t.native_id for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            tid = natives.get(ident)
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    state = f.read().rpartition(")")[2].split()[0]
            except (OSError, IndexError):
                continue
            if state != "R":
                continue
            self.running_samples += 1
            stack = traceback.extract_stack(frame)[-12:]
            self.stacks[
                " <- ".join(f"{Path(s.filename).name}:{s.name}:{s.lineno}" for s in reversed(stack))
            ] += 1


def runner_for(args: argparse.Namespace, work: Path, ws: Path, width: int | None) -> Any:
    if args.runner == "threadpool":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=width)
    from prefect_resoluto.task_runner.runner import ResolutoTaskRunner

    return ResolutoTaskRunner(
        runtime=args.runner,
        conduit=(work / "conduit").as_uri(),
        workspace=ws,
        outputs_dir=work / "outputs",
        warm_pool=None if args.pool else 0,
        min_isolation="none" if args.runner == "process" else None,
        max_workers=width,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runner", required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--nap", type=float, default=20.0)
    ap.add_argument("--width", type=int, default=0, help="max_workers: 0 = N, -1 = the runner's default")
    ap.add_argument("--pool", action="store_true")
    ap.add_argument("--every", type=float, default=0.5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cprofile", action="store_true", help="each task's thread CPU by function")
    ap.add_argument("--phases", action="store_true", help="thread CPU of the node's phases")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from common import child_workspace

    work, ws = child_workspace("scale-host", "scale_tasks", TASKS)
    import scale_tasks  # noqa: E402  (from the workspace, so the sandbox imports it by file)
    from prefect import flow

    logging.getLogger("prefect").setLevel(logging.WARNING)
    width: int | None = None if args.width < 0 else args.width or args.n
    sampler = Sampler(args.every, args.profile)

    def run_flow(n: int, nap: float, track: bool) -> tuple[list[int], float, int]:
        runner = runner_for(args, work, ws, width)

        @flow(task_runner=runner, name="scale-host", persist_result=False)
        def scale_host() -> list[int]:
            futures = scale_tasks.nap.map(range(n), seconds=nap)
            if track:
                for f in futures:
                    f.add_done_callback(sampler.task_done)
            return [f.result() for f in futures]

        t0 = time.perf_counter()
        res = scale_host()
        return res, time.perf_counter() - t0, runner._max_workers

    out: dict[str, Any] = {"runner": args.runner, "n": args.n, "nap_s": args.nap}
    warm, out["warmup_s"], _ = run_flow(2, 0.0, False)
    assert warm == [0, 2], warm
    stats = thread_cpu_profiles() if args.cprofile else None
    phases = phase_cpu() if args.phases else None
    threads0 = thread_cpu() if args.phases else {}
    before = proc_status()
    self0, children0 = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
    sampler.start()
    main_prof = None
    if args.cprofile:
        import cProfile

        main_prof = cProfile.Profile(time.thread_time)
        main_prof.enable()
    res, wall, out["width"] = run_flow(args.n, args.nap, True)
    if main_prof is not None:
        import io
        import pstats

        main_prof.disable()
        buf = io.StringIO()
        pstats.Stats(main_prof, stream=buf).sort_stats("cumulative").print_stats(50)
        out["main_profile"] = buf.getvalue()
    sampler.stop()
    self_cpu = cpu(resource.RUSAGE_SELF) - self0
    children_cpu = cpu(resource.RUSAGE_CHILDREN) - children0
    out.update(
        wall_s=round(wall, 3),
        correct=res == [2 * i for i in range(args.n)],
        wrong=sum(1 for i, v in enumerate(res) if v != 2 * i),
        self_cpu_s=round(self_cpu, 3),
        children_cpu_s=round(children_cpu, 3),
        rss_before_kib=before["VmRSS"],
        threads_before=before["Threads"],
        samples=sampler.samples,
    )
    if args.runner not in ("threadpool",):
        out["left"] = sandboxes_left(args.runner)
    if args.profile:
        out["profile"] = {
            "running_samples": sampler.running_samples,
            "top": sampler.stacks.most_common(40),
        }
    if stats is not None:
        out["cprofile"] = stats()
    if phases is not None:
        out["phases_ms_per_node"] = {k: round(v / args.n * 1000, 2) for k, v in sorted(phases.items())}
        after = thread_cpu()
        out["phases_ms_per_node"].update(
            {
                f"thread {k}": round((v - threads0.get(k, 0.0)) / args.n * 1000, 2)
                for k, v in after.items()
                if v - threads0.get(k, 0.0) > 0.001
            }
        )
    Path(args.out).write_text(json.dumps(out))
    shutil.rmtree(work, ignore_errors=True)


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread, by name (from /proc: the threads started before any patch too)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        name = names.get(int(tid), f"native {tid}")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def phase_cpu() -> dict[str, float]:
    """Thread CPU seconds spent in each phase of a node (and around it), summed over nodes."""
    import importlib

    spent: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    targets = {
        "prefect.task_engine": ["run_task_sync"],
        "prefect_resoluto.task_runner.python_calls": ["call"],
        "prefect_resoluto.task_runner.task_node": ["node_spec"],
        "prefect_resoluto.node.drive": [
            "_drive",
            "_prepare",
            "_claim_slot",
            "_put_inbox",
            "_start_sandbox",
            "_watch",
            "_poll",
            "_check_status",
            "_finish_sandbox",
            "_outcome",
            "_collect_outputs",
        ],
        "prefect_resoluto.task_runner.background": ["_run"],
        "prefect_resoluto.task_runner.call_spec": ["call_archive", "read_outcome", "function_ref"],
    }

    def wrap(name: str, fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                with lock:
                    spent[name] += time.thread_time() - t0
                    spent["calls " + name] += 1 / 1000  # reported per node like the ms

        return timed

    for mod_name, names in targets.items():
        mod = importlib.import_module(mod_name)
        for n in names:
            setattr(mod, n, wrap(f"{mod_name.rsplit('.', 1)[-1]}.{n}", getattr(mod, n)))
    extra = os.environ.get("SCALE_HOST_PHASES", "")  # module:Class.method,... measured too
    for item in filter(None, extra.split(",")):
        mod_name, _, attr = item.partition(":")
        owner: Any = importlib.import_module(mod_name)
        *path, meth = attr.split(".")
        for p in path:
            owner = getattr(owner, p)
        setattr(owner, meth, wrap(attr, getattr(owner, meth)))
    # The runner imported these by name before the patch: rebind where it calls them.
    import prefect_resoluto.task_runner.runner as runner_mod
    import prefect_resoluto.task_runner.task_node as task_node_mod

    task_node_mod.drive = importlib.import_module("prefect_resoluto.node.drive").drive
    runner_mod.python_calls = importlib.import_module("prefect_resoluto.task_runner.python_calls")
    return spent


def thread_cpu_profiles() -> Any:
    """Profile every thread started from now on (the task runner's workers: Prefect's engine
    and what each task runs; its background threads) by thread CPU time; returns a function
    that reports the CPU per kind of thread and the merged profile."""
    import cProfile
    import io
    import pstats
    import re

    lock = threading.Lock()
    merged: list[pstats.Stats] = []
    by_name: collections.Counter[str] = collections.Counter()
    run = threading.Thread.run

    def profiled(self: threading.Thread) -> None:
        prof = cProfile.Profile(time.thread_time)
        t0 = time.thread_time()
        prof.enable()
        try:
            run(self)
        finally:
            prof.disable()
            with lock:
                by_name[re.sub(r"[-_]?\d+", "", self.name)] += time.thread_time() - t0
                if merged:
                    merged[0].add(prof)
                else:
                    merged.append(pstats.Stats(prof))

    threading.Thread.run = profiled  # type: ignore[method-assign]

    def report() -> str:
        buf = io.StringIO()
        for name, secs in by_name.most_common():
            buf.write(f"{secs:8.3f} s  {name}\n")
        if merged:
            dump = os.environ.get("SCALE_HOST_PSTATS")  # a file for pstats, to read at leisure
            if dump:
                merged[0].dump_stats(dump)
            merged[0].stream = buf  # type: ignore[attr-defined]
            merged[0].sort_stats("tottime").print_stats(45)
            by_file: collections.Counter[str] = collections.Counter()
            for (file, _line, _fn), row in merged[0].stats.items():  # type: ignore[attr-defined]
                by_file[file] += row[2]
            buf.write("tottime by file:\n")
            for file, secs in by_file.most_common(40):
                buf.write(f"{secs:8.3f} s  {file}\n")
            merged[0].sort_stats("cumulative").print_stats(os.environ.get("SCALE_HOST_FILTER", ""), 70)
            callees = os.environ.get("SCALE_HOST_CALLEES")  # a regex of functions to break down
            if callees:
                merged[0].print_callees(callees)
            callers = os.environ.get("SCALE_HOST_CALLERS")  # a regex of functions to attribute
            if callers:
                merged[0].print_callers(callers)
        return buf.getvalue()

    return report


def sandboxes_left(runtime_name: str) -> dict[str, Any]:
    """What the runtime still holds of this run's sandboxes: its state records, and for
    gVisor the containers ``runsc list`` shows under its root."""
    from prefect_resoluto.runtimes import get_runtime

    rt: Any = get_runtime(runtime_name)
    left: dict[str, Any] = {"records": len(rt.list_ids())}
    if runtime_name == "gvisor":
        import subprocess

        root = rt.state / "runsc-root"
        res = subprocess.run(
            [shutil.which("runsc") or "runsc", f"--root={root}", "list", "-quiet"],
            capture_output=True,
            text=True,
        )
        left["runsc_list"] = (
            len(res.stdout.split()) if res.returncode == 0 else f"runsc list: {res.stderr[-200:]}"
        )
    return left


if __name__ == "__main__":
    main()
