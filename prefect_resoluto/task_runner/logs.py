"""Guest span events -> lines in the task run's Prefect logs.

A task's ``get_run_logger()`` records become records of Prefect's own task-run logger
(``prefect.task_runs``, the run's names attached, so the console reads "Task run
'square-ad1' - ..." as on threads), with the guest's own timestamp and level, through
that logger's handlers (the console and the API log handler). The task's prints (its
other output) are treated as Prefect treats a thread's: logged at INFO when the task run
logs prints (``log_prints``), else written to this process's stdout only. The guest
runner's own events are DEBUG. Every event stays in the node's event chunks
(``prefect-resoluto events``). Prefect's log worker sends
every 2 s; a sandbox's output goes to the API through the runner's ``ApiLogBatcher``
instead, which sends a line promptly and coalesces a heavy stream into at most
one request per 0.6 s.

With a batcher, a line's API row is built on the tail's thread and handed to the batcher
first; the logger's handlers (Prefect's console, which renders each line with rich, and
any other) run on the batcher's handler thread, in order, so a chatty
task's console cannot hold its lines back from the API. The row is the dict Prefect's
``APILogHandler.prepare`` makes, built directly (its pydantic model and pendulum
timestamp are the slow part of a line) once the first row of each forwarder has been checked
equal to Prefect's own; any difference and every row is Prefect's again.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from guest_runner import wire
from guest_runner.redact import Redactor
from prefect_resoluto.node import terminal
from prefect_resoluto.node.describe import describe_event
from prefect_resoluto.task_runner import holds

#: Gives a held line's bytes back to its node (holds.NodeHold.give), once it is gone.
Release = Callable[[], None]
#: The logger a sandbox's records go out under: Prefect's own for task runs.
SANDBOX_LOGGER = "prefect.task_runs"
#: Spans whose output lines are the task's own (its prints, its setup command's output).
OUTPUT_SPANS = frozenset({"workload", "setup"})
# A batch leaves once its oldest line has waited COALESCE (the lines of one chunk, and of
# chunks of other nodes landing together, share a request), the previous request started
# at least WINDOW ago and returned at least MIN_WINDOW ago. WINDOW grows with the square
# of the traffic (lines/s over the streams' last half second): 0.1 s up to 100 lines/s,
# 0.4 s at 200, 0.6 s from ~245 on. A lone line goes out within ~10 ms and a stream a
# person can read within ~0.1 s; a heavy one costs one request per 0.6 s (with the first
# line's and Prefect's own, ~2 a second for the flow run) and a line of it waits half
# that plus the round trip (the window's choice and its figures: docs/performance.md,
# "The log stream at 1 000 lines/s"). One request at a time: an API
# slower than WINDOW sets the pace (fewer, larger requests), as Prefect's own worker does,
# without WINDOW added on top of its round trip. A stream's rate is read on the guest's
# clock: a host that lags behind a fast stream still treats it as fast.
COALESCE = 0.01
MIN_WINDOW = 0.1
MAX_WINDOW = 0.6
QUIET_RATE = 100.0  # lines/s up to which the window stays MIN_WINDOW
STALL = 60.0  # at the runner's exit, how long a request may take before lines are given up
ATTEMPTS = 3  # a failed request is sent again (same lines, same order) this many times in all
_RATE_SPAN = 0.5  # seconds of a stream the rate is taken over
_RATE_BUCKET = 0.05


class StreamRate:
    """Lines per second of one node's stream over its last ``_RATE_SPAN``, by the guest's
    timestamps (differences of one clock only, so the host's clock never enters)."""

    def __init__(self) -> None:
        self._buckets: deque[list[float]] = deque()  # [first guest ts, lines]
        self.last_seen = 0.0  # host monotonic time of its latest line

    def add(self, ts: float, now: float) -> None:
        if self._buckets and 0.0 <= ts - self._buckets[-1][0] < _RATE_BUCKET:
            self._buckets[-1][1] += 1
        else:
            self._buckets.append([ts, 1])
        newest = self._buckets[-1][0]
        while newest - self._buckets[0][0] > _RATE_SPAN:
            self._buckets.popleft()
        self.last_seen = now

    def rate(self) -> float:
        # the buckets kept cover up to one bucket more than the span
        return sum(b[1] for b in self._buckets) / (_RATE_SPAN + _RATE_BUCKET)


class HandlerThread:
    """Runs loggers' handlers for queued records on one thread, in the order queued.

    Started in the caller's context (Prefect's settings: the console's style, its level).
    A record queued while the thread is not running is handled on the caller's thread.
    At most ``max_queued`` records, and ``max_bytes`` of them (each record's ``cost``, as
    holds.py measures it), wait: a stream faster than its handlers (a burst of 100 000 lines,
    the console at ~4 000 a second) then holds the tail back, as when the handlers ran on its
    thread, instead of piling records up in memory. The bound is the runner's, whatever the
    number of nodes: the console is one.
    """

    def __init__(self, max_queued: int = 10_000, max_bytes: int = holds.CONSOLE_BYTES) -> None:
        self.max_queued = max(1, max_queued)
        self.max_bytes = max_bytes
        self.held_back = 0  # records whose producer had to wait for room
        self.queued_bytes = 0
        self._cond = threading.Condition()
        self._queue: deque[tuple[logging.Logger, logging.LogRecord, int]] = deque()
        self._added = 0
        self._done = 0
        self._stop = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            ctx = contextvars.copy_context()
            self._thread = threading.Thread(
                target=ctx.run, args=(self._run,), name="resoluto-log-handlers", daemon=True
            )
            self._thread.start()

    def _full(self, cost: int) -> bool:
        # A record bigger than the whole bound still goes, alone.
        return len(self._queue) >= self.max_queued or (
            bool(self._queue) and self.queued_bytes + cost > self.max_bytes
        )

    def handle(self, logger: logging.Logger, record: logging.LogRecord, cost: int = 0) -> None:
        with self._cond:
            running = self._thread is not None and self._thread.is_alive() and not self._stop
            if running and self._full(cost):
                self.held_back += 1
                self._cond.notify_all()
            while running and self._full(cost):
                self._cond.wait(1.0)  # woken by each record handled; re-checks a thread that died
                running = self._thread is not None and self._thread.is_alive() and not self._stop
            if running:
                self._queue.append((logger, record, cost))
                self.queued_bytes += cost
                self._added += 1
                self._cond.notify_all()
        if not running:
            logger.handle(record)

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every record queued so far has been handled (False on timeout)."""
        with self._cond:
            target = self._added
            return self._cond.wait_for(
                lambda: self._done >= target or self._thread is None or not self._thread.is_alive(),
                timeout=timeout,
            )

    def stop(self) -> None:
        """Handle what is queued, then end the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join()
        self._thread = None

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._stop:
                        self._cond.wait()
                    if not self._queue:
                        return
                    logger, record, cost = self._queue.popleft()
                try:
                    logger.handle(record)
                except Exception:  # a handler's own failure is its handleError's; never stop here
                    pass
                del record
                with self._cond:
                    self.queued_bytes -= cost
                    self._done += 1
                    self._cond.notify_all()
        finally:
            with self._cond:  # nobody waits for a thread that is gone; later records go inline
                self._done = self._added
                self._cond.notify_all()


class ApiLogBatcher:
    """Sends a task runner's sandbox lines to the Prefect API, in coalesced batches.

    One background thread and one API client for the runner's lifetime. Lines are
    prepared by Prefect's own ``APILogHandler`` (identical rows to those it would send)
    and sent in arrival order. Prefect's log worker is left alone: draining it (what
    ``APILogHandler.flush()`` does) stops every worker instance and its client, and a
    batch behind its 2 s interval is not what a sandbox's live output needs.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        # (log, its bytes in a request body, what gives its held bytes back once sent)
        self._pending: deque[tuple[dict[str, Any], int, Release | None]] = deque()
        self._pending_bytes = 0
        self._max_bytes = _max_batch_bytes()
        self._oldest = 0.0  # monotonic arrival of the oldest pending line
        self._last_send = 0.0  # monotonic return of the last request
        self._last_start = 0.0  # monotonic start of the last request
        self._added = 0  # lines ever added
        self._done = 0  # lines ever sent, or given up with a failed request
        self._urgent = 0  # flush() callers waiting: send without waiting for the window
        self._streams: dict[int, StreamRate] = {}  # the streams that sent lines lately
        self._stop = False
        self._thread: threading.Thread | None = None
        self.requests = 0
        #: The loggers' handlers of the lines whose rows this batcher sends (the console ...).
        self.handlers = HandlerThread()

    def start(self) -> None:
        self.handlers.start()
        if self._thread is None:
            # The caller's context carries Prefect's settings (the API URL, its key).
            ctx = contextvars.copy_context()
            self._thread = threading.Thread(
                target=ctx.run, args=(self._run,), name="resoluto-api-logs", daemon=True
            )
            self._thread.start()

    def add(
        self,
        log: dict[str, Any],
        stream: StreamRate | None = None,
        ts: float | None = None,
        release: Release | None = None,
    ) -> None:
        """Queue one ``LogCreate``-shaped dict (``APILogHandler.prepare``'s output); ``ts``,
        the guest's timestamp of the line, counts it in its ``stream``'s rate; ``release``
        runs once it is sent or given up."""
        size = int(log.pop("__payload_size__", 0) or len(str(log))) + 1  # and its comma
        now = time.monotonic()
        with self._cond:
            if not self._pending:
                self._oldest = now
                self._cond.notify()
            self._pending.append((log, size, release))
            self._pending_bytes += size
            self._added += 1
            if stream is not None and ts is not None:
                stream.add(ts, now)
                self._streams[id(stream)] = stream
            if self._pending_bytes >= self._max_bytes:
                self._cond.notify()

    def flush(self, timeout: float = 10.0) -> bool:
        """Send every line added so far and wait until it has been sent (False on timeout);
        the handlers of every line queued so far have run too."""
        self.handlers.drain(timeout)
        with self._cond:
            target = self._added
            if self._done >= target:
                return True
            if self._thread is None or not self._thread.is_alive():
                return False
            self._urgent += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: self._done >= target, timeout=timeout)
            finally:
                self._urgent -= 1

    def stop(self) -> None:
        """Send what is pending and end the thread (the runner's exit). Waits as long as
        requests keep completing, as Prefect's own worker does at exit, so a slow API
        loses nothing; gives up only on an API that answers nothing for STALL seconds."""
        self.handlers.stop()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        thread = self._thread
        if thread is None:
            return
        done, since = self._done, time.monotonic()
        while thread.is_alive():
            thread.join(timeout=1.0)
            with self._cond:
                if self._done != done:
                    done, since = self._done, time.monotonic()
                elif time.monotonic() - since > STALL:
                    _report(
                        RuntimeError(
                            f"{self._added - self._done} sandbox log lines not sent: "
                            f"the API answered nothing for {STALL:g} s"
                        )
                    )
                    break
        self._thread = None

    def window(self, now: float) -> float:
        """Least time from one request's return to the next, from the recent line rate. Lock held."""
        for key in [k for k, st in self._streams.items() if now - st.last_seen > _RATE_SPAN]:
            del self._streams[key]  # a stream quiet on the host for a while no longer counts
        rate = sum(st.rate() for st in self._streams.values())
        return min(MAX_WINDOW, max(MIN_WINDOW, MIN_WINDOW * (rate / QUIET_RATE) ** 2))

    def _next_batch(self) -> list[tuple[dict[str, Any], int, Release | None]] | None:
        """Wait until a batch is due and take it; None once stopped with nothing left."""
        with self._cond:
            while True:
                now = time.monotonic()
                if self._pending:
                    due = max(
                        self._oldest + COALESCE,
                        self._last_start + self.window(now),
                        self._last_send + MIN_WINDOW,
                    )
                    if self._stop or self._urgent or self._pending_bytes >= self._max_bytes or now >= due:
                        return self._take()
                    self._cond.wait(due - now)
                elif self._stop:
                    return None
                else:
                    self._cond.wait()

    def _take(self) -> list[tuple[dict[str, Any], int, Release | None]]:
        """Up to one request's worth of pending lines (Prefect's batch size; always at least
        one line, as Prefect's worker does). Lock held."""
        batch: list[tuple[dict[str, Any], int, Release | None]] = []
        size = 0
        while self._pending and (not batch or size + self._pending[0][1] <= self._max_bytes):
            batch.append(self._pending.popleft())
            size += batch[-1][1]
        self._pending_bytes -= size
        self._oldest = time.monotonic()  # what is left waits from now
        return batch

    def _run(self) -> None:
        client: Any = None
        try:
            from prefect.client.orchestration import get_client

            client = get_client(sync_client=True)
            client.__enter__()
        except Exception as e:
            _report(e)
            client = None
        failures = 0
        try:
            while (batch := self._next_batch()) is not None:
                sent = True
                try:
                    if client is None:
                        raise RuntimeError("no Prefect API client")
                    self.requests += 1
                    with self._cond:
                        self._last_start = time.monotonic()
                    client.create_logs([log for log, _, _ in batch])
                    failures = 0
                except Exception as e:  # report, never break a task; retry a few times first
                    failures += 1
                    sent = failures >= ATTEMPTS or client is None
                    if sent:
                        _report(e)
                        failures = 0
                with self._cond:
                    self._last_send = time.monotonic()
                    if sent:
                        self._done += len(batch)
                    else:  # back at the head, in order; the window spaces the retry
                        self._pending.extendleft(reversed(batch))
                        self._pending_bytes += sum(n for _, n, _ in batch)
                        self._oldest = self._last_send
                    self._cond.notify_all()
                if sent:
                    for _, _, release in batch:
                        if release is not None:
                            release()
                else:
                    time.sleep(0.5 * failures)  # an API in trouble gets a moment
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    client.__exit__(None, None, None)
            with self._cond:  # nobody waits for a thread that is gone
                self._done = self._added
                self._cond.notify_all()


def _max_batch_bytes() -> int:
    from prefect.settings import PREFECT_LOGGING_TO_API_BATCH_SIZE, PREFECT_LOGGING_TO_API_MAX_LOG_SIZE

    batch: int = PREFECT_LOGGING_TO_API_BATCH_SIZE.value()
    line: int = PREFECT_LOGGING_TO_API_MAX_LOG_SIZE.value()
    return max(batch - line - 1, 1)


def _report(e: BaseException) -> None:
    if logging.raiseExceptions and sys.stderr:
        sys.stderr.write(f"--- Error logging to API ---\n{e}\n")


def api_handler_of(logger: logging.Logger) -> Any:
    """The ``APILogHandler`` a record handled by ``logger`` reaches, or None."""
    from prefect.logging.handlers import APILogHandler, WorkerAPILogHandler

    lg: logging.Logger | None = logger
    while lg is not None:
        for h in lg.handlers:
            if isinstance(h, APILogHandler) and not isinstance(h, WorkerAPILogHandler):
                return h
        lg = lg.parent if lg.propagate else None
    return None


def _to_api_enabled() -> bool:
    from prefect.context import get_settings_context

    return bool(get_settings_context().settings.logging.to_api.enabled)


class RowBuilder:
    """The API rows of one forwarder's records: what ``APILogHandler.prepare`` returns
    (a ``LogCreate`` dumped to JSON, with ``__payload_size__``), built without pydantic.
    The first record's row is Prefect's own, compared with ours; when they differ (another
    Prefect, another handler), every row is Prefect's."""

    def __init__(self, api: Any, flow_run_id: Any, task_run_id: Any) -> None:
        from prefect.settings import PREFECT_LOGGING_TO_API_MAX_LOG_SIZE

        self.api = api
        self.max_size: int = PREFECT_LOGGING_TO_API_MAX_LOG_SIZE.value()
        self.fast: bool | None = None  # None: not checked yet
        try:
            self.ids = {
                "flow_run_id": str(uuid.UUID(str(flow_run_id))),
                "task_run_id": None if task_run_id is None else str(uuid.UUID(str(task_run_id))),
            }
        except ValueError:
            self.fast = False

    def row(self, record: logging.LogRecord) -> dict[str, Any]:
        if self.fast is False:
            return dict(self.api.prepare(record))
        mine = self._build(record)
        if self.fast is None:
            theirs = dict(self.api.prepare(record))
            self.fast = mine == theirs
            return theirs
        if mine["__payload_size__"] > self.max_size:
            return dict(self.api.prepare(record))  # Prefect truncates it
        return mine

    def _build(self, record: logging.LogRecord) -> dict[str, Any]:
        import orjson

        stamp = datetime.fromtimestamp(record.created, UTC).isoformat()
        row: dict[str, Any] = {
            "name": record.name,
            "level": record.levelno,
            "message": self.api.format(record),
            "timestamp": stamp[:-6] + "Z" if stamp.endswith("+00:00") else stamp,
            **self.ids,
        }
        row["__payload_size__"] = len(orjson.dumps(row))
        return row


class EventLogForwarder:
    """Callable handed to the node driver: one Prefect log record per guest event."""

    def __init__(
        self,
        *,
        task_run_id: Any,
        flow_run_id: Any,
        node_id: str,
        redactor: Redactor | None = None,
        batcher: ApiLogBatcher | None = None,
        run_fields: dict[str, Any] | None = None,
        log_prints: bool = True,
        artifacts: Callable[[wire.SpanEvent], None] | None = None,
        allowance: int = holds.DEFAULT_ALLOWANCE,
    ) -> None:
        """``run_fields``: what Prefect's run logger attaches to a record (task_run_name,
        flow_run_name ...: the console's format names the run with them); ``log_prints``:
        whether the task's plain output lines are logged (else printed to stdout);
        ``artifacts``: takes the events of kind ``artifact`` (relayed_artifacts.ArtifactRelay),
        which are otherwise a DEBUG line; ``allowance``: the most bytes of this node's lines
        held at once, waiting for the API or the console (the rest is dropped, and
        :meth:`report_dropped` says so)."""
        self.task_run_id = task_run_id
        self.flow_run_id = flow_run_id
        self.node_id = node_id
        self.redactor = redactor or Redactor()
        self.batcher = batcher
        self.target = logging.getLogger("prefect.task_runs")
        # Without a batcher, or where the logging config has no API handler, records take
        # Prefect's own path unchanged.
        self._api = api_handler_of(self.target) if batcher is not None else None
        self._rows: RowBuilder | None = None
        self._rate = StreamRate()
        self.run_fields = {
            k: v for k, v in (run_fields or {}).items() if k not in ("task_run_id", "flow_run_id")
        }
        self.log_prints = log_prints
        self.artifacts = artifacts
        self._output_spans: set[str] = set()
        self.lines = 0
        self.hold = holds.NodeHold(allowance)
        self.line_limit = holds.line_limit(allowance)

    def emit(self, level: int, message: str, ts: float | None = None, *, held: bool = True) -> None:
        """One record of the node's; ``held``: counted against the node's allowance (the
        host's own lines about the node are not, and are never dropped)."""
        self.lines += 1
        if not self.target.isEnabledFor(level):
            return  # before any work: most of a node's events are DEBUG details
        # Redacted before it is cut: a secret cut in two would no longer be recognised.
        text = holds.clip(self.redactor.text(message), self.line_limit)
        record = logging.LogRecord(SANDBOX_LOGGER, level, __file__, 0, text, None, None)
        if ts is not None:
            record.created = float(ts)
            record.msecs = (record.created - int(record.created)) * 1000
        for k, v in self.run_fields.items():
            setattr(record, k, v)
        record.task_run_id = self.task_run_id
        record.flow_run_id = self.flow_run_id
        record.resoluto_node_id = self.node_id
        api = self._api
        if api is None:
            self.target.handle(record)
            return
        assert self.batcher is not None
        record.send_to_api = False  # the API row below; the console and other handlers as usual
        log: dict[str, Any] | None = None
        if level >= api.level and api.filter(record) and _to_api_enabled():
            if self._rows is None:
                self._rows = RowBuilder(api, self.flow_run_id, self.task_run_id)
            try:
                log = self._rows.row(record)
            except Exception:
                api.handleError(record)
        # The API row above keeps the text as written; the console shows it escaped.
        record.msg = terminal.safe(record.msg)
        # The row waits for the API, held against the node's allowance: past it the line is
        # dropped. The console's record holds the tail back instead (its bound is the runner's).
        row_cost = 0 if log is None else holds.ROW_OVERHEAD + holds.size(log.get("message"))
        if held and not self.hold.take(row_cost):
            return
        if log is not None:
            self.batcher.add(log, self._rate, ts, _giver(self.hold if held else None, row_cost))
        # Rendered on the batcher's handler thread: its cost never delays a row above.
        record_cost = holds.RECORD_OVERHEAD + holds.size(record.msg, getattr(record, "message", None))
        self.batcher.handlers.handle(self.target, record, record_cost)

    def report_dropped(self) -> None:
        """The node is over: one WARNING saying how much of its output the host dropped, if any."""
        hold = self.hold
        if hold.dropped_lines:
            self.emit(
                logging.WARNING,
                f"{holds.describe(hold.dropped_lines, hold.dropped_bytes)} of this task's sandbox "
                f"output dropped by the host: they came faster than the Prefect API and the console "
                f"took them, and the host holds at most {hold.allowance / 2**20:.1f} MiB of a "
                "sandbox's lines at once (setting log_allowance)",
                held=False,
            )

    def flush(self) -> None:
        """Every line emitted so far is in the API when this returns (or the wait timed out):
        called before the task reports its final state, as a thread's logs would be there."""
        if self.batcher is not None and self._api is not None:
            self.batcher.flush()

    def print_line(self, line: str) -> None:
        """A print of the task's that is not logged: on this process's stdout, as a thread's."""
        self.lines += 1
        out = sys.stdout
        if out is not None:
            out.write(terminal.safe(holds.clip(self.redactor.text(line), self.line_limit)) + "\n")
            out.flush()

    def __call__(self, ev: wire.SpanEvent) -> None:
        kind, event, data = ev.get("kind", ""), ev.get("event", ""), ev.get("data") or {}
        if kind == "artifact" and event == "log":
            if self.artifacts is not None:
                self.artifacts(ev)
            else:
                self.emit(logging.DEBUG, str(data.get("line", "")), ev.get("ts"))
            return
        if event == "open" and kind in OUTPUT_SPANS:
            self._output_spans.add(str(ev.get("span_id", "")))
        if event == "log" and kind == "log":
            if str(ev.get("parent_span_id", "")) in self._output_spans:
                if not data.get("level"):  # a plain line: a print, or a command's output
                    if not self.log_prints:
                        self.print_line(str(data.get("line", "")))
                        return
            elif not data.get("level"):
                # the guest runner's own words (staged, collected ...): details
                self.emit(logging.DEBUG, str(data.get("line", "")), ev.get("ts"))
                return
        described = describe_event(ev)
        if described is not None:
            self.emit(described[0], described[1], ev.get("ts"))


def _giver(hold: holds.NodeHold | None, cost: int) -> Release | None:
    if hold is None or not cost:
        return None
    return functools.partial(hold.give, cost)
