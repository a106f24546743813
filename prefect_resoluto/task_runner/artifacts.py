"""The runner's own artifacts, opt-in (``summary_artifact``; issue 41): by default a Prefect
user's Artifacts page and a run's Artifacts tab hold only what their own code made, and the
runner reports in the task runs' logs (task_node.runner_line).

When on: one table per flow run, a row per sandbox node, written once when the runner leaves
the flow run, under one key per *flow* (:func:`flow_key`: each run adds a version of one
collection, not a collection); and, for a task run that did not complete, its last node's
table on the task run (unkeyed). A task run that completed, even after failed attempts,
carries none: its attempts are rows of the flow run's table and lines of its logs. Cells
are short (a 1400 px page shows the table whole): long text is cut, whole in the logs.

Written from the runner's background thread (``background.py``) and at its exit, off the
task's critical path; everything here is best effort and never fails a task.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from dataclasses import dataclass, field

from guest_runner.redact import Redactor
from prefect_resoluto.node.outcome import NodeOutcome
from prefect_resoluto.task_runner.markup import inert

log = logging.getLogger("prefect_resoluto")

#: Most characters a cell shows (as rendered): the rest is in the task run's logs.
CELL = 60
#: The flow run table's columns, short ones first; the runtime is the description's.
COLUMNS = ("task run", "attempt", "outcome", "seconds", "sandbox", "error")
_SLUG = 40


def flow_key(flow_name: str) -> str:
    """The flow's summary key, the same for every run of it (Prefect's key rules: lowercase
    letters, digits, dashes): ``resoluto-<flow name>``; a name that is no key as written
    gets a short hash of itself too, so two flows whose names read alike stay apart."""
    slug = re.sub(r"[^a-z0-9]+", "-", flow_name.lower()).strip("-")[:_SLUG].strip("-") or "flow"
    if slug == flow_name:
        return f"resoluto-{slug}"
    return f"resoluto-{slug}-{hashlib.sha256(flow_name.encode()).hexdigest()[:6]}"


def error_summary(o: NodeOutcome, redactor: Redactor | None) -> str:
    """``ValueError: bad input`` for a failed workload (from the sandbox's error record),
    else the node's reason. One short line of inert markdown (:func:`cell`): the sandbox
    wrote it."""
    if o.ok:
        return ""
    text = o.reason
    if o.failure == "workload" and o.output_dir is not None:
        from prefect_resoluto.task_runner import call_spec

        e = call_spec.read_error(o.output_dir, redactor)  # bounded, no link followed
        if e is not None:
            kind, message = str(e.get("type") or "Exception"), str(e.get("message") or "")
            text = f"{kind}: {message}" if message else kind
    return cell(text)


def cell(text: str) -> str:
    """Text as a cell (and in a description): one line of at most :data:`CELL` characters,
    cut before it is made inert (:mod:`.markup`: a link or an image in it stays text), so
    an escape is never cut in half."""
    line = " ".join(re.sub(r"[\x00-\x1f\x7f]", " ", text).split())
    return inert(line) if len(line) <= CELL else inert(line[: CELL - 1]) + "…"


def _short(text: str) -> str:
    """The host's own text (a task run's name) cut to a cell."""
    return text if len(text) <= CELL else text[: CELL - 1] + "…"


def outcome(o: NodeOutcome) -> str:
    """``succeeded``, ``failed (workload)``, ``infrastructure failure (lost)``."""
    if o.ok:
        return "succeeded"
    if o.failure is None:
        return "failed"
    return f"infrastructure failure ({o.failure})" if o.infrastructure_failure else f"failed ({o.failure})"


def _seconds(o: NodeOutcome) -> str:
    return f"{o.timings.get('finish', 0.0):.2f}"


@dataclass
class NodeTable:
    """The flow run's table: a row per node, published once, when the runner leaves the flow run."""

    flow_run_id: str
    key: str
    flow_run_name: str
    rows: list[dict[str, str]] = field(default_factory=list)
    runtimes: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _version: int = 0
    _published: int = 0

    def add(self, o: NodeOutcome, task_run_name: str, attempt: int, error: str) -> None:
        row = (
            _short(task_run_name),
            str(attempt),
            outcome(o),
            _seconds(o),
            "warm" if o.warm else "cold",  # how and why: the task run's "ran in a ..." line
            error,
        )
        with self._lock:
            self.rows.append(dict(zip(COLUMNS, row, strict=True)))
            self.runtimes.add(o.runtime)
            self._version += 1

    def description(self) -> str:
        failed = [r for r in self.rows if r["outcome"] != "succeeded"]
        # The error cell is inert markdown already (cell()): its ": " is escaped.
        kinds = sorted({r["error"].split("\\:", 1)[0] for r in failed if r["error"]})
        told = f", {len(failed)} failed" + (f" ({', '.join(kinds)})" if kinds else "") if failed else ""
        # The Artifacts page's card shows the first ~40 characters: the counts first; each
        # version names its flow run (the flow's runs share the key).
        where = ", ".join(sorted(self.runtimes))
        return (
            f"{len(self.rows)} sandbox node{'s' if len(self.rows) != 1 else ''}, "
            f"{len(self.rows) - len(failed)} succeeded{told}; {where}; flow run {_short(self.flow_run_name)}"
        )

    def publish(self) -> None:
        """Publish the table as it is now, unless this version is already in the API."""
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
    """A failed node's details, a row each (the table a task run that did not complete keeps)."""
    rows = [
        {"field": "task run", "value": _short(task_run_name)},
        {"field": "attempt", "value": str(attempt)},
        {"field": "outcome", "value": outcome(o)},
    ]
    if error:
        rows.append({"field": "error", "value": error})
    rows += [
        {"field": "sandbox node", "value": o.node_id},
        {"field": "runtime", "value": o.runtime},
        {"field": "isolation", "value": o.isolation},
        # How the node got its sandbox (warm or cold, and why), in the runner's words.
        *([{"field": "sandbox", "value": cell(sandbox)}] if sandbox else []),
        {"field": "exit code", "value": str(o.exit_code)},
        {"field": "seconds", "value": _seconds(o)},
        {"field": "sandbox id", "value": o.sandbox_id},
        # Where to look further (`prefect-resoluto events`): the host's own words, whole.
        {"field": "conduit", "value": o.conduit_url},
        {"field": "node prefix", "value": o.conduit_prefix},
    ]
    declared = [rel for rel in o.output_files if not rel.startswith(".resoluto/")]
    if declared:
        rows.append({"field": "output files", "value": f"{len(declared)} in {o.output_dir}"})
    return rows


def publish_node_table(
    o: NodeOutcome, task_run_name: str, attempt: int, error: str, sandbox: str = ""
) -> None:
    """A failed node's own table, on its task run (unkeyed): the task run did not complete."""
    try:
        from prefect.artifacts import create_table_artifact

        how = outcome(o) + (f": {error}" if error else "")
        description = f"{_short(task_run_name)}: {how}; attempt {attempt}, {o.runtime}, {_seconds(o)} s"
        create_table_artifact(
            table=node_rows(o, task_run_name, attempt, error, sandbox), description=description, _sync=True
        )  # type: ignore[call-arg]
    except Exception as e:  # an artifact is a convenience; never fail the task over it
        log.debug("could not publish the node's table: %s", e)


def publish_tables(tables: list[NodeTable]) -> None:
    """The flow runs' tables, once each (the runner's exit)."""
    for table in tables:
        try:
            if table.rows:
                table.publish()
        except Exception as e:  # a convenience; never fail the flow over it
            log.debug("could not publish the flow run's sandbox table: %s", e)
