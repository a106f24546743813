"""The wire module: key layout, encodings and their agreement with schemas/."""

from __future__ import annotations

import json

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
    with pytest.raises(wire.WireError):
        wire.chunk_key("p", 0)


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "a b", ".hidden", "x" * 200, "a..b"])
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
