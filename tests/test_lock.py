"""The locks in constraints/ agree with pyproject.toml's ranges and with what setup.sh installed.

A requirement added or re-ranged in pyproject.toml without `bash scripts/lock.sh` fails
here, naming the package, instead of installing an untested release on the next fresh
machine.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DEV_LOCK = ROOT / "constraints" / "dev.txt"
REF_LOCK = ROOT / "constraints" / "ref.txt"
OLDEST_LOCK = ROOT / "constraints" / "prefect-oldest.txt"
REF_PYTHON = ROOT / ".venv-ref" / "bin" / "python"


def read_lock(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version and not any(c in line for c in " @;[<>~!"), (
            f"{path.name}:{n}: {line!r} is not an exact `name==version` pin"
        )
        pins[canonicalize_name(name)] = version
    return pins


def project_requirements() -> list[Requirement]:
    """The requirements `pip install -e '.[dev]'` resolves, the package's own extras expanded."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = canonicalize_name(project["name"])
    extras: dict[str, list[str]] = project.get("optional-dependencies", {})
    todo = [Requirement(r) for r in project["dependencies"]] + [Requirement(f"{name}[dev]")]
    reqs: list[Requirement] = []
    expanded: set[str] = set()
    while todo:
        req = todo.pop()
        if canonicalize_name(req.name) == name:
            for extra in sorted(req.extras - expanded):
                expanded.add(extra)
                todo += [Requirement(r) for r in extras[extra]]
        elif req.marker is None or req.marker.evaluate():
            reqs.append(req)
    return reqs


@pytest.mark.parametrize("lock", [DEV_LOCK, OLDEST_LOCK], ids=lambda p: p.name)
def test_every_project_requirement_is_pinned_inside_its_range(lock: Path) -> None:
    pins = read_lock(lock)
    problems = []
    for req in project_requirements():
        pin = pins.get(canonicalize_name(req.name))
        if pin is None:
            problems.append(f"{req}: no pin in {lock.name}")
        elif not req.specifier.contains(pin, prereleases=True):
            problems.append(f"{req}: the lock pins {pin}, outside the range")
    assert not problems, "refresh the lock with `bash scripts/lock.sh`:\n" + "\n".join(problems)


def test_the_oldest_lock_is_the_floor_of_the_prefect_range() -> None:
    """The range pyproject.toml claims is the range CI runs: its floor is the minor that
    scripts/prefect-range.sh installs from the oldest lock, its newest is the main lock's."""
    (prefect,) = [r for r in project_requirements() if canonicalize_name(r.name) == "prefect"]
    floors = [Version(s.version) for s in prefect.specifier if s.operator == ">="]
    assert len(floors) == 1, f"{prefect}: one `>=` floor, the oldest minor CI runs"
    oldest = Version(read_lock(OLDEST_LOCK)["prefect"])
    assert (oldest.major, oldest.minor) == floors[0].release[:2], (
        f"{prefect} claims from {floors[0]}, but {OLDEST_LOCK.name} (what CI runs as the oldest) pins "
        f"prefect {oldest}: move the floor or the lock (`bash scripts/lock.sh`) so they agree"
    )
    newest = Version(read_lock(DEV_LOCK)["prefect"])
    assert prefect.specifier.contains(newest) and newest > oldest, (newest, oldest)


def test_the_project_venv_has_the_locked_versions() -> None:
    """What setup.sh installed into the venv running this suite is what the lock says."""
    pins = read_lock(DEV_LOCK)
    differ = []
    for name, version in pins.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            differ.append(f"{name}: locked {version}, installed {installed}")
    assert not differ, f"{sys.prefix} differs from {DEV_LOCK.name} (run scripts/setup.sh):\n" + "\n".join(
        differ
    )


def test_the_reference_venv_has_the_locked_versions() -> None:
    pins = read_lock(REF_LOCK)
    assert pins.get("resoluto-sandbox") == "0.1.0", "the reference lock must pin resoluto-sandbox 0.1.0"
    if not REF_PYTHON.exists():
        pytest.skip(f"no {REF_PYTHON.parent.parent.name} here (no Python 3.12): nothing installed to compare")
    out = subprocess.run(
        [str(REF_PYTHON), "-m", "pip", "freeze", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    installed = {
        canonicalize_name(n): v for n, _, v in (line.partition("==") for line in out.splitlines()) if v
    }
    assert installed == pins, f".venv-ref differs from {REF_LOCK.name}: {installed} != {pins}"
