"""What the host holds of one node's lines, in bytes (issue 39, finding 3).

A sandbox writes lines faster than the Prefect API takes them; each line waiting for it is
host memory. A node's lines are held against its allowance (``log_allowance``): a line that
does not fit is dropped and counted, and the node's end says once how much was dropped.
The console's queue is bounded in bytes too (CONSOLE_BYTES, the runner's), by holding the
tails back. A line is measured as CPython holds it (a str with one
emoji costs 4 bytes a character), plus what its record and API row cost around it.
"""

from __future__ import annotations

import sys
import threading
from collections import deque

from prefect_resoluto.runtimes.base import parse_quantity
from prefect_resoluto.settings.fields import LOG_ALLOWANCE_DEFAULT, LOG_ALLOWANCE_MIN

#: The default allowance (declared with the setting): a few lines of the longest kind, or
#: thousands of short ones, per node.
DEFAULT_ALLOWANCE_TEXT = LOG_ALLOWANCE_DEFAULT
DEFAULT_ALLOWANCE = parse_quantity(LOG_ALLOWANCE_DEFAULT)
#: The most bytes of records waiting for the console, whatever the number of nodes: past it
#: the tails wait (the console is one, and its pace is what a terminal takes).
CONSOLE_BYTES = 16 << 20
MIN_ALLOWANCE = LOG_ALLOWANCE_MIN
#: A line the host keeps is at most this many characters (and at most a sixteenth of the
#: allowance, so a handful of the longest lines fit): Prefect's API stores a line of at most
#: ~1 MB anyway, and nobody reads a longer one on a console.
MAX_LINE_CHARS = 256 << 10
#: What a held line costs beside its text: its log record (~850 bytes measured) and its
#: API row (~600 bytes).
RECORD_OVERHEAD = 900
ROW_OVERHEAD = 600
#: The cost of a kept line of command output beside its text (the list's slot, the str header).
OUTPUT_OVERHEAD = 64


def line_limit(allowance: int) -> int:
    """The most characters of one line the host keeps, for a node of ``allowance`` bytes."""
    return max(1024, min(MAX_LINE_CHARS, allowance // 16))


def clip(line: str, limit: int) -> str:
    """``line``, cut at ``limit`` characters with a marker that says so."""
    if len(line) <= limit:
        return line
    return f"{line[:limit]} [... {len(line) - limit} more characters not kept: a line is at most {limit}]"


def size(*texts: object) -> int:
    """Bytes the distinct str objects among ``texts`` take (None and repeats cost nothing)."""
    seen: set[int] = set()
    total = 0
    for t in texts:
        if isinstance(t, str) and id(t) not in seen:
            seen.add(id(t))
            total += sys.getsizeof(t)
    return total


def describe(lines: int, nbytes: int) -> str:
    return f"{lines} line{'s' if lines != 1 else ''} ({nbytes / 2**20:.1f} MiB)"


class NodeHold:
    """One node's held bytes: ``take`` before holding a line, ``give`` back once it is gone."""

    def __init__(self, allowance: int) -> None:
        self.allowance = allowance
        self.held = 0
        self.peak = 0
        self.dropped_lines = 0
        self.dropped_bytes = 0
        self._lock = threading.Lock()

    def take(self, cost: int) -> bool:
        """Hold ``cost`` more bytes (True), or count the line as dropped (False)."""
        with self._lock:
            if self.held + cost > self.allowance:
                self.dropped_lines += 1
                self.dropped_bytes += cost
                return False
            self.held += cost
            self.peak = max(self.peak, self.held)
            return True

    def give(self, cost: int) -> None:
        with self._lock:
            self.held -= cost


class KeptOutput:
    """A command's output lines, at most ``allowance`` bytes of them: the first half of the
    allowance from its start and the rest from its end (where a failure usually says why),
    with a line in between saying what was left out."""

    def __init__(self, allowance: int) -> None:
        self.limit = line_limit(allowance)
        self._half = allowance // 2
        self._head: list[str] = []
        self._head_bytes = 0
        self._tail: deque[tuple[str, int]] = deque()
        self._tail_bytes = 0
        self.dropped_lines = 0
        self.dropped_bytes = 0

    def __call__(self, line: str) -> None:
        line = clip(line, self.limit)
        cost = size(line) + OUTPUT_OVERHEAD
        if not self._tail and self._head_bytes + cost <= self._half:
            self._head.append(line)
            self._head_bytes += cost
            return
        self._tail.append((line, cost))
        self._tail_bytes += cost
        while self._tail_bytes > self._half:
            _, gone = self._tail.popleft()
            self._tail_bytes -= gone
            self.dropped_lines += 1
            self.dropped_bytes += gone

    @property
    def held(self) -> int:
        return self._head_bytes + self._tail_bytes

    def text(self) -> str:
        lines = list(self._head)
        if self.dropped_lines:
            lines.append(f"[... {describe(self.dropped_lines, self.dropped_bytes)} of output not kept ...]")
        lines.extend(line for line, _ in self._tail)
        return "\n".join(lines)
