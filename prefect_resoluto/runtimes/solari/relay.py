"""Mirror one node's objects out of a Solari VM into the run's conduit.

The guest runner in the VM writes a local-filesystem store; this copies each new object
-- event chunks in order, then ``result.json``, ``outbox/*``, ``_manifest.json`` last --
to the same key of the run's own conduit, exactly once, so the run's conduit ends up as
any other runtime leaves it. Reads go through the SDK's files API (``fs.list`` / ``fs.read``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from guest_runner import wire

#: The temporary-file mark of the guest's local store (guest_runner.conduit): never mirrored.
_TMP_MARK = ".resoluto-tmp-"


class VmRelay:
    def __init__(self, files: Any, store_root: str, rel_prefix: str, conduit: Any) -> None:
        self.files = files  # the SDK handle's ``files``
        self.node_dir = f"{store_root}/{rel_prefix}"
        self.rel_prefix = rel_prefix
        self.conduit = conduit
        self.next_chunk = 1
        self.done = False  # _manifest.json mirrored
        self.mirrored: set[str] = set()
        #: Keys in the order they were put into the run's conduit.
        self.log: list[str] = []

    async def step(self) -> bool:
        """Mirror what is new in the VM's node directory; True when anything was mirrored."""
        before = len(self.mirrored)
        names = await self._list_files(self.node_dir)
        chunks = {wire.chunk_index(n): n for n in names}
        chunks.pop(None, None)
        while self.next_chunk in chunks:
            await self._mirror(chunks[self.next_chunk])
            self.next_chunk += 1
        if wire.MANIFEST not in names:
            return len(self.mirrored) > before
        raw = await self.files.read(f"{self.node_dir}/{wire.MANIFEST}")
        try:
            total = wire.decode_manifest(raw)
        except wire.WireError:
            total = self.next_chunk - 1  # mirror it as it is: the host's tail reports the broken manifest
        if self.next_chunk <= total:  # written before the manifest, so listed by now
            chunks = {wire.chunk_index(n): n for n in await self._list_files(self.node_dir)}
            while self.next_chunk <= total and self.next_chunk in chunks:
                await self._mirror(chunks[self.next_chunk])
                self.next_chunk += 1
        if wire.RESULT in names:
            await self._mirror(wire.RESULT)
        for name in await self._list_files(f"{self.node_dir}/{wire.OUTBOX}"):
            await self._mirror(f"{wire.OUTBOX}/{name}")
        await self._mirror(wire.MANIFEST, raw)
        self.done = True
        return True

    async def _list_files(self, path: str) -> list[str]:
        from solari_core.errors import ActionError

        try:
            entries = await self.files.list(path)
        except ActionError:  # no such directory (yet)
            return []
        return sorted(e.name for e in entries if not e.dir and not e.name.startswith(_TMP_MARK))

    async def _mirror(self, rel: str, data: bytes | None = None) -> None:
        key = f"{self.rel_prefix}/{rel}"
        if key in self.mirrored:
            return
        if data is None:
            data = await self.files.read(f"{self.node_dir}/{rel}")
        # The run's conduit may be S3 (blocking boto3): off the loop, so other nodes keep moving.
        await asyncio.get_running_loop().run_in_executor(None, self.conduit.put, key, data)
        self.mirrored.add(key)
        self.log.append(key)
