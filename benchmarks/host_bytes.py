"""What a task flooding its logs makes the flow process hold (issue 39, finding 3).

Runs tests/flows/flood_flow.py as its own process against a Prefect server of its own (the
server's memory is not the flow's): each node logs LINES lines of CHARS characters with
one emoji (4 bytes a character as the host holds them) from a 256 Mi gVisor sandbox, and
the child reports the peak growth of its resident memory while the flood ran.

``python benchmarks/host_bytes.py NODES LINES [CHARS [BURST]]`` (BURST: short lines after them). The tree before issue 39: the same, with its
``prefect_resoluto/`` checked out (``git checkout 8ee5093 -- prefect_resoluto``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    nodes, lines = int(sys.argv[1]), int(sys.argv[2])
    chars = int(sys.argv[3]) if len(sys.argv) > 3 else 900_000
    burst = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with (
        prefect_test_harness(server_startup_timeout=300),
        tempfile.TemporaryDirectory(prefix="resoluto-host-bytes-") as tmp,
    ):
        flows = ROOT / "tests" / "flows"
        env = dict(
            os.environ,
            PREFECT_API_URL=str(PREFECT_API_URL.value()),
            RESOLUTO_TEST_CONDUIT=(Path(tmp) / "conduit").as_uri(),
            RESOLUTO_STATE_DIR=str(Path(tmp) / "state"),
            PYTHONPATH=str(flows),
        )
        out = subprocess.run(
            [sys.executable, str(flows / "flood_flow.py"), str(lines), str(chars), str(nodes), str(burst)],
            env=env,
            capture_output=True,
            text=True,
        )
        if out.returncode:
            sys.exit(out.stderr[-4000:])
        got = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{nodes} node(s) x {lines} lines x {chars} chars: flow process grew "
            f"{got['growth'] / 2**20:.0f} MiB (result {got['result'][:3]}...)"
        )


if __name__ == "__main__":
    main()
