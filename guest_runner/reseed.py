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
    interpreter start and cannot change (docs/decisions/0009-restored-warm-sandboxes.md)."""
    import random
    import tempfile

    random.seed()
    tempfile._name_sequence = None  # type: ignore[attr-defined]
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        try:
            np_random.seed()
        except Exception:  # noqa: BLE001 - a broken numpy is the call's to report
            pass
