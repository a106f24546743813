"""Safe gzip-tar packing and unpacking, both directions of the conduit.

Packing never follows a link out of the tree and skips the usual junk. Unpacking
treats every archive as hostile: it is streamed (never held whole), every path is
created relative to a directory fd with no link followed, a link is kept only when it
names a regular file extracted earlier, limits stop bombs while they are read, and any
refusal (traversal, absolute names, other links, devices, FIFOs, duplicates, a limit)
names the member and undoes the whole extraction. See docs/security.md, "Outputs".
"""

from __future__ import annotations

import functools
import gzip
import io
import os
import re
import stat
import tarfile
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, cast

DEFAULT_EXCLUDES = frozenset(
    {
        ".venv",
        "venv",
        "__pycache__",
        ".git",
        ".hg",
        ".svn",
        "node_modules",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        ".tox",
        ".nox",
        ".hypothesis",
        ".cache",
        ".ipynb_checkpoints",
        ".DS_Store",
        ".resoluto",
        "resoluto-outputs",
    }
)
# gzip level 1: staging is on the critical path of every node, and level 1 is several
# times faster than tar's default 6 for a modest size increase.
_GZIP_LEVEL = 1


class ArchiveError(ValueError):
    """An archive that cannot be read (truncated, not gzip, not tar)."""


class UnsafeArchive(ArchiveError):
    """An archive member that would escape or subvert the destination."""

    def __init__(self, member: str, why: str) -> None:
        super().__init__(f"refusing archive member {member!r}: {why}")
        self.member = member
        self.why = why


class OutputPatternError(ValueError):
    """An output path/glob that is absolute or escapes the workspace."""


def check_pattern(pattern: str) -> str:
    p = pattern.strip()
    if not p:
        raise OutputPatternError("an output path may not be empty")
    if p.startswith("/") or p.startswith("~") or re.match(r"^[A-Za-z]:[\\/]", p):
        raise OutputPatternError(f"output path {pattern!r} must be relative to the workspace")
    parts = p.replace("\\", "/").split("/")
    if ".." in parts:
        raise OutputPatternError(f"output path {pattern!r} escapes the workspace ('..')")
    return "/".join(x for x in parts if x not in ("", "."))


@functools.lru_cache(maxsize=256)  # a host matches each node's outputs with the same patterns
def _glob_regex(pattern: str) -> "re.Pattern[str]":
    """Translate a path glob with ``**`` (any depth), ``*`` and ``?`` (within a segment)."""
    out = []
    segs = pattern.split("/")
    for i, seg in enumerate(segs):
        last = i == len(segs) - 1
        if seg == "**":
            out.append(".*" if last else "(?:[^/]+/)*")
            continue
        # Not fnmatch.translate: its '*' would cross '/'.
        body = ""
        j = 0
        while j < len(seg):
            c = seg[j]
            if c == "*":
                body += "[^/]*"
            elif c == "?":
                body += "[^/]"
            elif c == "[":
                k = seg.find("]", j + 1)
                if k == -1:
                    body += re.escape(c)
                else:
                    cls = seg[j + 1 : k]
                    if cls.startswith("!"):
                        cls = "^" + cls[1:]
                    body += "[" + cls.replace("\\", "\\\\") + "]"
                    j = k
            else:
                body += re.escape(c)
            j += 1
        out.append(body + ("" if last else "/"))
    return re.compile("^" + "".join(out) + "$")


class PathMatcher:
    """Matches workspace-relative member paths against declared output paths.

    A pattern without glob characters names a file or a directory (everything under
    it); with ``*``, ``?``, ``[`` or ``**`` it is a glob; a matched directory brings its
    whole subtree.
    """

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns = [check_pattern(p) for p in patterns]
        self._compiled = [(_glob_regex(p), p) for p in self.patterns]

    def match(self, rel: str) -> Optional[str]:
        rel = rel.strip("/")
        if rel.startswith("./"):
            rel = rel[2:]
        parts = rel.split("/")
        for rx, pat in self._compiled:
            # the path itself, or any ancestor directory, matching makes it selected
            for n in range(len(parts), 0, -1):
                if rx.match("/".join(parts[:n])):
                    return pat
        return None


def _inside(root: str, target: str) -> bool:
    return target == root or target.startswith(root.rstrip("/") + "/")


def _walk(
    root: Path, excludes: "frozenset[str]", skip: "frozenset[str]" = frozenset()
) -> List[Tuple[str, Path]]:
    """(relative path, absolute path) of every entry to pack, sorted, never following links.

    ``excludes`` are names skipped anywhere; ``skip`` are relative paths skipped exactly."""
    entries: List[Tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/")
        dirnames[:] = sorted(
            d for d in dirnames if d not in excludes and (f"{rel_dir}/{d}" if rel_dir else d) not in skip
        )
        for d in dirnames:
            entries.append((f"{rel_dir}/{d}" if rel_dir else d, Path(dirpath, d)))
        for f in sorted(filenames):
            if f in excludes:
                continue
            entries.append((f"{rel_dir}/{f}" if rel_dir else f, Path(dirpath, f)))
    entries.sort(key=lambda e: e[0])
    return entries


def stamp(
    root: "str | os.PathLike[str]", *, excludes: Iterable[str] = DEFAULT_EXCLUDES, skip: Iterable[str] = ()
) -> Tuple[str, int]:
    """A digest of what :func:`pack` would read from ``root`` (every entry's name, type, mode,
    size, inode, mtime and ctime, link targets), and the newest mtime/ctime in ns: equal
    digests mean an unchanged tree unless a file was rewritten within the clock's
    granularity, which the caller rules out by the second value."""
    import hashlib

    h = hashlib.sha256()
    newest = 0
    for rel, path in _walk(Path(root), frozenset(excludes), frozenset(skip)):
        try:
            st = os.lstat(path)
            link = os.readlink(path) if os.path.islink(path) else ""
        except OSError:
            continue
        newest = max(newest, st.st_mtime_ns, st.st_ctime_ns)
        h.update(
            f"{rel}\0{st.st_mode}\0{st.st_size}\0{st.st_ino}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0"
            f"{link}\n".encode("utf-8", "surrogateescape")
        )
    return h.hexdigest(), newest


def select(root: "str | os.PathLike[str]", patterns: Sequence[str]) -> Tuple[List[str], List[str]]:
    """Workspace-relative files matched by ``patterns`` and the patterns that matched nothing."""
    matcher = PathMatcher(patterns)
    root = Path(root)
    hit = set()
    files: List[str] = []
    for rel, path in _walk(root, frozenset()):
        if path.is_dir() and not path.is_symlink():
            continue
        pat = matcher.match(rel)
        if pat is not None:
            files.append(rel)
            hit.add(pat)
    return files, [p for p in matcher.patterns if p not in hit]


def pack(
    root: "str | os.PathLike[str]",
    *,
    patterns: Optional[Sequence[str]] = None,
    excludes: Iterable[str] = DEFAULT_EXCLUDES,
    extra: Optional[Sequence[Tuple[str, bytes]]] = None,
    skip: Iterable[str] = (),
) -> bytes:
    """Tar + gzip a directory (or only what ``patterns`` select) into bytes.

    Nothing is ever followed out of the tree. A symlink is stored as a link when its
    target is a regular file stored earlier in the same archive (links come after the
    files, so :func:`unpack`, which accepts only such links, takes them); a link to an
    in-tree regular file that is not in the archive (not selected) is stored as a copy
    of it; any other link (to a directory, outside, dangling) is skipped. ``extra`` adds
    in-memory files (relative name, content); ``skip`` names relative directories to
    leave out (a conduit or outputs directory that lives inside the workspace).
    """
    root_path = Path(root)
    if not root_path.is_dir():
        raise FileNotFoundError(f"workspace directory {str(root_path)!r} does not exist")
    excl = frozenset(excludes) if patterns is None else frozenset()
    matcher = PathMatcher(patterns) if patterns is not None else None
    real_root = os.path.realpath(root_path)
    links: List[Tuple[str, str, "os.stat_result"]] = []
    kinds: Dict[str, object] = {}  # what unpack will have made of each stored name
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=_GZIP_LEVEL, mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:

            def add_file(rel: str, path: str, st: "os.stat_result") -> None:
                ti = tarfile.TarInfo(rel)
                ti.size = st.st_size
                ti.mode = st.st_mode & 0o777
                ti.mtime = int(st.st_mtime)
                with open(path, "rb") as f:
                    tar.addfile(ti, f)
                _record_parents(kinds, rel)
                kinds[rel] = _FILE

            for rel, path in _walk(root_path, excl, frozenset(skip)):
                if matcher is not None and matcher.match(rel) is None:
                    continue
                try:
                    st = os.lstat(path)
                except OSError:
                    continue  # vanished while walking
                if os.path.islink(path):
                    try:
                        links.append((rel, os.readlink(path), st))
                    except OSError:
                        pass
                elif path.is_dir():
                    if matcher is not None:
                        continue  # directories come implicitly with their matched files
                    ti = tarfile.TarInfo(rel)
                    ti.type = tarfile.DIRTYPE
                    ti.mode = st.st_mode & 0o7777
                    ti.mtime = int(st.st_mtime)
                    tar.addfile(ti)
                    _record_parents(kinds, rel)
                    kinds[rel] = _DIR
                elif path.is_file():
                    add_file(rel, str(path), st)
                # sockets, FIFOs and devices are never packed
            # Links last, each once what it names is stored (a chain resolves link by link).
            pending = links
            while pending:
                later = []
                for rel, target, st in pending:
                    parent = rel.split("/")[:-1]
                    if all(kinds.get("/".join(parent[: i + 1])) is _DIR for i in range(len(parent))):
                        resolved = _resolve(kinds, parent, target)
                    else:
                        resolved = None
                    if resolved is not None:
                        ti = tarfile.TarInfo(rel)
                        ti.type = tarfile.SYMTYPE
                        ti.linkname = target
                        ti.mtime = int(st.st_mtime)
                        ti.mode = 0o777
                        tar.addfile(ti)
                        _record_parents(kinds, rel)
                        kinds[rel] = ("link", resolved)
                    else:
                        later.append((rel, target, st))
                if len(later) == len(pending):
                    break
                pending = later
            for rel, _target, _st in pending:
                # Not resolvable inside the archive: a copy of an in-tree regular file, or nothing.
                real = os.path.realpath(os.path.join(root_path, rel))
                if not _inside(real_root, real) or rel in kinds:
                    continue
                try:
                    st = os.stat(real)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    add_file(rel, real, st)
            _add_extra(tar, extra or ())
    return buf.getvalue()


def pack_files(files: Sequence[Tuple[str, bytes]]) -> bytes:
    """The archive :func:`pack` makes of an empty directory with ``extra=files``, without a
    directory to walk: a call's own file, sent with every node."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=_GZIP_LEVEL, mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            _add_extra(tar, files)
    return buf.getvalue()


def _add_extra(tar: tarfile.TarFile, files: Iterable[Tuple[str, bytes]]) -> None:
    for name, data in files:
        ti = tarfile.TarInfo(check_pattern(name))
        ti.size = len(data)
        ti.mode = 0o644
        tar.addfile(ti, io.BytesIO(data))


# -- unpacking ------------------------------------------------------------------------------
#
# Every path is created relative to a directory file descriptor, one component at a time,
# and no link is ever followed: a parent is entered with O_DIRECTORY|O_NOFOLLOW (a link or
# a file where a directory should be is refused), a file is created with
# O_CREAT|O_EXCL|O_NOFOLLOW, links are made with symlinkat/linkat, which do not follow
# either. What a link may name is decided from this extraction's own record, never from
# the disk: only a regular file extracted earlier from the same archive. So an archive can
# neither write nor read outside the destination, whatever its names and links say.

_FILE = "file"
_DIR = "dir"
_MEMORY = "memory"  # read into memory, never extracted: no link may name it
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_O_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
#: A file system block: every file the sandbox held took at least one page of its scratch.
PAGE = 4096
#: The largest pax or GNU long-name header read (names are at most PATH_MAX anyway).
MAX_HEADER_BYTES = 1 << 20
_OLD_MARK = ".resoluto-old-"


class LimitExceeded(ArchiveError):
    """The archive holds more than its :class:`Limits` allow."""

    def __init__(self, what: str, message: str) -> None:
        super().__init__(message)
        self.what = what  # "bytes" | "file" | "members" | "stream"


class Limits:
    """What the archives of one extraction (one node's outbox) may add up to.

    ``max_bytes``: the regular-file bytes written, all archives together; also the
    largest single file. ``max_members``: members of all archives (default one per
    :data:`PAGE` of ``max_bytes``: each file the sandbox held took a page). The
    decompressed stream may not exceed twice ``max_bytes`` plus 1 MiB (headers and
    padding), nor the compressed one ``max_bytes`` plus 1/256 and 1 MiB, so a gzip bomb
    or a header bomb is stopped while it is read. None: unlimited.
    """

    def __init__(self, max_bytes: Optional[int] = None, max_members: Optional[int] = None) -> None:
        self.max_bytes = max_bytes
        if max_members is None and max_bytes is not None:
            max_members = max(1, max_bytes // PAGE)
        self.max_members = max_members
        self.written = 0
        self.members = 0
        self.stream = 0
        self.raw = 0

    @property
    def max_stream(self) -> Optional[int]:
        return None if self.max_bytes is None else 2 * self.max_bytes + (1 << 20)

    @property
    def max_raw(self) -> Optional[int]:
        return None if self.max_bytes is None else self.max_bytes + self.max_bytes // 256 + (1 << 20)


def _record_parents(kinds: Dict[str, object], rel: str) -> None:
    parts = rel.split("/")
    for i in range(1, len(parts)):
        kinds.setdefault("/".join(parts[:i]), _DIR)


def _resolve(kinds: Dict[str, object], base: List[str], text: str) -> Optional[str]:
    """The regular file that link text ``text`` in directory ``base`` names, from what was
    extracted (``kinds``), or None: every component before the last must be a directory
    extracted or entered (``..`` never above the root), the last a regular file or a link
    already resolved to one."""
    if not text or text.startswith("/") or "\x00" in text:
        return None
    stack = list(base)
    comps = [c for c in text.split("/") if c not in ("", ".")]
    if not comps:
        return None
    for i, c in enumerate(comps):
        last = i == len(comps) - 1
        if c == "..":
            if not stack or last:
                return None
            stack.pop()
            continue
        stack.append(c)
        path = "/".join(stack)
        kind = kinds.get(path)
        if last:
            if kind is _FILE:
                return path
            if isinstance(kind, tuple):
                return str(kind[1])
            return None
        if kind is not _DIR:
            return None
    return None


def _split(name: str) -> List[str]:
    """A member name's components; refuses absolute names, ``..`` and NUL."""
    if "\x00" in name:
        raise UnsafeArchive(name, "NUL in the name")
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise UnsafeArchive(name, "absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchive(name, "path traversal ('..')")
    for p in parts:
        if len(p.encode("utf-8", "surrogateescape")) > 255:
            raise UnsafeArchive(name, "a path component longer than 255 bytes")
    return parts


class _Counted:
    """A reader that counts what passes through it and stops at ``cap``."""

    def __init__(self, inner: Any, limits: Limits, which: str, label: str) -> None:
        self.inner, self.limits, self.which, self.label = inner, limits, which, label

    def read(self, n: int = -1) -> bytes:
        data: bytes = self.inner.read(n if n is not None and n >= 0 else 1 << 20)
        if self.which == "raw":
            self.limits.raw += len(data)
            cap, got = self.limits.max_raw, self.limits.raw
        else:
            self.limits.stream += len(data)
            cap, got = self.limits.max_stream, self.limits.stream
        if cap is not None and got > cap:
            kind = "compressed" if self.which == "raw" else "uncompressed"
            raise LimitExceeded(
                "stream",
                f"{self.label}: the {kind} archive data exceeds {cap} bytes, more than an output limit "
                f"of {self.limits.max_bytes} bytes can hold (a compression bomb?); stopped while reading",
            )
        return data


class _GuardedInfo(tarfile.TarInfo):
    """Refuses an oversized pax / GNU long-name header before tarfile reads it into memory."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if (
            self.type
            in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE)
            or self.type == tarfile.SOLARIS_XHDTYPE
        ) and self.size > MAX_HEADER_BYTES:
            raise UnsafeArchive(self.name, f"a {self.size}-byte extended header (at most {MAX_HEADER_BYTES})")
        return super()._proc_member(tarfile_)  # type: ignore[misc, no-any-return]


class _Extraction:
    """One extraction into the directory ``root_fd``: what it made, so that a refusal
    undoes it, and what each name became, so that links are judged on its word only."""

    def __init__(
        self, dest: Path, limits: Limits, in_memory: "Optional[Dict[str, Optional[bytes]]]" = None
    ) -> None:
        self.dest = dest
        self._root_fd: Optional[int] = None
        self.made_dest = False
        self.limits = limits
        self.in_memory = in_memory
        self.kinds: Dict[str, object] = {}
        self.seen: Set[str] = set()
        self.created: List[Tuple[str, str, bool]] = []  # (parent rel, leaf, is_dir)
        self.moved: List[Tuple[str, str, str]] = []  # (parent rel, leaf, aside): replaced entries
        self.fds: Dict[str, int] = {}
        self.extracted: List[str] = []

    @property
    def root_fd(self) -> int:
        """The destination, made (with its parents) only once a member is written there."""
        if self._root_fd is None:
            self.made_dest = not self.dest.exists()
            self.dest.mkdir(parents=True, exist_ok=True)
            self._root_fd = os.open(self.dest, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        return self._root_fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def close_root(self) -> None:
        if self._root_fd is not None:
            os.close(self._root_fd)
            self._root_fd = None

    def keep_in_memory(self, tar: tarfile.TarFile, m: tarfile.TarInfo, rel: str) -> bool:
        """Read the member into ``in_memory`` if its name is one of its keys."""
        if self.in_memory is None or rel not in self.in_memory:
            return False
        src_f = tar.extractfile(m)
        assert src_f is not None
        self.in_memory[rel] = src_f.read(m.size)
        self.limits.written += m.size
        self.kinds[rel] = _MEMORY
        return True

    def dir_fd(self, parts: List[str], member: str, create: bool) -> int:
        """The directory ``parts`` (relative to the root), entered without following links."""
        rel = "/".join(parts)
        if not parts:
            return self.root_fd
        fd = self.fds.get(rel)
        if fd is not None:
            return fd
        parent = self.dir_fd(parts[:-1], member, create)
        leaf = parts[-1]
        try:
            fd = os.open(leaf, _O_DIR, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise UnsafeArchive(member, f"directory {rel!r} does not exist") from None
            try:
                os.mkdir(leaf, 0o755, dir_fd=parent)
            except OSError as e:
                raise UnsafeArchive(member, f"cannot create directory {rel!r}: {e.strerror}") from None
            self.created.append(("/".join(parts[:-1]), leaf, True))
            try:
                fd = os.open(leaf, _O_DIR, dir_fd=parent)
            except OSError as e:
                raise UnsafeArchive(member, f"cannot enter directory {rel!r}: {e.strerror}") from None
        except OSError:
            raise UnsafeArchive(
                member, f"its parent {rel!r} is not a directory (a link or a file is never entered)"
            ) from None
        self.kinds.setdefault(rel, _DIR)
        self.fds[rel] = fd
        return fd

    def make_room(self, parts: List[str], member: str) -> int:
        """The parent's fd, after moving aside what the destination already had at the
        name (restored if the extraction is refused); our own names are never replaced."""
        pfd = self.dir_fd(parts[:-1], member, True)
        leaf, rel = parts[-1], "/".join(parts)
        try:
            st = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return pfd
        if rel in self.kinds:
            raise UnsafeArchive(member, f"{rel!r} was already extracted from this archive")
        if stat.S_ISDIR(st.st_mode):
            raise UnsafeArchive(member, f"the destination already has a directory {rel!r}")
        aside = _OLD_MARK + os.urandom(8).hex()
        os.rename(leaf, aside, src_dir_fd=pfd, dst_dir_fd=pfd)  # renameat follows no link
        self.moved.append(("/".join(parts[:-1]), leaf, aside))
        return pfd

    def member(self, tar: tarfile.TarFile, m: tarfile.TarInfo, matcher: Optional[PathMatcher]) -> None:
        name = m.name
        lim = self.limits
        if len(self.fds) > 256:
            self.close()  # between members: no fd of the cache is in use
        lim.members += 1
        if lim.max_members is not None and lim.members > lim.max_members:
            raise LimitExceeded(
                "members",
                f"more than {lim.max_members} archive members (at most one per {PAGE} bytes of the output "
                f"limit of {lim.max_bytes})",
            )
        parts = _split(name)
        if m.ischr() or m.isblk():
            raise UnsafeArchive(name, "device file")
        if m.isfifo():
            raise UnsafeArchive(name, "FIFO")
        if m.issparse() or not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
            raise UnsafeArchive(name, f"unsupported member type {m.type!r}")
        if not parts:
            if m.isdir():
                return  # "./": the destination itself
            raise UnsafeArchive(name, "an empty name")
        rel = "/".join(parts)
        if rel in self.seen:
            raise UnsafeArchive(name, "duplicate member (a name may appear once)")
        self.seen.add(rel)
        if m.isreg() and lim.max_bytes is not None and m.size > lim.max_bytes:
            raise LimitExceeded(
                "file", f"member {name!r} is {m.size} bytes, more than the output limit of {lim.max_bytes}"
            )
        if self.in_memory is not None and rel in self.in_memory and not m.isreg():
            raise UnsafeArchive(name, "must be a regular file (the host reads it, never extracts it)")
        if matcher is not None and (m.isdir() or matcher.match(rel) is None):
            return  # not selected: never extracted (and so never a link's target)
        if m.isreg() and lim.max_bytes is not None:
            if lim.written + m.size > lim.max_bytes:
                raise LimitExceeded(
                    "bytes",
                    f"the files add up to more than the output limit of {lim.max_bytes} bytes "
                    f"(at member {name!r})",
                )
        if self.keep_in_memory(tar, m, rel):
            return
        if m.isdir():
            self.dir_fd(parts, name, True)
            return
        if m.issym():
            target = _resolve(self.kinds, parts[:-1], m.linkname)
            if target is None:
                raise UnsafeArchive(
                    name,
                    f"symlink to {m.linkname!r}, which is not a regular file extracted earlier from "
                    "this archive",
                )
            pfd = self.make_room(parts, name)
            os.symlink(m.linkname, parts[-1], dir_fd=pfd)
            self.created.append(("/".join(parts[:-1]), parts[-1], False))
            self.kinds[rel] = ("link", target)
        elif m.islnk():
            target = _resolve(self.kinds, [], m.linkname)
            if (
                target is None
                or self.kinds.get(target) is not _FILE
                or target != "/".join(_split(m.linkname))
            ):
                raise UnsafeArchive(
                    name,
                    f"hard link to {m.linkname!r}, which is not a regular file extracted earlier from "
                    "this archive",
                )
            src = target.split("/")
            sfd = self.dir_fd(src[:-1], name, False)
            pfd = self.make_room(parts, name)
            os.link(src[-1], parts[-1], src_dir_fd=sfd, dst_dir_fd=pfd, follow_symlinks=False)
            self.created.append(("/".join(parts[:-1]), parts[-1], False))
            self.kinds[rel] = _FILE
        else:
            pfd = self.make_room(parts, name)
            fd = os.open(parts[-1], _O_NEW, 0o600, dir_fd=pfd)
            self.created.append(("/".join(parts[:-1]), parts[-1], False))
            with os.fdopen(fd, "wb") as out:
                src_f = tar.extractfile(m)
                assert src_f is not None
                while True:
                    chunk = src_f.read(1 << 20)
                    if not chunk:
                        break
                    out.write(chunk)
                os.fchmod(out.fileno(), (m.mode & 0o755) | 0o600)
            lim.written += m.size
            self.kinds[rel] = _FILE
        self.extracted.append(rel)

    def _parent(self, rel: str) -> Optional[int]:
        try:
            return self.dir_fd(rel.split("/") if rel else [], rel, False)
        except ArchiveError:
            return None

    def undo(self) -> None:
        """Remove what this extraction made, newest first, and put back what it moved."""
        for parent, leaf, is_dir in reversed(self.created):
            pfd = self._parent(parent)
            if pfd is None:
                continue
            try:
                if is_dir:
                    self.fds.pop(f"{parent}/{leaf}" if parent else leaf, None)
                    os.rmdir(leaf, dir_fd=pfd)
                else:
                    os.unlink(leaf, dir_fd=pfd)
            except OSError:
                pass
        for parent, leaf, aside in reversed(self.moved):
            pfd = self._parent(parent)
            if pfd is not None:
                try:
                    os.rename(aside, leaf, src_dir_fd=pfd, dst_dir_fd=pfd)
                except OSError:
                    pass
        self.created.clear()
        self.moved.clear()

    def commit(self) -> None:
        """Drop what was moved aside: the extraction stands."""
        for parent, _leaf, aside in self.moved:
            pfd = self._parent(parent)
            if pfd is not None:
                try:
                    os.unlink(aside, dir_fd=pfd)
                except OSError:
                    pass
        self.moved.clear()


def _read_stream(ex: _Extraction, stream: BinaryIO, label: str, matcher: Optional[PathMatcher]) -> None:
    raw = _Counted(stream, ex.limits, "raw", label)
    gz = gzip.GzipFile(fileobj=cast(Any, raw), mode="rb")
    try:
        tar = tarfile.open(
            fileobj=cast(Any, _Counted(gz, ex.limits, "stream", label)), mode="r|", tarinfo=_GuardedInfo
        )
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise ArchiveError(f"{label} is not a valid gzip tar archive ({type(e).__name__}: {e})") from None
    try:
        for m in tar:
            ex.member(tar, m, matcher)
    except ArchiveError:
        raise
    except (tarfile.TarError, OSError, EOFError, zlib.error, RecursionError) as e:
        raise ArchiveError(f"{label} is not a valid gzip tar archive ({type(e).__name__}: {e})") from None
    finally:
        tar.close()


def unpack_stream(
    sources: Iterable[Tuple[str, "BinaryIO | Callable[[], BinaryIO]"]],
    dest: "str | os.PathLike[str]",
    *,
    patterns: Optional[Sequence[str]] = None,
    limits: Optional[Limits] = None,
    in_memory: "Optional[Dict[str, Optional[bytes]]]" = None,
) -> List[str]:
    """Extract each ``(label, stream)`` in turn into ``dest`` (a stream may be given as a
    function that opens it), read once, never held whole in memory; with ``patterns``,
    only the members they select. ``dest`` is made only when something is written there.

    ``in_memory``: selected names (its keys) whose regular file is read into it instead
    of written, within the same limits (a link, a directory or anything else at such a
    name is refused); a file the caller only reads costs no file on the host.

    Returns the extracted regular-file and link names. All or nothing: on any refusal
    (:class:`UnsafeArchive`, :class:`LimitExceeded`, a broken archive) everything the
    extraction made is removed, what it replaced is put back, and the error names the
    member.
    """
    matcher = PathMatcher(patterns) if patterns is not None else None
    ex = _Extraction(Path(dest), limits or Limits(), in_memory)
    try:
        for label, source in sources:
            stream = source() if callable(source) else source
            try:
                _read_stream(ex, stream, label, matcher)
            except UnsafeArchive as e:
                raise type(e)(e.member, f"{e.why} (in {label})") from None
            finally:
                stream.close()
        ex.commit()
        return ex.extracted
    except BaseException:
        ex.undo()
        if in_memory is not None:
            for name in in_memory:
                in_memory[name] = None
        if ex.made_dest:
            try:
                os.rmdir(ex.dest)
            except OSError:
                pass
        raise
    finally:
        ex.close()
        ex.close_root()


def unpack(
    data: bytes,
    dest: "str | os.PathLike[str]",
    *,
    patterns: Optional[Sequence[str]] = None,
    label: str = "archive",
    limits: Optional[Limits] = None,
    in_memory: "Optional[Dict[str, Optional[bytes]]]" = None,
) -> List[str]:
    """:func:`unpack_stream` of one archive held in memory."""
    return unpack_stream(
        [(label, io.BytesIO(data))], dest, patterns=patterns, limits=limits, in_memory=in_memory
    )
