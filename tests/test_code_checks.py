"""The code checks, run as tests so that CI fails on a lint, format or type regression.

Each test runs one tool from this venv as a subprocess, with the settings in
pyproject.toml, and on failure shows what the tool printed. mypy keeps its cache per
machine (``MYPY_CACHE``), so a warm run only re-checks what changed.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from prefect_resoluto.host.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]


#: Checks started ahead of their test (see ``start``), by argv.
_STARTED: dict[tuple[str, ...], subprocess.Popen[str]] = {}


def start(*argv: str) -> None:
    """Start `python -m <argv>` now; its test collects the result. support/scheduling.py starts the
    strict mypy run as soon as collection ends: cold, it takes a minute of CPU (it reads
    Prefect's typed sources), which then overlaps the tests that mostly wait on sandboxes."""
    if argv not in _STARTED:
        _STARTED[argv] = subprocess.Popen(
            [sys.executable, "-m", *argv],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )


def check(*argv: str) -> None:
    """Run `python -m <argv>` at the project root (or collect the run ``start`` began);
    fail with its output unless it exits 0."""
    start(*argv)
    proc = _STARTED.pop(argv)
    try:
        output, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    if proc.returncode != 0:
        pytest.fail(f"`{' '.join(argv)}` exited {proc.returncode}:\n{output.strip()}", pytrace=False)


#: mypy's cache lives per machine, in prefect-resoluto's cache root like the control plane's build: most of a cold strict run
#: (a minute and a half of CPU) is Prefect's own typed sources, the same for every clone. mypy
#: takes a cached module whose path or mtime differ once its source hash matches, and writes
#: each cache file atomically, so clones and parallel runs share it safely.
MYPY_CACHE = cache_dir() / "mypy"
MYPY_STRICT = ("mypy", "--cache-dir", str(MYPY_CACHE))


def test_ruff_lint() -> None:
    check("ruff", "check", "--no-fix", ".")


def test_ruff_format() -> None:
    check("ruff", "format", "--check", ".")


def test_mypy_strict() -> None:
    """prefect_resoluto/ and guest_runner/, strict (the exceptions are in pyproject.toml)."""
    check(*MYPY_STRICT)


def test_guest_runner_syntax_is_python_3_9() -> None:
    """The guest runner must run on any image's Python 3.9+: no newer syntax.

    ruff parses for the target version and reports syntax added later (`match`, `except*`,
    ...) as invalid; FA102 flags `X | Y` annotations, which 3.9 evaluates at run time
    unless the module has `from __future__ import annotations`.
    """
    check(
        "ruff",
        "check",
        "--isolated",
        "--no-fix",
        "--target-version",
        "py39",
        "--select",
        "FA102",
        "guest_runner",
    )


def test_guest_runner_uses_only_the_python_3_9_standard_library() -> None:
    """Against typeshed's 3.9 view: modules, functions and arguments added later are errors
    (`tomllib`, `datetime.UTC`, `itertools.pairwise`, `zip(strict=...)`, `dataclass(slots=...)`),
    and so is `X | Y` evaluated at run time (an alias, a `cast`)."""
    check("mypy", "--cache-dir", str(MYPY_CACHE), "--python-version", "3.9", "guest_runner")


#: The paths a node, a warm sandbox and a flow run take: every function on them reads at once.
SHORT_FUNCTION_PACKAGES = (
    "prefect_resoluto/node",
    "prefect_resoluto/warm",
    "prefect_resoluto/worker",
    "prefect_resoluto/runtimes",
    "prefect_resoluto/task_runner",
)
MAX_FUNCTION_LINES = 60


def long_functions(root: Path, packages: tuple[str, ...], limit: int) -> list[str]:
    """``path:line name (n lines)`` for every function or method over ``limit`` lines."""
    found = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > limit:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_functions_on_the_node_warm_worker_and_runtime_paths_are_short() -> None:
    found = long_functions(ROOT, SHORT_FUNCTION_PACKAGES, MAX_FUNCTION_LINES)
    assert not found, f"over {MAX_FUNCTION_LINES} lines (split into named steps):\n" + "\n".join(found)


def test_the_length_check_sees_nested_and_async_functions(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"        x{i} = {i}" for i in range(8))
    (pkg / "m.py").write_text(f"class C:\n    async def long(self):\n{body}\n\n\ndef short():\n    pass\n")
    assert long_functions(tmp_path, ("pkg",), 5) == ["pkg/m.py:2 long (9 lines)"]
