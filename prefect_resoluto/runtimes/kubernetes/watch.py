"""One watch of a runtime's pods instead of one GET per pod per status check.

A :class:`PodWatch` keeps the pods that carry its label (selected on the server:
``app.kubernetes.io/managed-by=prefect-resoluto,resoluto.io/watch=<its id>``) in a cache
fed by a single ``LIST`` then a ``WATCH`` from that list's resourceVersion, on one daemon
thread. ``status()`` reads the cache. The watcher

* resumes from the last resourceVersion it saw (an event's, or a ``BOOKMARK``'s: asked for
  with ``allowWatchBookmarks``) when a stream ends or its connection drops;
* lists again when the server says that version is gone (``410 Gone``, as an ``ERROR``
  event or as the answer), and counts pods missing from the new list as deleted;
* survives any one bad event: a line that is not JSON, an event of an unknown type, an
  object it cannot read -- logged, skipped, the stream read on;
* sends every request through the runtime's :class:`~.ratelimit.RateLimiter` (a 429
  pauses it for every caller).

It starts with the first pod it is told about and stops when the last one is released.
Runtimes with the same connection and namespace in one process share one watch and one
rate limit (:func:`shared`): a worker builds a runtime per flow run, and they still make
one watch.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from prefect_resoluto.runtimes.kubernetes.api import KubernetesApi, KubernetesApiError
from prefect_resoluto.runtimes.kubernetes.manifests import MANAGED_BY, MANAGED_BY_LABEL
from prefect_resoluto.runtimes.kubernetes.ratelimit import RateLimiter

logger = logging.getLogger(__name__)

#: The label that puts a pod in one watch's selection.
WATCH_LABEL = "resoluto.io/watch"
#: A watch line longer than this is skipped as a bad event (a pod is a few KiB).
MAX_EVENT_BYTES = 4 * 1024 * 1024
#: Server-side lifetime of one watch request; the stream then ends and is resumed.
DEFAULT_WATCH_TIMEOUT_S = 300
#: Longest pause between reconnection attempts.
MAX_RECONNECT_DELAY_S = 5.0


@dataclass(frozen=True)
class Sighting:
    """What the watch knows of one pod: ``pod`` is its last state (None: never seen)."""

    pod: Any
    deleted: bool


@dataclass
class WatchStats:
    """What the watcher sent and read (benchmarks and tests)."""

    lists: int = 0
    watches: int = 0
    events: int = 0
    bookmarks: int = 0
    bad_events: int = 0
    expired: int = 0  # 410s: the resourceVersion was compacted away, so a new LIST
    dropped: int = 0  # streams that broke off (reset, truncated, refused)
    errors: list[str] = field(default_factory=list)


class PodWatch:
    """The pods of one label selection in one namespace, kept by a LIST and a WATCH."""

    def __init__(
        self,
        api: KubernetesApi,
        namespace: str,
        *,
        watch_id: str | None = None,
        timeout_s: int = DEFAULT_WATCH_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.id = watch_id or uuid.uuid4().hex[:16]
        self.selector = f"{MANAGED_BY_LABEL}={MANAGED_BY},{WATCH_LABEL}={self.id}"
        self.timeout_s = max(1, int(timeout_s))
        self._clock = clock
        self._lock = threading.Condition()
        self._pods: dict[str, Any] = {}  # name -> the pod's last state
        self._deleted: set[str] = set()
        self._tracked: set[str] = set()
        self._rv = ""  # the resourceVersion the cache reflects ("": list first)
        self._synced = False  # a LIST has filled the cache
        self._connected_since: float | None = None
        self._down_since: float | None = clock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._response: Any = None
        #: A 4xx answer to the watch (RBAC, a server that does not serve watches): statuses are GETs.
        self.fatal: KubernetesApiError | None = None
        self.stats = WatchStats()

    # -- what the runtime asks --------------------------------------------------------------

    def track(self, name: str) -> None:
        """Keep ``name`` in the cache (a pod just created); start watching if not yet."""
        with self._lock:
            self._tracked.add(name)
            # A thread told to stop may still be winding down (a close or the last release
            # just before): it would end without watching for this pod, so a new one starts.
            if self._thread is None or not self._thread.is_alive() or self._stop.is_set():
                self._stop = threading.Event()
                self._thread = threading.Thread(
                    target=self._run, args=(self._stop,), daemon=True, name=f"resoluto-k8s-watch-{self.id}"
                )
                self._thread.start()

    def release(self, name: str) -> None:
        """Forget ``name``; the last one released stops the watch."""
        with self._lock:
            self._tracked.discard(name)
            self._pods.pop(name, None)
            self._deleted.discard(name)
            if not self._tracked:
                self._halt()

    def tracking(self, name: str) -> bool:
        with self._lock:
            return name in self._tracked

    def close(self) -> None:
        with self._lock:
            self._tracked.clear()
            self._pods.clear()
            self._deleted.clear()
            self._halt()

    def lookup(self, name: str) -> Sighting:
        with self._lock:
            return Sighting(self._pods.get(name), name in self._deleted)

    def covers(self, resource_version: str | None) -> bool:
        """Whether the cache reflects the server at ``resource_version`` or later (so a pod
        created there that the cache lacks was deleted). Resource versions are opaque to
        clients; an API server on etcd gives integers, and anything else says False."""
        with self._lock:
            mine = self._rv if self._synced else ""
        return bool(mine.isdigit() and resource_version and resource_version.isdigit()) and int(mine) >= int(
            resource_version or 0
        )

    def stale_for(self) -> float:
        """Seconds the cache has not been fed by a live stream (0 while one is open)."""
        with self._lock:
            return 0.0 if self._down_since is None else self._clock() - self._down_since

    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def wait_synced(self, timeout: float) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: self._synced and self._down_since is None, timeout)

    # -- the thread -----------------------------------------------------------------------------

    def _halt(self) -> None:
        self._stop.set()
        resp, self._response = self._response, None
        if resp is not None:
            _shut(resp)

    def _run(self, stop: threading.Event) -> None:
        failures = 0
        while not stop.is_set():
            try:
                if not self._rv:
                    self._list(stop)
                self._stream(stop)
                failures = 0
            except KubernetesApiError as e:
                failures += 1
                self._went_down(stop)
                if e.status == 410:
                    self._expired()
                    continue
                if e.status is not None and 400 <= e.status < 500 and e.status not in (408, 429):
                    if self.fatal is None:  # refused (RBAC, a server that does not watch): GETs then
                        logger.warning(
                            "kubernetes runtime: cannot watch pods (%s); every status is a GET until it can",
                            e,
                        )
                    self.fatal = e
                self._note(f"{e.status}: {e}")
            except Exception as e:  # a dropped connection, a truncated stream: resume from _rv
                failures += 1
                self._went_down(stop)
                self.stats.dropped += 1
                self._note(f"{type(e).__name__}: {e}")
                logger.debug("kubernetes runtime: pod watch broke off (%s); resuming", e)
            delay = 0.0 if failures <= 1 else min(MAX_RECONNECT_DELAY_S, 0.1 * 2 ** (failures - 2))
            if self.fatal is not None:
                delay = 30.0
            if delay:
                stop.wait(delay * (0.5 + random.random() / 2))
        self._went_down(stop)

    def _note(self, what: str) -> None:
        errs = self.stats.errors
        errs.append(what[:300])
        del errs[:-20]

    def _went_down(self, stop: threading.Event | None = None) -> None:
        with self._lock:
            if stop is not None and stop is not self._stop:
                return  # a stopped thread's last word: the cache is its successor's now
            if self._down_since is None:
                self._down_since = self._clock()
            self._connected_since = None

    def _expired(self) -> None:
        self.stats.expired += 1
        with self._lock:
            self._rv = ""

    def _list(self, stop: threading.Event) -> None:
        api = self.api
        core = api.core()
        listing = api.call(
            "list",
            "pods",
            "",
            lambda: core.list_namespaced_pod(
                self.namespace, label_selector=self.selector, _request_timeout=api.timeout()
            ),
        )
        self.stats.lists += 1
        self.fatal = None
        fresh = {p.metadata.name: p for p in listing.items or []}
        with self._lock:
            if stop is not self._stop:
                return
            for name in list(self._pods):
                if name not in fresh:  # deleted while nobody watched: its last state stays
                    self._deleted.add(name)
            self._pods.update((n, p) for n, p in fresh.items() if n in self._tracked)
            self._rv = listing.metadata.resource_version or ""
            self._synced = True
            self._lock.notify_all()

    def _stream(self, stop: threading.Event) -> None:
        api = self.api
        core = api.core()
        rv = self._rv
        connect, _ = api.timeout()
        resp = api.call(
            "watch",
            "pods",
            "",
            lambda: core.list_namespaced_pod(
                self.namespace,
                label_selector=self.selector,
                watch=True,
                resource_version=rv,
                allow_watch_bookmarks=True,
                timeout_seconds=self.timeout_s,
                _preload_content=False,
                _request_timeout=(connect, self.timeout_s + 30.0),
            ),
        )
        self.stats.watches += 1
        self.fatal = None
        with self._lock:
            if stop.is_set():
                _shut(resp)
                return
            self._response = resp
            self._down_since = None
            self._connected_since = self._clock()
            self._lock.notify_all()
        try:
            for line in _lines(resp):
                if stop.is_set():
                    return
                if not self._event(line):
                    return  # the server ended this stream (an ERROR event)
        finally:
            with self._lock:
                if self._response is resp:
                    self._response = None
            _shut(resp)
        self._went_down(stop)

    def _event(self, line: bytes | None) -> bool:
        """Apply one watch line; False when the stream must be left (410 and other ERRORs)."""
        if line is None:
            return self._bad(f"a line longer than {MAX_EVENT_BYTES} bytes")
        try:
            ev = json.loads(line)
            kind, obj = ev["type"], ev["object"]
            meta = obj.get("metadata") or {}
            rv = meta.get("resourceVersion") or ""
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return self._bad(f"an unreadable line ({type(e).__name__}: {line[:120]!r})")
        if kind == "ERROR":
            code = obj.get("code")
            self._went_down()
            if code == 410:
                self._expired()
            else:
                self._note(f"ERROR event: {code} {obj.get('message', '')}")
            return False
        if kind == "BOOKMARK":
            self.stats.bookmarks += 1
            self._advance(rv)
            return True
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return self._bad(f"an event of unknown type {kind!r}")
        try:
            pod = self.api.core().api_client.deserialize(json.dumps(obj), "V1Pod", "application/json")
            name = pod.metadata.name
        except Exception as e:
            return self._bad(f"a pod it cannot read ({type(e).__name__}: {e})")
        self.stats.events += 1
        with self._lock:
            if name in self._tracked:
                self._pods[name] = pod
                if kind == "DELETED":
                    self._deleted.add(name)
            self._rv = rv or self._rv
            self._lock.notify_all()
        return True

    def _advance(self, rv: str) -> None:
        if rv:
            with self._lock:
                self._rv = rv

    def _bad(self, what: str) -> bool:
        self.stats.bad_events += 1
        self._note(f"bad event: {what}")
        logger.warning("kubernetes runtime: skipped %s in the pod watch of %s", what, self.namespace)
        return True


def _lines(resp: Any) -> Any:
    """The stream's lines (None for one over :data:`MAX_EVENT_BYTES`, which is skipped)."""
    buf = bytearray()
    skipping = False
    for chunk in resp.stream(amt=None, decode_content=False):
        buf.extend(chunk)
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                if len(buf) > MAX_EVENT_BYTES:
                    buf.clear()
                    skipping = True
                break
            line = bytes(buf[:nl])
            del buf[: nl + 1]
            if skipping:
                skipping = False
                yield None
            elif line.strip():
                yield line
    if buf.strip() and not skipping:
        raise ConnectionError("the watch stream ended in the middle of an event")


def _shut(resp: Any) -> None:
    try:
        resp.shutdown()
    except Exception:
        pass
    try:
        resp.release_conn()
    except Exception:
        pass


# -- one watch and one rate limit per connection and namespace, in this process ------------------


@dataclass
class Shared:
    """What runtimes with the same connection share: the rate limit and the watch."""

    limiter: RateLimiter
    watch: PodWatch | None = None
    users: int = 0


_SHARED: dict[Hashable, Shared] = {}
_SHARED_LOCK = threading.Lock()


def shared(key: Hashable, make_limiter: Callable[[], RateLimiter]) -> Shared:
    """The :class:`Shared` of ``key`` (a connection and a namespace), made on first use."""
    with _SHARED_LOCK:
        s = _SHARED.get(key)
        if s is None:
            s = _SHARED[key] = Shared(make_limiter())
        s.users += 1
        return s


def watch_of(s: Shared, make: Callable[[], PodWatch]) -> PodWatch:
    with _SHARED_LOCK:
        if s.watch is None:
            s.watch = make()
        return s.watch
