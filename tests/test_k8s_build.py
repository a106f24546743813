"""The test session's background build of the Kubernetes control plane (tests/support/k8s_build.py):
waited on as a process, its failure reported with the build's own words. A stand-in script
plays ``k8s-local-cluster.sh`` (the real build is 5-15 minutes; the real script's cached
path runs in every session that selects a cluster test)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import k8s_build

STANDIN = """#!/usr/bin/env bash
case "$1" in
  status) [ -f "{done}" ] && echo cached || {{ echo "no cached build"; exit 1; }} ;;
  build) read -r _ < "{gate}"; echo "building..."; [ "{ok}" = 1 ] && touch "{done}" && exit 0; echo "make failed"; exit 3 ;;
esac
"""


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    why = k8s_build.wanted_here()
    if why:
        pytest.skip(f"this machine would not build: {why}")
    monkeypatch.setattr(k8s_build, "_build", None)
    monkeypatch.setattr(k8s_build, "_log", None)

    def make(ok: bool) -> Path:
        import os

        gate = tmp_path / "gate"
        os.mkfifo(gate)
        script = tmp_path / "k8s-local-cluster.sh"
        script.write_text(STANDIN.format(done=tmp_path / "done", gate=gate, ok=int(ok)))
        monkeypatch.setattr(k8s_build, "SCRIPT", script)
        return gate

    yield make
    proc = k8s_build._build
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


def test_the_build_runs_in_the_background_and_is_waited_on(standin, tmp_path: Path) -> None:
    gate = standin(ok=True)
    proc = k8s_build.start(tmp_path / "logs")
    assert proc is not None and k8s_build.running() is proc  # collection did not wait for it
    assert k8s_build.start(tmp_path / "logs") is proc  # once per session
    gate.write_text("go\n")  # the build finishes only now
    assert k8s_build.wait() == ""
    assert k8s_build.cached() and k8s_build.running() is None


def test_a_failed_build_says_why_with_its_log(standin, tmp_path: Path) -> None:
    gate = standin(ok=False)
    assert k8s_build.start(tmp_path / "logs") is not None
    gate.write_text("go\n")
    why = k8s_build.wait()
    assert "exited 3" in why and "make failed" in why, why


def test_a_cached_build_starts_nothing(standin, tmp_path: Path) -> None:
    standin(ok=True)
    (tmp_path / "done").touch()
    assert k8s_build.start(tmp_path / "logs") is None and k8s_build.wait() == ""
