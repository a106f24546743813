"""The runner's lifetime resources: taken on entry, released in reverse at exit, and released
too when entering fails half-way."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from guest_runner.conduit import LocalConduit
from prefect_resoluto import ResolutoTaskRunner
from prefect_resoluto.runtimes import get_runtime


class ClosingConduit(LocalConduit):
    def __init__(self, root: Path, log: list[str]) -> None:
        super().__init__(root)
        self.log = log

    def close(self) -> None:
        self.log.append("conduit closed")


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


def test_exit_releases_what_entering_took(tmp_path: Path) -> None:
    log: list[str] = []
    before = _threads()
    runner = ResolutoTaskRunner(
        runtime=get_runtime("process"),
        conduit=ClosingConduit(tmp_path / "c", log),
        min_isolation="none",
        warm_pool=0,
        outputs_dir=tmp_path / "out",
    )
    with runner:
        assert runner._resources is not None
        assert log == []
    assert log == ["conduit closed"]
    assert runner._resources is None and runner._packer is None
    assert _threads() <= before | {"MainThread"}, _threads() - before  # no pacer, reaper or queue left


def test_a_failure_while_entering_releases_what_was_taken(tmp_path: Path) -> None:
    log: list[str] = []
    runner = ResolutoTaskRunner(
        runtime=_Remote(), conduit=ClosingConduit(tmp_path / "c", log), min_isolation="none", warm_pool=0
    )
    with pytest.raises(ValueError, match="cannot see the local conduit"):
        runner.__enter__()
    assert log == ["conduit closed"]


class _Remote(type(get_runtime("process"))):  # type: ignore[misc]
    supports_local_conduit = False
