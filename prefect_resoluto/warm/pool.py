"""Warm sandboxes: started ahead of demand, each serving exactly one node, then destroyed.

A warm sandbox boots with nothing of a node: no run or node id, no argv, no env, no
secret. It runs ``python -m guest_runner.warm``, which imports the runner, pre-starts
the call's interpreter, prints that it is ready and blocks on stdin. Assignment
(:meth:`WarmSandbox.assign`) is one JSON line on that pipe, which only the host holds:
the conduit and every file on disk stay free of it.

On a local conduit the sandbox mounts a *slot*, a directory in its own state directory
(never in the conduit). At assignment the host renames the slot to the node's canonical
directory ``run/<run>/nodes/<node>/`` (the bind mount follows the directory), so the
node's objects land at the canonical keys and nowhere else, and a sandbox that is never
assigned leaves nothing in the conduit.

On a runtime that can checkpoint (gVisor), each key's sandboxes are *restored* from one
image of a template sandbox checkpointed at the point a warm guest waits for its
assignment (:mod:`prefect_resoluto.warm.snapshots`), instead of booted; without a usable
image they boot as before.

Pools are keyed by everything fixed at launch (:class:`PoolKey`); a node whose key has
no sandbox ready gets a cold one. Nodes with egress are always cold: their network
namespace and proxy belong to the run, which a sandbox started ahead of demand cannot
know.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guest_runner import wire
from guest_runner.conduit import Conduit
from guest_runner.conduit.local import make_dirs
from prefect_resoluto.host.remove import remove_tree
from prefect_resoluto.node import heartbeat
from prefect_resoluto.runtimes import slot
from prefect_resoluto.runtimes._guest_layout import host_interpreter
from prefect_resoluto.runtimes.base import Availability, LaunchSpec, Resources, SandboxHandle, SandboxRuntime
from prefect_resoluto.warm.snapshots import CorruptImage, SnapshotError, Snapshots
from prefect_resoluto.warm.snapshots import enabled_by_env as snapshots_by_env

if TYPE_CHECKING:
    from typing import TypeAlias

    from prefect_resoluto.egress import NetworkRequest
    from prefect_resoluto.runtimes.kubernetes.warm import WarmPod, WarmPods

    #: A runner's pool: sandboxes on this host, or a runtime's own (Kubernetes: warm pods).
    AnyPool: TypeAlias = "WarmPool | WarmPods"
    #: What a node's driver is handed instead of launching: either pool's.
    AnyWarm: TypeAlias = "WarmSandbox | WarmPod"

log = logging.getLogger("prefect_resoluto.warm.pool")

LABEL_POOL = "resoluto.pool"
LABEL_WARM = "resoluto.warm"
#: Idle warm sandboxes per key when ``warm_pool`` is not set: the runner's concurrency, capped
#: (each idle sandbox holds host memory: docs/performance.md, the pool's memory).
DEFAULT_CAP = 4
#: Sandboxes booting at once: boots compete with running tasks for the same cores.
MAX_BOOTING = 2
#: Sandboxes being restored at once. A restore to ready is ~160 ms of the sandbox's CPU in
#: ~0.4 s (the rest is runsc's processes starting and the image read), so two per core keep
#: the cores busy; at MAX_BOOTING a 50-way map waited on its restores (issue 42: 2 in flight
#: x 0.4 s each is 10 s for 50 nodes, before any node ran).
MAX_RESTORING = max(MAX_BOOTING, 2 * (os.cpu_count() or 1))
#: Idle sandboxes a key keeps while nothing says more will come: before its second take, one
#: (the first task finds it ready, and a second one too). Keeping the full lookahead from the
#: start restored four sandboxes for a one-task flow and discarded three at its end: on two
#: cores, CPU every other sandbox of the host waited for.
AHEAD_FIRST = 1
#: Once a key has been taken twice (tasks one after another), the idle sandboxes it keeps
#: beyond its nodes in flight: one booted, two restored. A restore takes ~0.3-0.5 s to ready,
#: longer than a short task: a chain of them (each task waiting on the one before) would
#: otherwise find its next sandbox still restoring at every step.
AHEAD_BOOTED = 1
AHEAD_RESTORED = 2
#: Idle sandboxes a key keeps once a map or chain has drained (every task submitted has
#: started): one for a next stage, not the lookahead per node in flight that was discarded
#: unused at the end of every map (issue 42).
AHEAD_DRAINED = 1
#: Seconds a node that found no warm sandbox counts as demand for its key.
MISS_WINDOW = 5.0
READY = wire.WARM_READY
SNAPSHOT_READY = wire.WARM_SNAPSHOT_READY
WAKE = wire.WARM_WAKE
SNAPSHOT_ENV = wire.ENV_WARM_SNAPSHOT
#: Seconds between looks at a starting sandbox's log for its ready line (the refill thread).
READY_LOOK = 0.02
#: Seconds between a waiting node's own looks for a ready sandbox while the refill thread
#: looks and tells it (each waiting node looking every READY_LOOK too was the same work done
#: twice).
TAKE_LOOK = 0.25
#: Seconds between looks at whether a starting sandbox died before its ready line (a status
#: read, ten times a log look's cost): a death is rare, and found this late at worst.
DEATH_LOOK = 0.25
#: Seconds close() waits for one idle sandbox's destroy before it goes on to the sweep.
DISCARD_WAIT = 60.0
#: Seconds a node waits at most for a restore of its key before it runs cold. A cold boot
#: costs about twice a restore's CPU and takes longer to ready, so on a loaded host booting
#: instead of waiting slowed every restore after it (issue 42: 20 of a 50-way map's nodes
#: booted cold after a 1 s wait on a loaded host).
RESTORE_WAIT = 10.0
#: Seconds a node of a key that pre-imports modules waits at most for its key's image (made
#: meanwhile) and a restore from it. Cold, such a node imports them itself: the real Prefect
#: is seconds of CPU in gVisor, what the image pays once for every node of the key (issue 41:
#: a flow's six real-Prefect nodes each paid it, next to the image being made).
IMAGE_WAIT = 60.0
#: Seconds a template may take to reach its checkpoint (the real Prefect, a loaded machine).
TEMPLATE_TIMEOUT = 300.0
#: Seconds a sandbox restored on demand may take to say it is ready before the node boots.
RESTORED_READY_TIMEOUT = 60.0
SLOT = slot.SLOT_NAME
GUEST_MODULE = "guest_runner.warm"


@dataclass(frozen=True)
class PoolKey:
    """What is fixed when a sandbox starts (the runtime and its mounts are the pool's own)."""

    image: str | None = None
    resources: Resources = field(default_factory=Resources)
    egress: tuple[str, ...] = ()
    #: Installed modules the call's interpreter pre-imports (:func:`imports_for`): the real
    #: Prefect's the task module names, and what the module's earlier nodes imported.
    imports: tuple[str, ...] = ()
    #: A worker's flow run: the pre-started process imports Prefect's flow-run engine, and
    #: the sandbox is laid out for the network it is restored into (:meth:`WarmPool.restore_for`).
    engine: bool = False


def key_for(spec: Any, *, imports: tuple[str, ...] = ()) -> PoolKey | None:
    """The pool key of a NodeSpec, or None when it must run cold."""
    if spec.egress or spec.setup_egress or spec.egress_forward or spec.egress_resolve:
        return None
    return PoolKey(image=spec.image, resources=spec.resources, egress=tuple(spec.egress), imports=imports)


#: What guest_runner.standin answers for ``from prefect import ...``.
_STAND_INS = {"task", "flow", "get_run_logger"}
_needs_prefect: dict[str, tuple[str, ...]] = {}
#: One parse at a time: CPython 3.11 keeps the AST converter's recursion depth per
#: interpreter, not per thread, and two tasks' threads parsing at once failed one of them
#: with "SystemError: AST constructor recursion depth mismatch".
_PARSING = threading.Lock()


def needs_real_prefect(source_file: str | os.PathLike[str] | None) -> tuple[str, ...]:
    """The real Prefect modules a task module imports beyond what the guest's stand-ins give
    (``import prefect.variables``, ``from prefect.blocks.system import ...``): () when the
    stand-ins do (``from prefect import task``, ``import prefect``), ("prefect",) for
    ``from prefect import <anything else>``."""
    if not source_file:
        return ()
    path = str(source_file)
    with _PARSING:
        if path not in _needs_prefect:
            _needs_prefect[path] = _prefect_imports(path)
        return _needs_prefect[path]


def _prefect_imports(path: str) -> tuple[str, ...]:
    # The module's import statements as Python parses them, wherever they are (a task's body
    # imports inside its function): never a comment or a string that looks like one.
    try:
        source = Path(path).read_bytes()
        try:
            tree = ast.parse(source, filename=path)
        except SystemError:  # 3.11's shared depth, raced by another library's compile: once more
            tree = ast.parse(source, filename=path)
    except (OSError, SyntaxError, ValueError, SystemError):  # ValueError: a null byte (before 3.12)
        return ()
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("prefect."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("prefect."):
                found.add(node.module)
            elif node.module == "prefect" and {a.name for a in node.names} - _STAND_INS:
                found.add("prefect")
    return tuple(sorted(found))


#: A module name a call may report (``pkg`` or ``pkg.sub``): nothing else is pre-imported.
_MODULE_NAME = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?$")
#: What one task module's warm sandboxes pre-import at most (guest_runner.call.MAX_IMPORTS).
MAX_IMPORTS = 200
#: A learned name not reported by any of this many later successful calls is forgotten.
KEEP_CALLS = 8
#: Never learned: the host alone decides real Prefect (needs_real_prefect, from the task's
#: module), and its own packages are the guest's plumbing.
_NEVER = frozenset({"prefect", "guest_runner", "prefect_resoluto"})


@functools.cache
def _top_levels() -> Mapping[str, list[str]]:
    import importlib.metadata

    return importlib.metadata.packages_distributions()


_verified: dict[str, bool] = {}
#: Names :func:`installed_module` remembers its answer for, at most.
MAX_VERIFIED = 4096
#: A module name longer than this is no installed module's.
MAX_MODULE_NAME = 200


def installed_module(name: str) -> bool:
    """Whether ``name`` is a module the host can vouch for: a top-level module of an installed
    distribution, or a submodule its files list (``pkg/sub.py``, ``pkg/sub/__init__.py``, an
    extension ``pkg/sub.*.so``); never a ``__main__`` (which runs a program), never Prefect
    or the project's own packages. Read from distribution metadata: nothing is imported."""
    if len(name) > MAX_MODULE_NAME:
        return False  # and not remembered: the cache holds short names only
    if name in _verified:
        return _verified[name]
    ok = False
    top, _, sub = name.partition(".")
    if _MODULE_NAME.match(name) and top not in _NEVER and "__main__" not in (top, sub):
        dists = _top_levels().get(top) or []
        if dists and not sub:
            ok = True
        elif dists:
            ok = any((top, sub) in _submodules(d) for d in dists)
    if len(_verified) < MAX_VERIFIED:  # names a sandbox reports: the cache is bounded, not they
        _verified[name] = ok
    return ok


@functools.cache
def _submodules(dist: str) -> frozenset[tuple[str, str]]:
    """(package, submodule) for each submodule ``dist``'s files list (``pkg/sub.py``,
    ``pkg/sub/__init__.py``, an extension ``pkg/sub.*.so``): read once per distribution,
    not once per name a call reports. ``dist`` is always an installed distribution's name
    (from :func:`_top_levels`), so the cache holds at most one entry per installed
    distribution: a smaller one was emptied in turn by a report cycling through more
    packages than it held (over a second a report)."""
    import importlib.metadata

    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        return frozenset()
    found: set[tuple[str, str]] = set()
    for f in files:
        parts = str(f).split("/")
        if len(parts) == 2 and parts[1].endswith(".py"):
            found.add((parts[0], parts[1][:-3]))
        elif len(parts) == 3 and parts[2] == "__init__.py":
            found.add((parts[0], parts[1]))
        elif len(parts) == 2 and parts[1].endswith((".so", ".pyd")):
            found.add((parts[0], parts[1].split(".", 1)[0]))
    return frozenset(found)


class Learned:
    """The installed packages each task module's successful calls imported
    (``.resoluto/imports.json``, names only), so the next warm sandboxes for that module
    import them before their assignment. A call's report is the sandbox's word, so only
    names the host can vouch for are kept (:func:`installed_module`: never the workspace's
    modules, a ``__main__``, Prefect or anything not installed), only from calls that
    succeeded, and a name no later call reports again is forgotten after KEEP_CALLS
    successful calls (the most recently reported win at the MAX_IMPORTS cap): one hostile
    call can neither add what is not installed nor hold the list for good."""

    def __init__(self) -> None:
        #: Per task module: name -> the number of the last successful call that reported it.
        self._by_file: dict[str, dict[str, int]] = {}
        self._calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def imports_for(self, source_file: str | os.PathLike[str] | None) -> tuple[str, ...]:
        parsed = needs_real_prefect(source_file)
        with self._lock:
            seen = self._by_file.get(str(source_file), {}) if source_file else {}
            # Stable for a pool key, packages before their submodules (as the guest imports).
            learned = tuple(sorted(seen, key=lambda n: ("." in n, n)))
        return learned + tuple(m for m in parsed if m not in learned)

    def learn(
        self,
        source_file: str | os.PathLike[str] | None,
        report: bytes | None,
        *,
        succeeded: bool = True,
    ) -> tuple[str, ...]:
        """Take what a finished call of ``source_file``'s module reported (its
        ``imports.json``, from the sandbox); the new names."""
        if not source_file or report is None or not succeeded or len(report) > MAX_IMPORTS_BYTES:
            return ()
        try:
            reported = json.loads(report).get("modules")
        except (ValueError, AttributeError, RecursionError):
            return ()
        if not isinstance(reported, list):
            return ()
        names = list(
            dict.fromkeys(
                m for m in reported[: 4 * MAX_IMPORTS] if isinstance(m, str) and installed_module(m)
            )
        )[:MAX_IMPORTS]
        key = str(source_file)
        with self._lock:
            call = self._calls[key] = self._calls.get(key, 0) + 1
            seen = self._by_file.setdefault(key, {})
            new = tuple(m for m in names if m not in seen)
            for m in names:
                seen[m] = call
            for m in [m for m, at in seen.items() if call - at >= KEEP_CALLS]:
                del seen[m]
            if len(seen) > MAX_IMPORTS:
                for m in sorted(seen, key=lambda n: seen[n])[: len(seen) - MAX_IMPORTS]:
                    del seen[m]
        if new:
            log.debug(
                "warm sandboxes for %s will pre-import %d more module(s): %s",
                source_file,
                len(new),
                ", ".join(new[:10]),
            )
        return new


#: Where guest_runner.call reports its imports, relative to the node's outputs.
IMPORTS_FILE = ".resoluto/imports.json"
#: The largest imports report read (names only, at most MAX_IMPORTS of them are kept).
MAX_IMPORTS_BYTES = 1 << 20


class WarmSandbox:
    def __init__(
        self,
        pool: WarmPool,
        key: PoolKey,
        handle: SandboxHandle,
        slot: Path | None,
        restored: Path | None = None,
    ) -> None:
        self.pool, self.key, self.handle, self.slot = pool, key, handle, slot
        #: The image it was restored from (None: booted).
        self.restored = restored
        #: Restored into the network of the one node it was made for (restore_for): no other
        #: sandbox of the pool can stand in for it.
        self.for_node = False
        #: The node's directory its slot became (place), until it is discarded.
        self.placed: Path | None = None
        self.started = time.monotonic()
        self._ready = False
        self._death_look = self.started

    @property
    def runtime(self) -> SandboxRuntime:
        return self.pool.runtime

    def ready(self) -> bool:
        if not self._ready:
            self._ready = self.runtime.said(self.handle, READY)
        return self._ready

    def alive(self) -> bool:
        st = self.runtime.status(self.handle)
        return not (st.terminal or st.gone)

    def died_starting(self) -> bool:
        """Ended before its ready line: looked at (a status read) every DEATH_LOOK at most."""
        now = time.monotonic()
        if self._ready or now < self._death_look:
            return False
        self._death_look = now + DEATH_LOOK
        return not self.alive()

    def place(self, conduit: Conduit, rel_prefix: str) -> None:
        """Move the slot to the node's canonical directory (before the inbox is put there)."""
        if self.slot is None:
            return
        root = conduit.local_root
        if root is None:
            raise OSError("a slotted warm sandbox needs the local conduit it was made for")
        target = root / rel_prefix
        make_dirs(target.parent, 0o700)
        if slot.mounted(self.slot):
            # A mount point cannot be renamed: the node's directory shows the same slot.
            slot.bind(self.slot, target)  # fails if the node directory exists: never merge two nodes
        else:
            os.rename(self.slot, target)
        self.slot, self.placed = None, target

    def assign(self, launch: LaunchSpec) -> SandboxHandle:
        """Hand the sandbox its node: ids, argv, env and secrets, on its stdin only (with the
        variables of the network it was restored into: its process has its template's).
        Raises :class:`NotWaiting` when the sandbox can no longer take it (the pool's own
        race: reaped, handed over or ended since it was taken): nothing of the node reached
        it, and the node goes to :meth:`replacement` or boots."""
        env = {**launch.env, **self.runtime.network_env(self.handle)}
        if self.pool.before_assign is not None:
            self.pool.before_assign(self)
        self.runtime.assign(
            self.handle,
            wire.encode_assignment(env, launch.secret_env),
            labels={**launch.labels, LABEL_WARM: "assigned"},
        )
        return self.handle

    def replacement(self) -> WarmSandbox | None:
        """Another ready sandbox of this one's key, for the node this one could not take
        (None: the node boots one). Taken as :func:`take_for` does, but as no new demand."""
        if self.for_node:
            return None
        w, _ = self.pool.take(self.key, warm=False)
        if w is None and self.key.imports:
            w, _ = self.pool.take(dataclasses.replace(self.key, imports=()), warm=False)
        return w

    def ended(self) -> None:
        """The node it was taken for is over (idempotent): the pool stops counting it in flight."""
        self.pool._ended(self)

    def discard(self) -> None:
        """Destroy the sandbox (idempotent; after ``assign`` the node's driver does it)."""
        self.ended()
        try:
            self.runtime.destroy(self.handle)
        except Exception as e:
            log.warning("could not destroy warm sandbox %s: %s", self.handle.id, e)
        if self.slot is not None:
            remove_tree(self.slot)  # the sandbox's own writing: any depth, no link followed


class WarmPool:
    """Idle warm sandboxes of one runtime and conduit, per key, refilled in the background."""

    def __init__(
        self,
        runtime: SandboxRuntime,
        conduit: Conduit,
        *,
        size: int,
        labels: dict[str, str] | None = None,
        snapshots: bool | None = None,
    ) -> None:
        """``snapshots``: restore warm sandboxes from per-key images where the runtime can
        (default: on, unless ``RESOLUTO_WARM_SNAPSHOTS=0``)."""
        self.runtime, self.conduit, self.size = runtime, conduit, max(0, size)
        self.id = uuid.uuid4().hex[:12]
        self.labels = {**(labels or {}), LABEL_POOL: self.id, LABEL_WARM: "idle"}
        self._idle: dict[PoolKey, list[WarmSandbox]] = {}
        self._wanted: list[PoolKey] = []
        self._broken: set[PoolKey] = set()
        # Demand per key: warm sandboxes handed out (alive = their node still runs) and the
        # times nodes found none (cold ones), which together say how many run at once.
        self._taken: dict[PoolKey, list[WarmSandbox]] = {}
        self._takes: dict[PoolKey, int] = {}  # ever, per key
        self._misses: dict[PoolKey, list[float]] = {}
        self._floor: dict[PoolKey, int] = {}
        #: Sandboxes the refill thread is starting (chosen, not yet idle): a node that
        #: arrives meanwhile waits for a restore as for one already in the idle list.
        self._starting: dict[PoolKey, int] = {}
        #: Nodes waiting in take() for a restore of their key: each is one more to restore.
        self._waiting: dict[PoolKey, int] = {}
        #: Tasks submitted to the runner that have not started yet (expect()): the flow's
        #: known demand. ``_burst``: more than one was pending at once since the last time
        #: none was (a map, a chain), so none pending means nothing more is known to come.
        self._pending = 0
        self._burst = False
        #: Keys taken from since that demand began: the ones it is for (a key warmed at the
        #: runner's start, or an earlier module's, keeps the usual lookahead instead).
        self._demanded: set[PoolKey] = set()
        #: The refill thread is making an image (a template boot: seconds): no restore of
        #: any key starts meanwhile.
        self._templating = False
        self._lock = threading.Condition()
        #: The refill thread is waiting between its looks (READY_LOOK apart while a sandbox
        #: is on its way), not busy starting one: nodes waiting in take() rely on its looks.
        self._looking = False
        self._closed = False
        self._thread: threading.Thread | None = None
        #: Tests only: called with each sandbox taken from this pool right before its
        #: assignment, the end of the window in which a reaper, a close or the sandbox's own
        #: end can take it from the node that picked it.
        self.before_assign: Callable[[WarmSandbox], None] | None = None
        self.why_not = usable(runtime, conduit).why if self.size else "warm_pool=0"
        self.learned = Learned()
        self.python = host_interpreter(runtime.python)
        self.snapshots = self._snapshots(snapshots if snapshots is not None else snapshots_by_env())
        #: Keys whose image could not be made or restored: their sandboxes boot.
        self._booting_only: set[PoolKey] = set()
        #: Keys whose image is being made for restore_for, and the threads making them.
        self._building: set[PoolKey] = set()
        self._builders: list[threading.Thread] = []
        #: Threads starting a restore each (the refill's): joined at close.
        self._starters: list[threading.Thread] = []

    def _snapshots(self, wanted: bool) -> Snapshots | None:
        """The pool's images, where it restores sandboxes (``wanted`` and the runtime can)."""
        if not (self.enabled and self.runtime.capabilities.snapshots and wanted):
            return None
        conduit = self.conduit
        seen = {k: v for k, v in conduit.guest_env().items() if k != wire.ENV_STORE_ROOT}  # /conduit inside
        slotted = conduit.local_root is not None and self.runtime.capabilities.mounts_conduit
        context = json.dumps({"conduit": seen, "slot": slotted}, sort_keys=True)
        found = Snapshots(self.runtime, self.python, context)
        found.prune()
        return found

    @property
    def enabled(self) -> bool:
        return not self.why_not

    # -- the host's side --------------------------------------------------------------
    def want(self, key: PoolKey, idle: int = 0) -> None:
        """Keep ``key`` warm from now on (the runner's defaults at start, every key in demand);
        ``idle``: at least that many idle (up to ``size``) whatever the demand."""
        if not self.enabled:
            return
        with self._lock:
            if self._closed or key in self._broken:
                return
            self._floor[key] = max(self._floor.get(key, 0), min(idle, self.size))
            if key not in self._wanted:
                self._wanted.append(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._refill, name="resoluto-warm-pool", daemon=True)
                self._thread.start()
            self._lock.notify_all()

    def expect(self, n: int) -> None:
        """``n`` more tasks to come (the runner: +1 at a submit, -1 when that task starts or
        will never run). The refill sizes its restores to them (:meth:`target`): a map's
        nodes find their sandboxes restored ahead, and none is restored for a node that will
        never come once the map has drained."""
        with self._lock:
            if n > 0 and self._pending == 0:
                self._burst = False
                self._demanded.clear()
            self._pending = max(0, self._pending + n)
            if self._pending > 1:
                self._burst = True
            self._lock.notify_all()

    def take(self, key: PoolKey | None, *, warm: bool = True) -> tuple[WarmSandbox | None, float]:
        """A ready warm sandbox of ``key`` and the seconds spent getting it; (None, seconds)
        when there is none: the node runs cold, and the key is warmed (``warm=False``: a
        fallback look that neither warms the key nor counts as its demand). Never one still
        booting: until the guest says it is ready, runsc may not have opened the slot it
        mounts, and moving the slot then would fail the sandbox's start. Where the
        key's sandboxes are *restored* (:meth:`_restore_coming`), the node waits for one
        (RESTORE_WAIT at most), counted as one more to restore: it is a fraction of a cold
        start away."""
        t0 = time.monotonic()
        if key is None or not self.enabled:
            return None, 0.0
        if warm:
            self.want(key)
            with self._lock:
                self._demanded.add(key)
        waiting = False
        try:
            while True:
                with self._lock:
                    idle = self._idle.get(key) or []
                    pick = next((w for w in idle if w.ready()), None)
                    if pick is None and warm and self._restore_coming(key, t0):
                        if not waiting:
                            waiting = True
                            self._waiting[key] = self._waiting.get(key, 0) + 1
                            self._lock.notify_all()  # the refill thread restores one more
                        # Ready is a line in its log: the refill thread looks every READY_LOOK
                        # and notifies, as it does when a restore joins the idle list; this
                        # wait's own end is only the fallback (and RESTORE_WAIT's clock), but
                        # while that thread is busy elsewhere (an image made, a sandbox booted
                        # on it) the node looks itself as often.
                        self._lock.wait(timeout=TAKE_LOOK if self._looking else READY_LOOK)
                        continue
                    if pick is None:
                        if warm:
                            self._misses.setdefault(key, []).append(time.monotonic())
                        return None, time.monotonic() - t0
                    idle.remove(pick)
                    self._taken.setdefault(key, []).append(pick)
                    self._takes[key] = self._takes.get(key, 0) + 1
                    if waiting:  # with the pick, in one step: the refill never sees it twice
                        waiting = False
                        self._waiting[key] -= 1
                    self._lock.notify_all()
                if pick.alive():
                    return pick, time.monotonic() - t0
                self._failed(pick)
        finally:
            if waiting:
                with self._lock:
                    self._waiting[key] -= 1

    def _ended(self, w: WarmSandbox) -> None:
        with self._lock:
            taken = self._taken.get(w.key) or []
            if w in taken:
                taken.remove(w)
                self._lock.notify_all()  # a place in flight is free: the refill may start one

    def _restore_coming(self, key: PoolKey, t0: float) -> bool:
        """Whether a restore of ``key`` will come for a node that found none ready: the key's
        image is made and the refill thread restores for every waiting node (:meth:`target`),
        MAX_RESTORING at a time. A restore reaches ready in ~0.3-0.5 s for about half a cold
        boot's CPU, so waiting beats booting even behind a few others (the first task of a
        flow arrives moments after the runner asked for its key, before the first restore).
        Not while the refill thread makes an image (seconds), nor beyond RESTORE_WAIT from
        ``t0`` (restores that hang), nor for a key whose sandboxes boot (seconds away).

        A key that pre-imports modules waits for its image too, while it is made (IMAGE_WAIT
        at most): its cold node would pay the same imports the image pays once."""
        if self._closed or key not in self._wanted:
            return False
        waited = time.monotonic() - t0
        if key.imports:
            return waited < IMAGE_WAIT and self.snapshots is not None and key not in self._booting_only
        return not self._templating and waited < RESTORE_WAIT and self._restorable(key)

    def close(self) -> None:
        """Destroy every idle sandbox (runner exit, Ctrl-C, cancellation, failure elsewhere)."""
        with self._lock:
            self._closed = True
            idle = [w for ws in self._idle.values() for w in ws]
            self._idle.clear()
            self._lock.notify_all()
            thread = self._thread
        _discard_all(idle)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)
        for builder in list(self._builders):  # a template being made sees _closed and stops
            if builder is not threading.current_thread():
                builder.join(timeout=30)
        with self._lock:
            starters = list(self._starters)
        for starter in starters:  # a restore being started: discarded by its thread (closed)
            if starter is not threading.current_thread():
                starter.join(timeout=30)
        with self._lock:  # one launched while we joined
            idle = [w for ws in self._idle.values() for w in ws]
            self._idle.clear()
        _discard_all(idle)
        try:  # any taken but never driven (the process is leaving): by the runtime's own listing
            self.runtime.sweep({LABEL_POOL: self.id})
        except Exception as e:
            log.warning("sweeping the warm pool's sandboxes failed: %s", e)

    def ready_count(self, key: PoolKey) -> int:
        """Idle sandboxes of ``key`` that have said they are ready (tests, benchmarks)."""
        with self._lock:
            return sum(1 for w in self._idle.get(key) or [] if w.ready())

    def idle_ids(self) -> list[str]:
        with self._lock:
            return [w.handle.id for ws in self._idle.values() for w in ws]

    # -- the refill thread -----------------------------------------------------------------
    def _refill(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                # A sandbox reaching ready frees a start (MAX_RESTORING) and is a node's to
                # take; ready is a line in its log, no event: looked at every READY_LOOK
                # while one is on its way, and the waiting nodes told (they look themselves
                # only every TAKE_LOOK while this thread looks). Choosing the next key looks
                # too: the nodes are told after it, whichever look saw it. Sleeping the idle
                # 0.5 s meanwhile held every next restore of a chain of short tasks back by
                # up to half a second.
                coming = [w for ws in self._idle.values() for w in ws if not w._ready]
                todo = self._next_key()  # looks at each starting sandbox's log, once
                if any(w._ready for w in coming):
                    self._lock.notify_all()
                if todo is None:
                    self._looking = True
                    try:
                        self._lock.wait(timeout=READY_LOOK if coming or self._starters else 0.5)
                    finally:
                        self._looking = False
                    continue
                self._starting[todo] = self._starting.get(todo, 0) + 1
                if self._restorable(todo):
                    # A restore's start (its state directory, cgroup, slot mount, runsc's
                    # processes) is 20-200 ms of this thread, more on a loaded host: started
                    # on a thread of its own, the next one starts meanwhile (MAX_RESTORING).
                    starter = threading.Thread(
                        target=self._start_one, args=(todo,), name="resoluto-warm-restore", daemon=True
                    )
                    self._starters.append(starter)
                    starter.start()
                    continue
            if not self._start_one(todo):
                return

    def _start_one(self, key: PoolKey) -> bool:
        """Start one sandbox of ``key`` (counted in ``_starting`` by the caller) into the idle
        list; False when the pool closed meanwhile (the sandbox is discarded). It leaves
        ``_starting`` and enters the idle list in one step: between the two the refill would
        count it nowhere and start one more."""
        try:
            w = self._launch(key)
        except Exception as e:
            with self._lock:
                self._started(key)
                self._broken.add(key)
                if key in self._wanted:
                    self._wanted.remove(key)
            log.warning(
                "could not start a warm sandbox on %s: %s; nodes of this kind run cold",
                self.runtime.name,
                e,
            )
            return True
        except BaseException:
            with self._lock:
                self._started(key)
            raise
        with self._lock:
            self._started(key)
            closed = self._closed
            if w is not None and not closed:
                self._idle.setdefault(key, []).append(w)  # a node waiting for a restore looks now
        if w is None:  # the pool closed while the key's image was being made
            return True
        if closed:
            w.discard()
        return not closed

    def _started(self, key: PoolKey) -> None:
        """One start of ``key`` over (under the lock): the refill may start the next one."""
        self._starting[key] -= 1
        self._starters = [t for t in self._starters if t is not threading.current_thread()]
        self._lock.notify_all()

    def target(self, key: PoolKey) -> int:
        """Idle sandboxes to keep for ``key``, at most ``size``: one for each node waiting for
        one, and ahead of demand either the tasks submitted and not started yet (a map's or a
        chain's: exactly what will come, for the keys its nodes take), or else the lookahead
        (AHEAD_FIRST until the key's second take, then AHEAD_BOOTED, AHEAD_RESTORED where
        they are restored) plus its nodes running now beyond the one the lookahead follows
        (warm ones whose node is not over, cold ones started in the last MISS_WINDOW seconds). Once a
        map or chain has drained, AHEAD_DRAINED: more would only be discarded at exit."""
        now = time.monotonic()
        taken = self._taken.get(key) or []  # the node's driver ends each (WarmSandbox.ended)
        misses = self._misses.get(key) or []
        misses[:] = [t for t in misses if now - t < MISS_WINDOW]
        waiting = self._waiting.get(key, 0)
        if key in self._demanded and self._pending:
            ahead = self._pending + waiting
        elif key in self._demanded and self._burst:
            ahead = waiting + AHEAD_DRAINED
        else:
            if self._takes.get(key, 0) < 2:
                lookahead = AHEAD_FIRST
            else:
                lookahead = AHEAD_RESTORED if self._restorable(key) else AHEAD_BOOTED
            ahead = lookahead + max(0, len(taken) + len(misses) - 1) + waiting
        return max(self._floor.get(key, 0), min(self.size, ahead))

    def _next_key(self) -> PoolKey | None:
        # A sandbox that died booting (a bad image, a refused mount) must not hold its place.
        for ws in self._idle.values():
            for w in [w for w in ws if not w.ready() and w.died_starting()]:
                ws.remove(w)
                threading.Thread(target=self._failed, args=(w,), daemon=True).start()
        # Started on their own threads and not in the idle list yet count as booting there.
        booting = sum(1 for ws in self._idle.values() for w in ws if not w._ready)  # just looked
        booting += sum(self._starting.values())
        if booting >= MAX_RESTORING:
            return None
        # Saturated, only a restore is started ahead: it costs a third of the CPU of the
        # cold boot it saves the next node (docs/performance.md, "cpu per node").
        saturated = self._saturated()
        for key in self._wanted:
            restorable = self._restorable(key)
            if booting >= (MAX_RESTORING if restorable else MAX_BOOTING):
                continue
            have = len(self._idle.get(key) or []) + self._starting.get(key, 0)
            # A node waiting for the key's image (_restore_coming) is in flight too: its image
            # is made even then, or it waits in vain.
            if have < self.target(key) and (not saturated or restorable or self._waiting.get(key)):
                return key
        return None

    def _restorable(self, key: PoolKey) -> bool:
        """Whether ``key``'s next sandbox would be restored from an image already made."""
        return (
            self.snapshots is not None and key not in self._booting_only and self.snapshots.path(key).is_dir()
        )

    def _saturated(self) -> bool:
        """As many nodes in flight as the host has cores: no idle CPU to boot ahead in, and a
        boot would only slow the running nodes (a saturated map runs slower with the pool
        booting replacements than without one)."""
        for key in self._wanted:
            self.target(key)  # prunes old misses
        inflight = sum(len(ws) for ws in self._taken.values()) + sum(len(ts) for ts in self._misses.values())
        return inflight >= (os.cpu_count() or 1)

    def _failed(self, w: WarmSandbox) -> None:
        why = self.runtime.status(w.handle).reason
        logs = self.runtime.logs(w.handle, tail=5).strip()
        w.discard()
        if not w._ready and w.restored is not None and self.snapshots is not None:
            if not w.restored.exists():  # discarded already (another restored from it failed first)
                return
            self.snapshots.discard(
                w.key, f"a sandbox restored from it ended before it was ready ({why}): {logs[-400:]}"
            )
            with self._lock:
                self._booting_only.add(w.key)
            return
        if not w._ready:
            log.warning(
                "a warm sandbox on %s ended before it was ready (%s): %s; nodes of this kind run cold",
                self.runtime.name,
                why,
                logs[-400:],
            )
            with self._lock:
                self._broken.add(w.key)
                if w.key in self._wanted:
                    self._wanted.remove(w.key)

    def _launch(self, key: PoolKey) -> WarmSandbox | None:
        """One warm sandbox of ``key``: restored from its image (made first if there is none
        yet) where the pool has snapshots, else booted. None: the pool closed meanwhile."""
        if self.snapshots is not None and key not in self._booting_only:
            try:
                image = self.snapshots.usable(key)  # a corrupt one: discarded, with a warning
                if image is None:
                    self._templating = True
                    try:
                        image = self._make_image(key)
                    finally:
                        self._templating = False
            except (SnapshotError, OSError) as e:
                self._no_image(key, None if isinstance(e, CorruptImage) else e)
            else:
                if image is not None:
                    return self._start(key, image=image)
                if self._closed:
                    return None
        return self._start(key)

    def _start(
        self,
        key: PoolKey,
        *,
        image: Path | None = None,
        template: bool = False,
        network: NetworkRequest | None = None,
        labels: dict[str, str] | None = None,
    ) -> WarmSandbox:
        """Boot (or, with ``image``, restore) one warm sandbox; ``template``: one to checkpoint;
        ``network``: the network of the node it is restored for (restore_for)."""
        sid = f"rsl-{uuid.uuid4().hex[:16]}"
        slotted = self.conduit.local_root is not None and self.runtime.capabilities.mounts_conduit
        env = {wire.ENV_WARM_CALL: wire.warm_call_mode(key.engine, key.imports)}
        env.update(self.conduit.guest_env())
        if image is not None or template:
            env[SNAPSHOT_ENV] = "1"  # identical in the template and every sandbox restored from it
        assert self.runtime.state is not None  # checked by usable()
        state = Path(self.runtime.state)
        spec = LaunchSpec(
            sandbox_id=sid,
            env=env,
            resources=key.resources,
            labels={**self.labels, **(labels or {})},
            image=key.image,
            command=[self.python, "-m", GUEST_MODULE],
            hold_stdin=True,
            network=network,
            network_layout=key.engine,
            conduit_root=(state / sid) if slotted else None,
            conduit_subdir=SLOT if slotted else "",
            conduit_slot=slot.capacity_of(key.resources.disk_bytes, key.resources.memory_bytes)[0]
            if slotted
            else None,
            # Bound now, read after the assignment: the heartbeat of the node's driver, this
            # process (prefect_resoluto.node.heartbeat), lies outside the slot.
            host_beat_dir=heartbeat.writer_for(self.conduit).local_dir() if slotted else None,
        )
        if slotted:
            from prefect_resoluto.runtimes._guest_layout import guest_conduit_dir

            env[wire.ENV_WARM_SLOT] = guest_conduit_dir(spec)
        if image is not None:
            handle = self.runtime.restore(spec, image, wake=WAKE)
        else:
            handle = self.runtime.launch(spec)
        return WarmSandbox(self, key, handle, state / sid / SLOT if slotted else None, restored=image)

    # -- restored on demand (a worker's flow runs) -----------------------------------------
    def restore_for(
        self, key: PoolKey, network: NetworkRequest | None, labels: dict[str, str]
    ) -> tuple[WarmSandbox | None, str]:
        """A sandbox of ``key`` restored now from the key's image into ``network`` (the node's
        own, made for it: a network belongs to its run, so such a sandbox cannot wait ahead
        of demand like the pool's), once it says it is ready; and the words for the log.
        (None, why) when it cannot be: then the node boots. Without an image yet, the image
        is made in the background meanwhile, for the key's next nodes."""
        if self.snapshots is None or not self.enabled:
            return None, f"booted (no snapshots: {self.why_not or 'turned off'})"
        if key in self._booting_only:
            return None, "booted (this kind's snapshot image could not be made or restored)"
        try:
            image = self.snapshots.usable(key)
        except SnapshotError:  # corrupt: discarded with a warning; made again
            image = None
        if image is None:
            self._build_in_background(key)
            return None, "booted (its snapshot image is being made for the next ones)"
        t0 = time.monotonic()
        try:
            w = self._start(key, image=image, network=network, labels=labels)
        except Exception as e:
            log.warning("could not restore a sandbox on %s: %s; booting one", self.runtime.name, e)
            return None, f"booted (the restore failed: {e})"
        deadline = t0 + RESTORED_READY_TIMEOUT
        while not w.ready():
            if w.died_starting() or time.monotonic() > deadline or self._closed:
                if w.alive():
                    w.discard()
                    return None, "booted (the restored sandbox was not ready in time)"
                self._failed(w)  # an image whose sandboxes die before ready is discarded
                return None, "booted (the restored sandbox ended before it was ready)"
            with self._lock:
                self._lock.wait(timeout=0.01)  # ready is a line in its log: no event to wait on
        w.for_node = True
        return w, f"restored sandbox {w.handle.id} from its snapshot in {time.monotonic() - t0:.2f} s"

    def _build_in_background(self, key: PoolKey) -> None:
        with self._lock:
            if self._closed or key in self._building or key in self._booting_only:
                return
            self._building.add(key)
            t = threading.Thread(target=self._build, args=(key,), name="resoluto-snapshot", daemon=True)
            self._builders.append(t)
        t.start()

    def _build(self, key: PoolKey) -> None:
        try:
            self._make_image(key)
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the key's sandboxes boot
            self._no_image(key, e)
        finally:
            with self._lock:
                self._building.discard(key)
                self._builders = [t for t in self._builders if t is not threading.current_thread()]

    def _no_image(self, key: PoolKey, e: BaseException | None) -> None:
        """``key``'s image could not be made (``e``, warned here) or was corrupt (None: the
        discard warned already): its sandboxes boot from now on."""
        if e is not None:
            log.warning(
                "could not make a warm-sandbox image on %s: %s; sandboxes of this kind boot",
                self.runtime.name,
                e,
            )
        with self._lock:
            self._booting_only.add(key)

    def _make_image(self, key: PoolKey) -> Path | None:
        """Boot ``key``'s template, checkpoint it where it waits for an assignment (no node
        exists yet), destroy it, and commit the image. None when the pool closed meanwhile."""
        assert self.snapshots is not None
        t0 = time.monotonic()
        w = self._start(key, template=True)
        try:
            deadline = t0 + TEMPLATE_TIMEOUT
            while not self.runtime.said(w.handle, SNAPSHOT_READY):
                with self._lock:
                    if self._closed:
                        return None
                    if not w.alive():
                        raise SnapshotError(
                            "the template sandbox ended before its checkpoint: "
                            + self.runtime.logs(w.handle, tail=5).strip()[-400:]
                        )
                    if time.monotonic() > deadline:
                        raise SnapshotError(f"the template sandbox was not ready in {TEMPLATE_TIMEOUT:.0f} s")
                    self._lock.wait(timeout=0.05)  # a log line has no event to wait on
            booted = time.monotonic() - t0
            tmp = self.snapshots.new_dir()
            t1 = time.monotonic()
            try:
                self.runtime.checkpoint(w.handle, tmp)
            except Exception as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise SnapshotError(str(e)) from e
            made = {"template_boot_s": round(booted, 3), "checkpoint_s": round(time.monotonic() - t1, 3)}
        finally:
            w.discard()
        image = self.snapshots.commit(key, tmp, made)
        log.debug("warm-sandbox image %s made in %.1f s", image, time.monotonic() - t0)
        return image


def _discard_all(sandboxes: list[WarmSandbox]) -> None:
    """Discard every one of ``sandboxes`` at once: each waits for its own guest to exit (up to
    a second on a loaded host), and the flow that closes the pool waits for the last."""
    if len(sandboxes) <= 1:
        for w in sandboxes:
            w.discard()
        return
    # Daemon and joined with a bound: a destroy that hangs must not hold the flow's exit (the
    # pool's sweep by label, after, still reaches that sandbox).
    threads = [
        threading.Thread(target=w.discard, name="resoluto-warm-discard", daemon=True) for w in sandboxes
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=DISCARD_WAIT)


def usable(runtime: SandboxRuntime, conduit: Conduit) -> Availability:
    """Whether ``runtime`` can keep sandboxes warm for ``conduit``, and if not why."""
    if not runtime.capabilities.warm:
        return Availability.refused(f"runtime {runtime.name!r} does not keep sandboxes warm")
    state = runtime.state
    if state is None:
        return Availability.refused(
            f"runtime {runtime.name!r} has no state directory for warm sandboxes' slots"
        )
    root = conduit.local_root
    if root is not None and runtime.capabilities.mounts_conduit:
        try:
            if os.stat(state).st_dev != os.stat(root).st_dev:
                return Availability.refused(
                    f"the local conduit {root} and the runtime's state directory {state} are on "
                    "different filesystems, so a warm sandbox's directory cannot be moved into place"
                )
        except OSError as e:
            return Availability.refused(f"cannot check the conduit's filesystem: {e}")
    return Availability(True)


def default_size(warm_pool: int | None, max_workers: int) -> int:
    if warm_pool is not None:
        return max(0, warm_pool)
    return min(DEFAULT_CAP, max(1, max_workers))


def start_for(cfg: Any, runtime: SandboxRuntime, conduit: Conduit, max_workers: int) -> AnyPool | None:
    """The task runner's pool (None when disabled or unsupported), already warming the
    runner's own settings so the first task finds a sandbox ready. On Kubernetes, warm pods
    (:mod:`prefect_resoluto.runtimes.kubernetes.warm`), only when ``warm_pool`` is set."""
    if runtime.name == "kubernetes":
        from prefect_resoluto.runtimes.kubernetes.runtime import KubernetesRuntime
        from prefect_resoluto.runtimes.kubernetes.warm import start_for as pods_for

        return pods_for(cfg, runtime, conduit) if isinstance(runtime, KubernetesRuntime) else None
    size = default_size(cfg.warm_pool, max_workers)
    if size == 0:
        return None
    pool = WarmPool(runtime, conduit, size=size)
    if not pool.enabled:
        if cfg.warm_pool:  # asked for explicitly: say why it is not there
            log.warning("warm_pool=%d ignored: %s", cfg.warm_pool, pool.why_not)
        return None
    if not (cfg.egress or cfg.setup_egress or cfg.egress_resolve):
        pool.want(PoolKey(image=cfg.image, resources=cfg.resources))
    return pool


def expected(pool: AnyPool | None) -> Callable[[], None]:
    """Count one submitted task as coming (:meth:`WarmPool.expect`); what is returned says it
    started or will never run (its first call counts, later ones do nothing)."""
    if not isinstance(pool, WarmPool):
        return _nothing
    pool.expect(1)
    once = threading.Lock()

    def started() -> None:
        if once.acquire(blocking=False):
            pool.expect(-1)

    return started


def _nothing() -> None:
    return None


def imports_for(pool: AnyPool | None, source_file: str | os.PathLike[str] | None) -> tuple[str, ...]:
    """What warm sandboxes for a task of ``source_file`` pre-import (() without a pool)."""
    return pool.learned.imports_for(source_file) if isinstance(pool, WarmPool) else ()


def learn(
    pool: AnyPool | None,
    source_file: str | os.PathLike[str] | None,
    report: bytes | None,
    *,
    succeeded: bool,
) -> None:
    """Record what a finished Python call of ``source_file`` imported (its ``imports.json``),
    if it succeeded (see :class:`Learned`)."""
    if isinstance(pool, WarmPool):
        pool.learned.learn(source_file, report, succeeded=succeeded)


def take_for(pool: AnyPool | None, spec: Any, *, imports: tuple[str, ...] = ()) -> tuple[AnyWarm | None, str]:
    """A warm sandbox for ``spec`` if one is ready, and the words for the task's log. One
    that pre-imported nothing serves when none with ``imports`` is ready: the call then
    imports them itself, still without a sandbox boot."""
    if pool is None:
        return None, "cold sandbox (warm pool off)"
    if not isinstance(pool, WarmPool):
        return pool.take_spec(spec)
    key = key_for(spec, imports=imports)
    if key is None:
        return None, "cold sandbox (nodes with egress are never pre-started)"
    w, waited = pool.take(key)
    plain = ""
    if w is None and key.imports:
        w, more = pool.take(dataclasses.replace(key, imports=()), warm=False)
        waited += more
        plain = ", without the module's imports pre-loaded"
    if w is None:
        return None, f"cold sandbox (no warm one of this kind ready; looked for {waited * 1000:.1f} ms)"
    age = time.monotonic() - w.started
    return w, (
        f"warm sandbox {w.handle.id} (waited {waited * 1000:.1f} ms for it; started {age:.1f} s ahead{plain})"
    )
