"""Artifacts a sandboxed task made, created by the host on its task run and flow run.

Inside the sandbox, ``create_markdown_artifact`` & co. do not reach an API (there is none):
:mod:`guest_runner.prefect_api` relays each one as an event of kind ``artifact``. Here,
on the task's own thread as its events arrive, each becomes the ``ArtifactCreate`` (or
progress ``ArtifactUpdate``) Prefect's own function would have sent from a thread: same
type, key, description and data, on the task run and flow run the *host* knows (never ids
the sandbox names). What the sandbox sends is hostile: an artifact over
:data:`MAX_ARTIFACT_BYTES`, past :data:`MAX_ARTIFACTS` in one node, of an unknown type or
with a malformed key is refused with an ERROR line in the task run's logs naming the
bound; the task's other artifacts, logs and result are kept.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from guest_runner.prefect_api import ARTIFACT_TYPES, MAX_ARTIFACTS
from guest_runner.redact import Redactor
from guest_runner.wire import MAX_ARTIFACT_BYTES, SpanEvent

log = logging.getLogger("prefect_resoluto")

Report = Callable[[int, str], None]


class ArtifactRelay:
    """The artifacts of one sandbox node, created in the Prefect API as they arrive."""

    def __init__(
        self, task_run_id: Any, flow_run_id: Any, report: Report, redactor: Redactor | None = None
    ) -> None:
        self.task_run_id = task_run_id
        self.flow_run_id = flow_run_id
        self.report = report
        self.redactor = redactor or Redactor()
        self.relayed = 0  # messages taken (created or updated)
        self.refused = 0
        self._ids: dict[str, Any] = {}  # the sandbox's id of an artifact -> the API's
        self._told_count = False

    def __call__(self, ev: SpanEvent) -> None:
        data = ev.get("data")
        rec = data.get("artifact") if isinstance(data, dict) else None
        if not isinstance(rec, dict):
            return self._refuse("it is not an artifact record")
        if self.relayed >= MAX_ARTIFACTS:
            self.refused += 1
            if not self._told_count:
                self._told_count = True
                self.report(
                    logging.ERROR,
                    f"artifacts refused: a sandboxed task may relay at most {MAX_ARTIFACTS} artifacts "
                    "(creations and progress updates) per attempt; the rest of this attempt's are not created",
                )
            return None
        size = len(json.dumps(rec, ensure_ascii=False, default=str).encode())
        if size > MAX_ARTIFACT_BYTES:
            return self._refuse(
                f"{size} bytes is more than one artifact may hold ({MAX_ARTIFACT_BYTES} bytes)"
            )
        rec = self.redactor.data(rec)
        try:
            if rec.get("op") == "update":
                self._update(rec)
            else:
                self._create(rec)
        except _Refused as e:
            return self._refuse(str(e))
        except Exception as e:  # the API's answer: told in the task's logs, never the task's failure
            return self._refuse(f"the API did not take it: {type(e).__name__}: {e}")
        self.relayed += 1
        return None

    def _create(self, rec: dict[str, Any]) -> None:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import ArtifactCreate
        from pydantic import ValidationError

        kind = rec.get("type")
        if kind not in ARTIFACT_TYPES:
            raise _Refused(f"type {str(kind)[:40]!r} is not one of {', '.join(ARTIFACT_TYPES)}")
        try:
            request = ArtifactCreate(
                type=kind,
                key=_optional_str(rec.get("label"), "key"),
                description=_optional_str(rec.get("description"), "description"),
                data=rec.get("data"),
                task_run_id=self.task_run_id,
                flow_run_id=self.flow_run_id,
            )
        except ValidationError as e:
            raise _Refused(_first_error(e)) from None
        created = get_client(sync_client=True).create_artifact(artifact=request)
        local = rec.get("id")
        if isinstance(local, str):
            self._ids[local] = created.id

    def _update(self, rec: dict[str, Any]) -> None:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import ArtifactUpdate
        from pydantic import ValidationError

        target = self._ids.get(str(rec.get("id")))
        if target is None:
            raise _Refused("it updates an artifact this task run did not create")
        try:
            fields: dict[str, Any] = {"data": rec.get("data")}
            if rec.get("description"):
                fields["description"] = _optional_str(rec.get("description"), "description")
            update = ArtifactUpdate(**fields)
        except ValidationError as e:
            raise _Refused(_first_error(e)) from None
        get_client(sync_client=True).update_artifact(artifact_id=target, artifact=update)

    def _refuse(self, why: str) -> None:
        self.refused += 1
        self.report(logging.ERROR, f"artifact refused: {why}")


class _Refused(ValueError):
    pass


def _optional_str(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise _Refused(f"its {what} is not a string")


def _first_error(e: Any) -> str:
    errors = e.errors()
    if not errors:
        return "it is malformed"
    first = errors[0]
    where = ".".join(map(str, first.get("loc", ()))) or "artifact"
    return f"{where}: {str(first.get('msg', ''))[:200]}"
