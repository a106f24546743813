"""Archives: packing skips junk and never follows links out; unpacking treats input as hostile."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from guest_runner import archive
from guest_runner.archive import ArchiveError, OutputPatternError, UnsafeArchive


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for ti, data in members:
            t.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    return ti, data


def _special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.linkname = linkname
    return ti, None


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "ws"
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "pkg" / "mod.py").write_text("print('hi')\n")
    (root / "data.csv").write_text("a,b\n1,2\n")
    (root / "empty").mkdir()
    for junk in (".venv/lib", "__pycache__", ".git/objects", "node_modules/x", ".pytest_cache"):
        (root / junk).mkdir(parents=True)
        (root / junk / "f").write_text("junk")
    (root / "src" / "pkg" / "__pycache__").mkdir()
    (root / "src" / "pkg" / "__pycache__" / "mod.pyc").write_bytes(b"\0")
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    (root / "leak").symlink_to(secret)  # points out of the tree
    (root / "leakdir").symlink_to(tmp_path)
    (root / "inner").symlink_to("data.csv")  # stays inside
    os.mkfifo(root / "fifo")
    return root


def test_pack_round_trip_skips_junk_and_outward_links(tree, tmp_path):
    data = archive.pack(tree)
    out = tmp_path / "out"
    names = archive.unpack(data, out)
    assert (out / "src" / "pkg" / "mod.py").read_text() == "print('hi')\n"
    assert (out / "empty").is_dir()
    assert os.readlink(out / "inner") == "data.csv" and (out / "inner").read_text() == "a,b\n1,2\n"
    for absent in (
        ".venv",
        "__pycache__",
        ".git",
        "node_modules",
        ".pytest_cache",
        "leak",
        "leakdir",
        "fifo",
        "src/pkg/__pycache__",
    ):
        assert not os.path.lexists(out / absent), absent
    assert "leak" not in names


def test_pack_is_deterministic(tree):
    assert archive.pack(tree) == archive.pack(tree)


def test_an_archive_of_files_alone_is_the_archive_of_an_empty_directory_with_them(tmp_path):
    files = [(".resoluto/call.json", b'{"a": 1}'), ("b.txt", b"x" * 5000)]
    (tmp_path / "empty").mkdir()
    assert archive.pack_files(files) == archive.pack(tmp_path / "empty", patterns=[], extra=files)
    got = archive.unpack(archive.pack_files(files), tmp_path / "out")
    assert sorted(got) == [".resoluto/call.json", "b.txt"]
    assert (tmp_path / "out/b.txt").read_bytes() == b"x" * 5000
    with pytest.raises(OutputPatternError):
        archive.pack_files([("../escape", b"")])


def test_pack_missing_workspace_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        archive.pack(tmp_path / "nope")


@pytest.mark.parametrize(
    "member, why",
    [
        (_file("../evil.txt"), "path traversal"),
        (_file("a/../../evil.txt"), "path traversal"),
        (_file("/etc/evil"), "absolute path"),
        (_special("link", tarfile.SYMTYPE, "/etc/passwd"), "not a regular file extracted earlier"),
        (_special("link", tarfile.SYMTYPE, "../../outside"), "not a regular file extracted earlier"),
        (_special("d/link", tarfile.SYMTYPE, "../.."), "not a regular file extracted earlier"),
        (_special("link", tarfile.SYMTYPE, "."), "not a regular file extracted earlier"),
        (_special("hard", tarfile.LNKTYPE, "/etc/passwd"), "hard link"),
        (_special("hard", tarfile.LNKTYPE, "never-seen"), "not a regular file extracted earlier"),
        (_file("good.txt", b"again"), "duplicate member"),
        (_file("good.txt/x"), "not a directory"),
        (_special("dev", tarfile.CHRTYPE), "device file"),
        (_special("blk", tarfile.BLKTYPE), "device file"),
        (_special("pipe", tarfile.FIFOTYPE), "FIFO"),
    ],
)
def test_hostile_members_are_refused_by_name_and_nothing_is_written(tmp_path, member, why):
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "earlier.txt").write_text("keep me")
    data = _tar([_file("good.txt", b"fine"), member])
    with pytest.raises(UnsafeArchive, match=why) as exc:
        archive.unpack(data, dest)
    assert repr(member[0].name) in str(exc.value)
    assert sorted(os.listdir(dest)) == ["earlier.txt"]  # the good member was not written either
    assert (dest / "earlier.txt").read_text() == "keep me"
    assert not (tmp_path / "evil.txt").exists()


def test_symlink_then_file_through_it_cannot_escape(tmp_path):
    """A link that is itself 'inside' but whose target is a directory outside, already on disk."""
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "sub").symlink_to(tmp_path)  # pre-existing hostile state in the destination
    with pytest.raises(UnsafeArchive, match="its parent 'sub' is not a directory"):
        archive.unpack(_tar([_file("sub/evil.txt")]), dest)
    assert not (tmp_path / "evil.txt").exists()


@pytest.mark.parametrize(
    "data, what",
    [
        (b"not a gzip at all", "not a valid gzip tar"),
        (b"", "not a valid gzip tar"),
    ],
)
def test_garbage_archives_are_clear_errors(tmp_path, data, what):
    with pytest.raises(ArchiveError, match=what):
        archive.unpack(data, tmp_path / "d", label="inbox/workspace.tar.gz")


def test_truncated_archive_is_refused_before_writing(tmp_path, tree):
    (tree / "big.bin").write_bytes(os.urandom(300_000))
    data = archive.pack(tree)
    dest = tmp_path / "d"
    with pytest.raises(ArchiveError, match="inbox/workspace.tar.gz is not a valid gzip tar"):
        archive.unpack(data[: len(data) // 2], dest, label="inbox/workspace.tar.gz")
    assert not dest.exists() or os.listdir(dest) == []


def test_unpack_with_patterns_materialises_only_declared_outputs(tmp_path):
    data = _tar(
        [
            _file("out/a.txt"),
            _file("out/sub/b.txt"),
            _file("report.md"),
            _file("secret/keys"),
            _file("outx/c.txt"),
        ]
    )
    dest = tmp_path / "d"
    got = archive.unpack(data, dest, patterns=["out", "*.md"])
    assert sorted(got) == ["out/a.txt", "out/sub/b.txt", "report.md"]
    assert not (dest / "secret").exists() and not (dest / "outx").exists()


@pytest.mark.parametrize(
    "patterns, expected",
    [
        (["out/**"], ["out/a.txt", "out/deep/er/c.txt", "out/sub/b.log"]),
        (["out/*.txt"], ["out/a.txt"]),
        (["**/*.txt"], ["out/a.txt", "out/deep/er/c.txt", "top.txt"]),
        (["top.txt"], ["top.txt"]),
        (["out/deep"], ["out/deep/er/c.txt"]),
        (["out/s?b/*"], ["out/sub/b.log"]),
    ],
)
def test_select_globs(tmp_path, patterns, expected):
    for rel in ("out/a.txt", "out/sub/b.log", "out/deep/er/c.txt", "top.txt", "other/x.bin"):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(rel)
    files, missing = archive.select(tmp_path, patterns)
    assert sorted(files) == expected and missing == []


def test_select_reports_patterns_matching_nothing(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    files, missing = archive.select(tmp_path, ["a.txt", "nothing/**", "nope.csv"])
    assert files == ["a.txt"] and missing == ["nothing/**", "nope.csv"]


@pytest.mark.parametrize("bad", ["/etc/passwd", "../up", "a/../../b", "", "~/x"])
def test_output_patterns_escaping_the_workspace_are_refused(bad):
    with pytest.raises(OutputPatternError):
        archive.check_pattern(bad)


def test_a_refusal_puts_back_what_the_destination_had_and_a_success_replaces_it(tmp_path):
    dest = tmp_path / "d"
    dest.mkdir()
    (dest / "a.txt").write_text("old")
    with pytest.raises(UnsafeArchive, match="FIFO"):
        archive.unpack(_tar([_file("a.txt", b"new"), _file("b.txt"), _special("p", tarfile.FIFOTYPE)]), dest)
    assert sorted(os.listdir(dest)) == ["a.txt"] and (dest / "a.txt").read_text() == "old"
    assert archive.unpack(_tar([_file("a.txt", b"new")]), dest) == ["a.txt"]
    assert sorted(os.listdir(dest)) == ["a.txt"] and (dest / "a.txt").read_text() == "new"


def test_links_to_files_extracted_earlier_are_made_and_chains_resolve(tmp_path):
    data = _tar(
        [
            _file("d/f.txt", b"payload"),
            _special("d/l1", tarfile.SYMTYPE, "f.txt"),
            _special("l2", tarfile.SYMTYPE, "d/l1"),  # through an earlier link to the file
            _special("h", tarfile.LNKTYPE, "d/f.txt"),
        ]
    )
    dest = tmp_path / "d"
    assert archive.unpack(data, dest) == ["d/f.txt", "d/l1", "l2", "h"]
    assert (dest / "l2").read_bytes() == b"payload" and os.path.islink(dest / "l2")
    assert os.stat(dest / "h").st_ino == os.stat(dest / "d" / "f.txt").st_ino


@pytest.mark.parametrize(
    "members, why",
    [
        ([_file("d/f"), _special("l", tarfile.SYMTYPE, "d")], "not a regular file extracted earlier"),
        ([_special("l", tarfile.SYMTYPE, "later"), _file("later")], "not a regular file extracted earlier"),
        ([_file("f"), _special("l", tarfile.SYMTYPE, "f"), _special("h", tarfile.LNKTYPE, "l")], "hard link"),
        (
            [_file("f"), _special("l", tarfile.SYMTYPE, "f"), _file("l/x")],
            "its parent 'l' is not a directory",
        ),
    ],
)
def test_links_to_directories_later_members_or_through_links_are_refused(tmp_path, members, why):
    with pytest.raises(UnsafeArchive, match=why):
        archive.unpack(_tar(members), tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_pack_orders_links_after_their_files_copies_unshipped_targets_and_skips_dir_links(tmp_path):
    root = tmp_path / "ws"
    (root / "sub").mkdir(parents=True)
    (root / "z.txt").write_text("z")
    (root / "a-link").symlink_to("z.txt")  # sorts before its target
    (root / "b-chain").symlink_to("a-link")
    (root / "dirlink").symlink_to("sub")
    (root / "sub" / "s.txt").write_text("s")
    out = tmp_path / "out"
    archive.unpack(archive.pack(root), out)
    assert os.readlink(out / "a-link") == "z.txt" and (out / "b-chain").read_text() == "z"
    assert not os.path.lexists(out / "dirlink")
    # Only the link is selected: its target is not shipped, so the link travels as a copy.
    only = tmp_path / "only"
    archive.unpack(archive.pack(root, patterns=["a-link"]), only)
    assert os.listdir(only) == ["a-link"] and not os.path.islink(only / "a-link")
    assert (only / "a-link").read_text() == "z"


def test_member_count_and_header_limits(tmp_path):
    limits = archive.Limits(8 * archive.PAGE)  # 8 members
    with pytest.raises(archive.LimitExceeded, match="more than 8 archive members"):
        archive.unpack(_tar([_file(f"f{i}") for i in range(9)]), tmp_path / "a", limits=limits)
    assert not (tmp_path / "a").exists()
    ti = tarfile.TarInfo("x" * 100)
    ti.pax_headers = {"comment": "y" * (archive.MAX_HEADER_BYTES + 10)}
    with pytest.raises(UnsafeArchive, match="extended header"):
        archive.unpack(_tar([(ti, None)]), tmp_path / "b")


def test_one_budget_spans_every_archive_of_a_node_and_a_refusal_removes_all(tmp_path):
    first, second = _tar([_file("a", b"1" * 3000)]), _tar([_file("b", b"2" * 3000)])
    dest = tmp_path / "d"
    with pytest.raises(archive.LimitExceeded, match="add up to more than the output limit of 5000"):
        archive.unpack_stream(
            [("one", io.BytesIO(first)), ("two", io.BytesIO(second))],
            dest,
            limits=archive.Limits(5000, max_members=10),
        )
    assert not dest.exists()


def test_files_only_read_are_taken_into_memory_and_nothing_is_made_on_disk(tmp_path):
    """A Python call's return.json is only read: taken from the outbox into memory, within
    the same budget, with no directory or file made for it; the rest is extracted."""
    dest, taken = tmp_path / "out" / "node", {".resoluto/return.json": None}
    got = archive.unpack(
        _tar([_file(".resoluto/return.json", b'{"value": 1}')]),
        dest,
        patterns=[".resoluto/**"],
        in_memory=taken,
    )
    assert got == [] and taken == {".resoluto/return.json": b'{"value": 1}'}
    assert not (tmp_path / "out").exists()
    taken = {".resoluto/return.json": None}
    got = archive.unpack(
        _tar([_file(".resoluto/return.json", b"{}"), _file("kept.txt")]), dest, in_memory=taken
    )
    assert (
        got == ["kept.txt"] and taken[".resoluto/return.json"] == b"{}" and os.listdir(dest) == ["kept.txt"]
    )
    with pytest.raises(archive.LimitExceeded):  # the same budget as a file written
        archive.unpack(
            _tar([_file("r", b"1" * 6000)]),
            tmp_path / "d2",
            limits=archive.Limits(5000),
            in_memory={"r": None},
        )


@pytest.mark.parametrize(
    "members",
    [
        [_file("secret.txt", b"host"), _special("r", tarfile.SYMTYPE, "secret.txt")],
        [_special("r", tarfile.DIRTYPE)],
        [_file("r", b"1"), _special("again", tarfile.LNKTYPE, "r")],
        [_file("r", b"1"), _special("again", tarfile.SYMTYPE, "r")],
    ],
    ids=["a-link-at-the-name", "a-directory-at-the-name", "a-hard-link-to-it", "a-symlink-to-it"],
)
def test_a_file_read_into_memory_is_a_regular_file_and_nothing_links_to_it(tmp_path, members):
    """Nothing but a regular file is read at such a name, and no link may name it (it is
    never on disk to be linked to); a refusal leaves the names unread and nothing made."""
    dest, taken = tmp_path / "d", {"r": None}
    with pytest.raises(UnsafeArchive):
        archive.unpack(_tar(members), dest, in_memory=taken)
    assert taken == {"r": None} and not dest.exists()


_MEASURE_UNPACK = """
import sys, tracemalloc
from pathlib import Path
from guest_runner import archive
src, dest = Path(sys.argv[1]), Path(sys.argv[2])
tracemalloc.start()
with open(src, "rb") as f:
    archive.unpack_stream([("big", f)], dest, limits=archive.Limits(64 << 20))
print(tracemalloc.get_traced_memory()[1])
"""


def test_unpack_stream_holds_a_piece_not_the_archive(tmp_path):
    """A 24 MiB (incompressible) archive read from a file: the extractor's own allocations
    stay a few MiB, whatever the archive's size. Measured in a process of its own:
    tracemalloc counts every thread's allocations, and a test process has others."""
    import subprocess
    import sys

    src = tmp_path / "big.tar.gz"
    src.write_bytes(_tar([_file("big.bin", os.urandom(24 << 20))]))
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE_UNPACK, str(src), str(tmp_path / "d")],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(archive.__file__).parents[1],
    )
    peak = int(out.stdout.split()[-1])
    assert (tmp_path / "d" / "big.bin").stat().st_size == 24 << 20
    assert peak < 6 << 20, f"peak {peak} bytes"
