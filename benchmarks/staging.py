"""Figure 6, staging: a 100 MB workspace of mixed files, pack + put on the host and
stage (list + get + safe unpack) in the guest, next to ``tar czf`` of the same tree.

The tree (seeded, so every run is alike): many small source-like text files, medium
random binaries, and a few large files, half incompressible and half compressible.
Host pack and put are timed around the same calls ``drive_node`` makes; the guest's
staging time is what the guest itself reports: from its ``node`` open event to its
``staged ... input archive(s)`` line, in a real guest on the process runtime.
MB/s is the tree's size over pack + put + stage.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import TRIVIAL, Target, log, median, r3, scratch, timed

from guest_runner import archive, wire
from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes import get_runtime

_WORDS = (
    "def class return import from self value result data node chunk event the a of to in "
    "for if else while with as try except raise None True False print len range list dict "
    "str int float async await lambda yield pass break continue"
).split()


def make_tree(root: Path, total_mb: float, seed: int = 6) -> int:
    """Write a mixed tree of about ``total_mb`` MB under ``root``; returns its size in bytes."""
    rnd = random.Random(seed)
    budget = int(total_mb * 1_000_000)
    shares = {"text": 0.3, "binary": 0.3, "large": 0.4}
    size = 0
    # Small source-like text files, in nested packages.
    target = size + int(budget * shares["text"])
    i = 0
    while size < target:
        d = root / "src" / f"pkg{i % 17}" / f"mod{i % 5}"
        d.mkdir(parents=True, exist_ok=True)
        n = rnd.randint(2_000, 40_000)
        words = rnd.choices(_WORDS, k=n // 5)
        text = "\n".join(" ".join(words[j : j + 12]) for j in range(0, len(words), 12))[:n]
        (d / f"file{i}.py").write_text(text)
        size += len(text)
        i += 1
    # Medium random binaries (model weights, images: incompressible).
    target = size + int(budget * shares["binary"])
    i = 0
    while size < target:
        d = root / "assets" / f"set{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        blob = rnd.randbytes(rnd.randint(100_000, 1_000_000))
        (d / f"blob{i}.bin").write_bytes(blob)
        size += len(blob)
        i += 1
    # A few large files: half random, half compressible (logs, CSV).
    large = int(budget * shares["large"]) // 4
    (root / "data").mkdir(exist_ok=True)
    for j in range(4):
        if j % 2 == 0:
            blob = rnd.randbytes(large)
        else:
            rows = [",".join(str(rnd.randint(0, 10**6)) for _ in range(20)) + "\n" for _ in range(500)]
            reps = large // sum(map(len, rows)) + 1
            blob = "".join(rows[k % 500] for k in range(reps * 500))[:large].encode()
        (root / "data" / f"large{j}.dat").write_bytes(blob)
        size += len(blob)
    return size


def run(quick: bool) -> dict[str, Any]:
    mb = 30.0 if quick else 100.0
    reps = 1 if quick else 3
    with scratch("staging") as work:
        tree = work / "tree"
        tree.mkdir()
        log(f"staging: building a {mb:g} MB mixed tree")
        size = make_tree(tree, mb)
        files = sum(1 for p in tree.rglob("*") if p.is_file())
        tar_t = []
        for _ in range(reps):
            t, res = timed(
                lambda: subprocess.run(
                    ["tar", "czf", str(work / "tree.tgz"), "-C", str(tree), "."], capture_output=True
                )
            )
            if res.returncode != 0:
                raise RuntimeError(f"tar czf failed: {res.stderr.decode(errors='replace')}")
            tar_t.append(t)
        tar_bytes = (work / "tree.tgz").stat().st_size
        conduit = LocalConduit(work / "conduit")
        rt = get_runtime("process")
        pack_t, put_t, stage_t = [], [], []
        for rep in range(reps):
            log(f"staging: pack + put + stage, run {rep + 1}/{reps}")
            t_pack, data = timed(lambda: archive.pack(tree))
            prefix = wire.node_prefix("bench-staging", f"stage-{rep}")
            t_put, _ = timed(
                lambda data=data, prefix=prefix: conduit.put(
                    wire.inbox_key(prefix, wire.WORKSPACE_ARCHIVE_NAME), data
                )
            )
            marks: dict[str, float] = {}

            def on_event(ev: dict[str, Any], marks: dict[str, float] = marks) -> None:
                if ev.get("kind") == "node" and ev.get("event") == "open":
                    marks["open"] = ev["ts"]
                line = str((ev.get("data") or {}).get("line", ""))
                if line.startswith("staged "):
                    marks["staged"] = ev["ts"]

            out = drive_node(
                NodeSpec(run_id="bench-staging", node_id=f"stage-{rep}", argv=list(TRIVIAL)),
                conduit,
                rt,
                on_event=on_event,
                min_isolation="none",
            )
            if not out.ok or "staged" not in marks:
                raise RuntimeError(f"staging node failed: {out.describe()}")
            pack_t.append(t_pack)
            put_t.append(t_put)
            stage_t.append(marks["staged"] - marks["open"])
            archive_bytes = len(data)
            del data
    mbytes = size / 1e6
    ours = median(pack_t) + median(put_t) + median(stage_t)
    tar = median(tar_t)
    return {
        "mb": round(mbytes, 1),
        "files": files,
        "reps": reps,
        "pack_s": r3(median(pack_t)),
        "put_s": r3(median(put_t)),
        "stage_s": r3(median(stage_t)),
        "ours_s": r3(ours),
        "ours_mb_s": round(mbytes / ours, 1),
        "archive_mb": round(archive_bytes / 1e6, 1),
        "tar_s": r3(tar),
        "tar_mb_s": round(mbytes / tar, 1),
        "tar_archive_mb": round(tar_bytes / 1e6, 1),
        "ratio_vs_tar": r3(tar / ours),
    }


def targets(res: dict[str, Any]) -> list[Target]:
    return [
        Target(
            "staging",
            "pack+put+stage rate vs tar czf",
            ">= 0.8 x tar",
            f"{res['ratio_vs_tar']} x ({res['ours_mb_s']} vs {res['tar_mb_s']} MB/s)",
            res["ratio_vs_tar"] >= 0.8,
        )
    ]


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (
            "staging",
            f"{res['mb']} MB/{res['files']} files: pack {res['pack_s']} s + put {res['put_s']} s + "
            f"stage {res['stage_s']} s = {res['ours_mb_s']} MB/s (archive {res['archive_mb']} MB); "
            f"tar czf {res['tar_s']} s = {res['tar_mb_s']} MB/s ({res['tar_archive_mb']} MB); "
            f"x{res['ratio_vs_tar']}",
        )
    ]


if __name__ == "__main__":
    print(run("--quick" in sys.argv))
