"""The guest's watch on its host: a sandbox whose host stopped driving it ends by itself.

The host rewrites one small object (``wire.host_beat_key``) every few seconds: a counter
and its own monotonic tick. The guest never compares that tick with its own clock (the
two machines' clocks mean nothing to each other): it reads the object every
``wire.host_beat_poll(bound)`` seconds and notes, by *its own* monotonic clock, when the
content last changed. Unchanged for ``bound`` seconds (``RESOLUTO_HOST_LOST_AFTER``) means
the host is gone (killed, its machine lost, cut off from the store): the watch calls
``on_lost``, which kills the node's work so that the sandbox ends.

Without ``RESOLUTO_HOST_BEAT_KEY`` (a host that writes no heartbeat: the reference
implementation, resoluto-sandbox 0.1.0) nothing is watched. A missing object counts as a
value like any other (the host writes its first beat before it launches anything), and a
read that fails (the store unreachable) counts as no news: neither resets the clock, so
the bound holds whatever the store does. Reads are bounded (``wire.MAX_HOST_BEAT_BYTES``).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Mapping, Optional, Union

from guest_runner import threads, wire
from guest_runner.conduit import Conduit, ConduitError, ObjectNotFound

_MISSING = b"\0missing"


class _Unreadable:
    pass


_UNREADABLE = _Unreadable()


class HostWatch:
    def __init__(
        self,
        conduit: Conduit,
        key: str,
        bound: float,
        on_lost: Callable[[float], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        accept: Optional[Callable[[bytes], bool]] = None,
    ) -> None:
        self.conduit = conduit
        self.key = key
        self.bound = bound
        self.poll = wire.host_beat_poll(bound)
        self.on_lost = on_lost
        self.clock = clock
        #: Whether a changed value is the host's (a warm pod's sealed beat); None: any change.
        self.accept = accept
        self.reads = 0
        self._stop = threading.Event()
        self._thread: Optional[threads.Started] = None

    def read(self) -> Union[bytes, _Unreadable]:
        """The heartbeat's content (at most MAX_HOST_BEAT_BYTES + 1 bytes of it)."""
        self.reads += 1
        try:
            with self.conduit.get_stream(self.key) as f:
                return bytes(f.read(wire.MAX_HOST_BEAT_BYTES + 1))
        except ObjectNotFound:
            return _MISSING
        except (ConduitError, OSError):
            return _UNREADABLE

    def start(self) -> "HostWatch":
        self._thread = threads.start(self._run, "resoluto-hostwatch")
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        last = self.read()
        changed = self.clock()
        while not self._stop.wait(self.poll):
            now_value = self.read()
            now = self.clock()
            if not isinstance(now_value, _Unreadable) and now_value != last and self._accepted(now_value):
                last, changed = now_value, now
            elif now - changed >= self.bound:
                if not self._stop.is_set():
                    self.on_lost(now - changed)
                return

    def _accepted(self, value: bytes) -> bool:
        return self.accept is None or self.accept(value)


def settings(env: Mapping[str, str]) -> Optional["tuple[str, float]"]:
    """(key, bound) from the environment, or None: no heartbeat to watch."""
    key = env.get(wire.ENV_HOST_BEAT_KEY, "")
    raw = env.get(wire.ENV_HOST_LOST_AFTER, "")
    if not key or not raw:
        return None
    try:
        bound = float(raw)
    except ValueError:
        return None
    if not bound > 0:
        return None
    return key, bound
