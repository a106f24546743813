"""Fresh random state for a process that may have been restored from a snapshot.

Every sandbox restored from one image starts from the same memory, so what a process
drew from the kernel's entropy *before* the checkpoint is the same in all of them.
"""

from __future__ import annotations

import sys


def reseed() -> None:
    """``random`` and numpy's global generator reseeded from the kernel, tempfile's name
    sequence dropped (rebuilt from ``random`` on next use). os.urandom, uuid4 and secrets
    read the kernel on every call and need nothing. The str hash seed is fixed at
    interpreter start and cannot change (docs/decisions/0009-restored-warm-sandboxes.md).

    Only what is loaded holds state from before the checkpoint: a module imported after the
    restore seeds itself from the kernel then. Importing ``random`` and ``tempfile`` here
    (with shutil, zlib, bz2 and lzma behind them) cost every restored sandbox and every
    node's call ~20-40 ms of CPU in gVisor for state that did not exist (issue 42)."""
    random = sys.modules.get("random")
    if random is not None:
        random.seed()
    tempfile = sys.modules.get("tempfile")
    if tempfile is not None:
        tempfile._name_sequence = None  # type: ignore[attr-defined]
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        try:
            np_random.seed()
        except Exception:  # noqa: BLE001 - a broken numpy is the call's to report
            pass
