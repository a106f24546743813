"""Property-based: generated hostile archives never reach outside the destination.

Each example builds a tar of random members (files, directories, symlinks and hard links
that chain through earlier members, absolute and ``..`` names, duplicates, FIFOs and
devices, files past the size limit) and extracts it into a destination that already holds
a file and a planted link to the outside. Whatever the extractor decides, a sentinel tree
next to the destination is unchanged (names, types, bytes, inode, link count, mtime), no
file in the destination is or links to an outside file, nothing there holds the sentinel's
secret, and the limits hold. A refusal leaves the destination exactly as it was.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guest_runner import archive

LIMIT = 64 * 1024  # bytes; members: LIMIT // 4096 = 16
SECRET = b"sentinel-secret-7f3a9c"
PLAIN = ["a", "b", "c"]
HOSTILE = ["..", ".", "", "prelink", "pre.txt", "outside"]


def snapshot(root: Path) -> dict[str, tuple[object, ...]]:
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            s = os.lstat(p)
            content: object = None
            if stat.S_ISREG(s.st_mode):
                content = p.read_bytes()
            elif stat.S_ISLNK(s.st_mode):
                content = os.readlink(p)
            out[str(p.relative_to(root))] = (
                stat.S_IFMT(s.st_mode),
                s.st_ino,
                s.st_nlink,
                s.st_size,
                s.st_mtime_ns,
                content,
            )
    return out


def inodes(root: Path) -> set[tuple[int, int]]:
    got = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            s = os.lstat(Path(dirpath, name))
            got.add((s.st_dev, s.st_ino))
    return got


@st.composite
def hostile_members(draw: st.DrawFn, sentinel: str) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    """Mostly plausible members (so that many archives are accepted and their links made),
    each one hostile with some probability: an odd name, a duplicate, a link to anything."""
    names: list[str] = []
    members: list[tuple[tarfile.TarInfo, bytes | None]] = []
    specials = [
        "../outside/secret.txt",
        sentinel,
        "prelink/secret.txt",
        "prelink",
        "pre.txt",
        "../" * 4 + "etc/passwd",
        ".",
        "a/../../outside/secret.txt",
    ]
    for _ in range(draw(st.integers(1, 12))):
        hostile = draw(st.integers(0, 7)) == 0
        alphabet = PLAIN + HOSTILE if hostile else PLAIN
        parts = draw(st.lists(st.sampled_from(alphabet), min_size=0 if not hostile else 1, max_size=3))
        kinds = (
            ["file", "dir", "sym", "hard", "fifo", "chr"]
            if hostile
            else ["file", "file", "dir", "sym", "hard"]
        )
        kind = draw(st.sampled_from(kinds))
        if not hostile and kind != "dir":
            parts.append(f"f{len(names)}")  # a fresh leaf: plausible archives have few duplicates
        name = ("/" if hostile and draw(st.booleans()) else "") + "/".join(parts)
        if names and draw(st.integers(0, 9)) == 0:
            name = draw(st.sampled_from(names))  # a duplicate
        kinds = (
            ["file", "dir", "sym", "hard", "fifo", "chr"]
            if hostile
            else ["file", "file", "dir", "sym", "hard"]
        )
        kind = draw(st.sampled_from(kinds))
        ti = tarfile.TarInfo(name or "x")
        data: bytes | None = None
        if kind == "file":
            size = draw(st.sampled_from([0, 1, 100, 5000, LIMIT // 2] + ([LIMIT + 1] if hostile else [])))
            data = b"\0" * size
            ti.size = size
        elif kind == "dir":
            ti.type = tarfile.DIRTYPE
        elif kind in ("sym", "hard"):
            ti.type = tarfile.SYMTYPE if kind == "sym" else tarfile.LNKTYPE
            pool = names + specials if hostile or not names else names
            target = draw(st.sampled_from(pool))
            if kind == "sym" and target in names:
                # relative to the link's own directory, as a symlink's text is
                target = "../" * name.count("/") + target
            ti.linkname = target
        elif kind == "fifo":
            ti.type = tarfile.FIFOTYPE
        else:
            ti.type = tarfile.CHRTYPE
        names.append(name)
        members.append((ti, data))
    return members


def tar_bytes(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as t:
        for ti, data in members:
            t.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_no_generated_archive_reaches_outside_the_destination(data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        outside = base / "outside"
        (outside / "sub").mkdir(parents=True)
        (outside / "secret.txt").write_bytes(SECRET)
        (outside / "sub" / "deep.txt").write_bytes(SECRET + b"-deep")
        dest = base / "dest"
        dest.mkdir()
        (dest / "pre.txt").write_bytes(b"was here before")
        (dest / "prelink").symlink_to(outside)  # hostile state already in the destination
        before_outside, before_dest = snapshot(outside), snapshot(dest)
        outside_inodes = inodes(outside)

        members = data.draw(hostile_members(str(outside / "secret.txt")))
        blob = tar_bytes(members)
        limits = archive.Limits(LIMIT)
        try:
            extracted = archive.unpack(blob, dest, limits=limits)
        except archive.ArchiveError:
            extracted = None

        assert snapshot(outside) == before_outside, "the outside tree changed"
        if extracted is None:
            assert snapshot(dest) == before_dest, "a refusal left something behind"
            return
        for dirpath, dirnames, filenames in os.walk(dest, followlinks=False):
            for name in dirnames + filenames:
                p = Path(dirpath, name)
                s = os.lstat(p)
                assert (s.st_dev, s.st_ino) not in outside_inodes, f"{p} shares an inode with an outside file"
                if stat.S_ISLNK(s.st_mode):
                    real = Path(os.path.realpath(p))
                    if p.name == "prelink" and p.parent == dest and str(p.relative_to(dest)) in before_dest:
                        continue  # the planted link itself, untouched by the archive
                    assert real.is_relative_to(dest.resolve()) and real.is_file(), f"{p} -> {real}"
                else:
                    assert stat.S_ISREG(s.st_mode) or stat.S_ISDIR(s.st_mode), f"{p} is neither file nor dir"
                if stat.S_ISREG(s.st_mode):
                    assert SECRET not in p.read_bytes(), f"{p} holds the outside secret"
        written = sum(m[0].size for m in members if m[0].isreg())
        assert limits.written <= LIMIT and limits.members <= LIMIT // archive.PAGE
        assert limits.written <= written
        assert all(not os.path.isabs(rel) and ".." not in rel.split("/") for rel in extracted)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3 * LIMIT), min_size=1, max_size=6),
    compress=st.booleans(),
)
def test_limits_stop_bombs_while_streaming_and_leave_nothing(sizes: list[int], compress: bool) -> None:
    """Files of zeros (a gzip bomb's shape): accepted only while every file and the total
    fit; else refused with a LimitExceeded naming the limit, and the destination is empty."""
    members = []
    for i, size in enumerate(sizes):
        ti = tarfile.TarInfo(f"f{i}")
        ti.size = size
        members.append((ti, (b"\0" if compress else b"z") * size))
    blob = tar_bytes(members)
    with tempfile.TemporaryDirectory() as tmp:
        dest = Path(tmp) / "d"
        fits = sum(sizes) <= LIMIT
        try:
            archive.unpack(blob, dest, limits=archive.Limits(LIMIT))
        except archive.LimitExceeded as e:
            assert not fits and str(LIMIT) in str(e)
            assert not dest.exists() or os.listdir(dest) == []
        else:
            assert fits
            assert sum(p.stat().st_size for p in dest.iterdir()) == sum(sizes)
