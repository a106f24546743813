"""Ships span events to the conduit as immutable, numbered JSONL chunks.

Lines are buffered and flushed as one chunk when the oldest buffered line has waited
``flush_interval`` seconds or the buffer reaches ``flush_bytes``, whichever comes
first; a background thread keeps that promise while the workload is quiet and adds a
heartbeat record when nothing at all was shipped for ``heartbeat_interval``.

A chunk whose put fails is retried with the same number and the same bytes, so a
put that failed after all (an ambiguous S3 timeout) is harmless to repeat.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

from guest_runner import threads, wire
from guest_runner.conduit import Conduit, ConduitError
from guest_runner.redact import Redactor

DEFAULT_FLUSH_INTERVAL = 0.05
DEFAULT_FLUSH_BYTES = 256 * 1024
DEFAULT_HEARTBEAT_INTERVAL = 10.0


class Shipper:
    def __init__(
        self,
        conduit: Conduit,
        prefix: str,
        run_id: str,
        *,
        redactor: Optional[Redactor] = None,
        flush_interval: float = DEFAULT_FLUSH_INTERVAL,
        flush_bytes: int = DEFAULT_FLUSH_BYTES,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.conduit = conduit
        self.prefix = prefix
        self.run_id = run_id
        self.redactor = redactor or Redactor()
        self.flush_interval = flush_interval
        self.flush_bytes = flush_bytes
        self.heartbeat_interval = heartbeat_interval
        self.clock = clock
        self.chunks_written = 0
        self._buf: List[str] = []
        self._buf_bytes = 0
        self._oldest: Optional[float] = None
        self._last_ship = time.monotonic()
        self._pending: Optional[bytes] = None  # a chunk body whose put has not succeeded yet
        self._lock = threading.Lock()  # guards the buffer
        self._flush_lock = threading.Lock()  # serialises chunk numbering and puts
        self._wake = threading.Condition(self._lock)
        self._stop = False
        self._thread: Optional[threads.Started] = None
        self.last_error: Optional[BaseException] = None
        # Span ids in wire.new_span_id's format (16 hex digits), from a random 64-bit start
        # counting up: unique within the node, and no uuid4()/getrandom(2) per log line,
        # which cost a third of the time per line (and a syscall, dear under gVisor).
        self._span_ids = itertools.count(int.from_bytes(os.urandom(8), "big"))

    def new_span_id(self) -> str:
        return "%016x" % (next(self._span_ids) & 0xFFFFFFFFFFFFFFFF)

    # -- emitting -------------------------------------------------------------
    def emit(self, event: wire.SpanEvent) -> None:
        line = wire.encode_event(event)
        with self._lock:
            self._buf.append(line)
            self._buf_bytes += len(line) + 1
            if self._oldest is None:
                self._oldest = time.monotonic()
                self._wake.notify()
            full = self._buf_bytes >= self.flush_bytes
        if full:
            self.flush()

    def event(self, kind: str, event: str, **kw: Any) -> wire.SpanEvent:
        if "data" in kw and kw["data"]:
            kw["data"] = self.redactor.data(kw["data"])
        kw.setdefault("span_id", self.new_span_id())
        ev = wire.make_event(self.run_id, kind, event, ts=self.clock(), **kw)
        self.emit(ev)
        return ev

    def log(self, parent_span_id: str, line: str, *, kind: str = "log", **data: Any) -> None:
        payload: Dict[str, Any] = {"line": self.redactor.text(line)}
        if data:
            payload.update(self.redactor.data(data))
        self.emit(
            wire.make_event(
                self.run_id,
                kind,
                "log",
                span_id=self.new_span_id(),
                parent_span_id=parent_span_id,
                data=payload,
                ts=self.clock(),
            )
        )

    @contextlib.contextmanager
    def span(
        self, parent_span_id: str, kind: str, name: str, inputs: Optional[Dict[str, Any]] = None
    ) -> Iterator["Span"]:
        span = Span(self, self.new_span_id(), parent_span_id, kind, name)
        self.event(
            kind, "open", span_id=span.span_id, parent_span_id=parent_span_id, name=name, data=inputs or {}
        )
        try:
            yield span
        except BaseException:
            span.status = "failure"
            raise
        finally:
            self.event(
                kind,
                "close",
                span_id=span.span_id,
                parent_span_id=parent_span_id,
                name=name,
                status=span.status,
                data=span.outputs,
            )

    # -- flushing -------------------------------------------------------------
    def flush(self) -> None:
        """Write buffered lines as the next chunk. Raises ConduitError if the put fails;
        the lines stay pending and go out with the same chunk number next time."""
        with self._flush_lock:
            if self._pending is None:
                with self._lock:
                    if not self._buf:
                        return
                    lines, self._buf, self._buf_bytes, self._oldest = self._buf, [], 0, None
                self._pending = wire.encode_chunk(lines)
            key = wire.chunk_key(self.prefix, self.chunks_written + 1)
            self.conduit.put(key, self._pending)
            self._pending = None
            self.chunks_written += 1
            self._last_ship = time.monotonic()

    def _due(self) -> Optional[float]:
        """Seconds until the next flush or heartbeat is due (<= 0: now). Lock held."""
        now = time.monotonic()
        if self._pending is not None:
            return 0.0
        if self._oldest is not None:
            return self._oldest + self.flush_interval - now
        return self._last_ship + self.heartbeat_interval - now

    def _run(self) -> None:
        backoff = 0.0
        while True:
            with self._lock:
                while not self._stop:
                    due = self._due()
                    if due is not None and due <= 0 and backoff <= 0:
                        break
                    self._wake.wait(timeout=max(backoff, due or 0.0, 0.001))
                    backoff = 0.0
                if self._stop:
                    return
                heartbeat = self._oldest is None and self._pending is None
            if heartbeat:
                # kind/span id as the reference's heartbeat record
                self.emit(wire.make_event(self.run_id, "heartbeat", "log", span_id="hb", ts=self.clock()))
            try:
                self.flush()
            except ConduitError as e:
                self.last_error = e
                backoff = 0.5  # the conduit's own client already retried; don't spin

    def start(self) -> "Shipper":
        self._thread = threads.start(self._run, "resoluto-shipper")
        return self

    def close(self) -> None:
        """Stop the background thread and ship everything still buffered."""
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.flush()

    def write_manifest(self) -> None:
        """The EOF marker: written last, after every chunk (and after result.json)."""
        self.conduit.put(wire.manifest_key(self.prefix), wire.encode_manifest(self.chunks_written))


class Span:
    __slots__ = ("shipper", "span_id", "parent_span_id", "kind", "name", "status", "outputs")

    def __init__(self, shipper: Shipper, span_id: str, parent: str, kind: str, name: str) -> None:
        self.shipper = shipper
        self.span_id = span_id
        self.parent_span_id = parent
        self.kind = kind
        self.name = name
        self.status = "success"
        self.outputs: Dict[str, Any] = {}

    def log(self, line: str, **data: Any) -> None:
        self.shipper.log(self.span_id, line, **data)
