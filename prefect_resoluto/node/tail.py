"""Host-side tail of a node's event chunks.

Chunks are delivered in sequence order and only contiguously: chunk N+1 is never
delivered before chunk N, however long N takes. The tail is finished once the
manifest has been read and every chunk up to ``total_chunks`` delivered.

Polling is adaptive (fast right after launch and after each arrival, backing off
while nothing arrives) and never lists in the steady state: a poll GETs the next
expected chunk key (a "no such key" means nothing new), so its cost is one GET
whatever the number of chunks already read, and a tail started late (a restart, an
adoption) reads from chunk 1 in order. The manifest is fetched on a cadence of its own,
backed off while nothing ends (at once when a root span closes, when a local conduit's
directory watch tells of its landing, or when the driver sees the sandbox exit). A listing is
only for recovery: once at the end (chunks beyond the manifest's count), and, backed
off, after a long stretch with nothing new while the sandbox runs (a gap: a later chunk
there while the next one never comes). Liveness is a silence watchdog, armed by the
driver once the sandbox runs: no chunk at all (not even a heartbeat) for
``silence_window`` seconds means the guest is gone.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from typing import BinaryIO

from guest_runner import wire
from guest_runner.conduit import Conduit, ObjectNotFound
from guest_runner.conduit.local import LocalConduit
from prefect_resoluto.node import bounded
from prefect_resoluto.node.dirwatch import MIN_WAKE_GAP, DirWatch, Fds, wait_fds

__all__ = ["MIN_WAKE_GAP", "ChunkTailer", "DirWatch", "TailError"]  # the watch's, where it was

Event = wire.SpanEvent

DEFAULT_SILENCE_WINDOW = 600.0
MIN_POLL = 0.01
# While silent, a poll at most every 1.5 s: on S3 that is ~40 GETs of the next chunk
# key (answered "no such key"), a GET more per heartbeat chunk (6 at the guest's 10 s)
# and a manifest GET or two per idle minute; no LIST. Doubling reaches the cap in 8 polls
# (~2.5 s) after the last arrival. A local conduit is not bound by this: its directory
# watch wakes the driver at once.
MAX_POLL = 1.5
BACKOFF = 2.0
# The manifest's own cadence: due at once when the tail starts (a node found finished),
# then MANIFEST_START later, doubling to MANIFEST_MAX while nothing ends (2 GETs an idle
# minute). A root span's close (the guest's last events, moments before its manifest) makes
# it due at once and restarts the doubling from MANIFEST_MIN: a node's end is seen within
# a fraction of a second without waiting for the runtime to report the exit.
MANIFEST_START = 2.0
MANIFEST_MIN = 0.05
MANIFEST_MAX = 30.0
# Under a directory watch the manifest's landing wakes the tail itself (it is not a chunk):
# it is looked up then, and on this schedule only as a backstop (a watch that missed it).
MANIFEST_WATCHED = 30.0
# A recovery listing while the sandbox runs: after this long with no chunk at all (a
# guest's heartbeat missed), doubling after each, so a live node never lists and a stalled
# one lists a handful of times before its silence window ends it.
GAP_PROBE_AFTER = 30.0
# A quiet guest heartbeats this many times a silence window (the host tells it so: a window
# shorter than the guest's own 10 s would end a live node that is only quiet)...
HEARTBEATS_PER_WINDOW = 4
# ...and at least this often (seconds), with room before a gap probe lists the node's chunks.
# Not more often: each beat is a chunk the guest writes (an object on S3), and a wake and a
# read of the host's tail.
MAX_HEARTBEAT_INTERVAL = GAP_PROBE_AFTER * 5 / 6


def heartbeat_interval(silence_window: float) -> float:
    """How often a quiet guest tailed with ``silence_window`` should heartbeat (seconds)."""
    return min(silence_window / HEARTBEATS_PER_WINDOW, MAX_HEARTBEAT_INTERVAL)


# A recovery listing reads a page of names at a time and gives up on a page of names that
# are not chunks: what a sandbox writes never sets how much the host holds or requests.
LIST_PAGE = 1000
# ...and at most this many pages: past chunk 99 999 a listing passes the node's own chunks,
# and a page of a local conduit is a scan of the whole directory (quadratic in what a guest
# wrote). A chunk hidden past them is one the host never reads either.
LIST_PAGES = 8
# A poll reads at most this many chunks, so the driver looks at status, cancellation and
# silence between them however fast a guest writes.
CHUNKS_PER_POLL = 16
# ...and stops after the chunk that takes it past this many bytes: a chunk may hold 32 MiB
# (~240 000 events, seconds to decode and deliver), and sixteen of them would keep the
# driver from its status, cancellation and silence checks for minutes.
POLL_BYTES = 4 << 20
# Encoders write none; a few are forgiven, a chunk of them is refused rather than read line
# by line (32 MiB of newlines is 33 M reads).
MAX_BLANK_LINES = 1024
# A chunk the manifest promises, or one a later chunk shows was written, may only be
# missing for this long.
MISSING_CHUNK_GRACE = 2.0


class TailError(RuntimeError):
    """The node's event stream breaks the wire contract."""


class MalformedChunk(TailError):
    def __init__(self, key: str, line_no: int, why: str) -> None:
        super().__init__(f"malformed event in {key} at line {line_no}: {why}")
        self.key = key
        self.line_no = line_no


class MissingChunk(TailError):
    pass


class ManifestMismatch(TailError):
    pass


class ChunkTailer:
    def __init__(
        self,
        conduit: Conduit,
        prefix: str,
        *,
        silence_window: float = DEFAULT_SILENCE_WINDOW,
        min_poll: float = MIN_POLL,
        max_poll: float = MAX_POLL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.conduit = conduit
        self.prefix = prefix.rstrip("/")
        self.silence_window = silence_window
        self.min_poll = min_poll
        self.max_poll = max_poll
        self.clock = clock
        self.delivered = 0  # highest chunk number delivered
        self.events_delivered = 0
        self.total: int | None = None
        self.polls = 0
        #: The last poll stopped at its budget with chunks maybe still there: poll again at
        #: once (no directory event will come for what has landed already).
        self.behind = False
        self.listings = 0  # recovery listings made (none in the steady state)
        self._result_seen = False
        self._armed_at: float | None = None
        self._last_arrival = clock()
        self._delay = min_poll
        self._manifest_at = self._last_arrival  # due at once: a node may be finished already
        self._manifest_gap = MANIFEST_START
        self._probe_after = GAP_PROBE_AFTER
        self._later: str | None = None  # a chunk after the missing next one, seen by a listing
        self._end_checked = False
        self._gap_since: float | None = None
        self.first_event_at: float | None = None
        self._watch: DirWatch | None = None
        self._watch_tried = False
        #: The node's directory on a local conduit, opened with the watch: each object is
        #: then one openat() by name, not a walk from the conduit's root (a poll's syscalls).
        self._dir: tuple[LocalConduit, int] | None = None
        #: The watch was opened before the sandbox could write (:meth:`watch_before_start`).
        self.watched_from_start = False

    # -- liveness ---------------------------------------------------------------
    def arm(self) -> None:
        """Start the silence window (idempotent): call once the sandbox is running."""
        if self._armed_at is None:
            self._armed_at = self._last_arrival = self.clock()

    @property
    def armed(self) -> bool:
        return self._armed_at is not None

    @property
    def silence(self) -> float:
        return self.clock() - self._last_arrival

    @property
    def silent(self) -> bool:
        """True when armed, unfinished and nothing arrived for the whole window."""
        return self.armed and not self.finished and self.silence > self.silence_window

    def silent_at(self) -> float:
        """When (``clock``) the silence window ends if nothing arrives (inf: not armed)."""
        if self._armed_at is None:
            return math.inf
        return self._last_arrival + self.silence_window

    @property
    def finished(self) -> bool:
        return self.total is not None and self.delivered >= self.total

    @property
    def result_seen(self) -> bool:
        """The guest has finished writing: its manifest was read."""
        return self._result_seen

    def next_delay(self) -> float:
        return self._delay

    @property
    def gapped(self) -> bool:
        """A chunk is known to be missing (the manifest counts more, or a later one is
        there): it has MISSING_CHUNK_GRACE to land, so the polls keep their own pace."""
        return (self.total is not None and self.delivered < self.total) or self._later is not None

    def wait(self, timeout: float, also: Fds = None) -> bool:
        """Sleep up to ``timeout`` seconds between polls, or until a descriptor of ``also``
        is readable. On a local conduit, wake as soon as a chunk or the manifest lands in the
        node's directory (True), so arrival is seen at once without polling fast (the
        manifest, when it was what landed, is then due too); elsewhere just sleep (False). The call
        that opens the watch returns True at once: what landed before it was open is read
        by the next poll."""
        if self._watch is None and not self._watch_tried and self._watcher() is not None:
            return True
        watch = self._watch
        if watch is None:
            return wait_fds(also, timeout)
        woke = watch.wait(timeout, also)
        if woke and not watch.only_chunks:
            # The manifest landed, or events were lost that may have been its: a chunk's
            # arrival made every poll also look up a manifest not yet there, one more failed
            # lookup per object the guest writes.
            self._manifest_at = self.clock()
        return woke

    def watch_before_start(self) -> None:
        """Open a local conduit's watch before the guest can write anything: then every chunk
        and the manifest wake :meth:`wait` as they land, so neither is looked for until one
        has (``watched_from_start``). Without a watch (a remote conduit, no directory yet)
        the first poll looks for everything, as after a watch opened late."""
        if self._watcher() is not None:
            self._manifest_at = self.clock() + MANIFEST_WATCHED  # due on its landing, or the backstop
            self.watched_from_start = True

    def unwatch(self) -> None:
        """The node's directory was replaced (its sandbox changed before it started): the
        watch goes, and the next :meth:`wait` opens one on the new directory, whose first
        poll looks for everything."""
        self.close()
        self._watch_tried = self.watched_from_start = False
        self._manifest_at = self.clock()

    @property
    def watching(self) -> bool:
        """Whether a directory watch wakes :meth:`wait` on every arrival (a local conduit)."""
        return self._watch is not None

    def _watcher(self) -> DirWatch | None:
        conduit = self.conduit
        if self._watch is not None or self._watch_tried or not isinstance(conduit, LocalConduit):
            return self._watch
        # The directory is opened first (from the root, no link followed) and the watch put on
        # what was opened: a node directory that is a link is neither read through nor watched.
        try:
            fd = conduit.open_dir(self.prefix)
        except ObjectNotFound:
            if os.path.lexists(conduit.root / self.prefix):
                self._watch_tried = True  # a link or a file where the directory should be
            return None  # else: not created yet, try again next time
        self._watch_tried = True
        self._watch = DirWatch.open(fd)
        # Reads by name from it only for a conduit whose reads are LocalConduit's own (not one
        # that counts or wraps them).
        if type(conduit).get_stream is LocalConduit.get_stream and "get_stream" not in vars(conduit):
            self._dir = (conduit, fd)
        else:
            os.close(fd)
        return self._watch

    def _opener(self, key: str) -> BinaryIO:
        """``key``'s object: by name from the node's directory when it is one of its own."""
        at = self._dir
        name = key[len(self.prefix) + 1 :]
        if at is None or not key.startswith(self.prefix + "/") or "/" in name:
            return self.conduit.get_stream(key)
        return at[0].get_stream_at(at[1], name, key)

    def close(self, *, later: bool = False) -> None:
        """Release the directory watch (if any); the tailer still polls afterwards."""
        if self._watch is not None:
            self._watch.close(later=later)
            self._watch = None
        if self._dir is not None:
            os.close(self._dir[1])
            self._dir = None

    def __del__(self) -> None:
        try:
            self.close(later=True)  # a finalizer may run in a thread holding the hub's lock
        except Exception:
            pass

    # -- polling ------------------------------------------------------------------
    def poll(self, on_event: Callable[[Event], None]) -> int:
        """One round: the manifest when it is due, then every chunk from the next expected
        one on, each fetched by its key, until one is not there yet.

        Returns the number of events delivered. Raises :class:`TailError` subclasses
        for contract violations, after delivering every event that precedes the fault.
        """
        self.polls += 1
        if self.total is None and self.clock() >= self._manifest_at:
            if not self.check_manifest():
                gap = MANIFEST_WATCHED if self._watch is not None else self._manifest_gap
                self._manifest_at = self.clock() + gap
                self._manifest_gap = min(MANIFEST_MAX, self._manifest_gap * BACKOFF)
        n_events = n_bytes = 0
        lively = self.behind = False
        for _ in range(CHUNKS_PER_POLL):
            if self.total is not None and self.delivered >= self.total:
                break
            key = wire.chunk_key(self.prefix, self.delivered + 1)
            try:
                n, heartbeat_only, size = self._deliver(key, on_event)
            except ObjectNotFound:  # not there (yet): nothing new
                break
            n_events += n
            n_bytes += size
            lively = lively or not heartbeat_only
            self.delivered += 1
            self._last_arrival = self.clock()
            self._later = self._gap_since = None
            if n_bytes >= POLL_BYTES:
                break
        else:
            n_bytes = POLL_BYTES  # the budget ran out, not the chunks: more are likely there
        if n_bytes >= POLL_BYTES:
            lively = True
            self.behind = self.total is None or self.delivered < self.total
        self._delay = self.min_poll if lively else min(self.max_poll, self._delay * BACKOFF)
        self._probe_for_gap()
        self._check_consistency()
        return n_events

    def check_manifest(self) -> bool:
        """Fetch _manifest.json directly; True when it exists (then checked against what was
        read: a tail it finishes makes its one listing for chunks beyond its count)."""
        if self.total is not None:
            return True
        try:
            self._read_manifest()
        except ObjectNotFound:
            return False
        self._check_consistency()
        return True

    def _read_manifest(self) -> None:
        key = wire.manifest_key(self.prefix)
        try:
            self.total = wire.decode_manifest(
                bounded.read(self.conduit, key, wire.MAX_MANIFEST_BYTES, "a manifest", self._opener)
            )
        except (wire.WireError, bounded.TooLarge) as e:
            raise ManifestMismatch(f"{key}: {e}") from None
        self._result_seen = True

    def _deliver(self, key: str, on_event: Callable[[Event], None]) -> tuple[int, bool, int]:
        """(events delivered, whether all were heartbeats, characters read) of one chunk."""
        n = blank = size = 0
        heartbeat_only = True
        for line_no, line in chunk_text_lines(self.conduit, key, self._opener):
            size += len(line) + 1
            if not line.strip():
                blank += 1
                if blank > MAX_BLANK_LINES:
                    raise MalformedChunk(key, line_no, f"more than {MAX_BLANK_LINES} blank lines")
                continue
            try:
                ev = wire.decode_event(line)
            except wire.WireError as e:
                raise MalformedChunk(key, line_no, str(e)) from None
            if ev["kind"] != "heartbeat":
                heartbeat_only = False
            if ev["event"] == "close" and not ev["parent_span_id"] and self._watch is None:
                # A root span closed: the guest's manifest is likely moments away (a watch
                # would say when it lands).
                self._manifest_at, self._manifest_gap = self.clock(), MANIFEST_MIN
            if self.first_event_at is None:
                self.first_event_at = time.monotonic()
            on_event(ev)
            n += 1
            self.events_delivered += 1
        return n, heartbeat_only, size

    def _chunk_after(self, after: int) -> str | None:
        """A recovery listing: the key of the first chunk numbered after ``after`` (the node's
        top level, chunk names only), or None. Page by page, one page's names held at a time."""
        # Names of 7+ digits sort among the 6-digit ones ("events-1000000" just after
        # "events-100000"): past 99 999 the listing starts where they can begin, and passes
        # the node's own chunks on its way.
        start = wire.chunk_key(self.prefix, min(after, 99_999)) if after else None
        strays = 0
        for _ in range(LIST_PAGES):
            self.listings += 1
            keys = self.conduit.list_prefix(
                f"{self.prefix}/{wire.CHUNK_PREFIX}", start_after=start, shallow=True, limit=LIST_PAGE
            )
            for key in keys:
                idx = wire.chunk_index(key[len(self.prefix) + 1 :])
                if idx is not None and idx > after:
                    return key
                strays += idx is None
            # A page's worth of names that are not chunks ends the search: a chunk hidden
            # behind them is one the host never reads, and the stray names are not paged.
            if strays >= LIST_PAGE or len(keys) < LIST_PAGE:
                return None
            start = keys[-1]
        return None

    def _probe_for_gap(self) -> None:
        """While the sandbox runs and nothing came for a long while, list once (backed off)
        for a chunk after the next one: that one is then a gap, not a quiet guest."""
        if self.total is not None or not self.armed or self._later is not None:
            return
        if self.silence < self._probe_after:
            return
        self._probe_after *= BACKOFF
        later = self._chunk_after(self.delivered)
        if later is not None:
            self._later = later
            self._gap_since = self.clock()

    def _check_consistency(self) -> None:
        if self.total is not None and self.delivered > self.total:
            raise ManifestMismatch(
                f"{wire.manifest_key(self.prefix)} declares {self.total} chunk(s) but "
                f"{wire.chunk_key(self.prefix, self.total + 1)} exists too"
            )
        if self.finished:
            self._check_nothing_beyond()
            return
        if self.total is None and self._later is None:
            return
        now = self.clock()
        if self._gap_since is None:
            self._gap_since = now
        elif now - self._gap_since > MISSING_CHUNK_GRACE:
            missing = wire.chunk_key(self.prefix, self.delivered + 1)
            if self.total is not None:
                why = f"the manifest declares {self.total} chunk(s) and {self.delivered} were read"
            else:
                why = f"{self._later} exists, so it was written, and {self.delivered} were read"
            raise MissingChunk(f"{missing} is missing: {why}")

    def _check_nothing_beyond(self) -> None:
        """Once, when the manifest's last chunk is read: one listing for chunks beyond it."""
        if self._end_checked or self.total is None:
            return
        self._end_checked = True
        extra = self._chunk_after(self.total)
        if extra is not None:
            raise ManifestMismatch(
                f"{wire.manifest_key(self.prefix)} declares {self.total} chunk(s) but {extra} exists too"
            )

    def follow(
        self,
        on_event: Callable[[Event], None],
        *,
        stop: Callable[[], bool] | None = None,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        """Poll until finished (or ``stop()``), waiting the adaptive delay in between
        (:meth:`wait`, which wakes early on a local conduit, unless ``sleep`` is given)."""
        while not self.finished:
            self.poll(on_event)
            if self.finished or (stop is not None and stop()):
                return
            if self.silent:
                raise TailError(f"no events for {self.silence:.0f}s (silence window {self.silence_window}s)")
            if sleep is not None:
                sleep(self._delay)
            else:
                self.wait(self._delay)


def chunk_text_lines(
    conduit: Conduit, key: str, opener: bounded.Opener | None = None
) -> Iterator[tuple[int, str]]:
    """A chunk's lines as text, bounded (prefect_resoluto.node.bounded); TailError for a chunk
    or a line the host does not read, or one that is not UTF-8."""
    try:
        for line_no, raw in bounded.chunk_lines(conduit, key, opener=opener):
            try:
                yield line_no, raw.decode("utf-8")
            except UnicodeDecodeError:
                raise MalformedChunk(key, line_no, "not UTF-8") from None
    except bounded.TooLarge as e:
        raise TailError(
            f"event chunk refused: {e} (a chunk holds at most {wire.MAX_CHUNK_BYTES} bytes, a line {wire.MAX_LINE_BYTES})"
        ) from None
