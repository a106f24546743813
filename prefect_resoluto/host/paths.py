"""Where prefect-resoluto keeps things on the host by default (one cache root for all)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/prefect-resoluto`` (default ``~/.cache/prefect-resoluto``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "prefect-resoluto"
