"""A test of the shared directory watch starts with the hub's queue drained of an earlier
test's events (another test in this process may have flooded a directory: its lost events
would wake this test's watches, as they must wake a host's)."""

from __future__ import annotations

import os
import tempfile
import time

from prefect_resoluto.node import dirwatch
from prefect_resoluto.node.dirwatch import DirWatch
from support.polling import scaled


def drain_hub() -> None:
    """Publish a chunk name into a directory of its own and wait until a wake tells of it by
    name: the queue is read in order, so everything queued before it has been read. Then no
    broadcast of lost events is owed any more."""
    with tempfile.TemporaryDirectory() as d:
        w = DirWatch.open(d)
        if w is None:
            return
        try:
            deadline = time.monotonic() + scaled(30)
            for i in range(1, 1_000_000):
                os.close(os.open(os.path.join(d, f"events-{i:06d}.jsonl"), os.O_WRONLY | os.O_CREAT))
                if w.wait(max(0.0, deadline - time.monotonic())) and w.only_chunks:
                    break
                assert time.monotonic() < deadline, "the shared watch never read a name"
        finally:
            w.close()
    hub = dirwatch._the_hub()
    if hub is not None:
        with hub.lock:
            hub.overflowed = False  # an overflow read before the name: its broadcast is not this test's
