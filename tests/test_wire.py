"""The wire module: key layout, encodings and their agreement with schemas/."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from guest_runner import wire


def test_key_layout_matches_the_seed():
    p = wire.node_prefix("run1", "node-a")
    assert p == "run/run1/nodes/node-a"
    assert wire.node_prefix("run1", "node-a", base="/base/x/") == "base/x/run/run1/nodes/node-a"
    assert wire.chunk_key(p, 1) == "run/run1/nodes/node-a/events-000001.jsonl"
    assert wire.chunk_key(p, 1234567) == "run/run1/nodes/node-a/events-1234567.jsonl"
    assert wire.inbox_key(p, "workspace") == "run/run1/nodes/node-a/inbox/workspace.tar.gz"
    assert wire.outbox_key(p) == "run/run1/nodes/node-a/outbox/output.tar.gz"
    assert wire.result_key(p) == "run/run1/nodes/node-a/result.json"
    assert wire.manifest_key(p) == "run/run1/nodes/node-a/_manifest.json"
    assert wire.task_key(p) == "run/run1/nodes/node-a/task.json"


def test_chunk_index_parses_only_chunks():
    assert wire.chunk_index("run/r/nodes/n/events-000042.jsonl") == 42
    assert wire.chunk_index("events-000001.jsonl") == 1
    assert wire.chunk_index("run/r/nodes/n/result.json") is None
    assert wire.chunk_index("run/r/nodes/n/events-1.jsonl") is None  # not zero-padded
    assert wire.chunk_index("events-000007.jsonl\n") is None  # a name a sandbox made, not chunk 7
    with pytest.raises(wire.WireError):
        wire.chunk_key("p", 0)


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "a b", ".hidden", "x" * 200, "a..b", "node\n"])
def test_ids_that_would_break_the_key_space_are_refused(bad):
    with pytest.raises(wire.WireError, match="not a valid identifier"):
        wire.node_prefix("run", bad)


def test_task_run_ids_with_attempt_suffix_are_valid():
    assert wire.node_prefix("0b8c7e4e-2f4a-4d6a-9a55-2d2f4f7c9b11", "5d5e1f1e-aaaa-bbbb-cccc-000000000000.2")


def test_event_encoding_is_compact_in_reference_field_order(validate):
    ev = wire.make_event("r", "log", "log", span_id="s1", parent_span_id="p", data={"line": "héllo"}, ts=1.5)
    line = wire.encode_event(ev)
    assert line == (
        '{"run_id":"r","span_id":"s1","parent_span_id":"p","kind":"log","name":"",'
        '"event":"log","ts":1.5,"status":"","data":{"line":"héllo"}}'
    )
    validate("event", json.loads(line))
    assert wire.decode_event(line) == ev


def test_decode_event_fills_reference_defaults_and_rejects_garbage():
    ev = wire.decode_event('{"run_id":"r","span_id":"s","kind":"log","event":"log","ts":1}')
    assert ev["parent_span_id"] == "" and ev["data"] == {} and ev["status"] == "" and ev["name"] == ""
    with pytest.raises(wire.WireError, match="not valid JSON"):
        wire.decode_event("{nope")
    with pytest.raises(wire.WireError, match="missing required field 'ts'"):
        wire.decode_event('{"run_id":"r","span_id":"s","kind":"log","event":"log"}')
    with pytest.raises(wire.WireError, match="unknown event"):
        wire.decode_event('{"run_id":"r","span_id":"s","kind":"log","event":"explode","ts":1}')


def test_result_and_manifest_encodings(validate):
    res = wire.make_result("n", "success", 0, "run/r/nodes/n/outbox/output.tar.gz")
    raw = wire.encode_result(res)
    assert raw.startswith(b'{"node_id":"n","status":"success","exit_code":0,')
    validate("result", json.loads(raw))
    assert wire.decode_result(raw) == res
    validate("manifest", json.loads(wire.encode_manifest(3)))
    assert wire.encode_manifest(3) == b'{"total_chunks": 3}'
    assert wire.decode_manifest(b'{"total_chunks": 3}') == 3
    for bad in (b"{}", b'{"total_chunks": -1}', b'{"total_chunks": "3"}', b"[]", b"nope"):
        with pytest.raises(wire.WireError):
            wire.decode_manifest(bad)
    with pytest.raises(wire.WireError, match="status"):
        wire.decode_result(b'{"status": "maybe"}')


def test_schemas_reject_what_the_seed_forbids(validate):
    import jsonschema

    with pytest.raises(jsonschema.ValidationError):
        validate("event", {"run_id": "r"})
    with pytest.raises(jsonschema.ValidationError):
        validate("result", {**wire.make_result("n"), "status": "partial"})
    with pytest.raises(jsonschema.ValidationError):
        validate("manifest", {"total_chunks": 1.5})
    with pytest.raises(jsonschema.ValidationError):
        validate("task", {"prompt": "no workspace"})
    validate("task", {"workspace_dir": "/workspace", "env": {"A": "1"}, "output_paths": ["out/**"]})


def test_schemas_are_draft_2020_12_and_ship_in_the_package(schemas):
    from importlib import resources

    for name, schema in schemas.items():
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema", name
    shipped = {p.name for p in (resources.files("prefect_resoluto") / "schemas").iterdir()}
    assert {"event.schema.json", "result.schema.json", "task.schema.json", "manifest.schema.json"} <= shipped


ROOT = Path(__file__).resolve().parents[1]


def test_the_typed_shapes_are_the_schemas_fields_in_wire_order(schemas):
    """The TypedDicts name exactly what the encoders write, in the reference's order."""
    assert tuple(wire.SpanEvent.__annotations__) == wire.EVENT_FIELDS
    assert tuple(wire.NodeResult.__annotations__) == wire.RESULT_FIELDS
    assert tuple(wire.Manifest.__annotations__) == ("total_chunks",)
    for name, shape in (("event", wire.SpanEvent), ("result", wire.NodeResult), ("manifest", wire.Manifest)):
        assert set(shape.__annotations__) == set(schemas[name]["properties"]), name
        assert shape.__total__, name  # make_*/decode_* always give every field


def test_wire_version_is_the_reference_release_setup_installs():
    """WIRE_VERSION names the reference release whose spec this code speaks: the one the
    interop tests run against (tests/test_wire_compat.py), installed by scripts/setup.sh."""
    assert re.fullmatch(r"\d+\.\d+\.\d+", wire.WIRE_VERSION)
    pin = f"resoluto-sandbox=={wire.WIRE_VERSION}"
    assert pin in (ROOT / "scripts" / "setup.sh").read_text()
    assert pin in (ROOT / "scripts" / "lock.sh").read_text()


def test_the_guest_environment_names_of_the_reference_runner():
    """The variables the reference's runner reads keep their names (spec/PROTOCOL.md)."""
    assert wire.ENV_WORKLOAD_ARGV == "RESOLUTO_WORKLOAD_ARGV"
    assert wire.ENV_WORKSPACE_DIR == "RESOLUTO_WORKSPACE_DIR"
    assert wire.ENV_OUTPUT_PATHS == "RESOLUTO_OUTPUT_PATHS"
    assert (wire.ENV_STORE_KIND, wire.ENV_STORE_ROOT, wire.ENV_STORE_PREFIX) == (
        "RESOLUTO_STORE_KIND",
        "RESOLUTO_STORE_ROOT",
        "RESOLUTO_STORE_PREFIX",
    )
    assert (wire.ENV_RUN_ID, wire.ENV_NODE_ID) == ("RESOLUTO_RUN_ID", "RESOLUTO_NODE_ID")
    for name, value in _protocol_names().items():
        assert value.startswith(wire.ENV_NAME_PREFIX), name
        if not name.endswith("NAME_PREFIX"):
            assert value == "RESOLUTO_" + name[len("ENV_") :], name


def _protocol_names() -> dict[str, str]:
    return {k: v for k, v in vars(wire).items() if k.startswith("ENV_") and isinstance(v, str)}


def test_only_the_wire_module_spells_a_variable_of_the_guests_environment():
    """Every RESOLUTO_* name of the protocol is declared once, in guest_runner/wire.py:
    no other module has it as a string literal (docstrings and messages aside)."""
    names = set(_protocol_names().values())
    found = []
    for path in sorted([*(ROOT / "guest_runner").rglob("*.py"), *(ROOT / "prefect_resoluto").rglob("*.py")]):
        if path == ROOT / "guest_runner" / "wire.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert not found, "\n".join(found)


def test_warm_lines_round_trip_and_keep_their_bytes():
    env, secret = {"RESOLUTO_RUN_ID": "r", "A": "é"}, {"TOKEN": "s"}
    line = wire.encode_assignment(env, secret)
    assert line == b'{"env":{"RESOLUTO_RUN_ID":"r","A":"\\u00e9"},"secret_env":{"TOKEN":"s"}}\n'
    assert wire.decode_assignment(line.decode()) == {**env, **secret}
    with pytest.raises(ValueError, match="'env' object"):
        wire.decode_assignment('{"secret_env": {}}')
    assert wire.warm_call_mode(False, ()) == "1"
    assert wire.warm_call_mode(False, ("numpy", "prefect.variables")) == "import:numpy,prefect.variables"
    assert wire.warm_call_mode(True, ("numpy",)) == "engine"
    assert wire.WARM_WAKE == b'{"wake":1}\n'
    assert (wire.WARM_READY, wire.WARM_SNAPSHOT_READY) == (
        "resoluto warm: ready",
        "resoluto warm: snapshot-ready",
    )


def test_the_sandbox_bootstrap_reads_only_the_wire_names():
    """The Kubernetes bootstrap is a program of its own text (it shows in the pod spec):
    the variables it reads are the wire's."""
    from prefect_resoluto.runtimes.guest_bundle import bootstrap_command

    used = set(re.findall(r"RESOLUTO_[A-Z0-9_]+", bootstrap_command()[-1]))
    assert {wire.ENV_GUEST_BUNDLE_KEY, wire.ENV_GUEST_BUNDLE_SHA256, wire.ENV_STORE_BUCKET} <= used
    assert used <= set(_protocol_names().values())
