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
import subprocess
import sys
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


#: The layers below the Prefect glue: they run where Prefect may not be importable (a CLI
#: without a server, a benchmark, the node engine driven by the worker's own child) and must
#: stay usable by any caller, so none of them imports Prefect or the glue built on it.
BELOW_THE_GLUE = (
    "prefect_resoluto.host",
    "prefect_resoluto.node",
    "prefect_resoluto.warm",
    "prefect_resoluto.runtimes",
    "prefect_resoluto.egress",
    "prefect_resoluto.settings",
)
#: The Prefect glue: the task runner, the worker, the blocks and what loads them.
GLUE = (
    "prefect_resoluto.task_runner",
    "prefect_resoluto.worker",
    "prefect_resoluto.blocks",
    "prefect_resoluto.collection",
    "prefect_resoluto.cli",
)
#: Named exceptions to the layering rule (module -> why).
LAYERING_EXCEPTIONS: dict[str, str] = {
    # A node held for a Solari slot says so in its task run's logs while it waits (a status
    # poll runs on the task run's thread); the import is deferred to that call and guarded,
    # so importing the module never loads Prefect (the subprocess test below checks it).
    "prefect_resoluto.runtimes.solari.status": "logs a wait for a Solari slot in the task run",
}


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _imported_names(path: Path, name: str, is_pkg: bool) -> set[str]:
    """Every module name an import statement of ``path`` names, ours or not (absolute)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_pkg else name.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join(here + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def test_the_layers_below_the_glue_never_import_prefect_or_the_glue() -> None:
    offences = []
    for name, (path, is_pkg) in sorted(_modules(ROOT, ("prefect_resoluto",)).items()):
        if not _within(name, BELOW_THE_GLUE) or name in LAYERING_EXCEPTIONS:
            continue
        for target in sorted(_imported_names(path, name, is_pkg)):
            if target == "prefect" or target.startswith("prefect.") or _within(target, GLUE):
                offences.append(f"  {name} imports {target}")
    assert not offences, "below the Prefect glue (see BELOW_THE_GLUE):\n" + "\n".join(offences)


def test_importing_every_layer_below_the_glue_loads_no_prefect() -> None:
    """The same rule, as the interpreter sees it: every module below the glue imported, and
    neither ``prefect`` nor a glue module among what got loaded."""
    below = sorted(
        n
        for n, (_, is_pkg) in _modules(ROOT, ("prefect_resoluto",)).items()
        if _within(n, BELOW_THE_GLUE) and not n.endswith("__main__") and "_restore_reaper" not in n
    )
    code = (
        "import importlib, sys\n"
        f"for m in {below!r}:\n"
        "    importlib.import_module(m)\n"
        f"glue = {GLUE!r}\n"
        "print(sorted(m for m in sys.modules if m == 'prefect' or m.startswith('prefect.')"
        " or any(m == g or m.startswith(g + '.') for g in glue)))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout


def test_the_layering_check_sees_a_deferred_prefect_import(tmp_path: Path) -> None:
    """The rule counts imports inside functions too: a deferred import still loads Prefect."""
    pkg = tmp_path / "prefect_resoluto" / "node"
    pkg.mkdir(parents=True)
    (tmp_path / "prefect_resoluto" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "x.py").write_text("def f():\n    from prefect.states import Completed\n")
    (pkg / "y.py").write_text("from ..task_runner import runner\n")
    names_x = _imported_names(pkg / "x.py", "prefect_resoluto.node.x", False)
    names_y = _imported_names(pkg / "y.py", "prefect_resoluto.node.y", False)
    assert "prefect.states" in names_x
    assert "prefect_resoluto.task_runner" in names_y and _within("prefect_resoluto.task_runner", GLUE)
