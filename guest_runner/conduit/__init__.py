"""The conduit: the only thing host and sandbox share -- a durable, narrow key/value store.

:mod:`.base` is the interface every backend implements (put / get / get_stream /
list_prefix / delete_prefix) and its errors; :mod:`.local` and :mod:`.s3` are the two
backends; :mod:`.registry` picks one from a URL or the guest's ``RESOLUTO_STORE_*``
variables. Standard library only (the S3 backend imports boto3 when it is used).
"""

from guest_runner.conduit.base import (
    Conduit,
    ConduitError,
    ConduitUnavailable,
    InvalidKey,
    ObjectNotFound,
    check_key,
)
from guest_runner.conduit.local import LocalConduit
from guest_runner.conduit.registry import conduit_from_env, conduit_from_url

__all__ = [
    "Conduit",
    "ConduitError",
    "ConduitUnavailable",
    "InvalidKey",
    "LocalConduit",
    "ObjectNotFound",
    "check_key",
    "conduit_from_env",
    "conduit_from_url",
]
