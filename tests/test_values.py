"""guest_runner.values: a task's values as tagged JSON, and what a sandbox may send instead."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import math
import uuid
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guest_runner import values


def no_fallback(obj: Any) -> Any:
    raise TypeError(f"no JSON for {type(obj).__name__}")


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (NaN equal to itself)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, decimal.Decimal) and a.is_nan():
        return b.is_nan()
    if isinstance(a, (dt.datetime, dt.time)) and a.utcoffset() != b.utcoffset():
        return False
    return bool(a == b)


def round_trip(value: Any) -> Any:
    return values.loads(json.dumps(values.encode(value, no_fallback)))


hashable = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.dates(),
    # An aware datetime keeps its UTC offset, not a zone's name: ISO 8601 carries no more.
    st.datetimes(
        timezones=st.none()
        | st.builds(
            dt.timezone,
            st.timedeltas(min_value=-dt.timedelta(hours=23), max_value=dt.timedelta(hours=23)).map(
                lambda d: dt.timedelta(minutes=d // dt.timedelta(minutes=1))
            ),
        )
    ),
    st.times(),
    st.timedeltas(),
    st.uuids(),
    st.decimals(allow_nan=False),
    st.builds(Path, st.text(alphabet="abc/", max_size=6)),
)
leaves = hashable | st.floats()
keys = st.text(max_size=4) | st.just(values.TAG) | st.integers() | st.tuples(st.integers())
json_values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.sets(hashable, max_size=3)
        | st.frozensets(hashable, max_size=3)
        | st.dictionaries(keys, inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_every_value_comes_back_as_the_same_types(value):
    assert same(round_trip(value), value)


def test_the_types_plain_json_would_change():
    tz = dt.timezone(dt.timedelta(hours=-5))
    for value in [
        (1, (2,)),
        {3},
        frozenset({"x"}),
        {1: "int key", "$resoluto": "the tag as a key"},
        b"\x00\xff",
        bytearray(b"ab"),
        dt.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=tz),
        dt.date(2026, 1, 2),
        dt.time(1, 2, 3, 4),
        dt.timedelta(days=-1, microseconds=1),
        decimal.Decimal("1.10"),
        uuid.UUID(int=7),
        PurePosixPath("/a/b"),
    ]:
        back = round_trip(value)
        want = bytes(value) if isinstance(value, bytearray) else value
        want = Path(want) if isinstance(want, PurePosixPath) else want
        assert same(back, want), (value, back)


def test_plain_lists_and_dicts_are_not_copied():
    plain = [{"a": 1, "b": [1.5, "x"]}] * 3
    assert values.encode(plain[0]["b"], no_fallback) is plain[0]["b"]
    assert json.dumps(values.encode(plain, no_fallback)) == json.dumps(plain)


def test_what_has_no_tag_goes_to_the_fallback_and_its_answer_is_encoded_too():
    class Point:
        def __init__(self, x: int, y: int) -> None:
            self.x, self.y = x, y

    def fallback(obj: Any) -> Any:
        return {"xy": (obj.x, obj.y)}

    assert same(round_trip_with(Point(1, 2), fallback), {"xy": (1, 2)})
    with pytest.raises(TypeError, match="no JSON for Point"):
        values.encode([Point(1, 2)], no_fallback)


def round_trip_with(value: Any, fallback: Any) -> Any:
    return values.loads(json.dumps(values.encode(value, fallback)))


# -- what a sandbox may send in return.json instead -------------------------------------------------
HOSTILE = [
    '{"$resoluto": "tuple", "v": 3}',
    '{"$resoluto": "set", "v": [[1]]}',
    '{"$resoluto": "dict", "v": [[[1], 2]]}',
    '{"$resoluto": "dict", "v": [[1, 2, 3]]}',
    '{"$resoluto": "os.system", "v": "id"}',
    '{"$resoluto": "builtins.eval", "v": "1"}',
    '{"$resoluto": ["tuple"], "v": []}',
    '{"$resoluto": "tuple", "v": [], "extra": 1}',
    '{"$resoluto": "tuple"}',
    '{"$resoluto": "bytes", "v": "not base64!"}',
    '{"$resoluto": "bytes", "v": 12}',
    '{"$resoluto": "date", "v": "2026-13-01"}',
    '{"$resoluto": "datetime", "v": 1e308}',
    '{"$resoluto": "timedelta", "v": [1e9, 0, 0]}',
    '{"$resoluto": "timedelta", "v": [99999999999999999999, 0, 0]}',
    '{"$resoluto": "uuid", "v": "not-a-uuid"}',
    '{"$resoluto": "decimal", "v": "twelve"}',
    '{"$resoluto": "path", "v": null}',
]


@pytest.mark.parametrize("text", HOSTILE)
def test_a_malformed_tag_is_a_value_error_naming_it(text):
    with pytest.raises(ValueError, match="tag|\\$resoluto"):
        values.loads(text)


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(
                st.sampled_from([values.TAG, "v", "x"]) | st.text(max_size=3), inner, max_size=3
            )
        ),
        max_leaves=12,
    )
)
def test_any_json_is_decoded_or_refused_with_a_value_error(data):
    text = json.dumps(data)
    try:
        values.loads(text)
    except ValueError:
        pass


def test_a_decimal_too_long_or_too_far_is_refused_and_one_within_comes_back():
    for text in ["1e99999999", "1e-9999999", "9" * 4301, "1e4301"]:
        with pytest.raises(ValueError, match="decimal"):
            values.loads(json.dumps({values.TAG: "decimal", "v": text}))
    for d in [decimal.Decimal("1e4300"), decimal.Decimal("-" + "9" * 4000), decimal.Decimal("sNaN")]:
        assert same(round_trip(d), d)


@pytest.mark.parametrize("kind", ["set", "frozenset", "dict"])
def test_members_flooding_one_hash_are_refused_quickly(kind):
    """Distinct ints with one hash (ints hash to themselves mod 2**61 - 1): built as a set,
    40 000 of them would take minutes; refused after counting them, once each."""
    members = [5 + i * (2**61 - 1) for i in range(40_000)]
    v = [[m, 0] for m in members] if kind == "dict" else members
    with pytest.raises(ValueError, match="share one hash"):
        values.loads(json.dumps({values.TAG: kind, "v": v}))
    legit = {-1, -2, *range(100)}  # -1 and -2 share a hash: a few may
    assert same(round_trip(legit), legit)
