"""Tasks for the drop-in fidelity tests (tests/test_drop_in.py).

Imported by file in the sandbox with the guest's stand-ins: at module level it touches
nothing of prefect but ``task`` (the stand-in path); what a task reads of the real
package, it imports inside its body.
"""

from __future__ import annotations

import os
import sys

from prefect import task


class QuotaExceeded(Exception):
    """A task module's own exception type, with a constructor of its own."""

    def __init__(self, used: int, limit: int) -> None:
        super().__init__(f"used {used} of {limit}")
        self.used, self.limit = used, limit


@task
def leak_secret() -> None:
    print("about to fail")
    raise RuntimeError("boom " + os.environ["API_TOKEN"])


@task
def raise_value_error(message: str) -> None:
    raise ValueError(message)


@task
def raise_quota(used: int) -> None:
    raise QuotaExceeded(used, 10)


@task
def raise_chained() -> None:
    try:
        {}["missing"]
    except KeyError as e:
        raise LookupError("lookup failed") from e


@task
def raise_group() -> None:
    raise ExceptionGroup("several", [ValueError("one"), TypeError("two")])


@task(retries=2, retry_delay_seconds=0)
def interrupt() -> None:
    raise KeyboardInterrupt("stop")


@task(retries=2, retry_delay_seconds=0)
def exit_with(code: int) -> None:
    sys.exit(code)


@task
def context_probe() -> dict:
    """What a task can read of its run (the real package loads here, lazily)."""
    from prefect.context import TagsContext
    from prefect.runtime import deployment, flow_run, task_run

    return {
        "tags": sorted(TagsContext.get().current_tags),
        "task_run": {
            k: getattr(task_run, k) for k in ("id", "name", "task_name", "run_count", "parameters", "tags")
        },
        "flow_run": {k: getattr(flow_run, k) for k in ("id", "name", "flow_name", "tags", "parameters")},
        "deployment": {k: getattr(deployment, k) for k in ("id", "name")},
        "real_prefect_loaded": type(sys.modules["prefect"]).__name__ == "module",
    }


@task
def double(x: int) -> int:
    return 2 * x


@task
def nested_calls(x: int) -> dict:
    """Calls another task three ways; each runs inline in this sandbox."""
    direct = double(x)
    submitted = double.submit(x + 1).result()
    mapped = [f.result() for f in double.map([x, x + 1, x + 2])]
    return {"direct": direct, "submitted": submitted, "mapped": mapped}


@task
def hog_memory(gib: float) -> int:
    """Touches ``gib`` GiB, a page at a time: past the sandbox's memory limit it is killed."""
    chunks = []
    step = 64 * 1024 * 1024
    for _ in range(int(gib * 1024**3 // step)):
        chunks.append(bytearray(step))  # zero-filled: every page touched
        print(f"holding {len(chunks) * 64} MiB", flush=True)
    return len(chunks)


@task
def read_limits() -> dict:
    """What the sandbox's kernel says about its memory and scratch sizes."""
    import shutil

    with open("/proc/meminfo") as f:
        meminfo = dict(line.split(":", 1) for line in f)
    return {
        "mem_total_kib": int(meminfo["MemTotal"].split()[0]),
        "tmp_bytes": shutil.disk_usage("/tmp").total,
        "workspace_bytes": shutil.disk_usage(".").total,
        "cpus": os.cpu_count(),
    }


@task
def echo_value(value):  # no annotation: the value's own type crosses, both ways
    return {"type": type(value).__name__, "value": value, "again": [value, (value,)]}


@task
def where_am_i(probe: str) -> dict:
    """The process a call ran in, and whether it can read ``probe`` (a host file)."""
    try:
        with open(probe, encoding="utf-8") as f:
            seen = f.read()
    except OSError:
        seen = None
    return {"pid": os.getpid(), "read": seen}


@task(retries=1, retry_delay_seconds=0)
def always_fails(message: str) -> None:
    raise ValueError(message)


@task
async def async_double(x: int) -> int:
    return 2 * x


@task
def write_note(name: str) -> str:
    os.makedirs("out", exist_ok=True)
    path = f"out/{name}.txt"
    with open(path, "w", encoding="utf-8") as f:
        f.write(name)
    return path


@task
def inspect_upstream(error):  # given a failed upstream through allow_failure
    return {
        "type": type(error).__name__,
        "is_own_class": isinstance(error, QuotaExceeded),
        "is_exception": isinstance(error, Exception),
        "message": str(error),
    }


@task
def end_in_state(kind: str):
    """Returns the state its run ends in, as Prefect lets a task do."""
    from prefect.states import Cancelled, Completed, Failed

    if kind == "failed":
        return Failed(message="told to fail")
    if kind == "skipped":
        return Completed(name="Skipped", message="nothing to do", data={"rows": (1, 2)})
    if kind == "cancelled":
        return Cancelled(message="not today")
    return Failed(message="with its exception", data=QuotaExceeded(3, 2))


@task
def return_exceptions() -> list:
    return [ValueError("a value, not raised"), QuotaExceeded(1, 2)]
