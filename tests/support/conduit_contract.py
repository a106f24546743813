"""Listing behaviour every Conduit shares, checked against each backend by its own tests."""

from __future__ import annotations

from guest_runner.conduit import Conduit


def check_shallow_listing(conduit: Conduit) -> None:
    """``shallow=True`` lists only the keys with no ``/`` after the prefix, in key order,
    ``start_after`` applied; without it, everything nested is listed as before."""
    node = "run/r/nodes/n/"
    for k in ("events-000001.jsonl", "result.json", "outbox/o.tar.gz", "d1/d2/x", "z/y"):
        conduit.put(node + k, b"x")
    assert conduit.list_prefix(node, shallow=True) == [node + "events-000001.jsonl", node + "result.json"]
    after = node + "events-000001.jsonl"
    assert conduit.list_prefix(node, start_after=after, shallow=True) == [node + "result.json"]
    assert conduit.list_prefix(node + "events-", shallow=True) == [node + "events-000001.jsonl"]
    assert len(conduit.list_prefix(node)) == 5
