"""No import circle in prefect_resoluto/ or guest_runner/.

The graph is drawn from the source (ast), not by importing, and it counts every import
statement a module holds: at module level, under ``if TYPE_CHECKING:`` and inside
functions. Deferred and type-only imports are included on purpose: the circles this test
was written against all ran through a deferred import (``runtimes/base.py`` importing
``egress`` inside a method, ``guest_runner/conduit.py`` importing ``s3conduit`` inside
the URL factory, ``cli/common.py`` importing ``cli/output.py`` inside ``err``) -- deferring
hides a circle from the interpreter, not from the next reader, and mypy follows
``TYPE_CHECKING`` imports like any other.

A package's ``__init__`` counts only when it is imported by name (``from pkg import x``
where ``x`` is not a submodule); the implicit import of every parent package is left out,
or the top package, which re-exports the runner, would close a loop through every module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("prefect_resoluto", "guest_runner")


def _modules(root: Path, packages: tuple[str, ...]) -> dict[str, tuple[Path, bool]]:
    mods: dict[str, tuple[Path, bool]] = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            mods[".".join(parts)] = (path, is_pkg)
    return mods


def _known(name: str, mods: dict[str, tuple[Path, bool]]) -> str | None:
    """The longest prefix of ``name`` that is one of ours (None: stdlib or third party)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    mods = _modules(root, packages)
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if is_pkg else name.split(".")[:-1]
                    here = here[: len(here) - (node.level - 1)]
                    base = ".".join(here + ([base] if base else []))
                # ``from pkg import sub`` imports the submodule; ``from pkg import obj`` the package.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                dep = _known(target, mods)
                if dep is not None and dep != name:
                    deps.add(dep)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def _describe(graph: dict[str, set[str]], comp: list[str]) -> str:
    inside = set(comp)
    return "\n".join(f"  {m} -> {', '.join(sorted(graph[m] & inside))}" for m in comp)


def test_no_import_circle() -> None:
    graph = import_graph(ROOT)
    assert "prefect_resoluto.task_runner.runner" in graph and "guest_runner.runner" in graph
    found = cycles(graph)
    assert not found, "import circles (move the shared part into a leaf module):\n" + "\n\n".join(
        _describe(graph, c) for c in found
    )


def test_the_graph_sees_deferred_type_only_and_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import C\n"
    )
    (pkg / "c.py").write_text("import os\nfrom . import a\n")
    (pkg / "d.py").write_text("from pkg.c import thing\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a"}
    assert graph["pkg.d"] == {"pkg.c"}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
