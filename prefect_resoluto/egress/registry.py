"""One registry per process of what each run has on the egress side: its proxy (started by
its first sandbox, stopped with its last) and the event sinks of its nodes.

Knows neither sockets nor policies: the proxy (:mod:`.proxy`) is whatever ``start`` made,
stopped through its ``stop()``. Sinks are keyed by (run, node) and may be set before the
run's proxy exists (the driver listens before it launches).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from guest_runner import wire

Sink = Callable[[wire.SpanEvent], None]


class Stoppable(Protocol):
    def stop(self) -> None: ...


P = TypeVar("P", bound=Stoppable)

_LOCK = threading.Lock()
_PROXIES: dict[str, tuple[Any, int]] = {}
_SINKS: dict[tuple[str, str], Sink] = {}


def acquire(run_id: str, start: Callable[[str], P]) -> P:
    """The run's proxy, made by ``start(run_id)`` for its first sandbox; pair every call with
    :func:`release`."""
    with _LOCK:
        entry = _PROXIES.get(run_id)
        if entry is None:
            proxy = start(run_id)
            _PROXIES[run_id] = (proxy, 1)
            return proxy
        _PROXIES[run_id] = (entry[0], entry[1] + 1)
        found: P = entry[0]
        return found


def release(run_id: str) -> None:
    """Stops the run's proxy when its last sandbox lets go."""
    with _LOCK:
        entry = _PROXIES.get(run_id)
        if entry is None:
            return
        proxy, count = entry
        if count > 1:
            _PROXIES[run_id] = (proxy, count - 1)
            return
        del _PROXIES[run_id]
    proxy.stop()


def proxy_of(run_id: str) -> Any:
    """The live proxy of ``run_id`` in this process, if any."""
    with _LOCK:
        entry = _PROXIES.get(run_id)
        return entry[0] if entry else None


def listen(run_id: str, node_id: str, sink: Sink) -> None:
    """Send the proxy's decisions for this node to ``sink(event)`` (any thread)."""
    with _LOCK:
        _SINKS[(run_id, node_id)] = sink


def unlisten(run_id: str, node_id: str) -> None:
    with _LOCK:
        _SINKS.pop((run_id, node_id), None)


def publish(run_id: str, node_id: str, ev: wire.SpanEvent) -> None:
    """Hand ``ev`` to the node's sink, if one listens (outside the lock: a sink may block)."""
    with _LOCK:
        sink = _SINKS.get((run_id, node_id))
    if sink is not None:
        sink(ev)
