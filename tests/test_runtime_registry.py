"""The runtime registry: lazy lookup by name, and the strongest runtime available here."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from prefect_resoluto import runtimes
from prefect_resoluto.runtimes import RUNTIMES, best_available, get_runtime, why_unavailable
from prefect_resoluto.runtimes.base import IsolationLevel, SandboxRuntime


@pytest.fixture(autouse=True)
def _state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESOLUTO_STATE_DIR", str(tmp_path / "state"))


def test_registry_names_and_classes() -> None:
    assert set(RUNTIMES) >= {"process", "bubblewrap", "gvisor", "container"}
    for name in ("process", "bubblewrap", "gvisor", "container"):
        cls = RUNTIMES[name]
        assert issubclass(cls, SandboxRuntime) and cls.name == name


@pytest.mark.sandbox
def test_get_runtime_with_options() -> None:
    rt = get_runtime("bubblewrap", bwrap="/nonexistent/bwrap")
    assert rt.name == "bubblewrap" and not rt.availability().ok
    assert get_runtime("container", oci_runtime="runc").isolation == IsolationLevel.NAMESPACE


def test_unknown_runtime_lists_known_names() -> None:
    with pytest.raises(ValueError) as e:
        get_runtime("firecracker")
    for name in ("process", "bubblewrap", "gvisor", "container"):
        assert name in str(e.value)


def test_registry_is_lazy_and_one_line_extensible(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = types.ModuleType("rsl_fake_runtime")

    class Fake(SandboxRuntime):
        name = "fake"
        isolation = IsolationLevel.VM  # type: ignore[assignment]

        def availability(self):  # type: ignore[no-untyped-def]
            from prefect_resoluto.runtimes.base import Availability

            return Availability(True)

        launch = status = destroy = sweep = logs = lambda *a, **k: None  # type: ignore[assignment]

    mod.Fake = Fake  # type: ignore[attr-defined]
    mod.NotRuntime = object  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rsl_fake_runtime", mod)
    monkeypatch.setitem(runtimes._PATHS, "fake", "rsl_fake_runtime:Fake")
    monkeypatch.setitem(runtimes._PATHS, "broken", "rsl_fake_runtime:NotRuntime")
    assert isinstance(get_runtime("fake"), Fake)
    with pytest.raises(TypeError):
        get_runtime("broken")


def test_best_available_respects_floor() -> None:
    rt = best_available("none")
    assert rt is not None and rt.availability().ok
    for level in IsolationLevel:
        got = best_available(level)
        if got is not None:
            assert got.isolation >= level and got.availability().ok
        else:
            assert "no sandbox runtime" in why_unavailable(level)


@pytest.mark.sandbox
def test_best_available_prefers_gvisor_over_podman_runsc() -> None:
    gv = get_runtime("gvisor")
    if not gv.availability().ok:
        pytest.skip(f"gvisor is not available here: {gv.availability().why}")
    rt = best_available("user-kernel")
    if rt is not None and rt.isolation == IsolationLevel.VM:
        pytest.skip("a VM runtime is available here and rightly wins")
    assert rt is not None and rt.name == "gvisor"


def test_best_available_none_when_nothing_qualifies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        runtimes, "_PREFERENCE", [("bubblewrap", {"bwrap": "/nonexistent/bwrap"}), ("process", {})]
    )
    assert best_available("namespace") is None
    why = why_unavailable("namespace")
    assert "/nonexistent/bwrap" in why and "process: isolation none is below namespace" in why
    assert best_available("none").name == "process"  # type: ignore[union-attr]


def test_best_available_passes_common_options(tmp_path: Path) -> None:
    rt = best_available("none", state_dir=str(tmp_path / "elsewhere"))
    assert rt is not None
    if hasattr(rt, "state"):
        assert str(rt.state).startswith(str(tmp_path / "elsewhere"))
