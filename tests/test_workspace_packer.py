"""The task runner packs an unchanged workspace once, and never hands a node a stale one."""

from __future__ import annotations

import io
import os
import sys
import tarfile
import time
from pathlib import Path

import pytest

from guest_runner import archive
from prefect_resoluto.task_runner.workspace import RACY_NS, WorkspacePacker

HOUR = 3600


def members(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


def aged(root: Path, seconds: float = HOUR) -> None:
    """Every entry's mtime an hour back (its ctime stays now: only the racy check uses it)."""
    old = time.time() - seconds
    for p in [root, *root.rglob("*")]:
        os.utime(p, (old, old), follow_symlinks=False)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    (ws / "pkg").mkdir(parents=True)
    (ws / "pkg" / "a.py").write_text("A = 1\n")
    (ws / "data.txt").write_text("old\n")
    (ws / "skipped").mkdir()
    (ws / "skipped" / "big.bin").write_bytes(b"x" * 100)
    return ws


def settled(packer: WorkspacePacker, ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend the clock moved past the racy window (ctimes cannot be set back)."""
    real = time.time_ns
    monkeypatch.setattr("prefect_resoluto.task_runner.workspace.time.time_ns", lambda: real() + 2 * RACY_NS)


def test_an_unchanged_tree_is_packed_once_and_matches_a_fresh_pack(tree, monkeypatch):
    packer = WorkspacePacker()
    settled(packer, tree, monkeypatch)
    first = packer(tree, ["skipped"])
    again = packer(tree, ["skipped"])
    assert again is first and packer.packs == 1
    assert members(first) == members(archive.pack(tree, skip=["skipped"]))
    assert "skipped/big.bin" not in members(first)
    packer(tree, [])  # another skip list is another archive
    assert packer.packs == 2


@pytest.mark.parametrize(
    "change", ["content", "same-size-same-mtime", "new-file", "removed", "mode", "symlink"]
)
def test_any_change_is_seen_by_the_next_node(tree, monkeypatch, change):
    packer = WorkspacePacker()
    settled(packer, tree, monkeypatch)
    before = packer(tree, [])
    data = tree / "data.txt"
    st = data.stat()
    if change == "content":
        data.write_text("new content\n")
    elif change == "same-size-same-mtime":
        data.write_text("new\n")  # same size; mtime put back: only the ctime tells
        os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif change == "new-file":
        (tree / "pkg" / "b.py").write_text("B = 2\n")
    elif change == "removed":
        data.unlink()
    elif change == "mode":
        data.chmod(0o600)
    elif change == "symlink":
        (tree / "link").symlink_to("data.txt")
    after = packer(tree, [])
    assert packer.packs == 2
    assert after != before
    assert members(after) == members(archive.pack(tree))


def test_a_tree_changed_within_the_racy_window_is_never_cached(tree):
    packer = WorkspacePacker()
    (tree / "data.txt").write_text("just now\n")  # ctime now: within the window
    packer(tree, [])
    packer(tree, [])
    assert packer.packs == 2


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect")
def test_a_mapped_flow_packs_once_and_a_later_node_sees_the_edited_workspace(tmp_path, monkeypatch):
    from prefect import flow, task

    from prefect_resoluto import ResolutoTaskRunner

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "ws_reader.py").write_text(
        "from prefect import task\n\n\n@task\ndef read(name: str, i: int = 0) -> str:\n"
        "    with open(name) as f:\n        return f.read()\n"
    )
    (ws / "data.txt").write_text("v1\n")
    aged(ws)
    monkeypatch.syspath_prepend(str(ws))
    sys.modules.pop("ws_reader", None)
    import ws_reader  # noqa: E402  (from the workspace, as the sandbox imports it)

    packers: list[WorkspacePacker] = []
    real_init = WorkspacePacker.__init__

    def recording_init(self: WorkspacePacker) -> None:
        real_init(self)
        packers.append(self)

    monkeypatch.setattr(WorkspacePacker, "__init__", recording_init)
    real = time.time_ns
    monkeypatch.setattr("prefect_resoluto.task_runner.workspace.time.time_ns", lambda: real() + 2 * RACY_NS)

    @task
    def edit() -> None:
        (ws / "data.txt").write_text("v2 edited\n")

    runner = ResolutoTaskRunner(
        runtime="process",
        min_isolation="none",
        warm_pool=0,
        workspace=ws,
        conduit=(tmp_path / "conduit").as_uri(),
        outputs_dir=tmp_path / "out",
    )

    @flow(task_runner=runner)
    def read_edit_read() -> tuple[list[str], str]:
        first = [f.result() for f in ws_reader.read.map(["data.txt"] * 3, [1, 2, 3])]
        edit.fn()  # on the host, between submissions
        return first, ws_reader.read.submit("data.txt").result()

    first, later = read_edit_read()
    assert first == ["v1\n"] * 3 and later == "v2 edited\n"
    (packer,) = packers
    assert packer.packs == 2  # once for the three mapped nodes, once after the edit
