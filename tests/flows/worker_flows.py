"""Flows deployed on a `resoluto` work pool by tests/test_worker.py (run by a real worker).

Each one reports what it sees from inside its sandbox as one JSON log line, so the test
reads the evidence back from the Prefect API, where the flow run itself sent it.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import time

from prefect import flow, get_run_logger


def _memory_limit() -> int | None:
    """The memory limit of this process's cgroup (v1 or v2), if it has one."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            f = f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"
        elif controllers == "":
            f = f"/sys/fs/cgroup{path}/memory.max"
        else:
            continue
        try:
            raw = open(f).read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 1 << 60:
            return int(raw)
    return None


def _meminfo_total() -> int | None:
    """MemTotal in bytes: gVisor reports its sandbox's memory limit here."""
    try:
        first = open("/proc/meminfo").readline().split()
        return int(first[1]) * 1024
    except (OSError, IndexError, ValueError):
        return None


def _facts(marker: str) -> dict:
    data_limit = resource.getrlimit(resource.RLIMIT_DATA)[0]
    return {
        "marker": marker,
        "run_id": os.environ.get("RESOLUTO_RUN_ID"),
        "node_id": os.environ.get("RESOLUTO_NODE_ID"),
        "pid": os.getpid(),
        "interfaces": sorted(name for _, name in socket.if_nameindex()),
        "memory_limit": _memory_limit(),
        "meminfo_total": _meminfo_total(),
        "rlimit_data": None if data_limit == resource.RLIM_INFINITY else data_limit,
        "api_url": os.environ.get("PREFECT_API_URL"),
        "secret_seen": os.environ.get("WORKER_TEST_SECRET") == "never-shown-7731",
        "block_secret_seen": os.environ.get("WORKER_TEST_BLOCK_SECRET") == "from-a-block-5519",
    }


@flow
def where_am_i(marker: str = "hello") -> dict:
    facts = _facts(marker)
    print(f"plain stdout from the flow: {marker}", flush=True)
    # A flow printing its secrets: the sandbox's events carry them redacted.
    print(
        f"secrets: {os.environ.get('WORKER_TEST_SECRET')} {os.environ.get('WORKER_TEST_BLOCK_SECRET')}",
        flush=True,
    )
    get_run_logger().info("FACTS %s", json.dumps(facts))
    return facts


@flow
def linger(seconds: float = 600.0) -> None:
    get_run_logger().info("FACTS %s", json.dumps(_facts("lingering")))
    time.sleep(seconds)


@flow
def dial(host: str, port: int) -> str:
    """Connect to host:port from inside the sandbox; fail (with the refusal logged) if refused."""
    log = get_run_logger()
    try:
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(b"ping\n")
            reply = s.recv(64).decode(errors="replace").strip()
    except OSError as e:
        log.error("DIAL REFUSED %s:%s: %s", host, port, e)
        raise
    log.info("DIAL REACHED %s:%s: %s", host, port, reply)
    return reply


@flow
def dies_before_the_api() -> None:  # never runs: its deployment's command replaces the engine
    pass


@flow
def hog(mb: int = 600) -> int:
    """Allocate past the sandbox's memory limit."""
    get_run_logger().info("FACTS %s", json.dumps(_facts("hogging")))
    blocks = [bytearray(1024 * 1024) for _ in range(mb)]
    for b in blocks:
        b[::4096] = b"x" * len(b[::4096])  # touch every page
    return len(blocks)


def _wait_for_release(flow, flow_run, state) -> None:
    """An on-completion hook: runs after the run's final state is in the API, as slow as the
    test wants (it waits for the test's release file)."""
    release = flow_run.parameters["release"]
    get_run_logger().info("HOOK after the final state, waiting for %s", release)
    deadline = time.monotonic() + 120
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.05)
    get_run_logger().info("HOOK released")


@flow(on_completion=[_wait_for_release])
def finishes_slowly(release: str) -> None:
    get_run_logger().info("FACTS %s", json.dumps(_facts("finishing slowly")))
