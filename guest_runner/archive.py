"""Safe gzip-tar packing and unpacking, both directions of the conduit.

Packing never follows a link out of the tree and skips the usual junk. Unpacking
treats every archive as hostile: the whole archive is checked before a single byte
is written, and path traversal, absolute paths, links leaving the destination,
devices and FIFOs are refused with an error naming the member.
"""

from __future__ import annotations

import gzip
import io
import os
import posixpath
import re
import tarfile
import zlib
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

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


def _link_stays_inside(root: Path, link_rel: str, target: str) -> bool:
    if target.startswith("/") or not target:
        return False
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(link_rel), target))
    return resolved != ".." and not resolved.startswith("../") and not resolved.startswith("/")


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

    Symlinks are stored as links only when they point inside the tree; others are
    skipped, never followed. ``extra`` adds in-memory files (relative name, content);
    ``skip`` names relative directories to leave out (a conduit or outputs directory
    that lives inside the workspace).
    """
    root_path = Path(root)
    if not root_path.is_dir():
        raise FileNotFoundError(f"workspace directory {str(root_path)!r} does not exist")
    excl = frozenset(excludes) if patterns is None else frozenset()
    matcher = PathMatcher(patterns) if patterns is not None else None
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=_GZIP_LEVEL, mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for rel, path in _walk(root_path, excl, frozenset(skip)):
                if matcher is not None and matcher.match(rel) is None:
                    continue
                try:
                    st = os.lstat(path)
                except OSError:
                    continue  # vanished while walking
                if os.path.islink(path):
                    target = os.readlink(path)
                    if not _link_stays_inside(root_path, rel, target):
                        continue
                    ti = tarfile.TarInfo(rel)
                    ti.type = tarfile.SYMTYPE
                    ti.linkname = target
                    ti.mtime = int(st.st_mtime)
                    ti.mode = 0o777
                    tar.addfile(ti)
                elif path.is_dir():
                    if matcher is not None:
                        continue  # directories come implicitly with their matched files
                    ti = tarfile.TarInfo(rel)
                    ti.type = tarfile.DIRTYPE
                    ti.mode = st.st_mode & 0o7777
                    ti.mtime = int(st.st_mtime)
                    tar.addfile(ti)
                elif path.is_file():
                    ti = tarfile.TarInfo(rel)
                    ti.size = st.st_size
                    ti.mode = st.st_mode & 0o777
                    ti.mtime = int(st.st_mtime)
                    with open(path, "rb") as f:
                        tar.addfile(ti, f)
                # sockets, FIFOs and devices are never packed
            for name, data in extra or ():
                ti = tarfile.TarInfo(check_pattern(name))
                ti.size = len(data)
                ti.mode = 0o644
                tar.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _open(data: bytes, label: str) -> tarfile.TarFile:
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")
        tar.getmembers()  # force a full read: a truncated archive fails here, not half-way
        return tar
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise ArchiveError(f"{label} is not a valid gzip tar archive ({type(e).__name__}: {e})") from None


def inspect(data: bytes, label: str = "archive") -> List[tarfile.TarInfo]:
    """Every member, after checking each is safe to extract anywhere."""
    tar = _open(data, label)
    members = tar.getmembers()
    names = set()
    for m in members:
        name = m.name
        if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
            raise UnsafeArchive(name, "absolute path")
        norm = posixpath.normpath(name)
        if norm == ".." or norm.startswith("../") or "/../" in f"/{name}/":
            raise UnsafeArchive(name, "path traversal ('..')")
        if m.ischr() or m.isblk():
            raise UnsafeArchive(name, "device file")
        if m.isfifo():
            raise UnsafeArchive(name, "FIFO")
        if not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
            raise UnsafeArchive(name, f"unsupported member type {m.type!r}")
        if m.issym():
            if m.linkname.startswith("/"):
                raise UnsafeArchive(name, f"absolute symlink to {m.linkname!r}")
            if not _link_stays_inside(Path("."), norm, m.linkname):
                raise UnsafeArchive(name, f"symlink to {m.linkname!r} points outside the destination")
        if m.islnk():
            target = posixpath.normpath(m.linkname)
            if m.linkname.startswith("/") or target.startswith("../") or target == "..":
                raise UnsafeArchive(name, f"hard link to {m.linkname!r} points outside the destination")
            if target not in names:
                raise UnsafeArchive(name, f"hard link to {m.linkname!r}, which is not an earlier member")
        names.add(norm)
    return members


def unpack(
    data: bytes,
    dest: "str | os.PathLike[str]",
    *,
    patterns: Optional[Sequence[str]] = None,
    label: str = "archive",
) -> List[str]:
    """Extract ``data`` into ``dest``; with ``patterns``, only members they select.

    Returns the extracted regular-file and link names. Nothing is written unless every
    member passes :func:`inspect`.
    """
    members = inspect(data, label)
    matcher = PathMatcher(patterns) if patterns is not None else None
    dest_path = Path(dest)
    dest_path.mkdir(parents=True, exist_ok=True)
    real_dest = os.path.realpath(dest_path)
    chosen = []
    for m in members:
        if matcher is not None and not m.isdir() and matcher.match(m.name) is None:
            continue
        if matcher is not None and m.isdir():
            continue
        # A symlink extracted earlier (or already in dest) must not redirect a later member.
        parent = os.path.realpath(os.path.join(real_dest, os.path.dirname(posixpath.normpath(m.name))))
        if not _inside(real_dest, parent):
            raise UnsafeArchive(m.name, "its parent directory resolves outside the destination")
        chosen.append(m)
    tar = _open(data, label)
    extracted: List[str] = []
    by_name = {m.name: m for m in tar.getmembers()}
    for m in chosen:
        member = by_name[m.name]
        target = os.path.join(real_dest, posixpath.normpath(m.name))
        parent = os.path.realpath(os.path.dirname(target))
        if not _inside(real_dest, parent):
            raise UnsafeArchive(m.name, "its parent directory resolves outside the destination")
        if member.isdir():
            os.makedirs(target, exist_ok=True)
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.lexists(target) and not os.path.isdir(target):
            os.unlink(target)
        if member.issym():
            os.symlink(member.linkname, target)
        elif member.islnk():
            src = os.path.join(real_dest, posixpath.normpath(member.linkname))
            if not os.path.exists(src):
                raise UnsafeArchive(m.name, f"hard link target {member.linkname!r} was not extracted")
            os.link(src, target)
        else:
            f = tar.extractfile(member)
            assert f is not None
            with open(target, "wb") as out:
                while True:
                    chunk = f.read(1 << 20)
                    if not chunk:
                        break
                    out.write(chunk)
            os.chmod(target, (member.mode & 0o755) | 0o600)
        extracted.append(posixpath.normpath(m.name))
    return extracted
