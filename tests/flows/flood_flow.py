"""Issue 39, finding 3: tasks flood their logs (flood_tasks.flood). Run as its
own process, so that its memory is measured alone: prints one JSON line (the flow run, its
result, the peak growth of this process's resident memory while it ran).

argv: lines per node, characters per line, nodes in flight[, short lines after them];
RESOLUTO_TEST_LOG_ALLOWANCE
sets log_allowance (else the default).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from flood_tasks import flood  # the workspace module, next to this file
from prefect import flow

from prefect_resoluto import ResolutoTaskRunner


def _runner() -> ResolutoTaskRunner:
    allowance = os.environ.get("RESOLUTO_TEST_LOG_ALLOWANCE")
    return ResolutoTaskRunner(
        runtime=os.environ.get("RESOLUTO_TEST_RUNTIME", "gvisor"),
        conduit=os.environ["RESOLUTO_TEST_CONDUIT"],
        workspace=Path(__file__).parent,
        warm_pool=0,
        memory="256Mi",
        **({"log_allowance": allowance} if allowance else {}),
    )


@flow(task_runner=_runner(), persist_result=False)
def flooding(lines: int, chars: int, nodes: int, burst: int = 0) -> list[int]:
    return [f.result() for f in flood.map([lines] * nodes, [chars] * nodes, [burst] * nodes)]


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise LookupError(field)


if __name__ == "__main__":
    lines, chars, nodes, burst = (int(a) for a in [*sys.argv[1:4], *sys.argv[4:5], "0"][:4])
    flooding(1, 10, nodes)  # imports, clients, threads: paid before the measure
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from now
    state = flooding(lines, chars, nodes, burst, return_state=True)
    growth = _status("VmHWM") - before
    print(
        json.dumps(
            {"flow_run_id": str(state.state_details.flow_run_id), "result": state.result(), "growth": growth}
        )
    )
