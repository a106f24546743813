"""Which conduit a URL or the guest's RESOLUTO_STORE_* variables name: the one registry of backends.

The backends (:mod:`guest_runner.conduit`'s :class:`LocalConduit`, :mod:`guest_runner.conduit.s3`)
never import this module, so there is no circle between a backend and the factory that picks it.
The S3 backend is imported only when an S3 conduit is named (its module imports boto3 lazily,
but a local guest need not even read it).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple, Optional

from guest_runner import wire
from guest_runner.conduit.base import Conduit
from guest_runner.conduit.local import LocalConduit

if TYPE_CHECKING:
    from urllib.parse import ParseResult


def _local_from_url(url: str, parsed: "ParseResult") -> Conduit:
    from urllib.parse import unquote

    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"file conduit URL must be file:///absolute/path, got {url!r}")
    path = unquote(parsed.path)
    if not path.startswith("/"):
        raise ValueError(f"file conduit URL must hold an absolute path, got {url!r}")
    return LocalConduit(path)


def _local_from_env(env: Mapping[str, str]) -> Conduit:
    root = env.get(wire.ENV_STORE_ROOT)
    if not root:
        raise ValueError(f"{wire.ENV_STORE_KIND}=localfs needs {wire.ENV_STORE_ROOT}")
    # The guest's side: no fsync per put (see LocalConduit).
    return LocalConduit(root, sync=False)


def _s3_from_url(url: str, parsed: "ParseResult") -> Conduit:
    from urllib.parse import parse_qs, unquote

    from guest_runner.conduit.s3 import S3Conduit  # boto3 only when S3 is named

    if not parsed.netloc:
        raise ValueError(f"s3 conduit URL needs a bucket: s3://bucket/base, got {url!r}")
    q = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
    unknown = set(q) - {"endpoint_url", "region"}
    if unknown:
        raise ValueError(
            f"unknown s3 conduit URL parameter(s) {sorted(unknown)}; allowed: endpoint_url, region"
        )
    return S3Conduit(
        parsed.netloc,
        base_prefix=unquote(parsed.path).strip("/"),
        endpoint_url=q.get("endpoint_url"),
        region=q.get("region"),
    )


def _s3_from_env(env: Mapping[str, str]) -> Conduit:
    from guest_runner.conduit.s3 import S3Conduit  # boto3 only when S3 is named

    bucket = env.get(wire.ENV_STORE_BUCKET)
    if not bucket:
        raise ValueError(f"{wire.ENV_STORE_KIND}=s3 needs {wire.ENV_STORE_BUCKET}")
    return S3Conduit(
        bucket,
        endpoint_url=env.get(wire.ENV_STORE_ENDPOINT) or None,
        region=env.get(wire.ENV_STORE_REGION) or None,
    )


class Backend(NamedTuple):
    """One conduit backend as the registry knows it: its URL scheme, its
    ``RESOLUTO_STORE_KIND`` and how each builds one."""

    scheme: str
    kind: str
    from_url: Callable[[str, "ParseResult"], Conduit]
    from_env: Callable[[Mapping[str, str]], Conduit]


#: Every backend; a new one is a row here (and passes tests/support/conduit_contract.py).
BACKENDS = (
    Backend("file", "localfs", _local_from_url, _local_from_env),
    Backend("s3", "s3", _s3_from_url, _s3_from_env),
)


def conduit_from_url(url: str) -> Conduit:
    """``file:///abs/dir`` or ``s3://bucket[/base]?endpoint_url=...&region=...``."""
    from urllib.parse import urlparse

    parsed = urlparse(url)
    for backend in BACKENDS:
        if parsed.scheme == backend.scheme:
            return backend.from_url(url, parsed)
    if "://" not in url and url.startswith("/"):
        return LocalConduit(url)
    raise ValueError(f"unsupported conduit URL {url!r}: use file:///abs/dir or s3://bucket/base")


def conduit_from_env(env: Optional[Mapping[str, str]] = None) -> Conduit:
    """Build the guest's conduit from RESOLUTO_STORE_* (the reference runner's variables)."""
    env = os.environ if env is None else env
    kind = env.get(wire.ENV_STORE_KIND, "")
    for backend in BACKENDS:
        if kind == backend.kind:
            return backend.from_env(env)
    raise ValueError(f"{wire.ENV_STORE_KIND} must be 'localfs' or 's3', got {kind!r}")
