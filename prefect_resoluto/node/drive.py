"""Drive one node: pack + put the inbox, launch, tail, judge, fetch outputs, reap.

:func:`_drive` reads as its phases, which share one :class:`_Node`: prepare (refuse bad
input, make the launch spec), place a warm sandbox, claim the slot, put the inbox, start the
sandbox, watch it (tail, status, silence, cancellation), finish it (on every path: hand it
over or destroy it, keep the egress decisions, settle the slot), then the outcome (the
guest's result, the outputs, the verdict).

The verdict comes from two places that are kept apart: ``result.json`` is the guest's
word on its own workload; the observed phase, reason and substrate logs are what the
host saw from outside (runtime status, silence, missing objects) and are never taken
from the guest.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import queue
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from guest_runner import archive, wire
from guest_runner.conduit import Conduit, ConduitError, ObjectNotFound
from guest_runner.conduit.local import make_dirs
from guest_runner.redact import Redactor
from prefect_resoluto.node import bounded, heartbeat, verdict
from prefect_resoluto.node.dirwatch import readable
from prefect_resoluto.node.observer import Callbacks, NodeObserver
from prefect_resoluto.node.outcome import (
    FailureKind,
    NodeOutcome,
)
from prefect_resoluto.node.spec import (
    NodeSpec,
    NodeSpecError,
    launch_spec,
)
from prefect_resoluto.node.tail import ChunkTailer, TailError
from prefect_resoluto.runtimes import slot
from prefect_resoluto.runtimes.base import (
    IsolationLevel,
    LaunchSpec,
    NotWaiting,
    SandboxHandle,
    SandboxRuntime,
    SandboxStatus,
    check_isolation,
)

if TYPE_CHECKING:
    from prefect_resoluto.warm.pool import AnyWarm

log = logging.getLogger("prefect_resoluto.node.drive")

# Consecutive observations before "unstartable"/"gone" is believed (a pod may report
# a transient ErrImagePull, a process may be between fork and exec).
CONFIRMATIONS = 3
#: Warm sandboxes one node tries at most before it boots its own: one the pool lost between
#: its pick and the assignment (reaped, handed over, ended while idle) costs a try, never the node.
WARM_TRIES = 3


def drive(
    spec: NodeSpec,
    conduit: Conduit,
    runtime: SandboxRuntime,
    observer: NodeObserver | None = None,
    *,
    warm: AnyWarm | None = None,
) -> NodeOutcome:
    """Run ``spec`` in a sandbox of ``runtime`` and return what happened; ``observer`` sees it
    happen (:class:`~prefect_resoluto.node.observer.NodeObserver`: launched, each event, finished)
    and answers for the host (cancelled? reap the sandbox? how to pack the workspace?).

    ``warm``: a sandbox of ``runtime`` started ahead of demand (:mod:`prefect_resoluto.warm.pool`),
    assigned this node instead of launching one; it is destroyed with the node either way.

    A node whose guest wrote a complete manifest and a successful result may be handed to
    ``observer.reap`` (its objects are all in the conduit; what is left is the guest's exit and
    the runtime's teardown), so the outcome returns without waiting for them;
    ``observed_phase`` is then the phase seen before the hand-over (``running``, or the exit
    when the host saw it first).

    Never raises for a failed node (see :meth:`NodeOutcome.raise_for_failure`); raises
    for bad input before anything is launched, and re-raises interruption after the
    sandbox has been reaped.
    """
    try:
        return _drive(spec, conduit, runtime, observer or NodeObserver(), warm)
    except BaseException:
        if warm is not None:
            warm.discard()  # refused before launch: a warm sandbox taken for it must not linger
        raise


def drive_node(
    spec: NodeSpec,
    conduit: Conduit,
    runtime: SandboxRuntime,
    *,
    on_event: Callable[[wire.SpanEvent], None] | None = None,
    min_isolation: IsolationLevel | str | None = None,
    silence_window: float | None = None,
    on_launch: Callable[[SandboxHandle], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
    warm: AnyWarm | None = None,
    reap: Callable[[SandboxHandle], None] | None = None,
    pack_workspace: Callable[[Path, list[str]], bytes] | None = None,
) -> NodeOutcome:
    """:func:`drive` with plain callbacks (a script, a test): ``min_isolation`` and
    ``silence_window``, when given, replace the spec's; ``reap(handle)`` takes over destroying
    the sandbox of a node that succeeded."""
    if min_isolation is not None or silence_window is not None:
        spec = dataclasses.replace(
            spec,
            min_isolation=spec.min_isolation if min_isolation is None else min_isolation,
            silence_window=spec.silence_window if silence_window is None else silence_window,
        )
    observer = Callbacks(
        on_event=on_event,
        on_launch=on_launch,
        should_cancel=should_cancel,
        reap=reap,
        pack_workspace=pack_workspace,
    )
    return drive(spec, conduit, runtime, observer, warm=warm)


@dataclass
class _Node:
    """One node being driven: what its phases share, filled in as they run."""

    spec: NodeSpec
    conduit: Conduit
    runtime: SandboxRuntime
    observer: NodeObserver
    launch: LaunchSpec
    rel_prefix: str
    tailer: ChunkTailer
    events: _Events
    t0: float
    warm: AnyWarm | None = None
    slot: _Slot | None = None
    handle: SandboxHandle | None = None
    st: SandboxStatus = field(default_factory=lambda: SandboxStatus(phase="pending"))
    failure: FailureKind | None = None
    reason: str = ""
    substrate_logs: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    #: result.json as read (bounded), once: a paid GET on S3, and one verdict from one read.
    result_raw: bytes | None = None
    #: The node's hold on its host's heartbeat (None: the spec asks for none).
    beat: heartbeat.Lease | None = None
    #: The id of a sandbox launched for the node (a warm one placed goes by its own).
    cold_id: str = ""
    #: Warm sandboxes offered to the node so far (at most WARM_TRIES).
    warm_tries: int = 0

    def fail(self, failure: FailureKind, reason: str) -> None:
        self.failure, self.reason = failure, reason


@dataclass
class _Slot:
    """The node's directory as a filesystem of its own (:mod:`prefect_resoluto.runtimes.slot`)."""

    dir: Path
    size: int
    setting: str
    #: What the host itself put there (the inbox): not counted against the guest.
    host_bytes: int = 0


class _Events:
    """The node's events as its observer gets them: counted and redacted; with a network, the
    egress proxy's decisions too, which arrive on the proxy's threads and are delivered from
    the driver's."""

    def __init__(self, observer: NodeObserver, redactor: Redactor) -> None:
        self.observer, self.redactor = observer, redactor
        self.count = 0
        self._egress_queue: queue.SimpleQueue[wire.SpanEvent] = queue.SimpleQueue()
        self._egress: list[wire.SpanEvent] = []
        self._egress_bound = 0
        self._listening = False

    def deliver(self, ev: wire.SpanEvent) -> None:
        self.count += 1
        if self.redactor.count:
            ev["data"] = self.redactor.data(ev.get("data") or {})
        self.observer.event(ev)

    def listen_egress(self, run_id: str, node_id: str) -> None:
        from prefect_resoluto import egress

        # The proxy caps each kind of decision per sandbox; the list kept holds no more than that.
        self._egress_bound = egress.events_bound()
        egress.listen(run_id, node_id, self._egress_queue.put)
        self._listening = True

    def deliver_egress(self) -> None:
        while True:
            try:
                ev = self._egress_queue.get_nowait()
            except queue.Empty:
                return
            if len(self._egress) >= self._egress_bound:
                continue
            if self.redactor.count:
                ev["data"] = self.redactor.data(ev.get("data") or {})
            self._egress.append(ev)
            self.deliver(ev)

    def stop_egress(self, conduit: Conduit, spec: NodeSpec) -> None:
        """Stop listening, deliver the last decisions and keep them all in the conduit."""
        if not self._listening:
            return
        from prefect_resoluto import egress

        egress.unlisten(spec.run_id, spec.node_id)
        self.deliver_egress()
        _save_egress_events(conduit, spec, self._egress)


def _drive(
    spec: NodeSpec,
    conduit: Conduit,
    runtime: SandboxRuntime,
    observer: NodeObserver,
    warm: AnyWarm | None,
) -> NodeOutcome:
    node = _prepare(spec, conduit, runtime, observer)
    try:
        node.warm = _place_warm(node, warm)
        node.slot = _claim_slot(node)
        _put_inbox(node)
        runtime.prepare(conduit, spec.run_id)
        if node.launch.network is not None:
            node.events.listen_egress(spec.run_id, spec.node_id)
        try:
            node.tailer.watch_before_start()  # then nothing is looked for until it has landed
            handle = _start_sandbox(node)
            if handle is not None:
                _watch(node, handle)
        finally:
            _finish_sandbox(node)
    finally:
        if node.warm is not None:
            node.warm.ended()  # told, not polled: its pool counts it in flight no longer
        if node.beat is not None:
            node.beat.release()
    return _outcome(node)


def _prepare(spec: NodeSpec, conduit: Conduit, runtime: SandboxRuntime, observer: NodeObserver) -> _Node:
    """Refuse what cannot run, before anything is put or launched, and say what to launch."""
    spec.validate()
    check_isolation(runtime, spec.min_isolation)
    t0 = time.monotonic()
    launch = launch_spec(spec, conduit)
    if runtime.capabilities.egress_by_name:
        launch.network = spec.network_request()
    elif spec.setup_egress or spec.egress_forward or spec.egress_resolve:
        raise NodeSpecError(
            f"runtime {runtime.name!r} enforces egress by address (CIDR), not by name: setup_egress, "
            "egress_forward and egress_resolve need a local runtime (gvisor, bubblewrap, container)"
        )
    if runtime.capabilities.host_credentials:
        # A sandbox on this host reaches the store with the host's own credentials; the
        # guest runner keeps them from the workload. Remote runtimes mint their own.
        launch.secret_env = {**conduit.guest_credentials(), **launch.secret_env}
    runtime.check_spec(launch)  # refusals (egress, local conduit on a remote runtime) before any put
    rel_prefix = wire.node_prefix(spec.run_id, spec.node_id)
    beat = None
    if spec.host_lost_after:  # last: nothing below raises, so the lease is always released
        beat = heartbeat.lease(conduit, spec.host_heartbeat_interval, spec.host_lost_after)
        try:
            launch.host_beat_dir = beat.local_dir
        except BaseException:
            beat.release()
            raise
        launch.env.update(beat.env)
    return _Node(
        beat=beat,
        spec=spec,
        conduit=conduit,
        runtime=runtime,
        observer=observer,
        launch=launch,
        rel_prefix=rel_prefix,
        tailer=ChunkTailer(conduit, rel_prefix, silence_window=spec.silence_window),
        events=_Events(observer, Redactor(spec.secret_env.values())),
        t0=t0,
        cold_id=launch.sandbox_id,
    )


def _place_warm(node: _Node, warm: AnyWarm | None) -> AnyWarm | None:
    """The warm sandbox's slot becomes the node's directory, before any put; one that cannot
    take the node is discarded for the pool's next (None: the node launches a cold one)."""
    while warm is not None:
        node.warm_tries += 1
        try:
            warm.place(node.conduit, node.rel_prefix)
        except OSError as e:
            warm = _next_warm(node, warm, f"its slot could not become the node's directory: {e}")
            continue
        node.launch.sandbox_id = warm.handle.id
        return warm
    node.launch.sandbox_id = node.cold_id
    return None


def _next_warm(node: _Node, lost: AnyWarm, why: str) -> AnyWarm | None:
    """Discard ``lost``, which never had the node, and say what takes the node instead: the
    pool's next ready sandbox while WARM_TRIES allows, else None (a cold launch)."""
    lost.discard()
    nxt = lost.replacement() if node.warm_tries < WARM_TRIES else None
    log.warning(
        "warm sandbox %s cannot take node %s (%s); %s",
        lost.handle.id,
        node.spec.node_id,
        why,
        f"warm sandbox {nxt.handle.id} takes it" if nxt is not None else "launching a cold one",
    )
    return nxt


def _retry_elsewhere(node: _Node, lost: AnyWarm, why: str) -> None:
    """A placed warm sandbox refused its assignment: the node's directory (its slot, holding
    only the host's inbox) goes with it, and the node is placed, claimed and filled again for
    the next sandbox."""
    node.warm = None
    placed, lost.placed = lost.placed, None
    nxt = _next_warm(node, lost, why)
    if placed is not None:
        node.tailer.unwatch()  # it watches the directory that goes now
        slot.release(placed)  # the bind of the lost sandbox's slot (its tmpfs went with it)
        shutil.rmtree(placed, ignore_errors=True)  # the host's inbox: the sandbox never ran the node
        node.slot = None
    node.warm = _place_warm(node, nxt)
    if placed is not None:  # elsewhere (a remote conduit) the inbox is where it was put
        node.slot = _claim_slot(node)
        _put_inbox(node)


def _claim_slot(node: _Node) -> _Slot | None:
    """The node's directory in a local conduit the sandbox mounts, made its slot (a warm
    sandbox's is mounted already); None when the sandbox mounts no directory of this host."""
    root, runtime = node.conduit.local_root, node.runtime
    if root is None or not (runtime.capabilities.local_conduit and runtime.capabilities.mounts_conduit):
        return None
    size, setting = slot.capacity_of(node.spec.resources.disk_bytes, node.spec.resources.memory_bytes)
    node_dir = root / node.rel_prefix
    make_dirs(node_dir.parent)
    node_dir.parent.chmod(0o700)  # the host's: a guest's chmod of its slot exposes nothing
    if node.warm is None:
        slot.mount(node_dir, size)
    return _Slot(node_dir, size, setting)


def _put_inbox(node: _Node) -> None:
    """The workspace archive and the spec's extra inbox objects; the slot then grows by what
    they took (the inbox is the host's, not the guest's)."""
    spec, conduit = node.spec, node.conduit
    # The inbox matters only while this host drives the node: a backend may skip its durability.
    if spec.workspace is not None:
        conduit.put_transient(
            wire.inbox_key(node.rel_prefix, wire.WORKSPACE_ARCHIVE_NAME),
            node.observer.pack_workspace(Path(spec.workspace), _nested_dirs(spec, conduit)),
        )
    for name, data in spec.extra_inbox.items():
        conduit.put_transient(wire.inbox_key(node.rel_prefix, name), data)
    root = conduit.local_root
    if root is not None and spec.workspace is None and not spec.extra_inbox:  # else a put made it
        make_dirs(root / node.rel_prefix)
    if node.slot is not None:
        node.slot.host_bytes = slot.used(node.slot.dir)
        slot.grow(node.slot.dir, node.slot.size + node.slot.host_bytes)


def _start_sandbox(node: _Node) -> SandboxHandle | None:
    """Launch the node's sandbox, or assign the warm one its node. None: it did not start
    (``unstartable``; a warm one stays in ``node.handle``, to be destroyed with the node)."""
    try:
        while node.warm is not None and node.handle is None:
            try:
                node.handle = node.warm.assign(node.launch)
            except NotWaiting as e:  # the pool's race, not the node's: the node goes elsewhere
                _retry_elsewhere(node, node.warm, str(e))
        if node.handle is None:
            node.handle = node.runtime.launch(node.launch)
    except BaseException as e:
        if node.warm is not None:
            node.handle = node.warm.handle  # destroyed with the node
        if not isinstance(e, Exception):
            raise
        node.fail(FailureKind.UNSTARTABLE, f"launch failed: {e}")
        return None
    node.timings["launch"] = time.monotonic() - node.t0
    node.observer.launched(node.handle)
    return node.handle


@dataclass
class _Sightings:
    """Consecutive statuses saying "unstartable" or "gone": believed at CONFIRMATIONS."""

    unstartable: int = 0
    gone: int = 0


def _watch(node: _Node, handle: SandboxHandle) -> None:
    """Deliver the node's events until its tail finishes, or it exits, fails to start, is
    gone, falls silent, or the host cancels it (``node.failure`` says which).

    Two clocks: the conduit is polled on the tail's adaptive delay (a poll may be a paid
    request), the runtime's status every ``runtime.status_interval``. Where the host is told
    instead -- a local conduit's directory watch wakes the loop when an object lands, a local
    child's exit descriptor when it exits -- each clock slows to a backstop, so a node that
    runs long costs the host next to nothing while it runs. The loop also wakes every
    ``WAKE`` seconds to see a cancellation (or Prefect's timeout, raised in this thread)
    unless the observer's descriptors tell of it (``wake_fds``, ``cancel_polled``); and at
    the end of the silence window, whatever else wakes it. A watch opened before the sandbox
    started tells of every object it writes: the loop then polls first when it is woken."""
    clocks = _Clocks(
        node.runtime.status_interval,
        node.runtime.exit_fd(handle),
        node.observer.wake_fds(),
        # Egress decisions arrive on the proxy's threads, delivered from this loop's wakes.
        WAKE if node.observer.cancel_polled() or node.launch.network is not None else POLL_BACKSTOP,
    )
    if node.tailer.watched_from_start:
        clocks.polled(node.tailer)  # the watch tells of every object: no first look for any
    else:
        node.tailer.wait(0.0)  # opens a local conduit's watch now: the first poll sees all before it
    try:
        _watch_loop(node, handle, clocks)
    finally:
        clocks.close()
    if node.failure is not None and node.failure != FailureKind.WORKLOAD:
        node.substrate_logs = _logs(node.runtime, handle)


#: Seconds between looks at what the host is also told of: a backstop, not the path. The
#: conduit under a directory watch (an object written without a rename or a close, a watch
#: opened late); a sandbox with an exit descriptor (which fires on its exit, whoever ends it).
POLL_BACKSTOP = 30.0
STATUS_BACKSTOP = 30.0
#: Seconds the watch loop sleeps at most while a cancellation can come unannounced: how soon
#: it is seen (Prefect's timeout of a sync task is an exception raised in this thread: it
#: lands when the loop wakes). A host that announces its cancellations
#: (``NodeObserver.wake_fds``) is not woken for them: a thousand sleeping nodes cost nothing.
WAKE = 2.0


@dataclass
class _Clocks:
    """When the watch loop next polls the conduit and asks the runtime's status."""

    status_interval: float
    exit_fd: int | None
    wake_fds: tuple[int, ...] = ()
    wake_every: float = WAKE
    next_poll: float = 0.0
    next_status: float = 0.0

    def polled(self, tailer: ChunkTailer) -> None:
        watched = tailer.watching and not tailer.behind and not tailer.gapped
        self.next_poll = time.monotonic() + (POLL_BACKSTOP if watched else tailer.next_delay())

    def asked(self, now: float) -> None:
        self.next_status = now + (STATUS_BACKSTOP if self.exit_fd is not None else self.status_interval)

    def wait(self, tailer: ChunkTailer) -> None:
        now = time.monotonic()
        until = min(self.next_poll, self.next_status, now + self.wake_every, tailer.silent_at())
        also = self.wake_fds if self.exit_fd is None else (self.exit_fd, *self.wake_fds)
        if tailer.wait(until - now, also):
            self.next_poll = 0.0  # something landed: read it now
        # Whatever woke it: a sandbox that floods its directory and dies leaves events queued
        # for many wakes, each of which would otherwise hide its exit until STATUS_BACKSTOP.
        if self.exit_fd is not None and _readable(self.exit_fd):
            self.next_status = 0.0  # the sandbox exited: see it now
            self.close()  # from now on, the runtime's own cadence

    def close(self) -> None:
        if self.exit_fd is not None:
            os.close(self.exit_fd)
            self.exit_fd = None


def _readable(fd: int) -> bool:
    return bool(readable([fd], 0.0))


def _watch_loop(node: _Node, handle: SandboxHandle, clocks: _Clocks) -> None:
    tailer, seen = node.tailer, _Sightings()
    while True:
        if time.monotonic() >= clocks.next_poll:
            if not _poll(node) or tailer.finished:
                break
            clocks.polled(tailer)
        if node.observer.cancelled():
            node.fail(FailureKind.LOST, "cancelled by the host")
            break
        now = time.monotonic()
        if now >= clocks.next_status or tailer.result_seen:
            clocks.asked(now)
            if _check_status(node, handle, seen):
                break
        if tailer.silent:  # a last look first: the directory watch may have missed a write
            if _poll(node) and not tailer.finished and tailer.silent:
                node.fail(
                    FailureKind.LOST,
                    f"no event for {tailer.silence:.0f}s (silence window {node.spec.silence_window:.0f}s); "
                    "the sandbox is presumed dead",
                )
            if node.failure is not None or tailer.finished:
                break
        node.events.deliver_egress()
        clocks.wait(tailer)


def _poll(node: _Node) -> bool:
    """Deliver the events that landed since the last poll; False when the tail broke."""
    try:
        node.tailer.poll(node.events.deliver)
    except TailError as e:
        node.fail(FailureKind.PROTOCOL, str(e))
        return False
    except ConduitError as e:
        node.fail(FailureKind.LOST, f"conduit unavailable while tailing: {e}")
        return False
    return True


def _check_status(node: _Node, handle: SandboxHandle, seen: _Sightings) -> bool:
    """One look at the runtime's status; True when it ends the watch (an exit, judged once
    what the sandbox left is read; or a confirmed failure to start, or disappearance)."""
    st = node.st = node.runtime.status(handle)
    if st.phase == "running":
        node.tailer.arm()
    if st.terminal:
        node.failure, node.reason = _drain_after_exit(
            node.tailer, node.events.deliver, st, cancelled=node.observer.cancelled
        )
        return True
    seen.unstartable = seen.unstartable + 1 if st.unstartable else 0
    if seen.unstartable >= CONFIRMATIONS:
        node.fail(FailureKind.UNSTARTABLE, st.reason or "the sandbox cannot start")
        return True
    seen.gone = seen.gone + 1 if st.gone else 0
    if seen.gone >= CONFIRMATIONS:
        reason = st.reason or "the sandbox disappeared"
        node.fail(FailureKind.LOST, reason if node.tailer.armed else reason + " (before it ever ran)")
        return True
    return False


def _finish_sandbox(node: _Node) -> None:
    """On every path, whatever happened: stop tailing, see the sandbox exit (or hand it to the
    host's reaper), destroy it, keep the egress decisions, settle the slot."""
    node.tailer.close()
    if node.handle is not None and node.failure is None:
        _exit_or_hand_over(node, node.handle)
    if node.handle is not None:
        try:
            node.runtime.destroy(node.handle)
        except Exception as e:  # reaping must not hide the real outcome
            log.warning("could not destroy sandbox %s: %s", node.handle.id, e)
    node.events.stop_egress(node.conduit, node.spec)
    if node.slot is not None:
        _settle_slot(node, node.slot)


def _exit_or_hand_over(node: _Node, handle: SandboxHandle) -> None:
    """A node the host saw nothing wrong with: a success whose objects are all in the conduit
    may be handed to ``observer.reap`` (``node.handle`` None: the teardown, and the exit if it
    has not been seen, are not waited for), whether or not its exit was seen first (which of
    the two the host hears of first is a race); otherwise observe the exit. A failed workload
    may have died at the memory limit, which only the substrate's view of the exited sandbox
    tells: wait longer for it."""
    said = _result_status(node)
    failed = said is not None and said != "success"
    if (
        said == "success"
        and node.tailer.finished
        and node.launch.network is None
        and node.observer.reap(handle)
    ):
        node.handle = None
    elif not node.st.terminal:
        node.st = _settle(node.runtime, handle, node.st, 5.0 if failed else 0.5)


def _settle_slot(node: _Node, s: _Slot) -> None:
    try:
        problems = slot.settle(s.dir, s.size, s.setting, host_bytes=s.host_bytes).reason()
    except OSError as e:
        problems = f"the node's conduit slot could not be kept: {e}"
    if problems and node.failure is not FailureKind.UNSTARTABLE:
        node.fail(FailureKind.PROTOCOL, problems)


def _outcome(node: _Node) -> NodeOutcome:
    """Judge the node from what the host saw, the guest's result and its outputs."""
    spec, t0 = node.spec, node.t0
    node.timings["finish"] = time.monotonic() - t0
    if node.tailer.first_event_at is not None:
        node.timings["first_event"] = node.tailer.first_event_at - t0
    status, exit_code = _judge_result(node)
    output_dir, output_files, archives, data = _collect_outputs(node)
    if node.failure is not None:
        status = "failure"
    failure, reason = verdict.with_memory(node.failure, node.reason, node.st, spec.resources)
    redactor = node.events.redactor
    outcome = NodeOutcome(
        run_id=spec.run_id,
        node_id=spec.node_id,
        status=status,
        exit_code=exit_code,
        reason=redactor.text(reason),
        observed_phase=node.st.phase,
        failure=failure,
        substrate_logs=redactor.text(node.substrate_logs),
        output_dir=output_dir,
        output_files=output_files,
        output_archives=archives,
        conduit_prefix=wire.node_prefix(spec.run_id, spec.node_id, base=node.conduit.base_prefix),
        conduit_url=node.conduit.url,
        runtime=node.runtime.name,
        isolation=node.runtime.isolation.label,
        sandbox_id=node.launch.sandbox_id,
        events=node.events.count,
        timings=node.timings,
        warm=node.warm is not None,
        output_data=data,
    )
    node.observer.finished(outcome)
    return outcome


def _judge_result(node: _Node) -> tuple[str, int | None]:
    """The status and exit code the guest reports in ``result.json``, read only when the host
    saw nothing wrong (then ``node.failure`` becomes the guest's verdict)."""
    if node.failure is not None:
        return "failure", node.st.exit_code
    try:
        result = wire.decode_result(_read_result(node))
    except ObjectNotFound:
        node.fail(FailureKind.NO_RESULT, "the sandbox wrote a manifest but no result.json")
        return "failure", node.st.exit_code
    except (wire.WireError, bounded.TooLarge) as e:
        node.fail(FailureKind.PROTOCOL, str(e))
        return "failure", node.st.exit_code
    status, exit_code = result["status"], result["exit_code"]
    node.failure, node.reason = verdict.of_result(result, networked=node.launch.network is not None)
    return status, exit_code


def _collect_outputs(node: _Node) -> tuple[Path | None, dict[str, Path], list[str], dict[str, bytes]]:
    """The outputs the spec asks for, from every outbox archive: one budget and one
    all-or-nothing extraction for them all (the spec's ``read_in_memory`` files into
    memory); a rejected outbox fails the node."""
    spec, conduit = node.spec, node.conduit
    files: dict[str, Path] = {}
    archives: list[str] = []
    data: dict[str, bytes | None] = dict.fromkeys(spec.read_in_memory)
    if node.failure not in (None, FailureKind.WORKLOAD) or not spec.output_paths:
        return None, files, archives, {}
    output_dir = (
        Path(spec.outputs_dir) if spec.outputs_dir else Path(tempfile.mkdtemp(prefix="resoluto-out-"))
    )
    try:
        keys = [
            k
            for k in conduit.list_prefix(wire.outbox_prefix(node.rel_prefix), shallow=True)
            if wire.is_archive_key(k)
        ]
        limit, source = spec.output_allowance()
        for rel in archive.unpack_stream(
            [(k, functools.partial(conduit.get_stream, k)) for k in keys],
            output_dir,
            patterns=spec.output_paths,
            limits=archive.Limits(limit),
            in_memory=data,
        ):
            files[rel] = output_dir / rel
        archives.extend(keys)
    except archive.LimitExceeded as e:
        node.fail(
            FailureKind.PROTOCOL,
            f"outbox rejected: {e}; nothing of it was kept. {verdict.limit_hint(limit, source)}",
        )
    except (archive.ArchiveError, ConduitError) as e:
        node.fail(
            FailureKind.PROTOCOL,
            f"outbox rejected: {e}; nothing of it was kept (the archives stay in the conduit)",
        )
    return output_dir, files, archives, {k: v for k, v in data.items() if v is not None}


def egress_events_key(run_id: str, node_id: str) -> str:
    """Where the host keeps a node's proxy decisions: outside the node's prefix, which
    the guest may write, so the guest can neither forge nor erase them."""
    return f"run/{run_id}/egress/{node_id}.jsonl"


def _save_egress_events(conduit: Conduit, spec: NodeSpec, evs: list[wire.SpanEvent]) -> None:
    try:
        conduit.put(
            egress_events_key(spec.run_id, spec.node_id),
            "".join(wire.encode_event(ev) + "\n" for ev in evs).encode(),
        )
    except (ConduitError, wire.WireError, TypeError, ValueError) as e:
        log.warning("could not store the egress decisions of node %s: %s", spec.node_id, e)


def _drain_after_exit(
    tailer: ChunkTailer,
    deliver: Callable[[wire.SpanEvent], None],
    st: SandboxStatus,
    *,
    cancelled: Callable[[], bool] = lambda: False,
) -> tuple[FailureKind | None, str]:
    """The sandbox has exited: read what it left, then judge. What it left is finite, but
    may be its whole slot of chunks: the host's cancellation is looked at between polls."""
    try:
        if tailer.check_manifest():
            while not tailer.finished:
                tailer.poll(deliver)
                if not tailer.finished and cancelled():
                    return FailureKind.LOST, "cancelled by the host"
                if not tailer.finished and not tailer.behind:
                    tailer.wait(tailer.next_delay())
            return verdict.after_exit(st, manifest=True)
        tailer.poll(deliver)
        while tailer.behind:  # it has exited: what it left is finite
            if cancelled():
                return FailureKind.LOST, "cancelled by the host"
            tailer.poll(deliver)
    except TailError as e:
        return FailureKind.PROTOCOL, str(e)
    except ConduitError as e:
        return FailureKind.LOST, f"conduit unavailable while reading the final events: {e}"
    return verdict.after_exit(st, manifest=False)


def _nested_dirs(spec: NodeSpec, conduit: Conduit) -> list[str]:
    """Our own directories inside the workspace (a local conduit, the outputs): shipping
    them would make every node's inbox hold every earlier node's, growing without bound."""
    assert spec.workspace is not None
    inside = _real(str(spec.workspace)).rstrip("/") + "/"
    nested = []
    for d in (conduit.local_root, spec.outputs_dir, *spec.workspace_skip):
        real = _real(str(d)) if d is not None else ""
        if real.startswith(inside) and real != inside:
            nested.append(real[len(inside) :])
    return nested


@functools.lru_cache(maxsize=64)
def _real(path: str) -> str:
    """``path`` with its links resolved, once per directory of the runner's (each node asks
    for the workspace's and the conduit's: a walk of the path each time)."""
    return os.path.realpath(path)


def _settle(
    runtime: SandboxRuntime, handle: SandboxHandle, st: SandboxStatus, patience: float = 0.5
) -> SandboxStatus:
    """The guest wrote its manifest and is exiting: observe the exit (briefly) so the
    outcome records the phase the substrate reported, not "running"."""
    deadline = time.monotonic() + patience
    pause = 0.005
    while time.monotonic() < deadline:
        try:
            st = runtime.status(handle)
        except Exception:
            return st
        if st.terminal or st.gone:
            return st
        time.sleep(pause)
        pause = min(pause * 2, 0.1)
    return st


def _result_status(node: _Node) -> str | None:
    """result.json's status, None when there is no valid one (judged later, in full)."""
    try:
        return str(wire.decode_result(_read_result(node)).get("status"))
    except Exception:
        return None


def _read_result(node: _Node) -> bytes:
    if node.result_raw is None:
        node.result_raw = bounded.read(
            node.conduit, wire.result_key(node.rel_prefix), wire.MAX_RESULT_BYTES, "a result"
        )
    return node.result_raw


def _logs(runtime: SandboxRuntime, handle: SandboxHandle) -> str:
    try:
        return runtime.logs(handle, tail=200)
    except Exception as e:
        return f"(substrate logs unavailable: {e})"
