"""Checkpoint images of warm sandboxes: one per pool key, in the runtime's state directory.

A *template* warm sandbox boots to the point every warm sandbox waits at (the guest
runner imported, the call's interpreter started, the key's pre-imports done), before any
node or credential exists, and is checkpointed there once; each further warm sandbox of
the key is restored from that image (``runtime.restore``) instead of booted.

An image lives at ``<state>/snapshots/<key hash>-<image hash>/`` (or under ``$RESOLUTO_WARM_IMAGES/<runtime>/``,
a directory several state directories share): runsc's files
(``checkpoint.img``, ``pages*.img``) and ``meta.json`` (what it was made from,
and the SHA-256 of runsc's files). The
image hash covers the guest runner's files, the key, the guest's interpreter and the
runtime's fingerprint (runsc version, platform, flags): a change to any of them names a
new image, which replaces the key's old one when it is built. A directory is complete
only once renamed into place, so a crash while checkpointing leaves a ``.tmp-*``
directory that :meth:`Snapshots.prune` (every pool's start) or ``sweep`` removes. An image whose
file no longer matches its recorded digest is discarded with a warning and the key boots.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from guest_runner.conduit.local import make_dirs
from prefect_resoluto.runtimes._guest_layout import guest_runner_dir

log = logging.getLogger("prefect_resoluto.warm.snapshots")

IMAGE_FILE = "checkpoint.img"
META_FILE = "meta.json"
DIR_NAME = "snapshots"
#: Set to "0" to boot every warm sandbox (no images made or used).
ENV = "RESOLUTO_WARM_SNAPSHOTS"
#: A directory for images instead of each runtime's state directory (one subdirectory per
#: runtime): hosts whose state directories differ (per user, per test) make an image once.
#: Images hold nothing of a node, and their names cover everything they were made from.
IMAGES_ENV = "RESOLUTO_WARM_IMAGES"
#: Temporary directories older than this are a crashed build's, not another process's.
STALE_TMP_SECONDS = 3600.0


class SnapshotError(Exception):
    """An image could not be made or is unusable (the key's sandboxes boot instead)."""


class CorruptImage(SnapshotError):
    """An image failed its check; it has been discarded, and the warning given."""


def images_root(runtime: Any) -> Path:
    """Where ``runtime``'s images live."""
    shared = os.environ.get(IMAGES_ENV, "").strip()
    return Path(shared) / str(runtime.name) if shared else Path(runtime.state) / DIR_NAME


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@functools.lru_cache(maxsize=1)
def guest_digest() -> str:
    """SHA-256 over the guest runner's files (names and contents): what a template ran."""
    root = guest_runner_dir()
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()


def _image_digest(d: Path) -> str:
    """SHA-256 over every file runsc wrote (``checkpoint.img``, ``pages*.img``...)."""
    h = hashlib.sha256()
    for p in sorted(d.iterdir()):
        if p.name == META_FILE:
            continue
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _files_state(d: Path) -> tuple[tuple[str, int, int, int], ...]:
    """Name, size, inode and modification time of each file of ``d``: what changes when a
    file is rewritten or replaced."""
    out = []
    try:
        for p in sorted(d.iterdir()):
            st = p.stat()
            out.append((p.name, st.st_size, st.st_ino, st.st_mtime_ns))
    except OSError:
        return ()
    return tuple(out)


def _key_text(key: Any) -> str:
    return json.dumps(dataclasses.asdict(key), sort_keys=True, default=str)


class Snapshots:
    """The images of one runtime (its state directory), as a pool uses them."""

    def __init__(self, runtime: Any, python: str, context: str = "") -> None:
        """``context``: what else the template's launch depends on (the pool's conduit kind
        and address, whether a slot is mounted): pools that differ there never share an image."""
        self.runtime = runtime
        self.python = python
        self.context = context
        self.root = images_root(runtime)
        # Images whose digest this process verified, with what their files looked like then
        # (a long-lived worker re-hashes only an image whose files changed since).
        self._checked: dict[Path, tuple[tuple[str, int, int, int], ...]] = {}
        self._paths: dict[Any, Path] = {}

    def _names(self, key: Any) -> tuple[str, str]:
        """(key hash, image hash) of ``key``'s current image."""
        # The key in its pool's context: a stale image is one of the same pair, made with
        # another guest runner, interpreter or runsc.
        key_hash = hashlib.sha256((_key_text(key) + self.context).encode()).hexdigest()[:16]
        material = json.dumps(
            [guest_digest(), _key_text(key), self.python, self.runtime.snapshot_fingerprint(), self.context]
        )
        return key_hash, hashlib.sha256(material.encode()).hexdigest()[:16]

    def path(self, key: Any) -> Path:
        # Asked at every look of the pool (a waiting node's, the refill's): its names are
        # fixed for this process (guest_digest and runsc's probe are read once), so worked
        # out once per key, not with a PATH lookup of runsc each time.
        found = self._paths.get(key)
        if found is None:
            key_hash, image_hash = self._names(key)
            found = self._paths[key] = self.root / f"{key_hash}-{image_hash}"
        return found

    def usable(self, key: Any) -> Path | None:
        """``key``'s current image, None if there is none yet; a bad one is discarded with a
        warning and SnapshotError raised."""
        d = self.path(key)
        if not d.is_dir():
            return None
        if self._checked.get(d) == _files_state(d):
            return d
        try:
            meta = json.loads((d / META_FILE).read_text())
            if not isinstance(meta, dict) or meta.get("sha256") != _image_digest(d):
                raise SnapshotError("its checkpoint does not match the digest recorded when it was made")
        except (OSError, ValueError, SnapshotError) as e:
            self.discard(key, f"{e}")
            raise CorruptImage(f"the image {d} was corrupt") from e
        self._checked[d] = _files_state(d)
        return d

    def new_dir(self) -> Path:
        """A fresh, not yet existing directory for runsc to write a checkpoint into."""
        make_dirs(self.root, 0o700)
        return self.root / f".tmp-{uuid.uuid4().hex[:12]}"

    def commit(self, key: Any, tmp: Path, made_from: dict[str, Any]) -> Path:
        """Move a finished checkpoint into place as ``key``'s image (replacing its stale
        ones); another process's image for the same key, committed first, wins."""
        img = tmp / IMAGE_FILE
        if not img.is_file() or img.stat().st_size == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SnapshotError(f"runsc wrote no checkpoint into {tmp}")
        meta = {
            "sha256": _image_digest(tmp),
            "bytes": sum(p.stat().st_size for p in tmp.iterdir()),
            "key": json.loads(_key_text(key)),
            "guest_digest": guest_digest(),
            "python": self.python,
            "runtime": self.runtime.snapshot_fingerprint(),
            "context": self.context,
            "created": time.time(),
            **made_from,
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        final = self.path(key)
        try:
            os.rename(tmp, final)
        except OSError:  # already there (another runner built it): keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
        key_hash = final.name.split("-", 1)[0]
        for old in self.root.glob(f"{key_hash}-*"):
            if old != final:
                log.info("removing stale warm-sandbox image %s (guest runner or settings changed)", old)
                shutil.rmtree(old, ignore_errors=True)
        self._checked[final] = _files_state(final)
        return final

    def discard(self, key: Any, why: str) -> None:
        d = self.path(key)
        log.warning(
            "discarding the warm-sandbox image %s: %s; warm sandboxes of this kind boot instead", d, why
        )
        self._checked.pop(d, None)
        shutil.rmtree(d, ignore_errors=True)

    def prune(self) -> None:
        """Remove what crashed builds left (``.tmp-*`` directories older than an hour)."""
        now = time.time()
        for tmp in self.root.glob(".tmp-*") if self.root.is_dir() else ():
            try:
                if now - tmp.stat().st_mtime > STALE_TMP_SECONDS:
                    shutil.rmtree(tmp, ignore_errors=True)
            except OSError:
                pass


def remove_all(runtime: Any) -> int:
    """``sweep``: every image of ``runtime`` (and unfinished ones); how many were removed."""
    root = images_root(runtime)
    if not root.is_dir():
        return 0
    n = 0
    for d in root.iterdir():
        shutil.rmtree(d, ignore_errors=True)
        n += 0 if d.name.startswith(".tmp-") else 1
    return n
