"""Listing behaviour every Conduit shares, checked against each backend by its own tests."""

from __future__ import annotations

from guest_runner.conduit import Conduit


def check_shallow_listing(conduit: Conduit) -> None:
    """``shallow=True`` lists only the keys with no ``/`` after the prefix, in key order,
    ``start_after`` applied; without it, everything nested is listed as before. And
    ``local_root``: the directory holding every key as a file for a local conduit, None for
    a store this machine cannot see as a directory."""
    node = "run/r/nodes/n/"
    for k in ("events-000001.jsonl", "result.json", "outbox/o.tar.gz", "d1/d2/x", "z/y"):
        conduit.put(node + k, b"x")
    assert conduit.list_prefix(node, shallow=True) == [node + "events-000001.jsonl", node + "result.json"]
    after = node + "events-000001.jsonl"
    assert conduit.list_prefix(node, start_after=after, shallow=True) == [node + "result.json"]
    assert conduit.list_prefix(node + "events-", shallow=True) == [node + "events-000001.jsonl"]
    assert len(conduit.list_prefix(node)) == 5
    root = conduit.local_root
    assert (root is not None) == (conduit.kind == "localfs")
    if root is not None:
        assert root.is_dir()
        assert (root / node / "outbox/o.tar.gz").read_bytes() == b"x"
