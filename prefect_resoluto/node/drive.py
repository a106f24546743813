"""Drive one node: pack + put the inbox, launch, tail, judge, fetch outputs, reap.

The verdict comes from two places that are kept apart: ``result.json`` is the guest's
word on its own workload; the observed phase, reason and substrate logs are what the
host saw from outside (runtime status, silence, missing objects) and are never taken
from the guest.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guest_runner import archive, wire
from guest_runner.conduit import Conduit, ConduitError, ObjectNotFound
from guest_runner.redact import Redactor
from prefect_resoluto.node import bounded, verdict
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
    SandboxHandle,
    SandboxRuntime,
    SandboxStatus,
    check_isolation,
)

if TYPE_CHECKING:
    from prefect_resoluto.warm.pool import WarmSandbox

log = logging.getLogger("prefect_resoluto.node.drive")

# Consecutive observations before "unstartable"/"gone" is believed (a pod may report
# a transient ErrImagePull, a process may be between fork and exec).
CONFIRMATIONS = 3


def drive(
    spec: NodeSpec,
    conduit: Conduit,
    runtime: SandboxRuntime,
    observer: NodeObserver | None = None,
    *,
    warm: WarmSandbox | None = None,
) -> NodeOutcome:
    """Run ``spec`` in a sandbox of ``runtime`` and return what happened; ``observer`` sees it
    happen (:class:`~prefect_resoluto.node.observer.NodeObserver`: launched, each event, finished)
    and answers for the host (cancelled? reap the sandbox? how to pack the workspace?).

    ``warm``: a sandbox of ``runtime`` started ahead of demand (:mod:`prefect_resoluto.warm.pool`),
    assigned this node instead of launching one; it is destroyed with the node either way.

    A node whose guest wrote a complete manifest and a successful result may be handed to
    ``observer.reap`` (its objects are all in the conduit; what is left is the guest's exit and
    the runtime's teardown), so the outcome returns without waiting for them;
    ``observed_phase`` is then the phase seen before the hand-over (``running``).

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
    on_event: Callable[[dict[str, Any]], None] | None = None,
    min_isolation: IsolationLevel | str | None = None,
    silence_window: float | None = None,
    on_launch: Callable[[SandboxHandle], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
    warm: WarmSandbox | None = None,
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


def _drive(
    spec: NodeSpec,
    conduit: Conduit,
    runtime: SandboxRuntime,
    observer: NodeObserver,
    warm: WarmSandbox | None,
) -> NodeOutcome:
    spec.validate()
    check_isolation(runtime, spec.min_isolation)
    t0 = time.monotonic()
    rel_prefix = wire.node_prefix(spec.run_id, spec.node_id)
    store_prefix = wire.node_prefix(spec.run_id, spec.node_id, base=conduit.base_prefix)
    redactor = Redactor(spec.secret_env.values())

    launch = launch_spec(spec, conduit)
    if runtime.egress_by_name:
        launch.network = spec.network_request()
    elif spec.setup_egress or spec.egress_forward or spec.egress_resolve:
        raise NodeSpecError(
            f"runtime {runtime.name!r} enforces egress by address (CIDR), not by name: setup_egress, "
            "egress_forward and egress_resolve need a local runtime (gvisor, bubblewrap, container)"
        )
    if runtime.supports_local_conduit:
        # A sandbox on this host reaches the store with the host's own credentials; the
        # guest runner keeps them from the workload. Remote runtimes mint their own.
        launch.secret_env = {**conduit.guest_credentials(), **launch.secret_env}
    runtime.check_spec(launch)  # refusals (egress, local conduit on a remote runtime) before any put
    if warm is not None:
        try:
            warm.place(conduit, rel_prefix)  # the slot becomes the node's directory, before any put
            launch.sandbox_id = warm.handle.id
        except OSError as e:
            log.warning(
                "warm sandbox %s cannot take node %s (%s); launching a cold one",
                warm.handle.id,
                spec.node_id,
                e,
            )
            warm.discard()
            warm = None

    # -- the slot: the node's directory as a filesystem of its own (prefect_resoluto.runtimes.slot)
    node_dir: Path | None = None
    slot_size, slot_setting = slot.capacity_of(spec.resources.disk_bytes, spec.resources.memory_bytes)
    root = conduit.local_root
    if root is not None and runtime.supports_local_conduit and runtime.mounts_conduit:
        node_dir = root / rel_prefix
        node_dir.parent.mkdir(parents=True, exist_ok=True)
        node_dir.parent.chmod(0o700)  # the host's: a guest's chmod of its slot exposes nothing
        if warm is None:
            slot.mount(node_dir, slot_size)

    # -- inbox ---------------------------------------------------------------------
    if spec.workspace is not None:
        _put_inbox(
            conduit,
            wire.inbox_key(rel_prefix, wire.WORKSPACE_ARCHIVE_NAME),
            observer.pack_workspace(Path(spec.workspace), _nested_dirs(spec, conduit)),
        )
    for name, data in spec.extra_inbox.items():
        _put_inbox(conduit, wire.inbox_key(rel_prefix, name), data)
    if root is not None:
        (root / rel_prefix).mkdir(parents=True, exist_ok=True)
    inbox_bytes = 0
    if node_dir is not None:
        inbox_bytes = slot.used(node_dir)
        slot.grow(node_dir, slot_size + inbox_bytes)  # the inbox is the host's, not the guest's
    runtime.prepare(conduit, spec.run_id)

    silence_window = spec.silence_window
    tailer = ChunkTailer(conduit, rel_prefix, silence_window=silence_window)
    events = 0
    # The proxy's decisions arrive on its threads; they are delivered from this one.
    egress_queue: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
    egress_events: list[dict[str, Any]] = []
    egress_bound = 0
    if launch.network is not None:
        from prefect_resoluto import egress as _egress

        # The proxy caps each kind of decision per sandbox; this list holds no more than that.
        egress_bound = _egress.events_bound()
        _egress.listen(spec.run_id, spec.node_id, egress_queue.put)

    def deliver(ev: dict[str, Any]) -> None:
        nonlocal events
        events += 1
        if redactor.count:
            ev["data"] = redactor.data(ev.get("data") or {})
        observer.event(ev)

    def deliver_egress() -> None:
        while True:
            try:
                ev = egress_queue.get_nowait()
            except queue.Empty:
                return
            if len(egress_events) >= egress_bound:
                continue
            if redactor.count:
                ev["data"] = redactor.data(ev.get("data") or {})
            egress_events.append(ev)
            deliver(ev)

    failure: FailureKind | None = None
    reason = ""
    substrate_logs = ""
    st = SandboxStatus(phase="pending")
    handle: SandboxHandle | None = None
    timings: dict[str, float] = {}
    try:
        try:
            if warm is not None:
                handle = warm.assign(launch)
            else:
                handle = runtime.launch(launch)
        except Exception as e:
            if warm is not None:
                handle = warm.handle  # reaped below like any other
            failure, reason = FailureKind.UNSTARTABLE, f"launch failed: {e}"
            raise _Stop() from None
        timings["launch"] = time.monotonic() - t0
        observer.launched(handle)
        unstartable_seen = gone_seen = 0
        # Two clocks: the conduit is polled on the tail's adaptive delay (a poll may be a
        # paid request), the runtime's status every runtime.status_interval; a local conduit also
        # wakes the loop the moment an object lands.
        next_poll = next_status = time.monotonic()
        while True:
            if time.monotonic() >= next_poll:
                try:
                    tailer.poll(deliver)
                except TailError as e:
                    failure, reason = FailureKind.PROTOCOL, str(e)
                    break
                except ConduitError as e:
                    failure, reason = FailureKind.LOST, f"conduit unavailable while tailing: {e}"
                    break
                if tailer.finished:
                    break
                next_poll = time.monotonic() + tailer.next_delay()
            if observer.cancelled():
                failure, reason = FailureKind.LOST, "cancelled by the host"
                break
            now = time.monotonic()
            if now >= next_status or tailer.result_seen:
                next_status = now + runtime.status_interval
                st = runtime.status(handle)
                if st.phase == "running":
                    tailer.arm()
                if st.terminal:
                    failure, reason = _drain_after_exit(tailer, deliver, st)
                    break
                unstartable_seen = unstartable_seen + 1 if st.unstartable else 0
                if unstartable_seen >= CONFIRMATIONS:
                    failure, reason = FailureKind.UNSTARTABLE, st.reason or "the sandbox cannot start"
                    break
                gone_seen = gone_seen + 1 if st.gone else 0
                if gone_seen >= CONFIRMATIONS:
                    failure = FailureKind.LOST
                    reason = st.reason or "the sandbox disappeared"
                    if not tailer.armed:
                        reason += " (before it ever ran)"
                    break
            if tailer.silent:
                failure = FailureKind.LOST
                reason = (
                    f"no event for {tailer.silence:.0f}s (silence window {silence_window:.0f}s); "
                    "the sandbox is presumed dead"
                )
                break
            deliver_egress()
            if tailer.wait(min(next_poll, next_status) - time.monotonic()):
                next_poll = 0.0  # something landed: read it now
        if failure is not None and failure != FailureKind.WORKLOAD and handle is not None:
            substrate_logs = _logs(runtime, handle)
    except _Stop:
        pass
    finally:
        tailer.close()
        if handle is not None and failure is None and not st.terminal:
            # A failed workload may have died at the memory limit, which only the
            # substrate's view of the exited sandbox tells: wait longer for it.
            said = _result_status(conduit, rel_prefix)
            failed = said is not None and said != "success"
            if said == "success" and tailer.finished and launch.network is None and observer.reap(handle):
                handle = None  # everything is in the conduit: the exit and teardown need not be waited for
            else:
                st = _settle(runtime, handle, st, 5.0 if failed else 0.5)
        if handle is not None:
            try:
                runtime.destroy(handle)
            except Exception as e:  # reaping must not hide the real outcome
                log.warning("could not destroy sandbox %s: %s", handle.id, e)
        if launch.network is not None:
            _egress.unlisten(spec.run_id, spec.node_id)
            deliver_egress()
            _save_egress_events(conduit, spec, egress_events)
        if node_dir is not None:
            try:
                problems = slot.settle(node_dir, slot_size, slot_setting, host_bytes=inbox_bytes).reason()
            except OSError as e:
                problems = f"the node's conduit slot could not be kept: {e}"
            if problems and failure is not FailureKind.UNSTARTABLE:
                failure, reason = FailureKind.PROTOCOL, problems
    timings["finish"] = time.monotonic() - t0
    if tailer.first_event_at is not None:
        timings["first_event"] = tailer.first_event_at - t0

    status, exit_code = "failure", st.exit_code
    output_dir: Path | None = None
    output_files: dict[str, Path] = {}
    archives: list[str] = []
    if failure is None:
        try:
            result = wire.decode_result(_read_result(conduit, rel_prefix))
            status, exit_code = result["status"], result["exit_code"]
            failure, reason = verdict.of_result(result, networked=launch.network is not None)
        except ObjectNotFound:
            failure, reason = FailureKind.NO_RESULT, "the sandbox wrote a manifest but no result.json"
        except (wire.WireError, bounded.TooLarge) as e:
            failure, reason = FailureKind.PROTOCOL, str(e)
    if failure in (None, FailureKind.WORKLOAD) and spec.output_paths:
        output_dir = (
            Path(spec.outputs_dir) if spec.outputs_dir else Path(tempfile.mkdtemp(prefix="resoluto-out-"))
        )
        try:
            keys = [
                k
                for k in conduit.list_prefix(wire.outbox_prefix(rel_prefix), shallow=True)
                if wire.is_archive_key(k)
            ]
            limit, source = spec.output_allowance()
            # One budget and one all-or-nothing extraction for every archive of the node.
            for rel in archive.unpack_stream(
                [(k, functools.partial(conduit.get_stream, k)) for k in keys],
                output_dir,
                patterns=spec.output_paths,
                limits=archive.Limits(limit),
            ):
                output_files[rel] = output_dir / rel
            archives.extend(keys)
        except archive.LimitExceeded as e:
            failure, status = FailureKind.PROTOCOL, "failure"
            reason = f"outbox rejected: {e}; nothing of it was kept. {verdict.limit_hint(limit, source)}"
        except (archive.ArchiveError, ConduitError) as e:
            failure, status = FailureKind.PROTOCOL, "failure"
            reason = f"outbox rejected: {e}; nothing of it was kept (the archives stay in the conduit)"
    if failure is not None:
        status = "failure"
    failure, reason = verdict.with_memory(failure, reason, st, spec.resources)
    outcome = NodeOutcome(
        run_id=spec.run_id,
        node_id=spec.node_id,
        status=status,
        exit_code=exit_code,
        reason=redactor.text(reason),
        observed_phase=st.phase,
        failure=failure,
        substrate_logs=redactor.text(substrate_logs),
        output_dir=output_dir,
        output_files=output_files,
        output_archives=archives,
        conduit_prefix=store_prefix,
        conduit_url=conduit.url,
        runtime=runtime.name,
        isolation=runtime.isolation.label,
        sandbox_id=launch.sandbox_id,
        events=events,
        timings=timings,
        warm=warm is not None,
    )
    observer.finished(outcome)
    return outcome


class _Stop(Exception):
    pass


def _put_inbox(conduit: Conduit, key: str, data: bytes) -> None:
    # The inbox matters only while this host drives the node: a backend may skip its durability.
    conduit.put_transient(key, data)


def egress_events_key(run_id: str, node_id: str) -> str:
    """Where the host keeps a node's proxy decisions: outside the node's prefix, which
    the guest may write, so the guest can neither forge nor erase them."""
    return f"run/{run_id}/egress/{node_id}.jsonl"


def _save_egress_events(conduit: Conduit, spec: NodeSpec, evs: list[dict[str, Any]]) -> None:
    try:
        conduit.put(
            egress_events_key(spec.run_id, spec.node_id),
            "".join(wire.encode_event(ev) + "\n" for ev in evs).encode(),
        )
    except (ConduitError, wire.WireError, TypeError, ValueError) as e:
        log.warning("could not store the egress decisions of node %s: %s", spec.node_id, e)


def _drain_after_exit(
    tailer: ChunkTailer, deliver: Callable[[dict[str, Any]], None], st: SandboxStatus
) -> tuple[FailureKind | None, str]:
    """The sandbox has exited: read what it left, then judge."""
    try:
        if tailer.check_manifest():
            while not tailer.finished:
                tailer.poll(deliver)
                if not tailer.finished:
                    tailer.wait(tailer.next_delay())
            return verdict.after_exit(st, manifest=True)
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
    ws = Path(spec.workspace).resolve()
    nested = []
    candidates = [
        conduit.local_root,
        spec.outputs_dir,
        *spec.workspace_skip,
    ]
    for d in candidates:
        if d is None:
            continue
        try:
            rel = Path(d).resolve().relative_to(ws)
        except ValueError:
            continue
        if rel.parts:
            nested.append(rel.as_posix())
    return nested


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


def _result_status(conduit: Conduit, rel_prefix: str) -> str | None:
    """result.json's status, None when there is no valid one (judged later, in full)."""
    try:
        return str(wire.decode_result(_read_result(conduit, rel_prefix)).get("status"))
    except Exception:
        return None


def _read_result(conduit: Conduit, rel_prefix: str) -> bytes:
    return bounded.read(conduit, wire.result_key(rel_prefix), wire.MAX_RESULT_BYTES, "a result")


def _logs(runtime: SandboxRuntime, handle: SandboxHandle) -> str:
    try:
        return runtime.logs(handle, tail=200)
    except Exception as e:
        return f"(substrate logs unavailable: {e})"
