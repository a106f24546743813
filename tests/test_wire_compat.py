"""Wire compatibility with the reference implementation, resoluto-sandbox 0.1.0.

Both directions on a local conduit, with real processes on both sides:

(a) our guest (``python -m guest_runner``) writes a node; the reference's host side
    (``ChunkReader``, ``NodeResult``, ``fetch_outputs``) reads every event in order,
    the result and the declared outputs;
(b) the reference guest (``run_node_in_sandbox``, with a stub canary: no network) writes
    a node; our ``ChunkTailer`` and ``wire.decode_result`` read it completely;
(c) byte level: key names and zero padding, compact JSON in the same field order
    (the reference's models re-serialise our objects to the very same bytes), and the
    manifest's exact bytes.

Every object either side writes is validated against ``schemas/``. The reference needs
Python >= 3.12 and lives in ``.venv-ref`` (``bash scripts/setup.sh`` makes it).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.guest import ROOT, guest_env

from guest_runner import archive, wire
from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.tail import ChunkTailer

REF_PY = ROOT / ".venv-ref" / "bin" / "python"
REF_TOOL = ROOT / "tests" / "support" / "reference_node.py"


def _reference_usable() -> str:
    if not REF_PY.exists():
        return f"{REF_PY} is absent (needs a Python 3.12: bash scripts/setup.sh makes it)"
    res = subprocess.run(
        [str(REF_PY), "-c", "import resoluto.sandbox.runner"], capture_output=True, text=True
    )
    if res.returncode != 0:
        return f"resoluto-sandbox is not importable in {REF_PY}: {res.stderr.strip()[-300:]}"
    return ""


_WHY = _reference_usable()
if _WHY:
    print(f"test_wire_compat: skipping: {_WHY}", file=sys.stderr)
pytestmark = pytest.mark.skipif(bool(_WHY), reason=_WHY or "reference available")

RUN = "run-compat"
# The guest collects a plain directory (the reference guest takes no globs); the host
# materialises only what matches the declared globs, so out/undeclared.bin stays behind.
GUEST_OUTPUTS = ["out"]
OUTPUTS = ["out/*.txt"]
# Unicode, an empty line, JSON-looking text, stderr, an output file, and an exit code.
WORKLOAD = (
    "import sys\n"
    "print('héllo ✓ from the workload')\n"
    "print('')\n"
    'print(\'{"looks": "like json"}\')\n'
    "print('to stderr', file=sys.stderr, flush=True)\n"
    "import os; os.makedirs('out', exist_ok=True)\n"
    "open('out/report.txt', 'w').write(open('data/in.txt').read().upper())\n"
    "open('out/undeclared.bin', 'w').write('x')\n"
    "sys.exit(int(sys.argv[1]))\n"
)


def _stage_inbox(conduit: LocalConduit, prefix: str, tmp: Path) -> None:
    src = tmp / "src"
    (src / "data").mkdir(parents=True)
    (src / "data" / "in.txt").write_text("staged by the host\n")
    conduit.put(wire.inbox_key(prefix, wire.WORKSPACE_ARCHIVE_NAME), archive.pack(src))


def _ref(*args: str, stdin: str | None = None) -> dict:
    res = subprocess.run(
        [str(REF_PY), str(REF_TOOL), *args], input=stdin, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _raw(conduit: LocalConduit, prefix: str) -> tuple[list[str], list[str]]:
    """(every relative key under the node, every event line in chunk order)."""
    keys = [k[len(prefix) + 1 :] for k in conduit.list_prefix(prefix + "/")]
    lines: list[str] = []
    for rel in sorted(k for k in keys if wire.chunk_index(k)):
        lines += conduit.get(f"{prefix}/{rel}").decode("utf-8").splitlines()
    return keys, lines


def _validate_node(conduit: LocalConduit, prefix: str, lines: list[str], validate) -> None:
    for line in lines:
        validate("event", json.loads(line))
    validate("result", json.loads(conduit.get(wire.result_key(prefix))))
    validate("manifest", json.loads(conduit.get(wire.manifest_key(prefix))))


def run_our_guest(conduit: LocalConduit, tmp: Path, node: str, code: int) -> str:
    prefix = wire.node_prefix(RUN, node)
    _stage_inbox(conduit, prefix, tmp)
    env = guest_env(
        conduit.root,
        RUN,
        node,
        [sys.executable, "-c", WORKLOAD, str(code)],
        RESOLUTO_WORKSPACE_DIR=str(tmp / f"ws-{node}"),
        RESOLUTO_OUTPUT_PATHS=json.dumps(GUEST_OUTPUTS),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "guest_runner"],
        env=env,
        cwd=str(tmp),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == (0 if code == 0 else 1), proc.stderr
    return prefix


def run_reference_guest(conduit: LocalConduit, tmp: Path, node: str, code: int) -> str:
    prefix = wire.node_prefix(RUN, node)
    _stage_inbox(conduit, prefix, tmp)
    env = guest_env(
        conduit.root,
        RUN,
        node,
        [sys.executable, "-c", WORKLOAD, str(code)],
        RESOLUTO_STORE_PREFIX=prefix,
        RESOLUTO_WORKSPACE_DIR=str(tmp / f"ws-{node}"),
        RESOLUTO_OUTPUT_PATHS=json.dumps(GUEST_OUTPUTS),
    )
    env.pop("PYTHONPATH")  # the reference guest imports only its own package
    proc = subprocess.run(
        [str(REF_PY), str(REF_TOOL), "guest"],
        env=env,
        cwd=str(tmp),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == (0 if code == 0 else 1), proc.stderr
    return prefix


def test_the_reference_is_the_release_our_wire_version_names():
    """What the tests below prove compatible with is the protocol wire.WIRE_VERSION names."""
    res = subprocess.run(
        [str(REF_PY), "-c", "import importlib.metadata as m; print(m.version('resoluto-sandbox'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert res.stdout.strip() == wire.WIRE_VERSION


@pytest.mark.parametrize("code", [0, 3])
def test_reference_host_reads_our_guest(local_conduit, tmp_path, validate, code):
    prefix = run_our_guest(local_conduit, tmp_path, "ours", code)
    _keys, lines = _raw(local_conduit, prefix)
    _validate_node(local_conduit, prefix, lines, validate)
    dest = tmp_path / "fetched"
    got = _ref("read", str(local_conduit.root), prefix, str(dest), json.dumps(OUTPUTS))

    assert got["finished"] is True
    # Every event, in order, exactly as our guest wrote it (the reference fills no default we left out).
    assert got["events"] == [json.loads(line) for line in lines]
    log_lines = [e["data"]["line"] for e in got["events"] if e["event"] == "log" and e["kind"] == "log"]
    for expected in ("héllo ✓ from the workload", "", '{"looks": "like json"}', "to stderr"):
        assert expected in log_lines
    assert got["result"] == json.loads(local_conduit.get(wire.result_key(prefix)))
    assert got["result"]["status"] == ("success" if code == 0 else "failure")
    assert got["result"]["exit_code"] == code
    # Our outbox, unpacked by the reference host, scoped to the declared globs.
    assert got["fetched"] == [wire.outbox_key(prefix)]
    assert (dest / "out" / "report.txt").read_text() == "STAGED BY THE HOST\n"
    assert not (dest / "out" / "undeclared.bin").exists()


@pytest.mark.parametrize("code", [0, 3])
def test_our_host_reads_the_reference_guest(local_conduit, tmp_path, validate, code):
    prefix = run_reference_guest(local_conduit, tmp_path, "theirs", code)
    keys, lines = _raw(local_conduit, prefix)
    _validate_node(local_conduit, prefix, lines, validate)
    assert "_canary_ok" in keys  # a key our tail has never heard of: ignored, not an error

    events: list[dict] = []
    tail = ChunkTailer(local_conduit, prefix)
    for _ in range(10):
        tail.poll(events.append)
        if tail.finished:
            break
    assert tail.finished
    assert events == [wire.decode_event(line) for line in lines]
    assert [e["event"] for e in events if e["kind"] in ("node", "workload")] == [
        "open",
        "open",
        "close",
        "close",
    ]
    log_lines = [e["data"]["line"] for e in events if e["event"] == "log"]
    for expected in ("héllo ✓ from the workload", "", '{"looks": "like json"}', "to stderr"):
        assert expected in log_lines
    result = wire.decode_result(local_conduit.get(wire.result_key(prefix)))
    assert result["node_id"] == "theirs"
    assert result["status"] == ("success" if code == 0 else "failure")
    assert result["exit_code"] == code
    if code == 0:  # the reference collects outputs only after a success
        assert result["output_archive"] == wire.outbox_key(prefix)
        dest = tmp_path / "fetched"
        got = archive.unpack(local_conduit.get(result["output_archive"]), dest, patterns=OUTPUTS)
        assert got == ["out/report.txt"]
        assert (dest / "out" / "report.txt").read_text() == "STAGED BY THE HOST\n"
    else:
        assert result["output_archive"] is None


def _field_order(line: str) -> list[str]:
    return [k for k, _ in json.loads(line, object_pairs_hook=lambda pairs: pairs)]


def test_byte_level_layout_and_encoding(local_conduit, tmp_path, validate):
    ours = run_our_guest(local_conduit, tmp_path / "a", "ours", 0)
    theirs = run_reference_guest(local_conduit, tmp_path / "b", "theirs", 0)
    our_keys, our_lines = _raw(local_conduit, ours)
    ref_keys, ref_lines = _raw(local_conduit, theirs)

    # Same key names and zero padding; every key either side wrote is one the other knows
    # (the reference's egress canary leaves its own _canary_ok probe object).
    chunk = re.compile(r"^events-\d{6}\.jsonl$")
    for keys in (our_keys, ref_keys):
        names = set(keys) - {"_canary_ok"}
        assert {wire.RESULT, wire.MANIFEST, "inbox/workspace.tar.gz", "outbox/output.tar.gz"} <= names
        chunks = sorted(k for k in names if chunk.match(k))
        assert chunks == [f"events-{i:06d}.jsonl" for i in range(1, len(chunks) + 1)]
        assert names - set(chunks) == {
            wire.RESULT,
            wire.MANIFEST,
            "inbox/workspace.tar.gz",
            "outbox/output.tar.gz",
        }
    assert wire.chunk_key(ours, 7).endswith("/events-000007.jsonl")

    # Compact JSON, the reference's field order, for events and results alike.
    for line in our_lines + ref_lines:
        assert _field_order(line) == list(wire.EVENT_FIELDS)
        assert line == json.dumps(json.loads(line), separators=(",", ":"), ensure_ascii=False)
    for prefix in (ours, theirs):
        raw = local_conduit.get(wire.result_key(prefix)).decode("utf-8")
        assert _field_order(raw) == list(wire.RESULT_FIELDS)
        assert raw == json.dumps(json.loads(raw), separators=(",", ":"), ensure_ascii=False)

    # The reference's own models serialise our objects to exactly our bytes.
    our_result = local_conduit.get(wire.result_key(ours)).decode("utf-8")
    again = _ref("reencode", stdin=json.dumps({"events": our_lines, "result": our_result}))
    assert again["events"] == our_lines
    assert again["result"] == our_result
    # ... and ours serialise theirs to exactly their bytes.
    assert [wire.encode_event(wire.decode_event(line)) for line in ref_lines] == ref_lines
    their_result = local_conduit.get(wire.result_key(theirs))
    assert wire.encode_result(wire.decode_result(their_result)) == their_result

    # The manifest, byte for byte: {"total_chunks": N} (json.dumps' default separators).
    for prefix, lines_keys in ((ours, our_keys), (theirs, ref_keys)):
        n = sum(1 for k in lines_keys if chunk.match(k))
        assert local_conduit.get(wire.manifest_key(prefix)) == f'{{"total_chunks": {n}}}'.encode()
        assert wire.encode_manifest(n) == f'{{"total_chunks": {n}}}'.encode()
        validate("manifest", json.loads(local_conduit.get(wire.manifest_key(prefix))))
