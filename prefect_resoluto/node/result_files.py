"""The Python-call protocol's files in a node's outputs directory, read and rewritten
without following a link.

The extractor only ever makes regular files, directories and in-tree links there; these
readers do not rely on it: every component is opened relative to the outputs directory's
file descriptor with O_NOFOLLOW, the file must be a regular file within a size limit, and
a rewrite is a fresh file renamed over the old name, never a write through it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from guest_runner.conduit.local import write_at
from guest_runner.wire import WireError

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class ResultFileError(WireError):
    """A result file that is not a plain regular file within its size limit."""


def _parent_fd(output_dir: Path, rel: str) -> tuple[int, str]:
    """(fd of the directory holding ``rel``, its last component); FileNotFoundError if absent."""
    parts = [p for p in rel.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ValueError(f"not a relative file name: {rel!r}")
    fd = os.open(output_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                raise
            except OSError:  # ELOOP / ENOTDIR: a link or a file where a directory should be
                raise ResultFileError(f"{rel} from the sandbox: {part!r} is not a directory") from None
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


def _open_regular(output_dir: Path, rel: str) -> tuple[BinaryIO, int] | None:
    """(the open file, its size) for a regular file at ``output_dir/rel``; None when absent."""
    try:
        dfd, leaf = _parent_fd(output_dir, rel)
    except FileNotFoundError:
        return None
    try:
        fd = os.open(leaf, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a link
        raise ResultFileError(f"{rel} from the sandbox is not a regular file ({e.strerror})") from None
    finally:
        os.close(dfd)
    f = os.fdopen(fd, "rb")
    st = os.fstat(f.fileno())
    if not stat.S_ISREG(st.st_mode):
        f.close()
        raise ResultFileError(f"{rel} from the sandbox is not a regular file")
    return f, st.st_size


def read(output_dir: Path, rel: str, limit: int | None) -> bytes | None:
    """The bytes of ``output_dir/rel``; None when there is no such file.

    Raises :class:`ResultFileError` for a link, a FIFO, a directory or anything else that
    is not a regular file, and for a file larger than ``limit`` bytes (None: no limit)."""
    opened = _open_regular(output_dir, rel)
    if opened is None:
        return None
    f, size = opened
    with f:
        if limit is not None and size > limit:
            raise ResultFileError(f"{rel} from the sandbox is {size} bytes, more than the limit of {limit}")
        data = f.read(limit + 1 if limit is not None else -1)
        if limit is not None and len(data) > limit:
            raise ResultFileError(f"{rel} from the sandbox grew past the limit of {limit} bytes")
        return data


def read_head(output_dir: Path, rel: str, limit: int) -> tuple[bytes, bool] | None:
    """At most the first ``limit`` bytes of ``output_dir/rel``, and whether there was more;
    None when there is no such file. Refuses what :func:`read` refuses, except the size."""
    opened = _open_regular(output_dir, rel)
    if opened is None:
        return None
    f, _ = opened
    with f:
        data = f.read(limit + 1)
    return data[:limit], len(data) > limit


def replace(output_dir: Path, rel: str, data: bytes) -> None:
    """Put ``data`` at ``output_dir/rel`` as a new file (O_EXCL, then renamed over the old
    name in the same directory): whatever was there, a link included, is replaced, never
    written through."""
    dfd, leaf = _parent_fd(output_dir, rel)
    try:
        write_at(dfd, leaf, data, sync=False)
    finally:
        os.close(dfd)
