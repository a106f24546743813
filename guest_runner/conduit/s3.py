"""S3 (or any S3-compatible store: MinIO, Ceph, moto) behind the :class:`Conduit` interface.

This module runs inside sandboxes on Python 3.9+, so it uses the standard library and
boto3/botocore only, and imports boto3 lazily: ``import guest_runner.conduit.s3`` works
without boto3; constructing an :class:`S3Conduit` without it raises an ImportError that
says so.

Keys are relative to ``base_prefix``. A missing key is :class:`ObjectNotFound`; every
other failure (endpoint unreachable, timeouts, 5xx after retries, AccessDenied,
NoSuchBucket, missing credentials ...) is :class:`ConduitUnavailable` naming the bucket,
the endpoint and the error code, never the credentials.
"""

from __future__ import annotations

import io
import os
import threading
from typing import Any, BinaryIO, Callable, Dict, List, Optional, TypeVar
from urllib.parse import quote, urlencode

from guest_runner import wire
from guest_runner.conduit.base import (
    Conduit,
    ConduitUnavailable,
    InvalidKey,
    ObjectNotFound,
    check_key,
)

_T = TypeVar("_T")

_loaders: Dict[str, Any] = {}
_loaders_lock = threading.Lock()


def _session(**kw: Any) -> Any:
    """A boto3 session of its own (credentials, region) whose botocore data loader is shared
    by every session of this process: a fresh loader parses S3's model and the endpoint
    rules again (~0.1 s of CPU), and a host makes a conduit per runner, node and check."""
    import boto3.session
    import botocore.loaders
    import botocore.session

    core = botocore.session.Session()
    data_path = core.get_config_variable("data_path") or ""
    with _loaders_lock:
        loader = _loaders.get(data_path)
        if loader is None:
            loader = _loaders[data_path] = botocore.loaders.create_loader(data_path)
        core.register_component("data_loader", loader)
        session = boto3.session.Session(botocore_session=core, **kw)
        # boto3 appends its own data directory to the loader's search path per session.
        paths = loader.search_paths
        paths[:] = list(dict.fromkeys(paths))
    return session


#: Error codes S3 (and compatibles) use for "that key does not exist".
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})

#: DeleteObjects accepts at most this many keys per call.
_DELETE_BATCH = 1000

_HINTS = {
    "NoSuchBucket": "the bucket does not exist; create it or fix the bucket name",
    "AccessDenied": "the credentials are not allowed to do this on the bucket/prefix",
    "InvalidAccessKeyId": "the access key id is not known to the endpoint",
    "SignatureDoesNotMatch": "the secret access key does not match the access key id",
    "ExpiredToken": "the session token has expired; refresh the credentials",
    "InvalidToken": "the session token is invalid",
    "PermanentRedirect": "the bucket lives in another region; set region",
    "AuthorizationHeaderMalformed": "the region is probably wrong for this bucket",
}


def _default_region() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


class S3Conduit(Conduit):
    """put / get / list_prefix / delete_prefix over one S3 bucket, under ``base_prefix``."""

    kind = "s3"

    def __init__(
        self,
        bucket: str,
        *,
        base_prefix: str = "",
        endpoint_url: Optional[str] = None,
        region: Optional[str] = None,
        access_key_id: Optional[str] = None,
        secret_access_key: Optional[str] = None,
        session_token: Optional[str] = None,
        path_style: Optional[bool] = None,
        max_attempts: int = 5,
        connect_timeout: float = 5,
        read_timeout: float = 30,
        max_pool_connections: int = 32,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"S3 conduit needs a bucket name without '/', got {bucket!r}")
        base = (base_prefix or "").strip("/")
        if base:
            check_key(base)
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        try:
            import boto3.session  # noqa: F401  (the clear error below, before anything else)
            from botocore.config import Config
        except ImportError as e:
            raise ImportError(
                "S3Conduit needs boto3 (and botocore), which is not importable in this Python "
                f"({e}); install it with 'pip install boto3' or use a local conduit"
            ) from e

        self._bucket = bucket
        self._base = base
        self._endpoint_url = endpoint_url or None
        self._region = region or _default_region()
        if path_style is None:
            path_style = self._endpoint_url is not None
        # Secrets, kept only to scrub them out of error messages.
        self._secrets = [s for s in (access_key_id, secret_access_key, session_token) if s]

        cfg: Dict[str, Any] = {
            # total_max_attempts counts the first try; botocore's "max_attempts" key would
            # count retries only (max_attempts=5 would mean six requests).
            "retries": {"mode": "standard", "total_max_attempts": int(max_attempts)},
            "connect_timeout": connect_timeout,
            "read_timeout": read_timeout,
            # One conduit is shared by every node a host tails; botocore's default pool
            # of 10 would drop and reopen connections under that concurrency.
            "max_pool_connections": int(max_pool_connections),
        }
        if path_style:
            cfg["s3"] = {"addressing_style": "path"}
        config = Config(**cfg)
        if self._endpoint_url is not None:
            # boto3 >= 1.36 sends CRC checksums on every upload by default, which many
            # S3-compatible stores reject; ask for them only where the API requires them
            # (unless the user chose otherwise through the environment).
            extra: Dict[str, str] = {}
            if "AWS_REQUEST_CHECKSUM_CALCULATION" not in os.environ:
                extra["request_checksum_calculation"] = "when_required"
            if "AWS_RESPONSE_CHECKSUM_VALIDATION" not in os.environ:
                extra["response_checksum_validation"] = "when_required"
            try:
                config = config.merge(Config(**extra))
            except TypeError:  # botocore older than 1.36: no such options, nothing to do
                pass

        try:
            session = _session(
                aws_access_key_id=access_key_id,
                aws_secret_access_key=secret_access_key,
                aws_session_token=session_token,
                region_name=self._region,
            )
            self._session = session
            self._client = session.client("s3", endpoint_url=self._endpoint_url, config=config)
        except Exception as e:  # bad endpoint URL, unknown region format, broken config file
            raise ConduitUnavailable(
                f"cannot create an S3 client for bucket {bucket!r} at {self._where()}: {self._scrub(str(e))}"
            ) from e

    # -- descriptive properties ---------------------------------------------------------

    @property
    def bucket(self) -> str:
        return self._bucket

    @property
    def base_prefix(self) -> str:
        return self._base

    @property
    def endpoint_url(self) -> Optional[str]:
        return self._endpoint_url

    @property
    def region(self) -> str:
        return self._region

    @property
    def url(self) -> str:
        url = f"s3://{self._bucket}"
        if self._base:
            url += "/" + quote(self._base, safe="/")
        params = []
        if self._endpoint_url:
            params.append(("endpoint_url", self._endpoint_url))
        if self._region:
            params.append(("region", self._region))
        if params:
            url += "?" + urlencode(params)
        return url

    def guest_env(self) -> Dict[str, str]:
        env = {wire.ENV_STORE_KIND: "s3", wire.ENV_STORE_BUCKET: self._bucket}
        if self._endpoint_url:
            env[wire.ENV_STORE_ENDPOINT] = self._endpoint_url
        env[wire.ENV_STORE_REGION] = self._region
        return env

    def guest_credentials(self) -> Dict[str, str]:
        """The credentials this conduit uses (explicit or ambient), as AWS_* variables for a
        guest on this host. Never for remote sandboxes: those get scoped credentials."""
        creds = self._session.get_credentials()
        if creds is None:
            return {}
        frozen = creds.get_frozen_credentials()
        env = {"AWS_ACCESS_KEY_ID": frozen.access_key, "AWS_SECRET_ACCESS_KEY": frozen.secret_key}
        if frozen.token:
            env["AWS_SESSION_TOKEN"] = frozen.token
        return env

    def close(self) -> None:
        client = getattr(self, "_client", None)
        if client is not None:
            client.close()

    # -- the interface ---------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        full = self._full(key)
        self._call("write", full, lambda: self._client.put_object(Bucket=self._bucket, Key=full, Body=data))

    def get(self, key: str) -> bytes:
        full = self._full(key)

        def fetch() -> bytes:
            resp = self._client.get_object(Bucket=self._bucket, Key=full)
            body = resp["Body"]
            try:
                data: bytes = body.read()
                return data
            finally:
                body.close()

        return self._call("read", full, fetch, missing_ok=True)

    def get_stream(self, key: str) -> BinaryIO:
        full = self._full(key)
        resp = self._call(
            "read", full, lambda: self._client.get_object(Bucket=self._bucket, Key=full), missing_ok=True
        )
        length = resp.get("ContentLength")
        size = length if isinstance(length, int) and not isinstance(length, bool) else None
        return io.BufferedReader(_Body(self, full, resp["Body"], size), buffer_size=1 << 20)

    def list_prefix(
        self,
        prefix: str,
        start_after: Optional[str] = None,
        shallow: bool = False,
        limit: Optional[int] = None,
    ) -> List[str]:
        if prefix:
            check_key(prefix)
        full_prefix = self._join(prefix)
        strip = len(self._base) + 1 if self._base else 0
        kwargs: Dict[str, Any] = {"Bucket": self._bucket, "Prefix": full_prefix}
        if shallow:
            kwargs["Delimiter"] = "/"  # what is nested comes back as CommonPrefixes, not read
        if start_after:
            kwargs["StartAfter"] = self._join(start_after)
        if limit is not None:
            kwargs["MaxKeys"] = max(1, min(limit, 1000))

        def collect() -> List[str]:
            keys: List[str] = []
            token: Optional[str] = None
            while True:
                call = dict(kwargs)
                if token:
                    call["ContinuationToken"] = token
                resp = self._client.list_objects_v2(**call)
                for obj in resp.get("Contents", ()):
                    keys.append(obj["Key"][strip:])
                token = resp.get("NextContinuationToken")
                if not resp.get("IsTruncated") or not token:
                    return keys
                if limit is not None and len(keys) >= limit:
                    return keys[:limit]

        keys = self._call("listing", full_prefix, collect)
        keys.sort()
        return keys if limit is None else keys[:limit]

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list_prefix(prefix)
        deleted = 0
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = [{"Key": self._join(k)} for k in keys[i : i + _DELETE_BATCH]]

            def delete(b: List[Dict[str, str]] = batch) -> Any:
                return self._client.delete_objects(Bucket=self._bucket, Delete={"Objects": b, "Quiet": True})

            resp = self._call("delete", self._join(prefix), delete)
            errors = resp.get("Errors") or []
            if errors:
                first = errors[0]
                raise ConduitUnavailable(
                    f"S3 conduit delete under s3://{self._bucket}/{self._join(prefix)} at "
                    f"{self._where()} failed for {len(errors)} of {len(batch)} keys "
                    f"(first: {first.get('Key')!r}: {first.get('Code')} {first.get('Message', '')})"
                )
            deleted += len(batch)
        return deleted

    # -- helpers ---------------------------------------------------------------------------

    def _join(self, key: str) -> str:
        if not self._base:
            return key
        return f"{self._base}/{key}"

    def _full(self, key: str) -> str:
        if not isinstance(key, str):
            raise InvalidKey(f"conduit key must be a string, got {type(key).__name__}")
        check_key(key)
        if key.endswith("/"):
            raise InvalidKey(f"conduit key {key!r} names a prefix, not an object")
        return self._join(key)

    def _where(self) -> str:
        return self._endpoint_url or f"AWS S3 ({self._region})"

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _call(self, what: str, full_key: str, fn: Callable[[], _T], missing_ok: bool = False) -> _T:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        location = f"s3://{self._bucket}/{full_key}"
        try:
            return fn()
        except ClientError as e:
            err = e.response.get("Error", {}) or {}
            code = str(err.get("Code") or "Unknown")
            status = (e.response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode")
            if missing_ok and code in _NOT_FOUND_CODES:
                raise ObjectNotFound(
                    f"no object {location} (bucket {self._bucket!r}, key {full_key!r})"
                ) from None
            hint = _HINTS.get(code) or (
                "the store kept failing after retries" if isinstance(status, int) and status >= 500 else ""
            )
            raise ConduitUnavailable(
                f"S3 conduit {what} of {location} at {self._where()} failed: {code}"
                f" (HTTP {status})" + (f" - {hint}" if hint else "") + f": {self._scrub(str(e))}"
            ) from e
        except NoCredentialsError:
            raise ConduitUnavailable(
                f"S3 conduit {what} of {location} at {self._where()} failed: no AWS credentials found "
                "(pass access_key_id/secret_access_key or set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
            ) from None
        except BotoCoreError as e:
            raise ConduitUnavailable(
                f"S3 conduit {what} of {location} at {self._where()} failed: {type(e).__name__}: "
                f"{self._scrub(str(e))}"
            ) from e
        except OSError as e:
            raise ConduitUnavailable(
                f"S3 conduit {what} of {location} at {self._where()} failed: {type(e).__name__}: "
                f"{self._scrub(str(e))}"
            ) from e


class _Body(io.RawIOBase):
    """A GetObject body read in pieces; a failure part-way is :class:`ConduitUnavailable`."""

    def __init__(self, conduit: S3Conduit, full_key: str, body: Any, size: Optional[int] = None) -> None:
        super().__init__()
        self._conduit, self._key, self._body = conduit, full_key, body
        #: The object's ContentLength: a reader checks it before reading anything.
        self.size = size

    def readable(self) -> bool:
        return True

    def read(self, size: Optional[int] = -1) -> bytes:
        n = None if size is None or size < 0 else size
        data: bytes = self._conduit._call("read", self._key, lambda: self._body.read(n))
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()
