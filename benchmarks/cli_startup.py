"""Start time of the CLI, this tree against a git ref, side by side in one run.

``python benchmarks/cli_startup.py [--ref main] [--runs 10]``: exports ``--ref``'s
``prefect_resoluto`` and ``guest_runner`` to a scratch directory, then runs
``prefect-resoluto --help``, ``doctor`` and ``doctor --json`` from each tree, interleaved
(this tree, the ref, this tree, ...) so machine noise hits both alike. Prints the median
wall time and the median CPU time (user + system of the child, steadier than wall time
on a loaded machine) per command and tree, and the ratio this tree / the ref.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {"--help": ["--help"], "doctor": ["doctor"], "doctor --json": ["doctor", "--json"]}
STUB = "import sys; from prefect_resoluto.cli import main; sys.exit(main())"  # what the console script runs


def export(ref: str, into: Path) -> None:
    tar = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "prefect_resoluto", "guest_runner", "schemas"],
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(tar)) as t:
        t.extractall(into, filter="tar")


def once(tree: Path, args: list[str], cwd: Path) -> tuple[float, float]:
    """(wall, cpu) seconds of one CLI invocation from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.perf_counter()
    p = subprocess.Popen(
        [sys.executable, "-c", STUB, *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode not in (0, 1):  # doctor exits 1 when nothing qualifies at the default floor
        raise RuntimeError(f"{args} from {tree} exited {p.returncode}")
    return wall, usage.ru_utime + usage.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", default="main", help="git ref to compare with (default: main)")
    ap.add_argument("--runs", type=int, default=10, help="runs per command and tree (default 10)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="resoluto-cli-bench-") as tmp:
        ref_tree = Path(tmp, "ref")
        export(args.ref, ref_tree)
        trees = {"this tree": ROOT, args.ref: ref_tree}
        times: dict[tuple[str, str], list[tuple[float, float]]] = {
            (t, c): [] for t in trees for c in COMMANDS
        }
        for i in range(args.runs):
            print(f"run {i + 1}/{args.runs}", file=sys.stderr, flush=True)
            for cmd, argv in COMMANDS.items():
                for name, tree in trees.items():
                    times[(name, cmd)].append(once(tree, argv, Path(tmp)))
    print(
        f"CLI start, median of {args.runs} interleaved runs (load average at the end: "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())})"
    )
    print(f"{'command':<15}{'tree':<12}{'wall ms':>10}{'cpu ms':>10}")
    for cmd in COMMANDS:
        med = {}
        for name in trees:
            wall = statistics.median(w for w, _ in times[(name, cmd)]) * 1000
            cpu = statistics.median(c for _, c in times[(name, cmd)]) * 1000
            med[name] = (wall, cpu)
            print(f"{cmd:<15}{name:<12}{wall:>10.1f}{cpu:>10.1f}")
        (w1, c1), (w0, c0) = med["this tree"], med[args.ref]
        print(f"{cmd:<15}{'ratio':<12}{w1 / w0:>10.3f}{c1 / c0:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
