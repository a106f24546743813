"""Plot a benchmark run: ``python benchmarks/plot.py RUN_OUTPUT [PNG]``.

RUN_OUTPUT is what ``benchmarks/run.py --json`` printed (its last line is the JSON).
Draws the latency distribution (tail callback and Prefect log API) and the per-runtime
overhead (driver vs bare launch) into one PNG, by default docs/performance.png.
Needs matplotlib: ``pip install -e '.[bench]'`` (not needed by the test suite).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(path: str) -> dict:
    text = Path(path).read_text().strip().splitlines()
    return json.loads(text[-1])


def plot(run: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    lat = run["figures"].get("latency", {})
    for key, label, color in (
        ("tail", "tail callback", "tab:blue"),
        ("prefect_api", "Prefect log API", "tab:orange"),
    ):
        xs = sorted((lat.get(key) or {}).get("latencies_ms") or [])
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            p50, p99 = lat[key]["p50_ms"], lat[key]["p99_ms"]
            ax1.plot(xs, ys, label=f"{label}: p50 {p50:g} ms, p99 {p99:g} ms", color=color)
    ax1.axvline(100, ls=":", color="grey")
    ax1.axvline(500, ls="--", color="grey")
    ax1.text(100, 0.5, " p50 target", color="grey", fontsize=8)
    ax1.text(500, 0.5, " p99 target", color="grey", fontsize=8)
    ax1.set_xscale("log")
    ax1.set_xlabel("arrival - print (ms, log scale)")
    ax1.set_ylabel("fraction of lines")
    ax1.set_title(f"Log latency, a line every 10 ms for {lat.get('seconds', '?')} s")
    ax1.legend(loc="upper left", fontsize=8)

    ovh = run["figures"].get("overhead", {})
    names = [n for n, r in ovh.items() if r.get("available")]
    bare = [ovh[n]["bare_median_ms"] for n in names]
    drv = [ovh[n]["driver_median_ms"] for n in names]
    x = range(len(names))
    ax2.bar([i - 0.2 for i in x], bare, width=0.4, label="bare runtime", color="tab:grey")
    ax2.bar([i + 0.2 for i in x], drv, width=0.4, label="through the node driver", color="tab:green")
    for i, n in enumerate(names):
        ax2.text(
            i + 0.2,
            drv[i],
            f"x{ovh[n]['ratio']:g}\n+{ovh[n]['added_ms']:g} ms",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax2.set_xticks(list(x), names)
    ax2.set_ylabel("median wall time per trivial node (ms)")
    ax2.set_title("Per-node overhead (python -c pass)")
    ax2.legend(fontsize=8)
    ax2.set_ylim(0, max(drv + bare + [1]) * 1.25)
    fig.suptitle(
        f"prefect-resoluto benchmarks, {run['mode']} run, {run['machine'].get('when', '')}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    target = (
        Path(sys.argv[2])
        if len(sys.argv) > 2
        else Path(__file__).resolve().parents[1] / "docs" / "performance.png"
    )
    plot(load(sys.argv[1]), target)
    print(target)
