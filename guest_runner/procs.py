"""The processes this sandbox's /proc lists. Standard library only; Python 3.9+."""

from __future__ import annotations

import os
from typing import Dict, Tuple


def live() -> Dict[int, Tuple[int, int]]:
    """Every process but the zombies: pid -> (parent, process group); empty without /proc."""
    found: Dict[int, Tuple[int, int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read(4096)
            # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses
            fields = stat[stat.rindex(b")") + 2 :].split()
            if fields[0] != b"Z":
                found[int(name)] = (int(fields[1]), int(fields[2]))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return found
