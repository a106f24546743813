"""A local conduit that counts the host's store requests, for tests of what a node costs."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from guest_runner.conduit import LocalConduit


class CountingConduit(LocalConduit):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.lists = 0
        self.gets = 0
        self.puts = 0

    def list_prefix(
        self, prefix: str, start_after: str | None = None, shallow: bool = False, limit: int | None = None
    ) -> list[str]:
        self.lists += 1
        return super().list_prefix(prefix, start_after, shallow, limit)

    def get(self, key: str) -> bytes:
        self.gets += 1
        return super().get(key)

    def get_stream(self, key: str) -> BinaryIO:
        self.gets += 1
        return super().get_stream(key)

    def put_transient(self, key: str, data: bytes) -> None:
        self.puts += 1
        super().put_transient(key, data)
