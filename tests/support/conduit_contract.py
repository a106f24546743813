"""What every Conduit does, whatever stores its objects: one test class, run per backend.

A backend's test module subclasses :class:`ConduitContract` once and gives it a ``conduit``
fixture, an empty conduit of that backend (docs/testing.md)::

    class TestLocalConduitContract(ConduitContract):
        @pytest.fixture
        def conduit(self, local_conduit: LocalConduit) -> Conduit:
            return local_conduit

What only one backend does (atomic renames, pagination, retries) stays in its own module.
"""

from __future__ import annotations

import pytest

from guest_runner.conduit import Conduit, ConduitUnavailable, InvalidKey, ObjectNotFound


class ConduitContract:
    """The shared behaviour; not collected itself (no ``Test`` prefix), only its subclasses."""

    def test_a_shallow_listing_holds_only_the_top_level(self, conduit: Conduit) -> None:
        """``shallow=True`` lists only the keys with no ``/`` after the prefix, in key order,
        ``start_after`` applied; without it, everything nested is listed. What the host's tail
        asks for: a node's top level, never the keys a sandbox nested below it (issue 30:
        ~31 000 deep keys grew the host by 117 MiB per poll)."""
        node = "run/r/nodes/n/"
        for k in ("events-000001.jsonl", "result.json", "outbox/o.tar.gz", "d1/d2/x", "z/y"):
            conduit.put(node + k, b"x")
        assert conduit.list_prefix(node, shallow=True) == [node + "events-000001.jsonl", node + "result.json"]
        after = node + "events-000001.jsonl"
        assert conduit.list_prefix(node, start_after=after, shallow=True) == [node + "result.json"]
        assert conduit.list_prefix(node + "events-", shallow=True) == [node + "events-000001.jsonl"]
        assert len(conduit.list_prefix(node)) == 5

    def test_a_limited_listing_is_the_first_keys_in_order(self, conduit: Conduit) -> None:
        """``limit`` keeps the first keys in key order, whatever order the store holds them
        in: the tail's recovery listings read a page, never every name a sandbox wrote."""
        node = "run/r/nodes/n/"
        for i in (7, 3, 9, 1, 5):
            conduit.put(f"{node}events-{i:06d}.jsonl", b"x")
        conduit.put(node + "deep/events-000000.jsonl", b"x")
        assert conduit.list_prefix(node + "events-", shallow=True, limit=2) == [
            f"{node}events-000001.jsonl",
            f"{node}events-000003.jsonl",
        ]
        after = f"{node}events-000003.jsonl"
        assert conduit.list_prefix(node + "events-", start_after=after, shallow=True, limit=2) == [
            f"{node}events-000005.jsonl",
            f"{node}events-000007.jsonl",
        ]
        assert conduit.list_prefix(node, limit=1) == [node + "deep/events-000000.jsonl"]
        assert len(conduit.list_prefix(node + "events-", limit=100)) == 5

    def test_objects_round_trip_and_list_in_key_order(self, conduit: Conduit) -> None:
        blobs = {
            "run/r/nodes/n/events-000002.jsonl": b"2",
            "run/r/nodes/n/events-000001.jsonl": "ünïcode ✓\n".encode(),
            "run/r/nodes/n/inbox/workspace.tar.gz": bytes(range(256)) * 40,
            "run/r/nodes/n/empty": b"",
            "run/r/nodes/n2/result.json": b"{}",
        }
        for k, v in blobs.items():
            conduit.put(k, v)
        for k, v in blobs.items():
            assert conduit.get(k) == v
            with conduit.get_stream(k) as f:
                assert f.read() == v
        assert conduit.list_prefix("") == sorted(blobs)
        assert conduit.list_prefix("run/r/nodes/n/") == sorted(k for k in blobs if "/n/" in k)
        events = ["run/r/nodes/n/events-000001.jsonl", "run/r/nodes/n/events-000002.jsonl"]
        assert conduit.list_prefix("run/r/nodes/n/events-") == events  # a key prefix, not a directory
        assert conduit.list_prefix("run/r/nodes/n/events-", start_after=events[0]) == events[1:]
        assert conduit.list_prefix("run/none/") == []

    def test_delete_prefix_removes_only_what_is_under_it(self, conduit: Conduit) -> None:
        for k in ("run/a/nodes/n/x", "run/a/nodes/n/y", "run/ab/z", "run/b/w"):
            conduit.put(k, b"1")
        assert conduit.delete_prefix("run/a/") == 2
        assert conduit.list_prefix("") == ["run/ab/z", "run/b/w"]
        assert conduit.delete_prefix("run/nothing/") == 0

    def test_a_missing_key_is_object_not_found_not_an_outage(self, conduit: Conduit) -> None:
        for read in (conduit.get, conduit.get_stream):
            with pytest.raises(ObjectNotFound) as exc:
                read("run/r/nodes/n/result.json")
            assert not isinstance(exc.value, ConduitUnavailable)

    @pytest.mark.parametrize("key", ["", "/abs", "../escape", "a/../../b", "a//b", "a/./b"])
    def test_keys_escaping_the_root_are_refused(self, conduit: Conduit, key: str) -> None:
        with pytest.raises(InvalidKey):
            conduit.put(key, b"x")
        with pytest.raises(InvalidKey):
            conduit.get(key)
        assert conduit.list_prefix("") == []

    def test_local_root_is_the_directory_of_every_key_or_none(self, conduit: Conduit) -> None:
        """``local_root``: the directory holding every key as a file for a local conduit, None
        for a store this machine cannot see as a directory (the host asks this, never the class)."""
        key = "run/r/nodes/n/outbox/o.tar.gz"
        conduit.put(key, b"x")
        root = conduit.local_root
        assert (root is not None) == (conduit.kind == "localfs")
        if root is not None:
            assert root.is_dir()
            assert (root / key).read_bytes() == b"x"
