"""One node's life on a Solari gateway, on the SDK's loop: admission, staging, the command, watching.

A :class:`Session` is the per-sandbox state both sides share: :class:`SessionDriver` (a
coroutine on the SDK's loop) writes it as it admits the sandbox -- waiting out 429s,
retrying no-capacity -- stages the guest runner into the VM, starts the command, relays
the node's objects out and keeps the gateway session alive; the runtime's ``status``
reads it without a request. Sessions are kept in a per-process registry by sandbox id.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import io
import logging
import random
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefect_resoluto.runtimes.solari.errors import (
    admission_kind,
    gateway_words,
    refusal,
    transient_rpc_error,
)
from prefect_resoluto.runtimes.solari.relay import VmRelay
from prefect_resoluto.runtimes.solari.request import VmLayout, create_kwargs
from prefect_resoluto.runtimes.solari.sdk import backoff_s

logger = logging.getLogger(__name__)

#: How long the relay keeps polling at its fastest after the last new object.
_HOT_S = 0.25


@dataclass
class Session:
    spec_id: str
    mode: str
    run_id: str
    rel_prefix: str
    create: dict[str, Any]
    command: dict[str, Any]
    conduit: Any = None  # the run's conduit (relay mode)
    inbox: dict[str, bytes] = field(default_factory=dict)
    gw_id: str | None = None
    sbx: Any = None
    cmd: Any = None
    state: str = "admission"  # admission -> staging -> running -> finished
    waiting_since: float | None = None
    waiting_logged: bool = False
    admission_waits: int = 0
    unstartable: str = ""
    lost: str = ""
    exit_code: int | None = None
    exited: bool = False
    relay: VmRelay | None = None
    finished: bool = False  # nothing more will come from the VM
    reconnects: int = 0
    output: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=2000))
    partial: dict[str, str] = field(default_factory=dict)
    task: concurrent.futures.Future[Any] | None = None
    destroyed: bool = False
    last_keepalive: float = 0.0
    last_view: float = 0.0


# -- the registry -------------------------------------------------------------------------------

_SESSIONS: dict[str, Session] = {}
_KEEP_REAPED = 64
_SESSIONS_LOCK = threading.Lock()


def register(s: Session) -> None:
    with _SESSIONS_LOCK:
        _SESSIONS[s.spec_id] = s
        # Keep the last few reaped sessions (status/logs after destroy), not every one ever run.
        reaped = [k for k, v in _SESSIONS.items() if v.destroyed]
        for k in reaped[: max(0, len(reaped) - _KEEP_REAPED)]:
            del _SESSIONS[k]


def lookup(sandbox_id: str) -> Session | None:
    with _SESSIONS_LOCK:
        return _SESSIONS.get(sandbox_id)


def forget(s: Session) -> None:
    with _SESSIONS_LOCK:
        _SESSIONS.pop(s.spec_id, None)


# -- driving one session ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DriveSettings:
    """The runtime's options a session's driver follows."""

    base_url: str | None
    session_timeout_s: float
    admission_backoff_max_s: float = 10.0
    admission_patience_s: float | None = None
    capacity_retries: int = 5
    reconnect_patience_s: float = 60.0
    relay_poll_min_s: float = 0.01
    relay_poll_max_s: float = 0.25
    view_interval_s: float = 5.0


class SessionDriver:
    """Runs one :class:`Session` from create to its last object; every method runs on the SDK's loop."""

    def __init__(self, settings: DriveSettings, layout: VmLayout) -> None:
        self.settings = settings
        self.layout = layout

    async def drive(self, client: Any, s: Session, first: concurrent.futures.Future[str]) -> None:
        def answer(verdict: str) -> None:
            if not first.done():
                first.set_result(verdict)

        try:
            if not await self._admit(client, s, answer):
                return
            answer("created")
            if s.destroyed:
                return
            asyncio.ensure_future(self._keepalive(s))
            s.state = "staging"
            await self._stage(s)
            if s.mode == "relay":
                s.relay = VmRelay(s.sbx.files, self.layout.store_root, s.rel_prefix, s.conduit)
            await self._start_command(s)
            s.state = "running"
            await self._watch(client, s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an unexpected error must end as a verdict, not a hung node
            if not (s.lost or s.unstartable):
                if s.state in ("admission", "staging"):
                    words = gateway_words(e)
                    hint = (
                        " (the control channel refused the API key: fix api_key or SOLARI_API_KEY)"
                        if ("401" in words or "403" in words)
                        else ""
                    )
                    s.unstartable = f"could not start the Solari sandbox: {type(e).__name__}: {words}{hint}"
                else:
                    s.lost = f"lost contact with the Solari sandbox: {type(e).__name__}: {gateway_words(e)}"
            logger.debug("solari session %s ended with %r", s.spec_id, e)
        finally:
            answer("refused" if s.unstartable else "")
            s.finished = True

    async def _admit(self, client: Any, s: Session, answer: Callable[[str], None]) -> bool:
        from solari_core.errors import ConcurrencyLimitError, NoCapacityError, SolariConnectionError

        capacity_tries = 0
        attempt = 0
        while not s.destroyed:
            try:
                # The SDK's create carries one Idempotency-Key across its own retries.
                sbx = await client.create(**create_kwargs(s.create))
            except Exception as e:
                kind = admission_kind(e, ConcurrencyLimitError, NoCapacityError, SolariConnectionError)
                if kind is None:
                    s.unstartable = refusal(e, self.settings.base_url)
                    return False
                if kind == "slot":
                    if not await self._wait_for_slot(s, e, answer, attempt):
                        return False
                    attempt += 1
                    continue
                capacity_tries += 1
                if capacity_tries > self.settings.capacity_retries:
                    s.unstartable = (
                        f"the Solari gateway {self.settings.base_url} had no capacity / could not be reached "
                        f"after {capacity_tries} create attempts: {gateway_words(e)}"
                    )
                    return False
                await asyncio.sleep(backoff_s(capacity_tries))
                continue
            s.sbx, s.gw_id = sbx, sbx.id
            if s.destroyed:  # destroyed while the create was in flight: do not leak the VM
                await kill(client, s)
                return False
            return True
        return False

    async def _wait_for_slot(
        self, s: Session, e: BaseException, answer: Callable[[str], None], attempt: int
    ) -> bool:
        """Held for admission (429): never unstartable, never an infrastructure retry."""
        if s.waiting_since is None:
            s.waiting_since = time.monotonic()
            answer("waiting")
        s.admission_waits += 1
        waited = time.monotonic() - s.waiting_since
        if self.settings.admission_patience_s is not None and waited >= self.settings.admission_patience_s:
            s.unstartable = (
                f"no Solari slot for {waited:.0f}s (admission_patience_s "
                f"{self.settings.admission_patience_s:.0f}): {gateway_words(e)}"
            )
            return False
        await asyncio.sleep(
            min(self.settings.admission_backoff_max_s, 0.2 * 2 ** min(attempt, 6))
            * (0.5 + random.random() / 2)
        )
        return True

    async def _stage(self, s: Session) -> None:
        """Write the guest runner (and, relaying, the inbox) into the VM through the files API."""
        from prefect_resoluto.runtimes.guest_bundle import build_guest_bundle

        files = s.sbx.files
        # SDK divergence 6: RPC params carry explicit nulls for unset fields; every fs.write here
        # names its mode so only the gateway's documented optional field is left out.
        dirs = {self.layout.guest_dir, self.layout.lib_dir, self.layout.workspace}
        _, blob = build_guest_bundle()
        members: list[tuple[str, bytes]] = []
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
            for m in tar.getmembers():
                if m.isfile():
                    data = tar.extractfile(m).read()  # type: ignore[union-attr]
                    members.append((f"{self.layout.lib_dir}/{m.name}", data))
                    dirs.add(f"{self.layout.lib_dir}/{m.name.rsplit('/', 1)[0]}")
        if s.mode == "relay":
            dirs.add(f"{self.layout.store_root}/{s.rel_prefix}")
            for key in s.inbox:
                dirs.add(f"{self.layout.store_root}/{key.rsplit('/', 1)[0]}")
        for d in sorted(dirs):
            await files.mkdir(d)
        for path, data in members:
            await files.write(path, data, 0o644)
        for key, data in sorted(s.inbox.items()):
            await files.write(f"{self.layout.store_root}/{key}", data, 0o644)
        s.inbox.clear()

    async def _start_command(self, s: Session) -> None:
        c = s.command
        # SDK divergence 8: commands.start(timeout_ms=N) arms its deadline even when the exit frame
        # beat the cmd.start reply, then sends a spurious cmd.kill -9: no SDK deadline at all --
        # liveness is the silence watchdog's.
        s.cmd = await s.sbx.commands.start(c["cmd"], args=c["args"], cwd=c["cwd"], env=c["env"])

        def on_data(stream: str, text: str) -> None:
            # SDK divergence 7: output is decoded per chunk with errors="replace"; it is forensics only
            # (events travel through the conduit), so a character split across chunks may show as U+FFFD.
            buf = s.partial.get(stream, "") + text
            *lines, rest = buf.split("\n")
            s.partial[stream] = rest
            s.output.extend(lines)

        s.cmd.on_data(on_data)
        asyncio.ensure_future(self._await_exit(s, s.cmd))

    async def _await_exit(self, s: Session, cmd: Any) -> None:
        try:
            s.exit_code = await cmd.wait()
            s.exited = True
        except Exception:
            # The channel dropped before cmd.exit: the exit frame is gone with it. The VM's own
            # objects (the manifest) tell the rest; the watch loop reconnects.
            pass

    async def _watch(self, client: Any, s: Session) -> None:
        delay = self.settings.relay_poll_min_s
        last_progress = time.monotonic()
        lost_channel_at: float | None = None
        while not s.destroyed:
            now = time.monotonic()
            try:
                if now - s.last_view >= self.settings.view_interval_s:
                    s.last_view = now
                    if not await self._still_there(client, s):
                        return
                progressed = False
                if s.relay is not None and not s.relay.done:
                    exited_before = s.exited
                    progressed = await s.relay.step()
                    if not s.relay.done and exited_before:
                        return  # a whole pass after the exit found no manifest: the guest left none
                if (s.relay is not None and s.relay.done) or (s.relay is None and s.exited):
                    return
                lost_channel_at = None
            except Exception as e:
                if not transient_rpc_error(e):
                    raise
                lost_channel_at = lost_channel_at or time.monotonic()
                if not await self._still_there(client, s):
                    return
                if time.monotonic() - lost_channel_at > self.settings.reconnect_patience_s:
                    s.lost = (
                        f"the control channel to Solari sandbox {s.gw_id} dropped and could not be "
                        f"re-established for {self.settings.reconnect_patience_s:.0f}s: {gateway_words(e)}"
                    )
                    return
                await asyncio.sleep(backoff_s(min(s.reconnects, 4)))
                try:
                    # SDK divergence 4: client.connect(id) derives the control URL from base_url and
                    # ignores the one the gateway returned; reconnecting the handle itself keeps the
                    # gateway's controlUrl from create.
                    await s.sbx.reconnect()
                    s.reconnects += 1
                except Exception as again:
                    logger.debug("solari reconnect of %s failed: %r", s.gw_id, again)
                continue
            # A busy guest ships a chunk every flush interval (50 ms): stay fast for a few of them
            # after the last new object, then back off while it is quiet (each poll is one RPC).
            if progressed:
                last_progress = time.monotonic()
            if time.monotonic() - last_progress < _HOT_S:
                delay = self.settings.relay_poll_min_s
            else:
                delay = min(self.settings.relay_poll_max_s, delay * 2)
            await asyncio.sleep(delay)

    async def _keepalive(self, s: Session) -> None:
        """Liveness is ours: while the host watches the node, the gateway keeps the session."""
        while not (s.finished or s.destroyed):
            try:
                await s.sbx.set_timeout(int(self.settings.session_timeout_s * 1000))
                s.last_keepalive = time.monotonic()
            except Exception as e:  # the watch loop judges a gone sandbox; retry soon
                logger.debug("solari set_timeout on %s failed: %r", s.gw_id, e)
                await asyncio.sleep(min(1.0, self.settings.session_timeout_s / 6))
                continue
            await asyncio.sleep(self.settings.session_timeout_s / 3)

    async def _still_there(self, client: Any, s: Session) -> bool:
        from solari_core.errors import NotFoundError

        try:
            view = await client.get(s.gw_id)
        except NotFoundError as e:
            if not s.destroyed:
                s.lost = f"the Solari sandbox {s.gw_id} is gone (404 from the gateway: {gateway_words(e)})"
            return False
        except Exception as e:  # the gateway itself is unreachable: keep trying, the watchdog decides
            logger.debug("solari GET %s failed: %r", s.gw_id, e)
            return True
        if view.state not in ("running", "starting") and not s.destroyed:
            s.lost = (
                f"the Solari sandbox {s.gw_id} is no longer running: the gateway reports state "
                f"{view.state!r} (expires at {view.expiresAt})"
            )
            return False
        return True


async def kill(client: Any, s: Session) -> None:
    """Kill the VM (idempotent: a 404 counts as done) and close the handle's channel."""
    if s.gw_id:
        await client.kill(s.gw_id)  # idempotent: a 404 counts as done
    if s.sbx is not None:
        try:
            await s.sbx.close()
        except Exception:
            pass
