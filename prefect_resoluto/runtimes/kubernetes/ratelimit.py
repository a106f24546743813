"""One client-side rate limit for every request a runtime sends to the API server.

A token bucket (``qps`` tokens a second, at most ``burst`` saved up), written as the
generic cell rate algorithm: one "theoretical arrival time" instead of a token count, so a
caller learns at once how long to wait and sleeps exactly that, once, outside the lock.
A 429 with ``Retry-After`` pauses the bucket for every caller of the runtime, not just
the one that was told (client-go's and Argo's controllers do the same: 20 QPS, burst 30).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: Argo's workflow controller's defaults for its Kubernetes client.
DEFAULT_QPS = 20.0
DEFAULT_BURST = 30
#: The longest pause one Retry-After may impose (a server asking for more is capped).
MAX_PAUSE_S = 60.0


class RateLimiter:
    """``acquire()`` before each request; ``pause(seconds)`` when the server says "later"."""

    def __init__(
        self,
        qps: float = DEFAULT_QPS,
        burst: int = DEFAULT_BURST,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if qps <= 0:
            raise ValueError("qps must be positive")
        self.qps = float(qps)
        self.burst = max(1, int(burst))
        self._interval = 1.0 / self.qps
        self._tolerance = (self.burst - 1) * self._interval
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tat = clock()  # the next token's theoretical arrival time
        self._paused_until = 0.0
        #: Seconds callers were made to wait, in all (for benchmarks and tests).
        self.waited_s = 0.0
        self.pauses = 0

    def reserve(self) -> float:
        """Take the next token; the seconds to wait before using it (0: at once)."""
        with self._lock:
            now = self._clock()
            tat = max(self._tat, now)
            wait = max(0.0, tat - self._tolerance - now, self._paused_until - now)
            self._tat = max(tat, now + wait) + self._interval
            self.waited_s += wait
            return wait

    def acquire(self) -> None:
        wait = self.reserve()
        if wait > 0:
            self._sleep(wait)

    def pause(self, seconds: float) -> None:
        """No request from any caller for ``seconds`` (capped at :data:`MAX_PAUSE_S`)."""
        seconds = min(max(0.0, float(seconds)), MAX_PAUSE_S)
        with self._lock:
            until = self._clock() + seconds
            if until > self._paused_until:
                self._paused_until = until
                self.pauses += 1
