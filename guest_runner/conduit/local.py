"""The local-filesystem conduit: one file per key under a root directory.

Puts are atomic (a temporary file renamed into place) and, on the host, fsynced; a reader
never sees a half-written object.
"""

from __future__ import annotations

import errno
import heapq
import os
import stat
from pathlib import Path
from typing import BinaryIO, Dict, Generator, Iterator, List, Optional

from guest_runner import wire
from guest_runner.conduit.base import Conduit, ConduitUnavailable, InvalidKey, ObjectNotFound, check_key

_TMP_MARK = ".resoluto-tmp-"
#: A writer's temporary file starts so: never an object, never listed.
TEMP_PREFIX = _TMP_MARK
#: Every directory a conduit's writer makes: never writable by others, whatever its umask
#: (0 in some images), for a reader refuses a world-writable directory in a node's as one a
#: sandbox could have left, and another user of the host must not plant objects.
DIR_MODE = 0o755


def make_dirs(path: "str | os.PathLike[str]", mode: int = DIR_MODE) -> None:
    """``path`` (made ``mode`` if missing) and its missing parents (made :data:`DIR_MODE`),
    each less what the umask takes: ``os.makedirs`` and ``Path.mkdir(parents=True)`` give
    the parents ``0o777`` less the umask, all of it under umask 0."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode if d == missing[0] else DIR_MODE)
        except FileExistsError:
            if not os.path.isdir(d):
                raise


class LocalConduit(Conduit):
    """A directory on a filesystem both sides can see (a bind mount for sandboxes).

    Writes are atomic (temporary file, fsync, rename) so a reader never sees half an
    object, and temporary files are never listed. ``sync=False`` skips the fsync of every
    put (the rename still publishes each object whole): a guest's conduit, whose objects
    only matter to the driver on the same host while the sandbox runs (a host crash ends
    both; nothing reads a node's objects after one). In gVisor each fsync is a round trip
    through the gofer to the host's disk.
    """

    kind = "localfs"

    def __init__(self, root: "str | os.PathLike[str]", *, sync: bool = True) -> None:
        self.sync = sync
        self.root = Path(root).absolute()
        try:
            make_dirs(self.root)
        except OSError as e:
            raise ConduitUnavailable(f"local conduit root {self.root} cannot be created: {e}") from e
        self._real_root = self.root.resolve()
        # Named in every "no such object" (a tail's look for its next chunk, each poll).
        self._url = self.root.as_uri()

    @property
    def local_root(self) -> Path:
        return self.root

    @property
    def url(self) -> str:
        return self._url

    def guest_env(self) -> Dict[str, str]:
        return {wire.ENV_STORE_KIND: "localfs", wire.ENV_STORE_ROOT: str(self.root)}

    def path_for(self, key: str) -> Path:
        """The file backing ``key``; refuses keys that resolve outside the root."""
        check_key(key.rstrip("/") or key)
        # Strings, not Path's parents: the host's tail asks this on every poll of every node.
        real = os.path.realpath(os.path.join(self.root, key))
        root = str(self._real_root)
        if real != root and not real.startswith(root.rstrip("/") + "/"):
            raise InvalidKey(f"conduit key {key!r} escapes the conduit root {self.root}")
        return Path(real)

    def put(self, key: str, data: bytes, *, sync: Optional[bool] = None) -> None:
        """``sync=False``: skip the fsync, for objects nobody needs after a host crash (a
        node's inbox, re-put by the next attempt); the rename still publishes it whole.
        Default: the conduit's own ``sync``.

        Written from the root one directory at a time (each made if missing), never through
        a link: a sandbox writes into its node's directory, and a link it planted there must
        not make the host write elsewhere (no check of a path then use of it, which a swap in
        between would beat). One ``openat`` a directory, not a ``realpath`` of the whole path."""
        if sync is None:
            sync = self.sync
        check_key(key)
        parent, _, name = key.rpartition("/")
        try:
            dir_fd = self._open_dir(parent.split("/") if parent else [], key, create=True)
            try:
                write_at(dir_fd, name, data, sync)
            finally:
                os.close(dir_fd)
        except (InvalidKey, ObjectNotFound):
            raise
        except OSError as e:
            raise ConduitUnavailable(f"local conduit write of {key!r} failed: {e}") from e

    def put_transient(self, key: str, data: bytes) -> None:
        self.put(key, data, sync=False)

    def get(self, key: str) -> bytes:
        with LocalConduit.get_stream(self, key) as f:  # not an override's: key is already ours
            try:
                return f.read()
            except OSError as e:
                raise ConduitUnavailable(f"local conduit read of {key!r} failed: {e}") from e

    def get_stream(self, key: str) -> BinaryIO:
        """The object's file, opened from the root one directory at a time without following
        a link, and only if it is a regular file: a sandbox writes into its node's directory,
        and a link or a FIFO planted there must not make the host read elsewhere, or hang."""
        check_key(key)
        parent, _, name = key.rpartition("/")
        fd = self._open_dir(parent.split("/") if parent else [], key)
        try:
            return self._open_leaf(fd, name, key)
        finally:
            os.close(fd)

    def open_dir(self, prefix: str) -> int:
        """A descriptor of the directory ``prefix`` names, opened as :meth:`get_stream` walks
        (ObjectNotFound when it is not a directory of the conduit): a reader of many objects
        of one directory (the host's tail of a node) opens each from it by name. The caller
        closes it."""
        check_key(prefix.rstrip("/") or prefix)
        return self._open_dir(prefix.rstrip("/").split("/"), prefix)

    def get_stream_at(self, dir_fd: int, name: str, key: str) -> BinaryIO:
        """The object ``name`` of the directory ``dir_fd`` (:meth:`open_dir`), opened as
        :meth:`get_stream` opens its last part; ``key`` names it in errors."""
        if not name or "/" in name or "\x00" in name or name in (".", ".."):
            raise InvalidKey(f"conduit key {key!r}: {name!r} is not a name in a directory")
        return self._open_leaf(dir_fd, name, key)

    def _open_dir(self, parts: List[str], key: str, create: bool = False) -> int:
        """The directory ``parts`` names under the root, entered one name at a time without
        following a link; with ``create``, each missing one is made (a writer's)."""
        flags = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0) | os.O_NOFOLLOW
        try:
            fd = os.open(self._real_root, flags)
        except FileNotFoundError:
            if not create:
                raise ObjectNotFound(f"no object {key!r} in {self.url}") from None
            try:  # the root went since it was made (the host's own path: a plain makedirs)
                make_dirs(self._real_root)
                fd = os.open(self._real_root, flags)
            except OSError as e:
                raise ConduitUnavailable(f"local conduit root {self.root} cannot be made: {e}") from None
        except OSError as e:
            raise ConduitUnavailable(f"local conduit root {self.root} cannot be opened: {e}") from None
        try:
            for part in parts:
                try:
                    nxt = os.open(part, flags, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(part, DIR_MODE, dir_fd=fd)
                    except FileExistsError:
                        pass  # another writer made it meanwhile
                    nxt = os.open(part, flags, dir_fd=fd)
                os.close(fd)
                fd = nxt
            return fd
        except FileNotFoundError:
            os.close(fd)
            raise ObjectNotFound(f"no object {key!r} in {self.url}") from None
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                # EACCES (a sandbox of the host's own user chmod-ed its directory), EMFILE ...:
                # the conduit's error, never a raw one.
                raise ConduitUnavailable(
                    f"local conduit: cannot enter the directories of {key!r}: {e.strerror}"
                ) from None
            if create:
                raise InvalidKey(
                    f"conduit key {key!r} escapes the conduit root {self.root} or passes through a "
                    f"link or a file ({e.strerror}): a key never leads through one"
                ) from None
            # ELOOP/ENOTDIR: a link or a file where a directory should be.
            raise ObjectNotFound(
                f"no object {key!r} in {self.url} ({e.strerror}: not a plain file)"
            ) from None

    def _open_leaf(self, dir_fd: int, name: str, key: str) -> BinaryIO:
        flags = getattr(os, "O_CLOEXEC", 0) | os.O_NOFOLLOW
        try:
            leaf = os.open(name, os.O_RDONLY | os.O_NONBLOCK | flags, dir_fd=dir_fd)
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key!r} in {self.url}") from None
        except OSError as e:
            # ELOOP: a link where the object should be.
            raise ObjectNotFound(
                f"no object {key!r} in {self.url} ({e.strerror}: not a plain file)"
            ) from None
        try:
            if not stat.S_ISREG(os.fstat(leaf).st_mode):
                raise ObjectNotFound(f"no object {key!r} in {self.url} (not a regular file)")
            os.set_blocking(leaf, True)
            return os.fdopen(leaf, "rb")
        except BaseException:
            os.close(leaf)
            raise

    def list_prefix(
        self,
        prefix: str,
        start_after: Optional[str] = None,
        shallow: bool = False,
        limit: Optional[int] = None,
    ) -> List[str]:
        # A prefix is a key prefix, not necessarily a directory: "run/a/nodes/n/events-"
        # lists the chunks. Walk the deepest directory the prefix names.
        if prefix:
            check_key(prefix.rstrip("/") or prefix)
        dir_part = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        # Entered as a reader enters it (no link followed): a prefix through a link lists nothing.
        try:
            base = self._open_dir(dir_part.split("/") if dir_part else [], prefix)
        except ObjectNotFound:
            return []
        try:
            keys = (
                k
                for k in _walk(base, dir_part + "/" if dir_part else "", shallow)
                if k.startswith(prefix) and (start_after is None or k > start_after)
            )
            # A directory has no order: the first ``limit`` keys are kept as it is read, so
            # memory is that many names however many files a sandbox left there.
            return sorted(keys) if limit is None else heapq.nsmallest(max(0, limit), keys)
        except OSError as e:
            raise ConduitUnavailable(f"local conduit listing of {prefix!r} failed: {e}") from e
        finally:
            os.close(base)

    def delete_prefix(self, prefix: str) -> int:
        """Unlink each object the listing names, from its own directory entered as a put
        enters it: a link is removed itself, and never leads the removal elsewhere."""
        n = 0
        for key in self.list_prefix(prefix):
            parent, _, name = key.rpartition("/")
            try:
                dir_fd = self._open_dir(parent.split("/") if parent else [], key)
            except ObjectNotFound:
                continue  # gone, or its directory replaced by a link: nothing of it to remove here
            try:
                os.unlink(name, dir_fd=dir_fd)
                n += 1
            except FileNotFoundError:
                pass
            except OSError as e:
                raise ConduitUnavailable(f"local conduit delete of {key!r} failed: {e}") from e
            finally:
                os.close(dir_fd)
        return n


#: A deep listing's bounds: a sandbox's node directory is its own to nest and fill, and the
#: walk holds one descriptor per level (an error beyond, never a host out of descriptors).
MAX_WALK_DEPTH = 64
MAX_WALK_DIRS = 100_000
_WALK_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _walk(dir_fd: int, rel_dir: str, shallow: bool) -> Iterator[str]:
    """Keys of the files under ``dir_fd`` (the key prefix ``rel_dir``), temporaries left out;
    nested directories too unless ``shallow``: entered by descriptor, depth first without
    recursion, never through a link (a link is listed as what it is, a name; reading it is
    refused), and never blocking on what replaced a directory meanwhile (a FIFO swapped in is
    refused by ``O_DIRECTORY``, opened ``O_NONBLOCK``). The caller sorts the keys."""
    stack: List["tuple[int, str, List[str]]"] = []  # (descriptor, key prefix, subdirectories left)
    fd = os.dup(dir_fd)
    entered = 0
    try:
        subdirs = yield from _scan(fd, rel_dir, shallow)
        stack.append((fd, rel_dir, subdirs))
        while stack:
            fd, rel, subdirs = stack[-1]
            if not subdirs:
                stack.pop()
                os.close(fd)
                continue
            name = subdirs.pop()
            entered += 1
            if len(stack) >= MAX_WALK_DEPTH or entered > MAX_WALK_DIRS:
                raise OSError(
                    f"the tree under {rel_dir!r} is deeper than {MAX_WALK_DEPTH} or holds more than "
                    f"{MAX_WALK_DIRS} directories"
                )
            try:
                sub = os.open(name, _WALK_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                    continue  # gone, or swapped for a link or a file since it was read
                raise
            try:
                found = yield from _scan(sub, f"{rel}{name}/", shallow)
            except BaseException:
                os.close(sub)
                raise
            stack.append((sub, f"{rel}{name}/", found))
    except BaseException:
        if not stack:
            os.close(fd)
        raise
    finally:
        for fd, _rel, _left in stack:
            os.close(fd)


def _scan(fd: int, rel: str, shallow: bool) -> Generator[str, None, List[str]]:
    """Yield the keys of ``fd``'s files (links included, unfollowed); return its
    subdirectories' names (none when ``shallow``), in reverse order for popping."""
    subdirs: List[str] = []
    with os.scandir(fd) as entries:
        for entry in entries:
            name = entry.name
            if name.startswith(_TMP_MARK):
                continue
            if not entry.is_dir(follow_symlinks=False):
                yield rel + name
            elif not shallow:
                subdirs.append(name)
    subdirs.sort(reverse=True)
    return subdirs


def write_at(dir_fd: int, name: str, data: bytes, sync: bool) -> None:
    """``name`` in ``dir_fd`` holds ``data``, published whole: written to a new, exclusively
    created temporary file of that directory, then renamed over the name."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | os.O_NOFOLLOW
    for _ in range(100):
        tmp = _TMP_MARK + os.urandom(6).hex()
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free temporary file name for {name!r}")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if sync:
                os.fsync(f.fileno())
            os.fchmod(f.fileno(), 0o644)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
