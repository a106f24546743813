"""Tasks for the warm-pool tests (tests/test_pool_runner.py)."""

from __future__ import annotations

import os

from prefect import task


@task
def mark_tmp() -> bool:
    """Whether an earlier task's marker is in this sandbox's /tmp; then leaves its own."""
    seen = os.path.exists("/tmp/resoluto-marker")
    with open("/tmp/resoluto-marker", "w") as f:
        f.write(os.environ.get("RESOLUTO_NODE_ID", ""))
    return seen


@task
def hog(megabytes: int) -> int:
    block = bytearray(megabytes * 1024 * 1024)
    for i in range(0, len(block), 4096):  # touch every page: the limit is on resident memory
        block[i] = 1
    return len(block) // (1024 * 1024)


@task
def draw() -> list[float]:
    """What a task draws from ``random`` (reseeded after a snapshot restore) and ``os.urandom``."""
    import random

    return [random.random(), int.from_bytes(os.urandom(8), "big") / 2**64]


@task
def same(i: int) -> int:
    """A mapped task's trivial node."""
    return i
