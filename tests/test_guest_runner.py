"""`python -m guest_runner` driven by env, as a real subprocess, on a local conduit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.guest import ROOT, find_python, guest_env

from guest_runner import archive, wire
from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.tail import ChunkTailer

PY = sys.executable


def run_guest(
    conduit: LocalConduit,
    argv: list[str],
    *,
    python: str = PY,
    flags: tuple[str, ...] = (),
    node: str = "n1",
    **extra: str,
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    env = guest_env(
        conduit.root,
        "r1",
        node,
        argv,
        RESOLUTO_WORKSPACE_DIR=str(conduit.root.parent / f"ws-{node}"),
        **extra,
    )
    proc = subprocess.run(
        [python, *flags, "-m", "guest_runner"],
        env=env,
        cwd=str(conduit.root.parent),
        capture_output=True,
        text=True,
        timeout=120,
    )
    events: list[dict] = []
    tail = ChunkTailer(conduit, wire.node_prefix("r1", node))
    assert tail.check_manifest(), proc.stderr
    for _ in range(100_000):  # a poll reads a bounded number of chunks: as many as it takes
        if tail.finished or not tail.poll(events.append):
            break
    assert tail.finished
    return proc, events


def all_objects_validate(conduit: LocalConduit, validate, node: str = "n1") -> dict:
    prefix = wire.node_prefix("r1", node)
    keys = conduit.list_prefix(prefix + "/")
    chunks = [k for k in keys if wire.chunk_index(k)]
    for k in chunks:
        for line in conduit.get(k).decode().splitlines():
            validate("event", json.loads(line))
    result = json.loads(conduit.get(wire.result_key(prefix)))
    validate("result", result)
    manifest = json.loads(conduit.get(wire.manifest_key(prefix)))
    validate("manifest", manifest)
    assert manifest["total_chunks"] == len(chunks)
    assert [wire.chunk_index(k) for k in chunks] == list(range(1, len(chunks) + 1))
    return result


def lines(events: list[dict]) -> list[str]:
    return [e["data"]["line"] for e in events if e["event"] == "log" and e["kind"] == "log"]


def test_happy_path_stages_runs_collects_and_validates(local_conduit, tmp_path, validate):
    ws = tmp_path / "src"
    (ws / "data").mkdir(parents=True)
    (ws / "data" / "in.txt").write_text("from the host\n")
    prefix = wire.node_prefix("r1", "n1")
    local_conduit.put(wire.inbox_key(prefix, "workspace"), archive.pack(ws))
    script = (
        "import sys; print(open('data/in.txt').read().strip()); print('to stderr', file=sys.stderr);"
        "import os; os.makedirs('out/sub', exist_ok=True); open('out/sub/r.txt','w').write('result');"
        "open('scratch.tmp','w').write('not declared')"
    )
    proc, events = run_guest(
        local_conduit, [PY, "-c", script], RESOLUTO_OUTPUT_PATHS=json.dumps(["out/**", "missing.csv"])
    )
    assert proc.returncode == 0, proc.stderr
    got = lines(events)
    assert "from the host" in got and "to stderr" in got
    assert any("'missing.csv' matched nothing" in x for x in got)
    result = all_objects_validate(local_conduit, validate)
    assert result["status"] == "success" and result["exit_code"] == 0
    assert result["output_archive"] == wire.outbox_key(prefix)
    out = tmp_path / "fetched"
    assert archive.unpack(local_conduit.get(result["output_archive"]), out) == ["out/sub/r.txt"]
    # span structure: node root, workload child, log lines under the workload
    opens = {e["kind"]: e for e in events if e["event"] == "open"}
    assert opens["node"]["parent_span_id"] == ""
    assert opens["workload"]["parent_span_id"] == opens["node"]["span_id"]
    closes = {e["kind"]: e for e in events if e["event"] == "close"}
    assert closes["workload"]["status"] == "success" and closes["node"]["status"] == "success"
    wl = [e for e in events if e.get("data", {}).get("line") == "from the host"][0]
    assert wl["parent_span_id"] == opens["workload"]["span_id"]


def test_failure_exit_code_setup_and_cleanup(local_conduit, validate):
    proc, events = run_guest(
        local_conduit,
        ["sh", "-c", "echo working; exit 3"],
        RESOLUTO_SETUP_ARGV=json.dumps(["sh", "-c", "echo setting up"]),
        RESOLUTO_CLEANUP_ARGV=json.dumps(["sh", "-c", "echo cleaning"]),
        RESOLUTO_OUTPUT_PATHS=json.dumps(["nothing/**"]),
    )
    assert proc.returncode == 1
    result = all_objects_validate(local_conduit, validate)
    assert result["status"] == "failure" and result["exit_code"] == 3
    assert result["reason"] == "workload exited with code 3"
    assert result["output_archive"] is None  # a missing output never turns failure into success
    got = lines(events)
    assert got[got.index("setting up") : got.index("working") + 1] == ["setting up", "working"]
    assert got.index("setting up") > [i for i, x in enumerate(got) if x.startswith("staged ")][0]
    kinds = [(e["kind"], e["event"]) for e in events if e["event"] != "log"]
    assert ("setup", "open") in kinds and ("cleanup", "close") in kinds
    assert kinds.index(("cleanup", "open")) > kinds.index(("workload", "close"))
    assert "cleaning" in lines(events)


def test_failed_setup_skips_the_workload(local_conduit, validate):
    proc, events = run_guest(
        local_conduit,
        ["sh", "-c", "echo SHOULD-NOT-RUN"],
        RESOLUTO_SETUP_ARGV=json.dumps(["sh", "-c", "exit 5"]),
    )
    assert proc.returncode == 1
    result = all_objects_validate(local_conduit, validate)
    assert result["exit_code"] == 5 and "setup" in result["reason"]
    assert "SHOULD-NOT-RUN" not in lines(events)


def test_missing_binary_is_a_127_failure_with_manifest(local_conduit, validate):
    proc, events = run_guest(local_conduit, ["/nonexistent/tool", "--flag"])
    assert proc.returncode == 1
    result = all_objects_validate(local_conduit, validate)
    assert result["exit_code"] == 127
    assert result["reason"] == "command not found: /nonexistent/tool"
    assert "command not found: /nonexistent/tool" in lines(events)


@pytest.mark.parametrize(
    "raw, msg",
    [
        ('"echo hi"', "must be a JSON list of strings"),
        ("[1, 2]", "must be a JSON list of strings"),
        ("not json", "must be a JSON list of strings"),
        ("[]", "empty list"),
    ],
)
def test_bad_workload_argv_is_a_failure_result_not_a_crash(local_conduit, validate, raw, msg):
    env = guest_env(local_conduit.root, "r1", "n1", [])
    env["RESOLUTO_WORKLOAD_ARGV"] = raw
    proc = subprocess.run(
        [PY, "-m", "guest_runner"],
        env=env,
        capture_output=True,
        text=True,
        cwd=str(local_conduit.root.parent),
    )
    assert proc.returncode == 1
    result = all_objects_validate(local_conduit, validate)
    assert result["status"] == "failure" and msg in result["reason"]
    assert "RESOLUTO_WORKLOAD_ARGV" in result["reason"]


def test_hostile_inbox_fails_the_node_with_the_member_named(local_conduit, validate):
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        ti = tarfile.TarInfo("../../escape.txt")
        ti.size = 1
        t.addfile(ti, io.BytesIO(b"x"))
    local_conduit.put(wire.inbox_key(wire.node_prefix("r1", "n1"), "workspace"), buf.getvalue())
    proc, _ = run_guest(local_conduit, ["sh", "-c", "echo SHOULD-NOT-RUN"])
    assert proc.returncode == 1
    result = all_objects_validate(local_conduit, validate)
    assert "inbox rejected" in result["reason"] and "'../../escape.txt'" in result["reason"]
    assert "path traversal" in result["reason"]


def test_secrets_never_reach_the_conduit(local_conduit):
    secret = "s3cr3t-value-xyz"
    proc, events = run_guest(
        local_conduit,
        ["sh", "-c", f"echo token is $MY_TOKEN; echo custom $CUSTOM; echo {secret}"],
        MY_TOKEN=secret,
        CUSTOM="declared-9876",
        RESOLUTO_SECRET_ENV='["CUSTOM"]',
    )
    assert proc.returncode == 0
    everything = b"".join(local_conduit.get(k) for k in local_conduit.list_prefix("run/"))
    assert secret.encode() not in everything and b"declared-9876" not in everything
    assert "token is ***" in lines(events) and "custom ***" in lines(events)


def test_conduit_credentials_are_not_passed_to_the_workload(local_conduit):
    proc, events = run_guest(
        local_conduit,
        ["sh", "-c", "echo key=${AWS_SECRET_ACCESS_KEY:-unset}"],
        AWS_SECRET_ACCESS_KEY="conduit-only-credential",
    )
    assert "key=unset" in lines(events)


def test_runner_crash_still_writes_failure_and_manifest(local_conduit, validate, tmp_path):
    # The workspace dir is a file: staging into it crashes inside the runner itself.
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    env = guest_env(local_conduit.root, "r1", "n1", ["true"], RESOLUTO_WORKSPACE_DIR=str(blocker / "ws"))
    proc = subprocess.run(
        [PY, "-m", "guest_runner"], env=env, capture_output=True, text=True, cwd=str(tmp_path)
    )
    assert proc.returncode == 1
    result = all_objects_validate(local_conduit, validate)
    assert result["status"] == "failure" and "guest runner crashed" in result["reason"]


def test_hundred_thousand_lines_arrive_complete_and_in_order(local_conduit):
    n = 100_000
    proc, events = run_guest(
        local_conduit, [PY, "-c", f"import sys\nfor i in range({n}): sys.stdout.write(f'{{i}}\\n')"]
    )
    assert proc.returncode == 0
    got = [x for x in lines(events) if x.isdigit()]
    assert got == [str(i) for i in range(n)]


@pytest.mark.parametrize("version", ["3.9", "3.13"])
def test_runs_on_other_pythons_without_site_packages(local_conduit, validate, tmp_path, version):
    py39 = find_python(version)
    if py39 is None:
        pytest.skip(f"no Python {version} interpreter on this machine (pyenv's python{version} is absent)")
    ws = tmp_path / "src"
    ws.mkdir()
    (ws / "x.txt").write_text("staged")
    local_conduit.put(wire.inbox_key(wire.node_prefix("r1", "n1"), "workspace"), archive.pack(ws))
    proc, events = run_guest(
        local_conduit,
        [py39, "-S", "-c", "import sys; print(sys.version_info[:2]); print(open('x.txt').read())"],
        python=py39,
        flags=("-S",),
        RESOLUTO_OUTPUT_PATHS='["x.txt"]',
    )
    assert proc.returncode == 0, proc.stderr
    assert str(tuple(int(x) for x in version.split("."))) in lines(events) and "staged" in lines(events)
    assert all_objects_validate(local_conduit, validate)["status"] == "success"


def test_guest_runner_imports_only_the_standard_library():
    code = (
        "import sys, guest_runner.runner, guest_runner.call as _c\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('boto3','botocore','prefect','pydantic','prefect_resoluto')]\n"
        "print(bad)"
    )
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=str(ROOT))
    if "No module named 'guest_runner.call'" in out.stderr:
        code = code.replace(", guest_runner.call as _c", "")
        out = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_reseed_renews_what_is_loaded_and_loads_nothing_else():
    """A restored guest reseeds at its wake and its call at its assignment (every sandbox of
    an image had the same state). Issue 42: it imported ``random`` and ``tempfile`` (and
    shutil, zlib, bz2, lzma behind them) to do so, ~20-40 ms of a restored sandbox's CPU and
    as much on each node's path, for state a module not yet loaded does not have."""
    untouched = (
        "import sys; from guest_runner import reseed; reseed.reseed(); "
        "print(sorted(m for m in ('random', 'tempfile', 'shutil', 'bz2') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", untouched], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    # Loaded before the checkpoint (a template's pre-imports): renewed, as before.
    loaded = (
        "import random, tempfile; random.seed(7); first = random.random(); random.seed(7); "
        "next(tempfile._get_candidate_names()); from guest_runner import reseed; reseed.reseed(); "
        "print(random.random() != first, tempfile._name_sequence is None)"
    )
    out = subprocess.run([sys.executable, "-c", loaded], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"], out.stdout
