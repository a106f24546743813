"""A per-node timeline of a flow process (``_chain_child.py --timeline``): the node's own
phases on the host as wall-clock spans, the guest's events as the guest stamped them, and
the pool's restores, so one chained task reads as submit -> ... -> result in ms.

Wraps functions of the tree in place (a benchmark's child only; nothing here ships).
"""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from typing import Any

SPANS: list[tuple[str, str, float, float]] = []  # (thread, label, start, end), time.time()
MARKS: list[tuple[str, str, float]] = []  # (thread, label, at)
_lock = threading.Lock()


def _wrap(owner: Any, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                SPANS.append((threading.current_thread().name, label, t0, time.time()))

    setattr(owner, name, timed)


def mark(label: str) -> None:
    with _lock:
        MARKS.append((threading.current_thread().name, label, time.time()))


PROFILES: list[Any] = []  # cProfile of each node's own thread, when asked for


def _profiled(fn: Any) -> Any:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
        try:
            return fn(*args, **kwargs)
        finally:
            prof.disable()
            with _lock:
                PROFILES.append(prof)

    return run


def dump_profiles(path: str) -> None:
    """The nodes' profiles merged into one pstats file at ``path`` (none: nothing written)."""
    import pstats

    if PROFILES:
        pstats.Stats(*PROFILES).dump_stats(path)


def install(profile_nodes: bool = False) -> None:
    from prefect_resoluto.node import drive
    from prefect_resoluto.runtimes import gvisor
    from prefect_resoluto.task_runner import python_calls, runner, task_node
    from prefect_resoluto.warm import pool

    _wrap(runner.ResolutoTaskRunner, "submit", "submit")
    _wrap(runner.ResolutoTaskRunner, "__enter__", "runner enter")
    _wrap(runner.ResolutoTaskRunner, "__exit__", "runner exit")
    _wrap(python_calls, "call", "call (host)")
    _wrap(python_calls.call_spec, "call_archive", "call archive")
    _wrap(python_calls.call_spec, "read_outcome", "read return")
    _wrap(python_calls.reads, "secret_entries", "reads")
    _wrap(task_node.TaskNodes, "run", "node")
    if profile_nodes:  # the host's CPU of each node's own thread, from take to outcome
        task_node.TaskNodes.run = _profiled(task_node.TaskNodes.run)  # type: ignore[method-assign]
    _wrap(pool, "take_for", "take warm")
    for name in (
        "_prepare",
        "_place_warm",
        "_claim_slot",
        "_put_inbox",
        "_start_sandbox",
        "_watch",
        "_finish_sandbox",
        "_outcome",
        "_judge_result",
        "_collect_outputs",
    ):
        _wrap(drive, name, name.strip("_"))
    _wrap(task_node.TaskRunObserver, "finished", "finished (log lines)")
    _wrap(task_node.NodeArtifacts, "publish", "artifacts")
    _wrap(pool.WarmPool, "_start", "pool restore")
    _wrap(pool.WarmPool, "close", "pool close")
    _wrap(gvisor.GVisorRuntime, "destroy", "destroy")
    ev = task_node.TaskRunObserver.event

    def event(self: Any, e: Any) -> None:
        with _lock:
            MARKS.append(
                (threading.current_thread().name, f"guest {e.get('name') or ''} {e.get('event')}", e["ts"])
            )
            MARKS.append((threading.current_thread().name, f"host got {e.get('event')}", time.time()))
        ev(self, e)

    task_node.TaskRunObserver.event = event  # type: ignore[method-assign]


def report(t_start: float) -> list[str]:
    """Lines: per thread, every span and mark in ms from ``t_start``, in order."""
    by: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for th, label, a, b in SPANS:
        by[th].append((a, f"{(a - t_start) * 1000:8.1f} +{(b - a) * 1000:7.1f}  {label}"))
    for th, label, at in MARKS:
        by[th].append((at, f"{(at - t_start) * 1000:8.1f}  .         {label}"))
    out = []
    for th in sorted(by, key=lambda k: min(a for a, _ in by[k])):
        out.append(f"[{th}]")
        out += [line for _, line in sorted(by[th])]
    return out
