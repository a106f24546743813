"""prefect-resoluto demo: every task run of this flow runs in its own sandbox.

    bash scripts/setup.sh && .venv/bin/python examples/demo_flow.py

Uses the embedded defaults: the strongest isolation available on this machine
(gVisor here), a local conduit under ~/.cache/prefect-resoluto, and Prefect's
ephemeral API. Nothing in the tasks knows it is sandboxed.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

# Prefect's ephemeral server would otherwise try to send usage telemetry off this machine.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# The first run on a fresh machine creates and migrates Prefect's database before its
# ephemeral server answers; on a busy 2-core machine that outlasts Prefect's 20 s default
# (seen: a cold demo at load 25 failed "Timed out while attempting to connect to ephemeral
# Prefect API server"). A bound on a start that does finish, not a wait for anything.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

from prefect import flow, get_run_logger, task  # noqa: E402

from prefect_resoluto import ResolutoTaskRunner, output_files, run_command, sandbox_options  # noqa: E402

TEXTS = {
    "hamlet": "To be, or not to be, that is the question",
    "tempest": "We are such stuff as dreams are made on, and our little life is rounded with a sleep",
    "lear": "Nothing will come of nothing",
}


@task
def word_stats(name: str, text: str) -> dict:
    """Fan-out: one sandbox per text."""
    words = [w.strip(",.").lower() for w in text.split()]
    get_run_logger().info("%s: %d words, running on %s", name, len(words), platform.release())
    return {"name": name, "words": len(words), "longest": max(words, key=len)}


@task
def write_report(stats: list[dict]) -> str:
    """Writes files in the sandbox; the declared ones come back through the outbox."""
    out = Path("reports")
    out.mkdir(exist_ok=True)
    lines = ["| text | words | longest word |", "|---|---|---|"]
    lines += [f"| {s['name']} | {s['words']} | {s['longest']} |" for s in stats]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("report written")
    return "reports/summary.md"


@task(retries=2, retry_delay_seconds=1)
def flaky_fetch() -> str:
    """Fails on its first attempt; Prefect retries it in a fresh sandbox."""
    node = os.environ.get("RESOLUTO_NODE_ID", "")
    if "." not in node:  # the first attempt's node id has no ".<attempt>" suffix
        raise ConnectionError("simulated flaky upstream (this attempt fails on purpose)")
    return f"fetched on attempt node {node}"


@flow(name="resoluto-demo", task_runner=ResolutoTaskRunner())
def demo() -> dict:
    stats = word_stats.map(list(TEXTS), list(TEXTS.values()))
    with sandbox_options(output_paths=["reports/**"]):  # only this task's files come back
        report = write_report.submit(stats)
    kernel = run_command.submit(
        ["sh", "-c", "uname -a; echo network interfaces: $(tail -n +3 /proc/net/dev | cut -d: -f1)"]
    )
    fetched = flaky_fetch.submit()
    written = report.result()  # "reports/summary.md": the task's own value
    return {
        "report": str(output_files(report)[written]),  # that declared file, on this host
        "sandbox kernel": kernel.result().output,
        "flaky": fetched.result(),
    }


if __name__ == "__main__":
    from prefect_resoluto.settings.config import cache_dir

    result = demo()
    print("\n=== prefect-resoluto demo finished ===")
    for k, v in result.items():
        print(f"{k}: {v}")
    print(f"report contents:\n{Path(result['report']).read_text()}")
    print(f"conduit (every node's inbox, events, result, outbox): {cache_dir() / 'conduit' / 'run'}")
    print(f"outputs per node: {cache_dir() / 'outputs'}")
    print(
        "replay a node's events: .venv/bin/prefect-resoluto events --conduit "
        f"{(cache_dir() / 'conduit').as_uri()} <flow_run_id> <task_run_id>"
    )
