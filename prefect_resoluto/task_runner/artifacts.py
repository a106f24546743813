"""The runner's own artifacts, kept few so a user's own stand out: one keyed table per flow
run, a row per sandbox node, written once when the runner leaves the flow run (one card on
the Artifacts page, one version); and, for a *failed* attempt only, an unkeyed table on its
task run with the node's details (a successful attempt's details are in its DEBUG lines and
the node's events, ``prefect-resoluto events``).

Written from the runner's background thread (``background.py``) and at its exit, off the
task's critical path; everything here is best effort and never fails a task.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import dataclass, field

from guest_runner.redact import Redactor
from prefect_resoluto.node.outcome import NodeOutcome
from prefect_resoluto.task_runner.markup import inert

log = logging.getLogger("prefect_resoluto")

#: Longest exception text kept in a table cell (the sandbox wrote it: bounded, one line).
ERROR_CELL = 300
#: Most bytes of error.json read for the cell (read_outcome has already read it within the
#: node's allowance; this only needs its first fields).
ERROR_FILE_LIMIT = 16 * 1024 * 1024


def flow_run_key(flow_run_name: str, flow_run_id: str) -> str:
    """The flow run's artifact key (lowercase letters, digits, dashes):
    ``resoluto-<flow run name>-<last 8 of its id>``; the id's tail tells apart two runs
    that drew the same name."""
    slug = re.sub(r"[^a-z0-9]+", "-", flow_run_name.lower()).strip("-")[:40].strip("-") or "flow-run"
    short = re.sub(r"[^a-z0-9]", "", flow_run_id.lower())[-8:] or "run"
    return f"resoluto-{slug}-{short}"


def error_summary(o: NodeOutcome, redactor: Redactor | None) -> str:
    """``ValueError: bad input`` for a failed workload (from the sandbox's error record),
    else the node's reason. One line, bounded and inert markdown (:func:`_cell`): the
    sandbox wrote it."""
    if o.ok:
        return ""
    text = o.reason
    if o.failure == "workload" and o.output_dir is not None:
        from prefect_resoluto.task_runner import call_spec

        e = call_spec.read_error(o.output_dir, redactor, limit=ERROR_FILE_LIMIT)  # no link followed
        if e is not None:
            kind, message = str(e.get("type") or "Exception"), str(e.get("message") or "")
            text = f"{kind}: {message}" if message else kind
    return _cell(text)


def _cell(text: str) -> str:
    """A sandbox's text as a cell (and in a description): one line, bounded, and inert in
    the markdown the UI renders it as (:mod:`.markup`: a link or an image in it stays text)."""
    line = " ".join(re.sub(r"[\x00-\x1f\x7f]", " ", text).split())
    return inert(line if len(line) <= ERROR_CELL else line[: ERROR_CELL - 1] + "…")


def _status(o: NodeOutcome) -> str:
    return "success" if o.ok else f"failure ({o.failure})" if o.failure else "failure"


def _seconds(o: NodeOutcome) -> str:
    return f"{o.timings.get('finish', 0.0):.2f}"


@dataclass
class NodeTable:
    """The flow run's table: a row per node, published once, when the runner leaves the flow run."""

    flow_run_id: str
    key: str
    flow_run_name: str
    rows: list[dict[str, str]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _version: int = 0
    _published: int = 0

    def add(self, o: NodeOutcome, task_run_name: str, attempt: int, error: str, sandbox: str = "") -> None:
        with self._lock:
            self.rows.append(
                {
                    "task run": task_run_name,
                    "attempt": str(attempt),
                    "status": _status(o),
                    "error": error,
                    # Short columns first, so the page shows them; the node's id, conduit
                    # and isolation are in a failed attempt's own table and in its events.
                    "runtime": o.runtime,
                    "warm": "yes" if o.warm else "no",
                    "seconds": _seconds(o),
                    # How the node got its sandbox (warm or cold, why, the wait): the one
                    # place a successful node's details are kept in the API.
                    "sandbox": sandbox,
                }
            )
            self._version += 1

    def description(self) -> str:
        failed = [r for r in self.rows if r["status"] != "success"]
        # The error cell is inert markdown already (_cell): its ": " is escaped.
        kinds = sorted({r["error"].split("\\:", 1)[0] for r in failed if r["error"]})
        told = f", {len(failed)} failed" + (f" ({', '.join(kinds)})" if kinds else "") if failed else ""
        # The Artifacts page's card shows the first ~40 characters: the counts first.
        return f"{len(self.rows)} sandbox node(s), {len(self.rows) - len(failed)} succeeded{told}"

    def publish(self) -> None:
        """Publish the table as it is now, unless this version is already in the API: nodes
        finishing together cost one request, not one each."""
        with self._lock:
            if self._published == self._version:
                return
            version, rows, description = self._version, [dict(r) for r in self.rows], self.description()
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import ArtifactCreate

        with get_client(sync_client=True) as client:
            client.create_artifact(
                ArtifactCreate(
                    key=self.key,
                    type="table",
                    data=json.dumps(rows),
                    description=description,
                    flow_run_id=self.flow_run_id,  # type: ignore[arg-type]
                )
            )
        with self._lock:
            self._published = max(self._published, version)


def node_rows(
    o: NodeOutcome, task_run_name: str, attempt: int, error: str, sandbox: str = ""
) -> list[dict[str, str]]:
    rows = [
        {"field": "task run", "value": task_run_name},
        {"field": "attempt", "value": str(attempt)},
        {"field": "status", "value": _status(o)},
    ]
    if error:
        rows.append({"field": "error", "value": error})
    rows += [
        {"field": "sandbox node", "value": o.node_id},
        {"field": "runtime", "value": o.runtime},
        {"field": "isolation", "value": o.isolation},
        {"field": "warm sandbox", "value": "yes" if o.warm else "no"},
        # How the node got its sandbox (warm or cold, and why), in the runner's words.
        *([{"field": "sandbox", "value": sandbox}] if sandbox else []),
        {"field": "exit code", "value": str(o.exit_code)},
        {"field": "seconds", "value": _seconds(o)},
        {"field": "sandbox id", "value": o.sandbox_id},
        {"field": "conduit", "value": o.conduit_url},
        {"field": "node prefix", "value": o.conduit_prefix},
    ]
    for rel, path in sorted(o.output_files.items()):
        if rel.startswith(".resoluto/"):
            continue
        rows.append({"field": f"output {inert(rel)}", "value": inert(str(path))})  # the sandbox named it
    return rows


def publish_node_artifact(
    o: NodeOutcome,
    task_run_name: str,
    attempt: int = 1,
    redactor: Redactor | None = None,
    table: NodeTable | None = None,
    sandbox: str = "",
) -> None:
    """The node's row in the flow run's table and, for a failed attempt, its own table on its
    task run (unkeyed). ``sandbox``: how the node got its sandbox (warm or cold, and why),
    the runner's words."""
    try:
        from prefect.artifacts import create_table_artifact

        error = error_summary(o, redactor)
        if table is not None:
            table.add(o, task_run_name, attempt, error, sandbox)
        if o.ok:
            return
        how = f"{_status(o)}" + (f": {error}" if error else "")
        description = f"{task_run_name}, attempt {attempt}: {how}; {o.runtime}, {_seconds(o)} s"
        create_table_artifact(
            table=node_rows(o, task_run_name, attempt, error, sandbox), description=description, _sync=True
        )  # type: ignore[call-arg]
    except Exception as e:  # an artifact is a convenience; never fail the task over it
        log.debug("could not publish the node's artifacts: %s", e)


def publish_tables(tables: list[NodeTable]) -> None:
    """The flow runs' tables, once each (the runner's exit)."""
    for table in tables:
        try:
            if table.rows:
                table.publish()
        except Exception as e:  # a convenience; never fail the flow over it
            log.debug("could not publish the flow run's sandbox table: %s", e)
