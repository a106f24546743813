"""The one shape of a "can this be used here?" answer (runtimes, egress, the warm pool, doctor).

A leaf: the egress package and the runtime seam both answer with it, and neither may import
the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Availability:
    """Every "can this be used here?" answer: ``ok``, else ``why`` not (a sentence that names
    the fix); ``detail`` says how, when it is (for ``doctor``)."""

    ok: bool
    why: str = ""
    detail: str = ""

    @classmethod
    def refused(cls, why: str) -> Availability:
        return cls(False, why=why)

    @classmethod
    def of(cls, why: str, detail: str = "") -> Availability:
        """From a probe's "" (fine) or reason."""
        return cls(not why, why=why, detail="" if why else detail)
