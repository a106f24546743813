"""S3Conduit against a real S3 HTTP endpoint (moto's server behind the counting proxy).

Fixtures come from ``support.s3_fixtures`` (a plugin). Everything talks to
127.0.0.1 only; faults are injected on the HTTP path, boto3 is never patched.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.conduit_contract import ConduitContract
from support.s3_fixtures import Faults, RequestCounter, S3Endpoint, free_port

from guest_runner.conduit import (
    ConduitError,
    ConduitUnavailable,
    InvalidKey,
    ObjectNotFound,
)
from guest_runner.conduit.registry import conduit_from_env, conduit_from_url

pytest.importorskip("boto3")

from guest_runner.conduit.s3 import S3Conduit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

SECRET_ID = "AKIARESOLUTOSECRETID"
SECRET_KEY = "resoluto/secret+access/key"
SECRET_TOKEN = "resoluto-session-token-value"


@pytest.fixture
def make_conduit(moto_server: S3Endpoint, s3_bucket: str) -> Iterator:
    made: list[S3Conduit] = []

    def make(**kw: object) -> S3Conduit:
        kw.setdefault("endpoint_url", moto_server.endpoint_url)
        c = S3Conduit(kw.pop("bucket", s3_bucket), **kw)  # type: ignore[arg-type]
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _raw_keys(moto_server: S3Endpoint, bucket: str) -> list[str]:
    raw = moto_server.raw_client()
    try:
        keys: list[str] = []
        for page in raw.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys += [o["Key"] for o in page.get("Contents", ())]
        return sorted(keys)
    finally:
        raw.close()


# -- importability (the guest side runs on bare Python 3.9+) ------------------------------


def _python39() -> str | None:
    candidates = [shutil.which("python3.9")]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.9*/bin/python3.9")))
    for cand in candidates:
        if not cand:
            continue
        try:
            ok = (
                subprocess.run(
                    [cand, "-S", "-c", "import sys; assert sys.version_info[:2] == (3, 9)"],
                    capture_output=True,
                    timeout=60,
                ).returncode
                == 0
            )
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return cand
    return None


_PROBE = textwrap.dedent(
    """
    import guest_runner.conduit.s3 as m
    assert m.S3Conduit.kind == "s3"
    try:
        m.S3Conduit("bucket")
    except ImportError as e:
        print("boto3-missing:", e)
    else:
        print("constructed")
    """
)


def test_imports_on_python39_without_site_packages() -> None:
    py = _python39()
    if py is None:
        print("python3.9 not found (PATH or ~/.pyenv/versions/3.9*): skipping")
        pytest.skip("python3.9 is not installed here")
    proc = subprocess.run(
        [py, "-S", "-c", _PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip()
    # Under -S there is no site-packages, so boto3 is absent: the error must say so.
    assert out.startswith("boto3-missing:") and "boto3" in out.split(":", 1)[1], out


def test_import_without_boto3_and_a_clear_error_on_construction() -> None:
    script = "import sys; sys.modules['boto3'] = None; sys.modules['boto3.session'] = None\n" + _PROBE
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("boto3-missing:"), proc.stdout
    assert "pip install boto3" in proc.stdout


# -- round trips -----------------------------------------------------------------------------


def test_put_get_list_round_trip(
    s3_conduit: S3Conduit, moto_server: S3Endpoint, s3_bucket: str, s3_counter: RequestCounter
) -> None:
    blobs = {
        "run/r1/nodes/n1/inbox/workspace.tar.gz": bytes(range(256)) * 40,
        "run/r1/nodes/n1/result.json": b'{"status": "success"}',
        "run/r1/nodes/n1/empty": b"",
        "run/r1/nodes/n2/events-000001.jsonl": "ünïcode ✓\n".encode(),
    }
    for k, v in blobs.items():
        s3_conduit.put(k, v)
    for k, v in blobs.items():
        assert s3_conduit.get(k) == v
    assert s3_conduit.list_prefix("") == sorted(blobs)
    assert s3_conduit.list_prefix("run/r1/nodes/n1/") == sorted(k for k in blobs if "/n1/" in k)
    assert s3_conduit.list_prefix("run/r1/nodes/n9/") == []
    # Stored under the base prefix in the bucket, keys come back relative to it.
    assert _raw_keys(moto_server, s3_bucket) == sorted(f"base/{k}" for k in blobs)
    snap = s3_counter.snapshot(s3_bucket)
    assert snap == {"PUT": 4, "GET": 4, "LIST": 3}, snap
    assert s3_conduit.kind == "s3" and s3_conduit.base_prefix == "base"


def test_conduits_share_botocore_data_but_never_credentials_or_region(moto_server: S3Endpoint) -> None:
    """Every conduit of a process shares one botocore data loader (S3's model parsed once),
    while each keeps the credentials and region it was given, made from many threads at once."""
    import guest_runner.conduit.s3 as s3_module

    def make(i: int) -> S3Conduit:
        return S3Conduit(
            "b",
            endpoint_url=moto_server.endpoint_url,
            region=f"eu-west-{i % 3 + 1}",
            access_key_id=f"AKIA{i:04d}",
            secret_access_key=f"secret-{i}",
        )

    with ThreadPoolExecutor(8) as pool:
        conduits = list(pool.map(make, range(24)))
    for i, c in enumerate(conduits):
        assert c.guest_credentials() == {
            "AWS_ACCESS_KEY_ID": f"AKIA{i:04d}",
            "AWS_SECRET_ACCESS_KEY": f"secret-{i}",
        }
        assert c._client.meta.region_name == f"eu-west-{i % 3 + 1}"
    loaders = {id(c._session._loader) for c in conduits}
    assert len(loaders) == 1
    paths = conduits[0]._session._loader.search_paths
    assert len(paths) == len(set(paths))  # boto3's per-session append does not pile up
    assert len(s3_module._loaders) == 1


def test_partial_prefix_lists_event_chunks(s3_conduit: S3Conduit) -> None:
    node = "run/r/nodes/n/"
    for name in ("events-000002.jsonl", "events-000001.jsonl", "result.json", "_manifest.json"):
        s3_conduit.put(node + name, b"x")
    assert s3_conduit.list_prefix(node + "events-") == [
        node + "events-000001.jsonl",
        node + "events-000002.jsonl",
    ]


def test_start_after_semantics_with_and_without_base(make_conduit) -> None:
    based = make_conduit(base_prefix="base")
    bare = make_conduit()
    deep = make_conduit(base_prefix="/deep/er/")
    assert deep.base_prefix == "deep/er"
    for k in ("a/1", "a/2", "a/3", "b/1"):
        based.put(k, k.encode())
        deep.put(k, b"deep " + k.encode())
    # Neighbours of the base prefix in the same bucket must never leak in.
    for k in ("basement/a/9", "base", "other/a/1", "a/0"):
        bare.put(k, b"outside")

    assert based.list_prefix("a/", start_after="a/1") == ["a/2", "a/3"]
    assert based.list_prefix("a/", start_after="a/15") == ["a/2", "a/3"]  # not an existing key
    assert based.list_prefix("a/", start_after="0") == ["a/1", "a/2", "a/3"]  # before the prefix
    assert based.list_prefix("a/", start_after="a/3") == []
    assert based.list_prefix("a/", start_after="z") == []  # after the prefix
    assert based.list_prefix("", start_after="a/3") == ["b/1"]
    assert based.list_prefix("", start_after="") == ["a/1", "a/2", "a/3", "b/1"]
    assert based.list_prefix("") == ["a/1", "a/2", "a/3", "b/1"]
    assert deep.list_prefix("", start_after="a/2") == ["a/3", "b/1"]
    assert deep.get("a/3") == b"deep a/3"
    # The unprefixed view sees the real layout, and its start_after is not shifted.
    assert bare.list_prefix("a/") == ["a/0"]
    assert bare.list_prefix("base/a/", start_after="base/a/2") == ["base/a/3"]
    assert bare.list_prefix("", start_after="deep/er/b/1") == ["other/a/1"]


def test_pagination_beyond_1000_keys_and_batched_delete(
    make_conduit, s3_counter: RequestCounter, s3_bucket: str
) -> None:
    c = make_conduit(base_prefix="base")
    keys = [f"run/r/nodes/n/events-{i:06d}.jsonl" for i in range(1, 1006)]
    with ThreadPoolExecutor(max_workers=16) as pool:  # also: the client is shared by threads
        list(pool.map(lambda k: c.put(k, k.encode()), keys))
    c.put("run/r/nodes/other/x", b"not under the prefix")
    assert s3_counter.snapshot(s3_bucket).get("PUT") == 1006

    s3_counter.reset()
    assert c.list_prefix("run/r/nodes/n/") == keys
    assert s3_counter.snapshot(s3_bucket) == {"LIST": 2}  # 1000 + 5: one pass, two pages

    s3_counter.reset()
    tail = c.list_prefix("run/r/nodes/n/", start_after=keys[499])
    assert tail == keys[500:]
    assert s3_counter.snapshot(s3_bucket) == {"LIST": 1}

    s3_counter.reset()
    assert c.delete_prefix("run/r/nodes/n/") == 1005
    snap = s3_counter.snapshot(s3_bucket)
    assert snap == {"LIST": 2, "DELETE": 2}, snap  # two DeleteObjects batches, not 1005 deletes
    assert c.list_prefix("run/r/nodes/n/") == []
    assert c.list_prefix("") == ["run/r/nodes/other/x"]


def test_delete_prefix_scope(
    make_conduit, moto_server: S3Endpoint, s3_bucket: str, s3_counter: RequestCounter
) -> None:
    based = make_conduit(base_prefix="base")
    bare = make_conduit()
    for k in ("run/a/nodes/n/x", "run/a/nodes/n/y", "run/ab/z", "run/b/w"):
        based.put(k, b"1")
    bare.put("run/a/nodes/n/x", b"outside the base")
    assert based.delete_prefix("run/a/") == 2
    assert based.list_prefix("") == ["run/ab/z", "run/b/w"]
    assert bare.get("run/a/nodes/n/x") == b"outside the base"
    s3_counter.reset()
    assert based.delete_prefix("run/nothing/") == 0
    assert s3_counter.snapshot(s3_bucket) == {"LIST": 1}  # nothing to delete, no DeleteObjects
    assert based.delete_prefix("") == 2
    assert _raw_keys(moto_server, s3_bucket) == ["run/a/nodes/n/x"]


# -- key validation --------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["", "/abs", "../x", "a/../../x", "a//b", "a/./b", "a\\b", "nul\x00", "dir/"])
def test_invalid_keys_never_reach_the_store(
    s3_conduit: S3Conduit, s3_counter: RequestCounter, key: str
) -> None:
    with pytest.raises(InvalidKey):
        s3_conduit.put(key, b"x")
    with pytest.raises(InvalidKey):
        s3_conduit.get(key)
    assert s3_counter.total() == 0


@pytest.mark.parametrize("prefix", ["/abs/", "../", "a/../../", "a//"])
def test_invalid_prefixes_are_refused(s3_conduit: S3Conduit, s3_counter: RequestCounter, prefix: str) -> None:
    with pytest.raises(InvalidKey):
        s3_conduit.list_prefix(prefix)
    with pytest.raises(InvalidKey):
        s3_conduit.delete_prefix(prefix)
    assert s3_counter.total() == 0


@pytest.mark.parametrize("base", ["../up", "a/../../b", "a//b"])
def test_invalid_base_prefix(moto_server: S3Endpoint, base: str) -> None:
    with pytest.raises(InvalidKey):
        S3Conduit("bucket", base_prefix=base, endpoint_url=moto_server.endpoint_url)


# -- missing key vs outage -------------------------------------------------------------------


def test_exception_classes_are_distinct() -> None:
    assert not issubclass(ObjectNotFound, ConduitUnavailable)
    assert not issubclass(ConduitUnavailable, ObjectNotFound)
    assert issubclass(ObjectNotFound, ConduitError) and issubclass(ConduitUnavailable, ConduitError)


def test_missing_key_is_object_not_found(s3_conduit: S3Conduit, s3_bucket: str) -> None:
    with pytest.raises(ObjectNotFound) as ei:
        s3_conduit.get("run/r/nodes/n/result.json")
    assert not isinstance(ei.value, ConduitUnavailable)
    msg = str(ei.value)
    assert s3_bucket in msg and "base/run/r/nodes/n/result.json" in msg, msg


def test_closed_port_is_unavailable(s3_bucket: str) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    c = S3Conduit(s3_bucket, endpoint_url=endpoint, max_attempts=2, connect_timeout=2)
    try:
        for op in (lambda: c.get("k"), lambda: c.put("k", b"v"), lambda: c.list_prefix("")):
            with pytest.raises(ConduitUnavailable) as ei:
                op()
            assert not isinstance(ei.value, ObjectNotFound)
            msg = str(ei.value)
            assert endpoint in msg and s3_bucket in msg and "EndpointConnectionError" in msg, msg
    finally:
        c.close()


@pytest.mark.parametrize("mode", ["refuse", "reset"])
def test_endpoint_down_then_back(make_conduit, s3_faults: Faults, mode: str) -> None:
    c = make_conduit(base_prefix="base", max_attempts=2)
    c.put("kept", b"before the outage")
    s3_faults.down(mode)
    with pytest.raises(ConduitUnavailable) as ei:
        c.get("kept")  # exists, but the store cannot be reached: not ObjectNotFound
    assert not isinstance(ei.value, ObjectNotFound)
    with pytest.raises(ConduitUnavailable):
        c.get("never-written")
    s3_faults.up()
    assert c.get("kept") == b"before the outage"
    with pytest.raises(ObjectNotFound):
        c.get("never-written")


def test_missing_bucket_is_unavailable_not_missing_key(make_conduit) -> None:
    c = make_conduit(bucket="resoluto-no-such-bucket-here")
    for op in (lambda: c.get("k"), lambda: c.put("k", b"v"), lambda: c.list_prefix("")):
        with pytest.raises(ConduitUnavailable) as ei:
            op()
        assert not isinstance(ei.value, ObjectNotFound)
        msg = str(ei.value)
        assert "NoSuchBucket" in msg and "resoluto-no-such-bucket-here" in msg, msg


# -- retries and 5xx over the real HTTP path ------------------------------------------------


def test_transient_503s_are_retried_transparently(
    make_conduit, s3_faults: Faults, s3_counter: RequestCounter, s3_bucket: str
) -> None:
    c = make_conduit(base_prefix="base")
    s3_faults.fail_next(2, status=503, kinds="PUT")
    c.put("k", b"v")
    assert s3_faults.pending == 0
    assert s3_counter.snapshot(s3_bucket) == {"PUT": 3}  # two 503s, then the write
    s3_faults.fail_next(1, status=500, kinds="GET")
    assert c.get("k") == b"v"
    s3_faults.fail_next(1, status=503, kinds="LIST")
    assert c.list_prefix("") == ["k"]
    s3_faults.drop_next(1, kinds="PUT")  # connection closed without an answer
    c.put("k2", b"v2")
    assert s3_counter.snapshot(s3_bucket) == {"PUT": 5, "GET": 2, "LIST": 2}
    assert c.get("k2") == b"v2"


def test_persistent_5xx_is_unavailable_and_earlier_objects_survive(
    make_conduit, s3_faults: Faults, s3_counter: RequestCounter, s3_bucket: str, moto_server: S3Endpoint
) -> None:
    c = make_conduit(base_prefix="base", max_attempts=3)
    c.put("run/r/nodes/n/events-000001.jsonl", b"first")
    s3_counter.reset()
    s3_faults.fail_next(3, status=503, kinds="PUT")
    with pytest.raises(ConduitUnavailable) as ei:
        c.put("run/r/nodes/n/events-000002.jsonl", b"second")
    assert s3_counter.snapshot(s3_bucket) == {"PUT": 3}  # max_attempts, then give up
    msg = str(ei.value)
    for part in (s3_bucket, moto_server.endpoint_url, "ServiceUnavailable", "503", "events-000002"):
        assert part in msg, msg
    assert c.get("run/r/nodes/n/events-000001.jsonl") == b"first"
    with pytest.raises(ObjectNotFound):
        c.get("run/r/nodes/n/events-000002.jsonl")


def test_access_denied_is_unavailable_and_not_retried(
    make_conduit, s3_faults: Faults, s3_counter: RequestCounter, s3_bucket: str
) -> None:
    c = make_conduit(base_prefix="base")
    s3_faults.fail_next(1, status=403, code="AccessDenied")
    with pytest.raises(ConduitUnavailable) as ei:
        c.get("k")
    assert not isinstance(ei.value, ObjectNotFound)
    assert "AccessDenied" in str(ei.value) and "403" in str(ei.value)
    assert s3_counter.snapshot(s3_bucket) == {"GET": 1}


def test_read_timeout_is_retried_then_unavailable(
    make_conduit, s3_faults: Faults, s3_counter: RequestCounter, s3_bucket: str
) -> None:
    retrying = make_conduit(base_prefix="base", max_attempts=2, read_timeout=2.0)
    retrying.put("k", b"v")
    s3_faults.hang_next(1, kinds="GET")
    assert retrying.get("k") == b"v"  # the hung attempt timed out, the retry answered
    s3_faults.clear()

    once = make_conduit(base_prefix="base", max_attempts=1, read_timeout=2.0)
    s3_counter.reset()
    s3_faults.hang_next(1, kinds="GET")
    with pytest.raises(ConduitUnavailable) as ei:
        once.get("k")
    assert "ReadTimeout" in str(ei.value), str(ei.value)
    assert s3_counter.snapshot(s3_bucket) == {"GET": 1}


# -- URLs, guest env, secrets ----------------------------------------------------------------


def test_url_round_trip(make_conduit, moto_server: S3Endpoint, s3_bucket: str) -> None:
    c = make_conduit(base_prefix="my base/ü+x", region="eu-west-1")
    url = c.url
    assert url.startswith(f"s3://{s3_bucket}/my%20base/") and "region=eu-west-1" in url, url
    back = conduit_from_url(url)
    try:
        assert isinstance(back, S3Conduit)
        assert (back.bucket, back.base_prefix, back.endpoint_url, back.region) == (
            s3_bucket,
            "my base/ü+x",
            moto_server.endpoint_url,
            "eu-west-1",
        )
        assert back.url == url
        c.put("k", b"written by the original")
        assert back.get("k") == b"written by the original"
        assert back.list_prefix("") == ["k"]
    finally:
        back.close()
    assert _raw_keys(moto_server, s3_bucket) == ["my base/ü+x/k"]


def test_url_without_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-central-1")
    monkeypatch.delenv("AWS_REGION", raising=False)
    c = S3Conduit("bkt")  # no request is made: construction is offline
    try:
        assert c.url == "s3://bkt?region=eu-central-1"
        assert c.region == "eu-central-1" and c.endpoint_url is None
        assert c._client.meta.config.s3 is None or c._client.meta.config.s3.get("addressing_style") != "path"
    finally:
        c.close()
    monkeypatch.setenv("AWS_REGION", "ap-south-1")
    c2 = conduit_from_url("s3://bkt/a/b")
    try:
        assert isinstance(c2, S3Conduit) and c2.region == "ap-south-1" and c2.base_prefix == "a/b"
    finally:
        c2.close()


def test_client_configuration(make_conduit) -> None:
    c = make_conduit(max_attempts=7, connect_timeout=3, read_timeout=11)
    cfg = c._client.meta.config
    assert cfg.retries == {"mode": "standard", "total_max_attempts": 7}  # 7 requests in all
    assert cfg.s3 == {"addressing_style": "path"}  # default when an endpoint is set
    assert (cfg.connect_timeout, cfg.read_timeout) == (3, 11)
    assert cfg.max_pool_connections == 32
    virtual = make_conduit(path_style=False)
    assert (virtual._client.meta.config.s3 or {}).get("addressing_style") != "path"


def test_guest_env_and_repr_carry_no_secrets(make_conduit, moto_server: S3Endpoint, s3_bucket: str) -> None:
    c = make_conduit(
        region="us-west-2", access_key_id=SECRET_ID, secret_access_key=SECRET_KEY, session_token=SECRET_TOKEN
    )
    env = c.guest_env()
    assert env == {
        "RESOLUTO_STORE_KIND": "s3",
        "RESOLUTO_STORE_BUCKET": s3_bucket,
        "RESOLUTO_STORE_ENDPOINT": moto_server.endpoint_url,
        "RESOLUTO_STORE_REGION": "us-west-2",
    }
    visible = " ".join([*env.values(), c.url, repr(c)])
    for secret in (SECRET_ID, SECRET_KEY, SECRET_TOKEN):
        assert secret not in visible
    # The guest rebuilds an equivalent conduit from those variables (credentials ambient).
    guest = conduit_from_env(env)
    try:
        c.put("from-host", b"hello guest")
        assert guest.get("from-host") == b"hello guest"
        assert guest.url == c.url
    finally:
        guest.close()


def test_error_messages_carry_no_credentials(make_conduit, s3_faults: Faults, s3_bucket: str) -> None:
    creds = {"access_key_id": SECRET_ID, "secret_access_key": SECRET_KEY, "session_token": SECRET_TOKEN}
    down = S3Conduit(s3_bucket, endpoint_url=f"http://127.0.0.1:{free_port()}", max_attempts=1, **creds)
    up = make_conduit(max_attempts=1, **creds)
    errors: list[BaseException] = []
    try:
        for op in (lambda: down.put("k", b"v"), lambda: down.get("k")):
            with pytest.raises(ConduitUnavailable) as ei:
                op()
            errors.append(ei.value)
        s3_faults.fail_next(1, status=403, code="InvalidAccessKeyId")
        with pytest.raises(ConduitUnavailable) as ei:
            up.get("k")
        errors.append(ei.value)
        assert "access key id" in str(ei.value)  # the hint a person can act on
    finally:
        down.close()
    for err in errors:
        chain = []
        e: BaseException | None = err
        while e is not None:
            chain.append(str(e))
            e = e.__cause__ or e.__context__
        text = "\n".join(chain)
        for secret in (SECRET_ID, SECRET_KEY, SECRET_TOKEN):
            assert secret not in text, text


def test_get_stream_reads_an_object_in_pieces(
    s3_conduit: S3Conduit, s3_counter: RequestCounter, s3_bucket: str
) -> None:
    """One GetObject, read as it arrives (the outbox archives are never held whole)."""
    import os

    data = os.urandom(3 << 20)
    s3_conduit.put("run/r/nodes/n/outbox/output.tar.gz", data)
    s3_counter.reset()
    with s3_conduit.get_stream("run/r/nodes/n/outbox/output.tar.gz") as f:
        first = f.read(1 << 16)
        assert first == data[: 1 << 16]
        assert f.read() == data[1 << 16 :]
    assert s3_counter.snapshot(s3_bucket) == {"GET": 1}
    with pytest.raises(ObjectNotFound):
        s3_conduit.get_stream("run/r/nodes/n/outbox/absent.tar.gz")


class TestS3ConduitContract(ConduitContract):
    @pytest.fixture
    def conduit(self, s3_conduit: S3Conduit) -> S3Conduit:
        return s3_conduit  # under base_prefix="base": keys come back relative to it
