"""Drives the reference implementation (resoluto-sandbox 0.1.0) without its network canary.

Run with the reference's interpreter (``.venv-ref/bin/python``, Python >= 3.12); it
imports nothing of prefect-resoluto. Used by tests/test_wire_compat.py and by the
``reference`` benchmark.

The reference's ``runner_main`` always runs an egress canary that opens TCP
connections to 169.254.169.254 and 1.1.1.1; that traffic is forbidden here, so
``runner_main`` is never run. The guest below calls ``run_node_in_sandbox`` with a stub
canary that keeps only the canary's store probe (a PUT of ``_canary_ok`` into the node's
own prefix) and reports a pass.

Modes::

    guest                       the reference guest, configured by RESOLUTO_* like runner_main
                                (local store only: RESOLUTO_STORE_KIND=localfs)
    read ROOT PREFIX [DEST GLOBS_JSON]
                                the reference host side reads a finished node: every event
                                through ChunkReader, result.json through NodeResult, and (with
                                DEST) the outbox through fetch_outputs scoped to GLOBS; prints JSON
    reencode                    stdin {"events": [line...], "result": text}: each parsed by the
                                reference models and serialised again; prints the JSON
    bench ROOT N WORKLOAD_JSON  N trivial nodes through the reference drive_node, its
                                LocalConduit and a minimal subprocess runtime; prints JSON
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

from resoluto.sandbox.conduit.local import LocalConduit
from resoluto.sandbox.contracts import (
    NodeResult,
    SandboxHandle,
    SandboxLaunchSpec,
    SandboxRuntime,
    SandboxStatus,
    SpanEvent,
)
from resoluto.sandbox.driver import drive_node
from resoluto.sandbox.egress_canary import CanaryVerdict, ProbeResult, probe_store
from resoluto.sandbox.runner import run_node_in_sandbox
from resoluto.sandbox.staging import fetch_outputs
from resoluto.sandbox.telemetry import ChunkReader, result_key


async def store_only_canary(store, prefix: str) -> CanaryVerdict:  # type: ignore[no-untyped-def]
    """The reference canary minus its TCP probes: no packet leaves the machine."""
    ok = await probe_store(store, prefix)
    probe = ProbeResult(target="store", expected_reachable=True, actual_reachable=ok, passed=ok)
    return CanaryVerdict(passed=ok, results=[probe], reason="" if ok else "store probe failed")


def guest() -> int:
    env = os.environ
    if env.get("RESOLUTO_STORE_KIND") != "localfs":
        print("reference_node guest: only RESOLUTO_STORE_KIND=localfs is supported here", file=sys.stderr)
        return 2
    outputs = env.get("RESOLUTO_OUTPUT_PATHS")
    result = asyncio.run(
        run_node_in_sandbox(
            store=LocalConduit(env["RESOLUTO_STORE_ROOT"]),
            prefix=env["RESOLUTO_STORE_PREFIX"],
            run_id=env["RESOLUTO_RUN_ID"],
            node_id=env["RESOLUTO_NODE_ID"],
            workload_argv=json.loads(env["RESOLUTO_WORKLOAD_ARGV"]),
            workspace_dir=env.get("RESOLUTO_WORKSPACE_DIR"),
            output_paths=json.loads(outputs) if outputs else None,
            run_canary=store_only_canary,
        )
    )
    return 0 if result.status == "success" else 1


async def read(
    root: str, prefix: str, dest: str | None = None, globs: list[str] | None = None
) -> dict[str, object]:
    store = LocalConduit(root)
    reader = ChunkReader(store, prefix)
    events = []
    for _ in range(1000):  # the node is finished: a poll or two reads everything
        events += [ev.model_dump(mode="json") for ev in await reader.poll()]
        if reader.finished:
            break
    result = NodeResult.model_validate_json(await store.get(result_key(prefix)))
    out: dict[str, object] = {
        "finished": reader.finished,
        "events": events,
        "result": result.model_dump(mode="json"),
    }
    if dest is not None:
        out["fetched"] = await fetch_outputs(store, prefix, dest, globs)
    return out


def reencode(doc: dict[str, object]) -> dict[str, object]:
    events = [SpanEvent.model_validate_json(line).model_dump_json() for line in doc["events"]]  # type: ignore[union-attr]
    return {"events": events, "result": NodeResult.model_validate_json(str(doc["result"])).model_dump_json()}


class SubprocessRuntime(SandboxRuntime):
    """The smallest SandboxRuntime the reference driver accepts: the reference guest as a child."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    async def launch(self, spec: SandboxLaunchSpec) -> SandboxHandle:
        sid = spec.labels["resoluto.node_id"]
        self.procs[sid] = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "guest"], env=spec.env, stdin=subprocess.DEVNULL
        )
        return SandboxHandle(id=sid, labels=spec.labels)

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        code = self.procs[handle.id].poll()
        if code is None:
            return SandboxStatus(phase="running")
        return SandboxStatus(phase="succeeded" if code == 0 else "failed", exit_code=code)

    async def destroy(self, handle: SandboxHandle) -> None:
        proc = self.procs.pop(handle.id, None)
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()

    async def sweep(self, labels: dict[str, str]) -> int:
        return 0


async def bench(root: str, n: int, workload: list[str]) -> dict[str, object]:
    store = LocalConduit(root)
    runtime = SubprocessRuntime()
    times = []
    for i in range(n + 1):  # the first node is a warm-up
        node_id = f"ref-{i}"
        prefix = f"run/bench-reference/nodes/{node_id}"
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/tmp"),
            "RESOLUTO_STORE_KIND": "localfs",
            "RESOLUTO_STORE_ROOT": root,
            "RESOLUTO_STORE_PREFIX": prefix,
            "RESOLUTO_RUN_ID": "bench-reference",
            "RESOLUTO_NODE_ID": node_id,
            "RESOLUTO_WORKLOAD_ARGV": json.dumps(workload),
        }
        spec = SandboxLaunchSpec(
            image="local", env=env, store_prefix=prefix, labels={"resoluto.node_id": node_id}
        )
        t0 = time.perf_counter()
        result = await drive_node(runtime, store, spec)
        took = time.perf_counter() - t0
        if result.status != "success":
            raise RuntimeError(f"reference node {node_id} failed: {result.reason}")
        if i:
            times.append(took)
    return {"times_s": times}


def main(argv: list[str]) -> int:
    mode = argv[1] if len(argv) > 1 else ""
    if mode == "guest":
        return guest()
    if mode == "read":
        dest, globs = (argv[4], json.loads(argv[5])) if len(argv) > 5 else (None, None)
        print(json.dumps(asyncio.run(read(argv[2], argv[3], dest, globs)), ensure_ascii=False))
        return 0
    if mode == "reencode":
        print(json.dumps(reencode(json.load(sys.stdin)), ensure_ascii=False))
        return 0
    if mode == "bench":
        print(json.dumps(asyncio.run(bench(argv[2], int(argv[3]), json.loads(argv[4])))))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
