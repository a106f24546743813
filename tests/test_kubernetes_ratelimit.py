"""The Kubernetes runtime's client-side rate limit (pure: a fake clock, no server)."""

from __future__ import annotations

import pytest

from prefect_resoluto.runtimes.kubernetes.ratelimit import MAX_PAUSE_S, RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_goes_at_once_then_one_request_per_interval() -> None:
    clock = Clock()
    rl = RateLimiter(qps=10, burst=3, clock=clock)
    assert [rl.reserve() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert [round(rl.reserve(), 6) for _ in range(3)] == [0.1, 0.2, 0.3]  # each its own slot
    clock.now += 10  # idle for long: the burst is back, never more than it
    assert [rl.reserve() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert rl.reserve() > 0


def test_a_pause_holds_every_caller_back() -> None:
    clock = Clock()
    rl = RateLimiter(qps=100, burst=30, clock=clock)
    rl.pause(3)
    waits = [rl.reserve() for _ in range(5)]
    assert all(w >= 3 for w in waits), waits
    assert rl.pauses == 1 and rl.waited_s >= 15
    rl.pause(1)  # a shorter pause does not shorten the longer one
    assert rl.pauses == 1
    clock.now += 4
    assert rl.reserve() < 1


def test_a_pause_is_capped_and_the_settings_are_checked() -> None:
    clock = Clock()
    rl = RateLimiter(qps=1000, burst=1000, clock=clock)
    rl.pause(10_000)
    assert rl.reserve() == pytest.approx(MAX_PAUSE_S)
    with pytest.raises(ValueError):
        RateLimiter(qps=0)


def test_acquire_sleeps_the_wait_once() -> None:
    clock = Clock()
    slept: list[float] = []
    rl = RateLimiter(qps=2, burst=1, clock=clock, sleep=slept.append)
    rl.acquire()
    rl.acquire()
    assert slept == [pytest.approx(0.5)]
