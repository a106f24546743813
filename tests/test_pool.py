"""Warm sandboxes at the driver level: real sandboxes, a real pool, a local conduit.

A warm sandbox boots without a node, takes its assignment on stdin, writes the node's
objects at the canonical keys only (readable by the reference host), serves one node
and is gone; one never assigned is destroyed and leaves nothing in the conduit.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.polling import scaled, wait_for
from test_wire_compat import _WHY as REF_WHY
from test_wire_compat import OUTPUTS, WORKLOAD, _raw, _ref, _validate_node

from guest_runner import wire
from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes import get_runtime
from prefect_resoluto.warm.pool import WarmPool, WarmSandbox, key_for


def _ready_pool(rt, conduit: LocalConduit, key, n: int = 1) -> WarmPool:
    """A pool holding ``n`` warm sandboxes of ``key`` that have reported ready."""
    pool = WarmPool(rt, conduit, size=n)
    assert pool.enabled, pool.why_not
    pool.want(key, idle=n)
    wait_for(lambda: pool.ready_count(key) == n or key in pool._broken, timeout=120, what="warm sandboxes")
    assert key not in pool._broken, "warm sandboxes ended before they were ready"
    return pool


def _take(pool: WarmPool, key) -> WarmSandbox:
    w, waited = pool.take(key)
    assert w is not None and waited < scaled(5)  # taken ready, not booted on demand
    return w


def _sandboxes_wrote(root: Path) -> list[Path]:
    """What is in the conduit but the host's own heartbeat directory (decision 0017)."""
    return [p for p in root.iterdir() if p.name != wire.HOSTS]


def _no_sandboxes(rt) -> None:
    assert rt.list_ids() == []
    if hasattr(rt, "containers"):
        assert rt.containers() == []


@pytest.fixture(
    params=[
        pytest.param("gvisor", marks=pytest.mark.sandbox),
        pytest.param("bubblewrap", marks=pytest.mark.sandbox),
        "process",
    ]
)
def local_runtime(request):
    rt = get_runtime(request.param)
    if not rt.availability().ok:
        pytest.skip(f"{request.param} is not available here: {rt.availability().why}")
    return rt


def test_warm_node_canonical_keys_and_one_node_per_sandbox(
    local_runtime, local_conduit, tmp_path, monkeypatch
):
    rt = local_runtime
    from prefect_resoluto.runtimes import slot

    bound: list[str] = []
    real_bind = slot.bind
    monkeypatch.setattr(slot, "bind", lambda src, dst: (bound.append(dst.name), real_bind(src, dst))[1])
    # HOME is /tmp in gVisor and bubblewrap (the marker), the sandbox's own home on process.
    marker = [
        "python3",
        "-c",
        "import os,sys; m=os.path.expanduser('~/marker'); seen=os.path.exists(m); "
        "open(m,'w'); print('seen' if seen else 'fresh'); sys.exit(3 if seen else 0)",
    ]
    spec1 = NodeSpec(run_id="run-w", node_id="n1", argv=marker)
    key = key_for(spec1)
    pool = _ready_pool(rt, local_conduit, key, n=2)
    try:
        outcomes = []
        for node in ("n1", "n2"):
            w = _take(pool, key)
            lines: list[str] = []
            spec = NodeSpec(run_id="run-w", node_id=node, argv=marker)
            o = drive_node(
                spec,
                local_conduit,
                rt,
                warm=w,
                min_isolation="none",
                on_event=lambda ev, _l=lines: _l.append((ev.get("data") or {}).get("line", "")),
            )
            assert o.ok and o.warm, o.describe()
            assert "fresh" in lines  # /tmp of the first node's sandbox is not this one's
            assert w.handle.id not in rt.list_ids()  # served its node and is gone
            outcomes.append(o)
        assert outcomes[0].sandbox_id != outcomes[1].sandbox_id
    finally:
        pool.close()
    _no_sandboxes(rt)
    # Everything in the conduit is under the two nodes' canonical prefixes (but the host's
    # own heartbeat, decision 0017: bound read-only into the sandboxes, never theirs).
    files = sorted(
        p.relative_to(local_conduit.root).as_posix()
        for p in local_conduit.root.rglob("*")
        if p.is_file() and not p.relative_to(local_conduit.root).as_posix().startswith(wire.HOSTS + "/")
    )
    assert files and all(f.startswith(("run/run-w/nodes/n1/", "run/run-w/nodes/n2/")) for f in files), files
    if rt.mounts_conduit:  # each warm slot was bound at its node's directory and settled there
        assert bound == ["n1", "n2"]
        modes = {f: (local_conduit.root / f).stat().st_mode & 0o7777 for f in files}
        assert set(modes.values()) == {0o600}, modes
        assert not any(os.path.ismount(local_conduit.root / f"run/run-w/nodes/{n}") for n in ("n1", "n2"))


@pytest.fixture
def umask_0():
    """The host process under umask 0, as in some container images (restored after)."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_a_host_under_umask_0_serves_warm_and_cold_nodes_and_leaves_nothing_writable_by_others(
    local_runtime, tmp_path, umask_0
):
    """Every directory the host makes in the conduit (its root, a run's, a node's, its inbox,
    the heartbeat's) and everything its guest writes there are made with modes of their own,
    not ``0o777`` less the umask: under umask 0 the host's own inbox in a warm slot was
    world-writable, and its settle refused every warm node as a sandbox's doing."""
    rt = local_runtime
    conduit = LocalConduit(tmp_path / "conduit")
    src = tmp_path / "src"
    src.mkdir()
    os.chmod(src, 0o755)
    (src / "data.txt").write_text("staged by the host\n")
    os.chmod(src / "data.txt", 0o644)
    write = [
        "python3",
        "-c",
        "import os; os.makedirs('out', exist_ok=True); open('out/r.txt','w').write('ok')",
    ]

    def spec(node: str) -> NodeSpec:
        return NodeSpec(
            run_id="run-umask", node_id=node, argv=write, workspace=src, output_paths=["out/*.txt"]
        )

    key = key_for(spec("warm"))
    pool = _ready_pool(rt, conduit, key)
    try:
        warm = drive_node(spec("warm"), conduit, rt, warm=_take(pool, key), min_isolation="none")
    finally:
        pool.close()
    cold = drive_node(spec("cold"), conduit, rt, min_isolation="none")
    for o in (warm, cold):
        assert o.ok, o.describe()
        assert (o.output_dir / "out" / "r.txt").read_text() == "ok"
    assert warm.warm and not cold.warm
    open_to_others = {
        p.relative_to(conduit.root).as_posix(): oct(p.lstat().st_mode & 0o7777)
        for p in [conduit.root, *conduit.root.rglob("*")]
        if p.lstat().st_mode & 0o022
    }
    assert open_to_others == {}
    _no_sandboxes(rt)


@pytest.mark.sandbox
@pytest.mark.skipif(bool(REF_WHY), reason=REF_WHY or "reference available")
def test_warm_node_is_read_by_the_reference_host(gvisor, local_conduit, tmp_path, validate):
    src = tmp_path / "src"
    (src / "data").mkdir(parents=True)
    (src / "data" / "in.txt").write_text("staged by the host\n")
    spec = NodeSpec(
        run_id="run-compat",
        node_id="warm",
        argv=["python3", "-c", WORKLOAD, "0"],
        workspace=src,
        output_paths=["out/*.txt"],
    )
    key = key_for(spec)
    pool = _ready_pool(gvisor, local_conduit, key)
    try:
        w = _take(pool, key)
        assert w.restored is not None  # gVisor's default: restored from the key's snapshot image
        o = drive_node(spec, local_conduit, gvisor, warm=w)
    finally:
        pool.close()
    assert o.ok and o.warm, o.describe()
    prefix = wire.node_prefix("run-compat", "warm")
    keys, lines = _raw(local_conduit, prefix)
    _validate_node(local_conduit, prefix, lines, validate)
    assert set(keys) - {k for k in keys if wire.chunk_index(k)} == {
        wire.RESULT,
        wire.MANIFEST,
        "inbox/workspace.tar.gz",
        "outbox/output.tar.gz",
    }
    got = _ref("read", str(local_conduit.root), prefix, str(tmp_path / "fetched"), json.dumps(OUTPUTS))
    assert got["finished"] is True
    assert got["events"] == [json.loads(line) for line in lines]
    assert got["result"]["output_archive"] == wire.outbox_key(prefix)  # canonical, not the slot's
    assert (tmp_path / "fetched" / "out" / "report.txt").read_text() == "STAGED BY THE HOST\n"
    _no_sandboxes(gvisor)


def _files_containing(roots: list[Path], needle: bytes) -> list[str]:
    hits = []
    for root in roots:
        for p in root.rglob("*"):
            try:
                if p.is_file() and needle in p.read_bytes():
                    hits.append(str(p))
            except OSError:
                pass
    return hits


@pytest.mark.sandbox
def test_assignment_secrets_never_reach_the_conduit_or_a_spec_file(gvisor, local_conduit, tmp_path):
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    spec = NodeSpec(
        run_id="run-s",
        node_id="n1",
        secret_env={"API_TOKEN": secret},
        argv=["python3", "-c", "import os; print('len', len(os.environ['API_TOKEN']))"],
    )
    key = key_for(spec)
    pool = _ready_pool(gvisor, local_conduit, key)
    state = Path(gvisor.state)
    scanned: list[list[str]] = []

    def on_event(ev: dict) -> None:
        line = (ev.get("data") or {}).get("line", "")
        if line.startswith("len "):  # the workload holds the secret now; its sandbox's files all exist
            assert line == f"len {len(secret)}"
            scanned.append(_files_containing([state, local_conduit.root], secret.encode()))

    try:
        o = drive_node(spec, local_conduit, gvisor, warm=_take(pool, key), on_event=on_event)
    finally:
        pool.close()
    assert o.ok and o.warm, o.describe()
    assert scanned == [[]]
    assert _files_containing([state, local_conduit.root], secret.encode()) == []


@pytest.mark.sandbox
def test_a_never_assigned_sandbox_is_destroyed_and_leaves_nothing(gvisor, local_conduit):
    key = key_for(NodeSpec(run_id="r", node_id="n", argv=["true"]))
    pool = _ready_pool(gvisor, local_conduit, key, n=2)
    ids = pool.idle_ids()
    assert len(ids) == 2 and set(ids) <= {c["id"] for c in gvisor.containers()}
    pool.close()
    _no_sandboxes(gvisor)
    assert _sandboxes_wrote(local_conduit.root) == []


@pytest.mark.sandbox
def test_sweep_reaps_warm_sandboxes_of_a_host_that_lost_them(gvisor, local_conduit):
    key = key_for(NodeSpec(run_id="r", node_id="n", argv=["true"]))
    pool = _ready_pool(gvisor, local_conduit, key)
    try:
        # As `prefect-resoluto sweep` would after the host process died: by the runtime's own listing.
        assert gvisor.sweep({}) == 1
        _no_sandboxes(gvisor)
    finally:
        pool.close()
    assert _sandboxes_wrote(local_conduit.root) == []


@pytest.mark.sandbox
def test_a_key_mismatch_gets_its_own_limits(gvisor, local_conduit):
    from prefect_resoluto.runtimes.base import Resources

    hog = ["python3", "-c", "b = bytearray(400 * 1024 * 1024); print('allocated')"]
    spec = NodeSpec(
        run_id="run-m", node_id="small", argv=hog, resources=Resources.from_quantities(memory="256Mi")
    )
    default_key = key_for(NodeSpec(run_id="run-m", node_id="x", argv=hog))
    key = key_for(spec)
    assert key != default_key
    pool = _ready_pool(gvisor, local_conduit, key)
    try:
        other = pool.take(default_key)[0]  # none, or one restored from the other key's own image
        assert other is None or (other.key == default_key and other.restored)
        if other is not None:
            other.discard()
        w = _take(pool, key)
        cfg = json.loads((Path(w.handle.data["bundle"]) / "config.json").read_text())
        assert cfg["linux"]["resources"]["memory"]["limit"] == 256 * 1024 * 1024
        o = drive_node(spec, local_conduit, gvisor, warm=w)
    finally:
        pool.close()
    assert not o.ok and o.warm
    assert o.failure in ("killed", "workload"), o.describe()
    _no_sandboxes(gvisor)


@pytest.mark.sandbox
def test_archive_of_a_warm_node_is_unpacked_by_the_host(gvisor, local_conduit, tmp_path):
    spec = NodeSpec(
        run_id="run-o",
        node_id="n1",
        argv=["sh", "-c", "mkdir -p out && echo hi > out/a.txt"],
        output_paths=["out/*.txt"],
        outputs_dir=tmp_path / "o",
    )
    key = key_for(spec)
    pool = _ready_pool(gvisor, local_conduit, key)
    try:
        o = drive_node(spec, local_conduit, gvisor, warm=_take(pool, key))
    finally:
        pool.close()
    assert o.ok, o.describe()
    assert (tmp_path / "o" / "out" / "a.txt").read_text() == "hi\n"


def test_warm_pool_setting_on_config_block_and_runner(tmp_path):
    from prefect_resoluto import ResolutoTaskRunner
    from prefect_resoluto.blocks import SandboxBlock
    from prefect_resoluto.settings.config import SandboxConfig
    from prefect_resoluto.warm.pool import default_size

    with pytest.raises(ValueError, match="warm_pool"):
        SandboxConfig(warm_pool=-1)
    assert SandboxBlock(warm_pool=2).to_config().warm_pool == 2
    assert SandboxBlock().to_config().warm_pool is None
    assert ResolutoTaskRunner(warm_pool=0)._options["warm_pool"] == 0
    assert default_size(None, 8) == 4 and default_size(None, 2) == 2 and default_size(0, 8) == 0


def test_real_prefect_is_learned_from_the_module_imports(tmp_path):
    from prefect_resoluto.warm.pool import needs_real_prefect

    cases = {
        "from prefect import task, flow\nimport prefect\n": (),
        "from prefect import (task,\n    get_run_logger)\n": (),
        "import prefect.variables\nfrom prefect import task\n": ("prefect.variables",),
        "from prefect.blocks.system import Secret\n": ("prefect.blocks.system",),
        "from prefect import task, variables as v\n": ("prefect",),
        "# import prefect.variables\nx = 'from prefect.x import y'\n": (),
    }
    for i, (src, want) in enumerate(cases.items()):
        f = tmp_path / f"m{i}.py"
        f.write_text(src)
        assert needs_real_prefect(f) == want, src
    assert needs_real_prefect(tmp_path / "missing.py") == ()


def test_slot_conduit_holds_one_node_and_speaks_canonical_keys(tmp_path):
    from guest_runner.conduit import InvalidKey
    from guest_runner.warm import SlotConduit

    slot = tmp_path / "slot"
    c = SlotConduit(str(slot), "run/r/nodes/n")
    c.put("run/r/nodes/n/events-000001.jsonl", b"{}\n")
    assert (slot / "events-000001.jsonl").read_bytes() == b"{}\n"
    assert c.list_prefix("run/r/nodes/n/events-") == ["run/r/nodes/n/events-000001.jsonl"]
    assert c.get("run/r/nodes/n/events-000001.jsonl") == b"{}\n"
    for bad in ("run/r/nodes/other/result.json", "run/r/nodes/n/../m/x", "inbox/x"):
        with pytest.raises(InvalidKey):
            c.put(bad, b"x")
    assert c.delete_prefix("run/r/nodes/n/") == 1


@pytest.mark.sandbox
def test_a_warm_sandbox_that_dies_booting_stops_the_pool_for_its_key(gvisor, local_conduit, caplog):
    from prefect_resoluto.runtimes.base import Resources
    from prefect_resoluto.warm.pool import PoolKey

    # 1 MiB cannot hold an interpreter: the guest dies before it is ready.
    key = PoolKey(resources=Resources(memory_bytes=1024 * 1024))
    pool = WarmPool(gvisor, local_conduit, size=1)
    try:
        pool.want(key, idle=1)
        wait_for(lambda: key in pool._broken, timeout=120, what="the pool to give up on the key")
        assert pool.take(key)[0] is None
        assert "ended before it was ready" in caplog.text
    finally:
        pool.close()
    _no_sandboxes(gvisor)


def test_a_call_reports_installed_packages_only(tmp_path):
    """imports.json names what the image provides (here jsonschema), never the standard
    library, the guest runner, the stand-ins or the workspace's own modules."""
    from test_guest_call import run_call

    ws = tmp_path / "ws"
    (ws / "pkg").mkdir(parents=True)
    (ws / "pkg" / "__init__.py").write_text("")
    (ws / "helper.py").write_text("X = 1\n")
    (ws / "tasks.py").write_text(
        "import json, helper, pkg\nfrom prefect import task\n\n"
        "@task\ndef f():\n    import jsonschema\n    return helper.X\n"
    )
    proc, ret, err = run_call(ws, {"file": "tasks.py", "qualname": "f", "parameters": {}})
    assert ret == {"value": 1}, (proc.stderr, err)
    names = json.loads((ws / ".resoluto" / "imports.json").read_text())["modules"]
    assert "jsonschema" in names
    assert not {n.partition(".")[0] for n in names} & {
        "json",
        "os",
        "helper",
        "pkg",
        "tasks",
        "guest_runner",
        "prefect",
        "prefect_resoluto",
    }, names
    assert all(n.count(".") <= 1 for n in names) and len(names) <= 200


@pytest.mark.parametrize("up_front", [False, True], ids=["lazily", "up-front"])
def test_a_real_prefect_calls_report_is_its_own_imports_not_prefects(tmp_path, up_front):
    """A module needing the real Prefect reports what it imported itself (jmespath), not what
    loading Prefect did (pydantic, httpx, ...): a warm sandbox for the module pre-imports
    Prefect anyway, and reporting Prefect's own modules changed the module's pool key after
    its first call (a second image, Prefect imported again in a template). The same whether
    the real Prefect came with the module's imports (a cold call) or before them."""
    from test_guest_call import run_call

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "tasks.py").write_text(
        "import prefect.variables\nfrom prefect import task\n\n@task\ndef f():\n    import jmespath\n    return 1\n"
    )
    proc, ret, err = run_call(
        ws, {"file": "tasks.py", "qualname": "f", "parameters": {}}, real_prefect=up_front
    )
    assert ret == {"value": 1}, (proc.stderr, err)
    names = json.loads((ws / ".resoluto" / "imports.json").read_text())["modules"]
    assert "jmespath" in names, names
    assert not {n.partition(".")[0] for n in names} & {"pydantic", "httpx", "anyio", "typing_extensions"}, (
        names
    )


def _report(out: Path, names: list[object]) -> None:
    (out / ".resoluto").mkdir(parents=True, exist_ok=True)
    (out / ".resoluto" / "imports.json").write_text(json.dumps({"modules": names}))


def _read(out):
    """What the host now takes from a call's outbox: imports.json's bytes, or None."""
    f = out / ".resoluto" / "imports.json"
    return f.read_bytes() if f.exists() else None


def test_learned_imports_are_verified_from_successful_calls_and_evicted(tmp_path):
    from prefect_resoluto.warm.pool import KEEP_CALLS, MAX_IMPORTS, Learned

    src = tmp_path / "mod.py"
    src.write_text("import prefect.variables\n")
    out = tmp_path / "out"
    learned = Learned()
    assert learned.imports_for(src) == ("prefect.variables",)  # from the module's own imports first
    # The hostile list: real Prefect, a __main__, a module that opens a browser, names
    # that are not installed, shapes that are not names -- and one honest package.
    hostile = ["prefect", "prefect.blocks", "unittest.__main__", "antigravity", "this", "guest_runner"]
    hostile += ["../evil", "os;rm -rf /", 3, "a.b.c", "yaml.__main__", "json", "unittest"]
    _report(out, [*hostile, *(f"m{i}" for i in range(2 * MAX_IMPORTS)), "yaml", "yaml._yaml"])
    assert learned.learn(src, _read(out), succeeded=False) == ()  # a failed call teaches nothing
    assert learned.imports_for(src) == ("prefect.variables",)
    assert learned.learn(src, _read(out)) == ("yaml", "yaml._yaml")  # only what is installed, by name
    assert learned.imports_for(src) == ("yaml", "yaml._yaml", "prefect.variables")
    _report(out, ["attr"])
    learned.learn(src, _read(out))
    assert learned.imports_for(src) == ("attr", "yaml", "yaml._yaml", "prefect.variables")
    for _ in range(KEEP_CALLS):  # calls that no longer import yaml: it is forgotten
        learned.learn(src, _read(out))
    assert learned.imports_for(src) == ("attr", "prefect.variables")
    _report(out, ["not json"])
    (out / ".resoluto" / "imports.json").write_text("not json")
    assert learned.learn(src, _read(out)) == () and learned.learn(src, _read(tmp_path / "none")) == ()
    assert learned.imports_for(tmp_path / "other.py") == ()


def test_a_report_of_many_long_names_costs_one_read_of_each_package_and_a_bounded_memory(
    tmp_path, monkeypatch
):
    """imports.json is the sandbox's word: 800 submodule names of one installed package
    re-read that package's file list once per name (14.8 s of the flow process), and every
    name ever reported was remembered. Each package's list is read once, a name past
    MAX_MODULE_NAME is no module's, and the answers kept are bounded."""
    import importlib.metadata

    from prefect_resoluto.warm import pool as pool_mod

    reads: list[str] = []
    real = importlib.metadata.distribution
    monkeypatch.setattr(importlib.metadata, "distribution", lambda d: reads.append(d) or real(d))
    monkeypatch.setattr(pool_mod, "_verified", {})
    pool_mod._submodules.cache_clear()
    src = tmp_path / "mod.py"
    src.write_text("x = 1\n")
    names = ["kubernetes.client", "x" * 5000] + [f"kubernetes.m{i}" for i in range(798)]
    learned = pool_mod.Learned()
    assert learned.learn(src, json.dumps({"modules": names}).encode()) == ("kubernetes.client",)
    assert len(reads) == len(set(reads)) <= 2, reads  # once per distribution of the package
    assert "x" * 5000 not in pool_mod._verified
    # names cycling through more packages than a small cache holds: each read once still
    tops = sorted(t for t, d in importlib.metadata.packages_distributions().items() if t.isidentifier() and d)
    assert len(tops) > 64
    reads.clear()
    for round_ in range(2):  # new names each round: none answered from what was remembered
        names = [f"{t}.zz{round_}_{i}" for i, t in enumerate(tops[:200])]
        learned.learn(src, json.dumps({"modules": names}).encode())
    assert len(reads) == len(set(reads)), [d for d in set(reads) if reads.count(d) > 1][:5]
    for chunk in range(0, 3 * pool_mod.MAX_VERIFIED, 500):
        learned.learn(
            src, json.dumps({"modules": [f"nothere{i}" for i in range(chunk, chunk + 500)]}).encode()
        )
    assert len(pool_mod._verified) <= pool_mod.MAX_VERIFIED


def test_a_full_learned_list_still_takes_an_honest_calls_names(tmp_path):
    """A call that reports every installed module fills the cap; the next honest call's
    names still get in (the least recently reported go), and the flood is gone after
    KEEP_CALLS honest calls."""
    import importlib.metadata

    from prefect_resoluto.warm.pool import KEEP_CALLS, MAX_IMPORTS, Learned, installed_module

    src, out = tmp_path / "mod.py", tmp_path / "out"
    src.write_text("x = 1\n")
    flood = sorted(n for n in importlib.metadata.packages_distributions() if installed_module(n))
    assert len(flood) > 20
    learned = Learned()
    _report(out, flood * 3)
    learned.learn(src, _read(out))
    assert len(learned.imports_for(src)) == min(len(flood), MAX_IMPORTS)
    for _ in range(KEEP_CALLS):
        _report(out, ["yaml"])
        learned.learn(src, _read(out))
        assert "yaml" in learned.imports_for(src)
    assert learned.imports_for(src) == ("yaml",)


@settings(max_examples=200, deadline=None)
@given(
    reports=st.lists(
        st.tuples(
            st.booleans(),
            st.lists(
                st.one_of(
                    st.sampled_from(
                        [
                            "yaml",
                            "yaml._yaml",
                            "attr",
                            "jsonschema",
                            "prefect",
                            "prefect.flows",
                            "unittest.__main__",
                            "antigravity",
                            "yaml.__main__",
                            "guest_runner",
                            "prefect_resoluto.warm.pool",
                            "os",
                            "pytest",
                            "_pytest",
                        ]
                    ),
                    st.from_regex(
                        r"[A-Za-z_][A-Za-z0-9_]{0,8}(\.[A-Za-z_][A-Za-z0-9_]{0,8})?", fullmatch=True
                    ),
                    st.text(max_size=12),
                    st.integers(),
                ),
                max_size=30,
            ),
        ),
        max_size=12,
    )
)
def test_learned_imports_property(tmp_path_factory, reports):
    """Whatever calls report: the list holds only installed, non-__main__, non-Prefect
    modules, at most MAX_IMPORTS, from successful calls among the last KEEP_CALLS."""
    from prefect_resoluto.warm.pool import KEEP_CALLS, MAX_IMPORTS, Learned, installed_module

    src = tmp_path_factory.mktemp("m") / "mod.py"
    src.write_text("x = 1\n")
    out = tmp_path_factory.mktemp("o")
    learned = Learned()
    ok_calls: list[list[object]] = []
    for succeeded, names in reports:
        _report(out, names)
        learned.learn(src, _read(out), succeeded=succeeded)
        if succeeded:
            ok_calls.append(names)
    got = learned.imports_for(src)
    assert len(got) <= MAX_IMPORTS and len(set(got)) == len(got)
    recent = {n for names in ok_calls[-KEEP_CALLS:] for n in names if isinstance(n, str)}
    for n in got:
        assert installed_module(n) and n in recent, n
        assert "__main__" not in n and n.split(".")[0] not in ("prefect", "guest_runner", "prefect_resoluto")


def test_no_boots_ahead_while_every_core_has_a_node(tmp_path):
    """In flight = warm nodes still running + cold ones started in the last MISS_WINDOW:
    at the host's core count the refill boots nothing (no idle CPU to boot in)."""
    import os
    import time

    from prefect_resoluto.warm.pool import PoolKey

    rt = get_runtime("process")
    pool = WarmPool(rt, LocalConduit(tmp_path / "conduit"), size=4)
    assert pool.enabled, pool.why_not
    key = PoolKey()
    pool._wanted.append(key)  # as want() does, without starting the refill thread
    assert not pool._saturated() and pool._next_key() == key
    pool._misses[key] = [time.monotonic()] * (os.cpu_count() or 1)
    assert pool._saturated() and pool._next_key() is None
    pool._misses[key] = [time.monotonic() - 60] * (os.cpu_count() or 1)  # long gone
    assert not pool._saturated() and pool._next_key() == key


def test_the_lookahead_is_earned_a_lone_task_costs_two_sandboxes_not_four(tmp_path, monkeypatch):
    """A one-task flow restored four sandboxes and discarded three: the pool kept two idle
    ahead plus one per node in flight from the runner's start. Now a key keeps one idle until
    its second take; then the lookahead, plus its nodes in flight beyond the first."""
    import time

    from prefect_resoluto.warm.pool import AHEAD_FIRST, AHEAD_RESTORED, PoolKey

    pool = WarmPool(get_runtime("process"), LocalConduit(tmp_path / "conduit"), size=4)
    assert pool.enabled, pool.why_not
    monkeypatch.setattr(pool, "_restorable", lambda key: True)  # as gVisor with its image made
    key = PoolKey()
    pool._wanted.append(key)  # as want() does, without starting the refill thread

    class Running:
        def alive(self) -> bool:
            return True

    assert pool.target(key) == AHEAD_FIRST == 1
    pool._takes[key], pool._taken[key] = 1, [Running()]  # the first task runs
    assert pool.target(key) == AHEAD_FIRST  # one for a second task, if one comes
    pool._takes[key], pool._taken[key] = 2, []  # a second came: tasks one after another
    assert pool.target(key) == AHEAD_RESTORED
    pool._taken[key] = [Running(), Running(), Running()]  # three at once
    assert pool.target(key) == AHEAD_RESTORED + 2
    pool._misses[key] = [time.monotonic()]  # and one that found none
    assert pool.target(key) == min(pool.size, AHEAD_RESTORED + 3)


def test_a_runners_pending_tasks_size_the_restores_and_a_drained_map_keeps_one(tmp_path):
    """Issue 42: the tasks submitted and not started yet (a map's) are what the pool keeps
    ready ahead, up to its size; each node waiting for one is one more; once they have all
    started one is kept for a next stage, not the lookahead per node in flight (discarded
    unused at exit). A lone task later is unknown demand again: the usual few ahead."""
    from prefect_resoluto.warm.pool import AHEAD_DRAINED, AHEAD_FIRST, PoolKey

    rt = get_runtime("process")
    pool = WarmPool(rt, LocalConduit(tmp_path / "conduit"), size=4)
    assert pool.enabled, pool.why_not
    key = PoolKey()
    pool._wanted.append(key)  # as want() does, without starting the refill thread
    other = PoolKey(imports=("json",))  # an earlier module's key, not the map's
    pool._wanted.append(other)
    assert pool.target(key) == AHEAD_FIRST
    for _ in range(6):
        pool.expect(1)  # a 6-way map submitted
    pool._demanded.add(key)  # as its first node's take() does
    assert pool.target(key) == 4  # its width, not a fixed lookahead
    assert pool.target(other) == AHEAD_FIRST  # a key the map does not take keeps the usual
    for _ in range(6):
        pool.expect(-1)  # all started
    assert pool.target(key) == AHEAD_DRAINED
    pool._waiting[key] = 2  # two of its nodes still waiting for their sandboxes
    assert pool.target(key) == AHEAD_DRAINED + 2 and pool._next_key() == key
    pool._waiting[key] = 0
    pool.expect(1)
    pool.expect(-1)
    assert pool.target(key) == AHEAD_FIRST


def test_a_node_of_a_key_with_imports_waits_for_its_image_while_it_is_made(tmp_path, monkeypatch):
    """A key that pre-imports modules (the real Prefect: seconds of CPU in gVisor): its node
    waits for the key's image, made meanwhile, and a restore from it (IMAGE_WAIT at most)
    rather than booting cold to import them itself; the refill makes that image even when
    every core has a node. A key importing nothing still runs cold while an image is made
    (its cold boot is cheaper than the wait), and no key waits once its image failed."""
    import os
    import time

    from prefect_resoluto.warm.pool import IMAGE_WAIT, PoolKey

    pool = WarmPool(get_runtime("process"), LocalConduit(tmp_path / "conduit"), size=4)
    assert pool.enabled, pool.why_not
    plain, heavy = PoolKey(), PoolKey(imports=("prefect.variables",))
    pool._wanted += [plain, heavy]  # as want() does, without starting the refill thread
    monkeypatch.setattr(pool, "snapshots", object())  # as gVisor: images are made
    monkeypatch.setattr(pool, "_restorable", lambda key: False)  # none made yet
    now = time.monotonic()
    assert pool._restore_coming(heavy, now) and not pool._restore_coming(plain, now)
    pool._templating = True  # the refill thread makes an image (this key's)
    assert pool._restore_coming(heavy, now) and not pool._restore_coming(heavy, now - IMAGE_WAIT)
    pool._templating = False
    pool._misses[plain] = [time.monotonic()] * (os.cpu_count() or 1)  # every core has a node
    assert pool._saturated() and pool._next_key() is None
    pool._waiting[heavy] = 1
    assert pool._next_key() == heavy
    pool._booting_only.add(heavy)  # its image could not be made: its sandboxes boot
    assert not pool._restore_coming(heavy, now)


def _gated_spec(tmp_path: Path) -> tuple[NodeSpec, Path]:
    """A node whose workload runs until the returned gate file exists."""
    gate = tmp_path / "gate"
    wait_gate = [
        "python3",
        "-c",
        f"import os,time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.01)",
    ]
    return NodeSpec(run_id="run-t", node_id="n1", argv=wait_gate), gate


def _drive_in_thread(spec: NodeSpec, conduit: LocalConduit, rt, w: WarmSandbox):
    """``spec`` driven on the warm sandbox ``w`` in a thread: (the thread, its outcome's list)."""
    import threading

    out: list = []
    t = threading.Thread(
        target=lambda: out.append(drive_node(spec, conduit, rt, warm=w, min_isolation="none"))
    )
    t.start()
    return t, out


def test_a_warm_guest_runs_its_node_on_threads_started_before_it_was_ready(tmp_path):
    # Starting a thread in a restored gVisor sandbox costs 2-15 ms of the node's time; a warm
    # guest starts the node's two (the shipper's, the host watch's) while it waits, and its node
    # starts none. Seen from the host on `process`, where the runner is the sandbox's process:
    # three threads at ready, still three while the node runs (the workload is a process).
    rt = get_runtime("process", state_dir=tmp_path / "state")
    conduit = LocalConduit(str(tmp_path / "conduit"))
    spec, gate = _gated_spec(tmp_path)
    key = key_for(spec)
    pool = _ready_pool(rt, conduit, key, n=1)
    try:
        w = _take(pool, key)
        tasks = Path(f"/proc/{w.handle.data['pid']}/task")
        assert len(list(tasks.iterdir())) == 3  # main, and the two spares waiting
        t, out = _drive_in_thread(spec, conduit, rt, w)
        try:
            wait_for(
                lambda: (Path(w.handle.data["dir"]) / "output.log").exists() and _running_workload(tasks),
                what="the node's workload",
            )
            assert len(list(tasks.iterdir())) == 3  # the node started no thread of its own
        finally:
            gate.touch()
            t.join(scaled(120))
        assert out and out[0].ok, out and out[0].describe()
    finally:
        pool.close()


def _running_workload(tasks: Path) -> bool:
    """Whether the runner at ``tasks`` has a child (its node's workload) yet."""
    return any(
        (tasks / t / "children").read_text().split()
        for t in os.listdir(tasks)
        if (tasks / t / "children").exists()
    )


def test_spare_threads_take_the_work_they_are_given_and_then_new_ones_start():
    import threading

    from guest_runner import threads

    before = threading.active_count()
    threads.prestart(2)
    assert threading.active_count() == before + 2
    ran: list[int] = []
    gate = threading.Event()
    started = [threads.start(lambda n=n: (gate.wait(), ran.append(n)), f"worker-{n}") for n in range(3)]
    assert threading.active_count() == before + 3  # two spares, one new
    assert sorted(t.thread.name if hasattr(t, "thread") else t.name for t in started) == [
        "worker-0",
        "worker-1",
        "worker-2",
    ]
    gate.set()
    for t in started:
        t.join(scaled(30))
    assert sorted(ran) == [0, 1, 2]


def test_spare_threads_started_before_a_later_hardening_are_let_go():
    # A warm guest's spares carry the hardening done before them. Should the process be
    # hardened only at its assignment (per-thread state), the runner lets them end unused and
    # starts its threads after the hardening instead.
    import threading

    from guest_runner import threads

    threads.prestart(2)
    spares = list(threads._SPARES)
    threads.drop()
    for spare in spares:
        spare.join(scaled(30))
        spare.thread.join(scaled(30))
        assert not spare.thread.is_alive()
    done = threading.Event()
    t = threads.start(done.set, "after-the-hardening")
    assert isinstance(t, threading.Thread)  # none of the dropped spares
    t.join(scaled(30))
    assert done.is_set()


def test_a_warm_node_is_in_flight_until_its_driver_ends_it_and_the_pool_never_asks(tmp_path):
    """The pool counts the warm sandboxes whose nodes run (its lookahead, its saturation) from
    the driver's word: taken until the node's drive ends it, and no status call meanwhile (it
    asked the runtime for every taken sandbox at every look, every 20 ms while a restore came:
    ~50 status reads a node on a pooled gVisor map)."""
    rt = get_runtime("process", state_dir=tmp_path / "state")
    conduit = LocalConduit(str(tmp_path / "conduit"))
    spec, gate = _gated_spec(tmp_path)
    key = key_for(spec)
    pool = _ready_pool(rt, conduit, key, n=1)
    asked: list[str] = []
    status = rt.status
    try:
        w = _take(pool, key)
        t, out = _drive_in_thread(spec, conduit, rt, w)
        try:
            wait_for(lambda: (Path(w.handle.data["dir"]) / "output.log").exists(), what="the node's start")
            rt.status = lambda handle: asked.append(handle.id) or status(handle)  # type: ignore[method-assign]
            for _ in range(20):
                assert pool._taken[key] == [w]
                pool._saturated(), pool.target(key)
            assert w.handle.id not in asked
        finally:
            gate.touch()
            t.join(scaled(120))
        assert out and out[0].ok, out and out[0].describe()
        assert pool._taken[key] == []  # ended by its driver, on its way out
        w.ended()  # idempotent
        assert pool._taken[key] == []
    finally:
        rt.status = status  # type: ignore[method-assign]
        pool.close()


def test_a_starting_sandbox_is_asked_whether_it_died_every_death_look_not_every_ready_look(tmp_path):
    """The refill looks at a starting sandbox's log every READY_LOOK (its ready line); whether
    it died (a status read, ten times the cost) only every DEATH_LOOK."""
    import time

    from prefect_resoluto.warm.pool import DEATH_LOOK, READY_LOOK

    assert DEATH_LOOK >= 5 * READY_LOOK
    rt = get_runtime("process", state_dir=tmp_path / "state")
    asked: list[str] = []
    status = rt.status
    rt.status = lambda handle: asked.append(handle.id) or status(handle)  # type: ignore[method-assign]
    spec = NodeSpec(run_id="run-t", node_id="n1", argv=["true"])
    t0 = time.monotonic()
    pool = _ready_pool(rt, LocalConduit(str(tmp_path / "conduit")), key_for(spec), n=1)
    try:
        elapsed = time.monotonic() - t0
        assert 1 <= len(asked) <= elapsed / DEATH_LOOK + 1, (len(asked), elapsed)
    finally:
        rt.status = status  # type: ignore[method-assign]
        pool.close()


@pytest.mark.sandbox
def test_warm_gvisor_sandboxes_of_one_layout_share_one_read_only_root(local_conduit, tmp_path):
    """A warm sandbox's root holds only mount points and links, the same for every sandbox of
    its layout: made once in the runtime's state (not ~35 entries made and removed a
    sandbox), linked from each bundle, served read-only, kept by sweeps; a node that tries to
    write into it changes nothing."""
    from prefect_resoluto.runtimes.gvisor import ROOTFS_DIR

    rt = get_runtime("gvisor", state_dir=tmp_path / "state")
    if not rt.availability().ok:
        pytest.skip(f"gvisor is not available here: {rt.availability().why}")
    plant = (
        "import os\nfor p in ('/planted', '/etc/planted', '/conduit/planted', '/opt/planted'):\n"
        "    try:\n        open(p, 'w').write('x'); print('wrote', p)\n"
        "    except OSError as e:\n        print('refused', p, e.errno)\n"
    )
    spec = NodeSpec(run_id="run-r", node_id="n1", argv=["python3", "-c", plant])
    key = key_for(spec)
    pool = _ready_pool(rt, local_conduit, key, n=2)
    try:
        links = [Path(w.handle.data["dir"]) / "bundle" / "rootfs" for w in pool._idle[key]]
        assert all(p.is_symlink() for p in links), links
        (root,) = {p.resolve() for p in links}
        assert root.parent == rt.state / ROOTFS_DIR
        before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
        modes = {p.name: p.lstat().st_mode for p in [root, *root.rglob("*")] if not p.is_symlink()}
        assert not [n for n, m in modes.items() if m & 0o022], modes  # no one but root writes it
        lines: list[str] = []
        o = drive_node(
            spec,
            local_conduit,
            rt,
            warm=_take(pool, key),
            min_isolation="none",
            on_event=lambda ev: lines.append((ev.get("data") or {}).get("line", "")),
        )
        assert o.ok, o.describe()
        assert not [line for line in lines if line.startswith("wrote")], lines
        assert len([line for line in lines if line.startswith("refused")]) == 4, lines
    finally:
        pool.close()
    _no_sandboxes(rt)
    rt.sweep({})
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before  # kept, unchanged
