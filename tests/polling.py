"""Waiting in tests is polling a condition with a deadline, never sleeping a guess."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(
    cond: Callable[[], Any],
    timeout: float = 60.0,
    what: str = "condition",
    *,
    first_delay: float = 0.01,
    max_delay: float = 0.2,
    growth: float = 1.5,
) -> Any:
    """Poll ``cond`` until truthy and return its value; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = first_delay
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(delay)  # polling interval, not synchronisation
        delay = min(delay * growth, max_delay)
