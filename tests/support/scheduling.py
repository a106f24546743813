"""How the suite is handed to its three workers, and what it starts in the background (a
plugin, loaded by tests/conftest.py after ``support.tiers`` has marked every test).

Three workers (pytest-xdist, ``-n 3 --dist loadgroup`` in pyproject.toml): on 2 cores three
take 0.83 x the time of two, and four no less than three (a run keeps both cores ~88 % busy). Each worker has its own session servers (Prefect API, S3). Work is
handed out in the order of ``items`` (``--no-loadscope-reorder``) in units: a test alone, or
every test of a module that shares a module-scoped fixture (a worker process, a testnet, one
sandbox's findings: one instance, on one worker), or all the cluster tests (one control
plane, after its build). Heavy units go first and single tests fill the end, so all workers
finish together. The cluster unit is the largest: it goes first when the control plane is
cached, last when it has to wait for its build (started at collection, ``support.k8s_build``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support import gateway_server, k8s_build

K8S_GROUP = "k8s"
GATEWAY_GROUP = "gateway"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Run the tests against the genuine apiserver last when its build is pending (the
    session builds it meanwhile), first otherwise; the rest in units, largest first."""
    k8s = [item for item in items if item.get_closest_marker("k8s")]
    rest = [item for item in items if not item.get_closest_marker("k8s")]
    items[:] = _distribution_order(rest, k8s, build_pending=bool(k8s) and _k8s_build_pending())


def _k8s_build_pending() -> bool:
    """Will the cluster tests wait for the control plane's build (not cached, and buildable)?"""
    return not k8s_build.wanted_here() and not k8s_build.cached()


def _shared_scope_module(item: pytest.Item) -> str:
    """The module's name if the test uses a fixture shared across the module's tests; the
    gateway's group for a test on its shared server (support/gateway_server.py: one per
    worker process, so its modules go to one worker)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return ""
    if gateway_server.FIXTURE in info.names_closure:
        return GATEWAY_GROUP
    for defs in info.name2fixturedefs.values():
        if any(d.scope in ("module", "class", "package") for d in defs):
            return item.path.stem
    return ""


def _group(item: pytest.Item, name: str) -> None:
    """Send ``item`` to the worker of group ``name``: loadgroup's scheduler reads the group from
    the node id's ``@name`` suffix. xdist 3.8's worker writes that suffix from an
    ``xdist_group`` mark into ``item._nodeid``, which pytest 9 no longer reads (a node's id is
    ``item._id`` now): every grouped test would be scheduled alone. So it is written here."""
    item.add_marker(pytest.mark.xdist_group(name))
    if not os.environ.get("PYTEST_XDIST_WORKER") or item.nodeid.endswith(f"@{name}"):
        return
    if hasattr(item, "_id"):
        from _pytest.nodeid import coerce_node_id

        item._id = coerce_node_id(f"{item.nodeid}@{name}")
    else:
        item._nodeid = f"{item.nodeid}@{name}"


def _distribution_order(
    rest: list[pytest.Item], k8s: list[pytest.Item], *, build_pending: bool
) -> list[pytest.Item]:
    grouped: dict[str, list[pytest.Item]] = {}
    sandboxed: list[pytest.Item] = []
    plain: list[pytest.Item] = []
    for item in rest:
        module = _shared_scope_module(item)
        if module:
            _group(item, module)
            grouped.setdefault(module, []).append(item)
        elif item.get_closest_marker("slow"):
            sandboxed.append(item)
        else:
            plain.append(item)
    for item in k8s:
        _group(item, K8S_GROUP)
    # A module's group keeps its tests in file order (one unit); units, largest first.
    units = sorted(grouped.values(), key=len, reverse=True)
    # The code checks run whole-tree tools (a cold strict mypy is a minute of CPU): they start
    # at once, beside the first large units, and are never the last thing a worker does.
    checks = [i for i in plain if i.path.name == "test_code_checks.py"]
    plain = [i for i in plain if i.path.name != "test_code_checks.py"]
    ordered = checks + [i for unit in units for i in unit] + sandboxed + plain
    return ordered + k8s if build_pending else k8s + ordered


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start, in the background, what collected tests will need later: the strict type check
    (its test only collects the result) and, if a genuine-apiserver test is selected and the
    build is not cached, the Kubernetes control plane's build (niced; those tests run last)."""
    if not session.config.option.collectonly and any(
        item.get_closest_marker("k8s") for item in session.items
    ):
        proc = k8s_build.start(Path(session.config.rootpath) / ".pytest_cache", _worker_id(session.config))
        if proc is not None:
            session.config.get_terminal_writer().line(
                f"k8s: building the control plane in the background (pid {proc.pid}, nice 19, "
                f"log .pytest_cache/k8s-build.log); its tests run last and wait for it"
            )
    if _worker_id(session.config):
        # Under xdist the other workers go on while this one type-checks; a background run
        # per worker would only share one .mypy_cache and the CPU.
        return
    for item in session.items:
        if item.path.name == "test_code_checks.py" and item.name == "test_mypy_strict":
            module = item.module  # type: ignore[attr-defined]
            module.start(*module.MYPY_STRICT)
            return


def _worker_id(config: pytest.Config) -> str:
    """This xdist worker's id ("gw0", ...), or "" in a run without workers."""
    workerinput = getattr(config, "workerinput", None)
    return str(workerinput["workerid"]) if workerinput else ""


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    proc = k8s_build.running()
    if proc is not None:  # no genuine-apiserver test was reached (-x, Ctrl-C): it is left to finish
        terminalreporter.write_line(
            f"k8s: the control plane's build (pid {proc.pid}) continues in the background; "
            "the next run reuses its cache"
        )
