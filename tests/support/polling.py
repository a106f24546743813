"""Waiting in tests is polling a condition with a deadline, never sleeping a guess."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

#: Upper bound of the scale a busy machine gets (a deadline is a hang detector, not a budget).
MAX_SCALE = 10.0


def scale() -> float:
    """How much slower than idle this machine is now: the load per core (at least 1, at most
    MAX_SCALE), or RESOLUTO_TEST_TIME_SCALE when set. The suite runs on 2 shared cores next
    to other suites; a deadline written for an idle machine is multiplied by this."""
    forced = os.environ.get("RESOLUTO_TEST_TIME_SCALE")
    if forced:
        return max(1.0, float(forced))
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        per_core = 1.0
    return min(MAX_SCALE, max(1.0, per_core))


def scaled(seconds: float) -> float:
    """A deadline (a hang detector) of ``seconds`` on an idle machine, scaled to the load now."""
    return seconds * scale()


def wait_for(
    cond: Callable[[], Any],
    timeout: float = 60.0,
    what: str = "condition",
    *,
    first_delay: float = 0.01,
    max_delay: float = 0.2,
    growth: float = 1.5,
) -> Any:
    """Poll ``cond`` until truthy and return its value; fail after ``timeout`` seconds, scaled
    to the machine's load (:func:`scaled`): the deadline only tells a hang from a slow machine."""
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    delay = first_delay
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(delay)  # polling interval, not synchronisation
        delay = min(delay * growth, max_delay)
