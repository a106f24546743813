"""The conduit: the only thing host and sandbox share. A durable key/value store.

The interface is deliberately narrow (put / get / get_stream / list_prefix /
delete_prefix), so a backend is a page of code. Keys are ``/``-separated and relative to the conduit's
base; objects are immutable once written. A missing key (:class:`ObjectNotFound`)
is a different exception from a store that cannot be reached
(:class:`ConduitUnavailable`); both derive from :class:`ConduitError`.

The backends are :mod:`.local` and :mod:`.s3`; which one a URL or the guest's
RESOLUTO_STORE_* variables name is decided in :mod:`.registry`, which imports the
backends; no backend imports it back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, BinaryIO, Dict, List, Optional

if TYPE_CHECKING:
    from pathlib import Path

# tempfile and urllib.parse are not imported here: the guest runner imports this module
# in every sandbox, where each import costs (see runner.py).


class ConduitError(Exception):
    """Base of every conduit failure."""


class ObjectNotFound(ConduitError, KeyError):
    """The key does not exist (the store itself answered)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "object not found"


class ConduitUnavailable(ConduitError):
    """The store could not be reached or failed (outage, 5xx after retries, I/O error)."""


class InvalidKey(ConduitError, ValueError):
    """A key that is empty, absolute, or escapes the conduit's root."""


def check_key(key: str) -> str:
    if not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise InvalidKey(f"invalid conduit key {key!r}")
    parts = key.split("/")
    if any(p in ("..", ".") for p in parts) or "" in parts[:-1]:
        raise InvalidKey(f"conduit key {key!r} escapes its root or has empty segments")
    return key


class Conduit(ABC):
    """put / get / get_stream / list_prefix / delete_prefix over immutable objects."""

    #: Value of RESOLUTO_STORE_KIND for a guest talking to this conduit.
    kind: str = ""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None: ...

    def put_transient(self, key: str, data: bytes) -> None:
        """Put an object only the host driving the node needs while it runs (a node's inbox,
        put again by the next attempt): a backend may skip making it durable."""
        self.put(key, data)

    @abstractmethod
    def get(self, key: str) -> bytes: ...

    @abstractmethod
    def get_stream(self, key: str) -> BinaryIO:
        """The object as a binary stream the caller reads once and closes, for objects that
        must never be held whole in memory (a sandbox's output archives). Errors as
        :meth:`get`: when opening, or while reading (:class:`ConduitUnavailable`)."""

    @abstractmethod
    def list_prefix(
        self,
        prefix: str,
        start_after: Optional[str] = None,
        shallow: bool = False,
        limit: Optional[int] = None,
    ) -> List[str]:
        """Every key under ``prefix`` in lexicographic order, only those after
        ``start_after`` when given (so a poller's cost stays flat as keys accumulate).
        ``shallow``: only the keys with no ``/`` after ``prefix`` (S3's delimiter): a host
        tailing a node reads its top level, never walks what the sandbox nested below.
        ``limit``: at most that many keys, the first in order (one page on S3, and memory
        for that many names however many a sandbox wrote)."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``; returns how many were deleted."""

    @property
    @abstractmethod
    def url(self) -> str:
        """A URL that :func:`conduit_from_url` turns back into an equivalent conduit."""

    @property
    def local_root(self) -> Optional[Path]:
        """The directory holding this conduit's keys when this machine can see the store as
        one (``<local_root>/<key>`` is the object's file), else None."""
        return None

    @property
    def base_prefix(self) -> str:
        """Prefix every key of this conduit lives under in the backing store ('' for none)."""
        return ""

    def guest_env(self) -> Dict[str, str]:
        """RESOLUTO_STORE_* variables a guest needs to reach this conduit (no credentials)."""
        raise NotImplementedError

    def guest_credentials(self) -> Dict[str, str]:
        """Secret variables a guest on this host needs to reach the store ('' for none)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Release clients; the default has nothing to release."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def __eq__(self, other: object) -> bool:
        # Two conduits are the same store when they address the same place.
        return type(other) is type(self) and other.url == self.url

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.url))
