"""The table artifact each node leaves on its task run: what ran where, and how it ended.

Published from the runner's background thread (``background.py``), off the task's
critical path.
"""

from __future__ import annotations

import logging
import re

from prefect_resoluto.node import NodeOutcome

log = logging.getLogger("prefect_resoluto")


def artifact_key(task_name: str, node_id: str) -> str:
    """A valid Prefect artifact key (lowercase letters, digits, dashes) naming the node:
    ``resoluto-<task>-<last 8 of the task run id>[-<attempt>]``. The tail of the id, since
    task run ids are UUIDv7, whose leading digits are a timestamp shared by neighbours."""
    slug = re.sub(r"[^a-z0-9]+", "-", task_name.lower()).strip("-")[:40].strip("-") or "task"
    run_id, _, attempt = node_id.partition(".")
    short = re.sub(r"[^a-z0-9]", "", run_id.lower())[-8:] or "node"
    return f"resoluto-{slug}-{short}" + (f"-{attempt}" if attempt else "")


def publish_node_artifact(o: NodeOutcome, task_name: str, attempt: int = 1, sandbox: str = "") -> None:
    """``sandbox``: how the node got its sandbox (warm or cold, and why), the runner's words."""
    try:
        from prefect.artifacts import create_table_artifact

        status = o.status + (f" ({o.failure})" if o.failure else "")
        rows = [
            {"field": "task", "value": task_name},
            {"field": "attempt", "value": str(attempt)},
            {"field": "status", "value": status},
            {"field": "node id", "value": o.node_id},
            {"field": "runtime", "value": o.runtime},
            {"field": "isolation", "value": o.isolation},
            *([{"field": "sandbox", "value": sandbox}] if sandbox else []),
            {"field": "exit code", "value": str(o.exit_code)},
            {"field": "duration (s)", "value": f"{o.timings.get('finish', 0.0):.2f}"},
            {"field": "conduit", "value": o.conduit_url},
            {"field": "node prefix", "value": o.conduit_prefix},
        ]
        if not o.ok:
            rows.append({"field": "reason", "value": o.reason})  # redacted by the node driver
        for rel, path in sorted(o.output_files.items()):
            if rel.startswith(".resoluto/"):
                continue
            rows.append({"field": f"output {rel}", "value": f"{path} (from {', '.join(o.output_archives)})"})
        # The Artifacts page cuts descriptions after ~30 characters: what tells nodes apart first.
        description = f"{task_name} attempt {attempt}: {status} — sandbox node {o.node_id} on {o.runtime}"
        create_table_artifact(
            table=rows, key=artifact_key(task_name, o.node_id), description=description, _sync=True
        )  # type: ignore[call-arg]
    except Exception as e:  # an artifact is a convenience; never fail the task over it
        log.debug("could not publish the node artifact: %s", e)
