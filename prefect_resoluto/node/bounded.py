"""Reading what a guest wrote to a conduit with bounded memory (issue 30, finding 3).

Every object a sandbox writes is read through a stream: its size is checked first where
the conduit knows it (a local file's ``fstat``, S3's ``ContentLength``) and the read
itself never asks for more than the limit allows, so an object that lies about its size
or grows while read costs no more. Chunks are read a line at a time, each line bounded.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator
from typing import BinaryIO

from guest_runner import wire
from guest_runner.conduit import Conduit, ConduitError, ConduitUnavailable


class TooLarge(ConduitError):
    """An object or a line in it is bigger than the host reads."""


def size_of(f: BinaryIO) -> int | None:
    """The stream's total size, when its conduit says (None: it does not)."""
    size = getattr(getattr(f, "raw", None), "size", None)
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    try:
        return os.fstat(f.fileno()).st_size
    except (OSError, AttributeError, io.UnsupportedOperation):
        return None


def _check_size(f: BinaryIO, key: str, limit: int, what: str) -> None:
    size = size_of(f)
    if size is not None and size > limit:
        raise TooLarge(f"{key} is {size} bytes, more than the {limit} bytes the host reads of {what}")


#: How an object is opened: ``conduit.get_stream`` unless the reader has a quicker way to the same file.
Opener = Callable[[str], BinaryIO]


def read(conduit: Conduit, key: str, limit: int, what: str, opener: Opener | None = None) -> bytes:
    """The whole object, at most ``limit`` bytes (TooLarge beyond: before reading when the
    size is known, else after ``limit + 1`` bytes)."""
    with (opener or conduit.get_stream)(key) as f:
        _check_size(f, key, limit, what)
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise ConduitUnavailable(f"read of {key!r} failed: {e}") from e
    if len(data) > limit:
        raise TooLarge(f"{key} is more than the {limit} bytes the host reads of {what}")
    return data


def chunk_lines(
    conduit: Conduit,
    key: str,
    *,
    max_bytes: int = wire.MAX_CHUNK_BYTES,
    max_line: int = wire.MAX_LINE_BYTES,
    opener: Opener | None = None,
) -> Iterator[tuple[int, bytes]]:
    """(line number, line without its newline) of an event chunk, one line in memory at a
    time. TooLarge for a chunk above ``max_bytes`` (before reading it when the size is
    known) or a line above ``max_line``."""
    with (opener or conduit.get_stream)(key) as f:
        _check_size(f, key, max_bytes, "an event chunk")
        total = 0
        line_no = 0
        while True:
            try:
                line = f.readline(max_line + 1)
            except OSError as e:
                raise ConduitUnavailable(f"read of {key!r} failed: {e}") from e
            if not line:
                return
            line_no += 1
            total += len(line)
            if total > max_bytes:
                raise TooLarge(f"{key} is more than the {max_bytes} bytes the host reads of an event chunk")
            if line.endswith(b"\n"):
                line = line[:-1]
            elif len(line) > max_line:
                raise TooLarge(f"{key} line {line_no} is longer than {max_line} bytes")
            yield line_no, line
