"""Shared fixtures. Servers (S3, Prefect) start once per session, on 127.0.0.1 only."""

from __future__ import annotations

import inspect
import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Nothing may leave this machine: Prefect's server would try to send usage telemetry, and
# every subprocess a test starts inherits this.
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
SCHEMAS = ROOT / "schemas"

# A suite started in the background by a non-interactive shell (`cmd &`, nohup) inherits
# SIGINT as ignored, and so would every flow, worker and sandbox a test starts: the tests
# of Ctrl-C and of stopping a worker would then wait on processes that cannot hear them.
# Python's own handler makes it default again in each child (exec resets a handler, not an
# ignore).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# An xdist worker starts with COLUMNS=80 LINES=24 set (execnet's pipe is no terminal); every
# program a test starts would take them over its own terminal's size. Not the suite's own.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name in ("COLUMNS", "LINES"):
        if os.environ.get(_name) in ("80", "24"):
            os.environ.pop(_name, None)

from s3_fixtures import *  # noqa: E402,F401,F403


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runtimes record sandboxes under RESOLUTO_STATE_DIR; keep tests from seeing each other's."""
    if "RESOLUTO_STATE_DIR" not in os.environ:
        monkeypatch.setenv("RESOLUTO_STATE_DIR", str(tmp_path_factory.mktemp("state")))


@pytest.fixture(scope="session")
def schemas() -> dict[str, dict]:
    return {p.name.split(".")[0]: json.loads(p.read_text()) for p in SCHEMAS.glob("*.schema.json")}


@pytest.fixture(scope="session")
def validate(schemas):
    import jsonschema

    validators = {k: jsonschema.Draft202012Validator(v) for k, v in schemas.items()}

    def _validate(kind: str, obj: object) -> None:
        validators[kind].validate(obj)

    return _validate


@pytest.fixture
def gvisor():
    """The gVisor runtime, or a skip saying why this machine has none."""
    from prefect_resoluto.runtimes import get_runtime

    rt = get_runtime("gvisor")
    avail = rt.availability()
    if not avail.ok:
        pytest.skip(f"gVisor is not available here: {avail.why}")
    return rt


@pytest.fixture
def local_conduit(tmp_path: Path):
    from guest_runner.conduit import LocalConduit

    return LocalConduit(tmp_path / "conduit")


def guest_env(conduit_root: Path, run_id: str, node_id: str, argv: list[str], **extra: str) -> dict[str, str]:
    """Environment for `python -m guest_runner` on a local conduit."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(ROOT),
        "RESOLUTO_STORE_KIND": "localfs",
        "RESOLUTO_STORE_ROOT": str(conduit_root),
        "RESOLUTO_RUN_ID": run_id,
        "RESOLUTO_NODE_ID": node_id,
        "RESOLUTO_WORKLOAD_ARGV": json.dumps(argv),
    }
    env.update(extra)
    return env


PY = sys.executable


def find_python(version: str) -> str | None:
    """An interpreter for ``version`` (e.g. "3.9") that actually runs, or None."""
    import glob
    import shutil
    import subprocess

    candidates = [shutil.which(f"python{version}") or ""]
    candidates += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}*/bin/python{version}")))
    for c in candidates:
        if c and subprocess.run([c, "-S", "-c", "pass"], capture_output=True).returncode == 0:
            return c
    return None


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory: pytest.TempPathFactory):
    """A real Prefect API (SQLite), started once for the whole session."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))
    from polling import scaled
    from prefect.testing.utilities import prefect_test_harness

    # A hang bound, scaled: in a loaded full run the harness took 130 s to come up (its first
    # start migrates a fresh database), next to a fixed 120 s bound.
    with prefect_test_harness(server_startup_timeout=int(scaled(120))):
        yield


@pytest.fixture
def prefect(prefect_api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Per test: fresh result storage so cached states never leak between tests."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: tmp_path / "results"}):
        yield


# Tiers, by what a test needs (pyproject.toml lists the markers; README, "Development"):
# markers come from the fixtures a test uses, so a new test is tiered by what it asks for.
K8S_FIXTURES = {"k8s_cluster"}  # k8s_agent, k8s_ns and every fixture built on them need it
# `prefect`, the worker and server fixtures are built on prefect_api; auth_server is a
# `prefect server` of its own (with an auth string) and a worker on it.
PREFECT_FIXTURES = {"prefect_api", "auth_server"}
# Fixtures that hand the test a real sandbox (gVisor, bubblewrap, podman, an egress testnet).
SANDBOX_FIXTURES = {"gvisor", "gv", "gw_gvisor", "testnet", "k8s_agent"}
# Fixtures that run whole guests behind a loopback service (the Solari gateway fake): no
# sandbox, but seconds each; they are `slow` too.
SLOW_FIXTURES = {"gw"}
SANDBOX_MODULE_RT = {  # the modules whose `rt` fixture is a real sandbox runtime
    "test_runtime_gvisor.py",
    "test_runtime_bubblewrap.py",
    "test_runtime_container.py",
}
# A runtime named in the test itself: ResolutoTaskRunner(runtime="gvisor"), get_runtime("gvisor"),
# or a parametrize value; `process` and `solari` (the loopback gateway) are no sandbox here.
SANDBOX_RUNTIMES = {"gvisor", "runsc", "bubblewrap", "container", "podman", "kata"}
_NAMED_RUNTIME = re.compile(r"""(?:runtime\s*=\s*|get_runtime\(\s*)["'](\w+)["']""")


def _uses_sandbox(item: pytest.Item) -> bool:
    names = set(getattr(item, "fixturenames", ()))
    if names & SANDBOX_FIXTURES or (item.path.name in SANDBOX_MODULE_RT and "rt" in names):
        return True
    callspec = getattr(item, "callspec", None)
    if callspec is not None and any(
        isinstance(v, str) and v in SANDBOX_RUNTIMES for v in callspec.params.values()
    ):
        return True
    fn = getattr(item, "function", None)
    try:
        src = inspect.getsource(fn) if fn is not None else ""
    except (OSError, TypeError):
        src = ""
    return any(m in SANDBOX_RUNTIMES for m in _NAMED_RUNTIME.findall(src))


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Mark each test by what it needs, and run the ones against the genuine apiserver last
    (the session may be building it meanwhile, tests/k8s_build.py)."""
    k8s: list[pytest.Item] = []
    rest: list[pytest.Item] = []
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        needs_k8s = bool(names & K8S_FIXTURES)
        needs_prefect = bool(names & PREFECT_FIXTURES)
        needs_sandbox = _uses_sandbox(item)
        if needs_k8s:
            item.add_marker(pytest.mark.k8s)
        if needs_prefect:
            item.add_marker(pytest.mark.prefect)
        if needs_sandbox:
            item.add_marker(pytest.mark.sandbox)
        if (
            needs_k8s
            or needs_prefect
            or needs_sandbox
            or names & SLOW_FIXTURES
            or item.get_closest_marker("slow")
        ):
            item.add_marker(pytest.mark.slow)
        (k8s if needs_k8s else rest).append(item)
    items[:] = _distribution_order(rest, k8s, build_pending=bool(k8s) and _k8s_build_pending())


def _k8s_build_pending() -> bool:
    """Will the cluster tests wait for the control plane's build (not cached, and buildable)?"""
    import k8s_build

    return not k8s_build.wanted_here() and not k8s_build.cached()


# Two workers (pytest-xdist, `-n 2 --dist loadgroup` in pyproject.toml): the suite waits on
# sandboxes, servers and Prefect far more than it computes, so two of it on 2 cores take
# about half the time of one. Each worker has its own session servers (Prefect API, S3).
# Work is handed out in the order of `items` (--no-loadscope-reorder) in units: a test alone,
# or every test of a module that shares a module-scoped fixture (a worker process, a
# testnet, one sandbox's findings: one instance, on one worker), or all the cluster tests
# (one control plane, after its build). Heavy units go first and single tests fill the end,
# so both workers finish together. The cluster unit is the largest: it goes first when the
# control plane is cached, last when it has to wait for its build (started at collection).
K8S_GROUP = "k8s"


def _shared_scope_module(item: pytest.Item) -> str:
    """The module's name if the test uses a fixture shared across the module's tests."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return ""
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
    import k8s_build

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
        # Under xdist the other worker goes on while this one type-checks; two background
        # runs (one per worker) would only share one .mypy_cache and the CPU.
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
    import k8s_build

    proc = k8s_build.running()
    if proc is not None:  # no genuine-apiserver test was reached (-x, Ctrl-C): it is left to finish
        terminalreporter.write_line(
            f"k8s: the control plane's build (pid {proc.pid}) continues in the background; "
            "the next run reuses its cache"
        )
