"""What one sandboxed flow run may ask of the Prefect API: its own run and nothing else.

The table below is what Prefect 3.9's engine sends for a flow run with tasks, retries,
logs, an artifact and a persisted result (recorded through the gateway, docs/worker.md
"Behind the gateway"); every request and event is judged against it and anything else
is refused with the name of the rule that refused it. Objects are the run's own when the
API says so (read with the worker's credential, many ids in one filtered query), or when
a ``201 Created`` answered the run's own request through this gateway; ids the run names
that the API does not know yet (task runs, whose creation travels as events) are claimed
for the run on first sight. An admitted body is forwarded as the gateway rebuilt it
(``bodies``): a sub-flow's creation and a listing from the engine's fields only, every
other write without a field the engine does not send. A flow is the run's when it is its
own or its deployment registered it (``identity``: a mark in the API, never the run's word).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from guest_runner import refusal
from prefect_resoluto.worker.bodies import (
    FLOW_RUN_FIELDS,
    MAX_IDS,
    Answered,
    Rebuilt,
    Refusal,
    background_in,
    canonical_uuid,
    engine_fields,
    flow_run_listing,
    subflow_run,
)
from prefect_resoluto.worker.identity import flow_registration, granted, not_owned, owns_flow

__all__ = ["FLOW_RUN_FIELDS", "Answered", "ApiReader", "Rebuilt", "Refusal", "RunRules"]


class ApiReader(Protocol):
    """The API as the rules read it to judge a request (with the worker's credential, through
    the run's gateway): whose task runs and tags are whose."""

    async def upstream_get(self, rel: str) -> tuple[int, Any]: ...

    async def upstream_post(self, rel: str, body: Any) -> tuple[int, Any]: ...


#: Reads any flow run may make: the server's, not a run's.
_OPEN_READS = frozenset({"/admin/version", "/health", "/hello", "/csrf-token", "/admin/storage"})
#: Objects a run may read one of by id (or, a work pool, by name): its own.
_OWN_OBJECTS = ("flows", "deployments", "work_queues", "work_pools")

#: Seconds a tagged task's slot request waits for its task run's tags (they travel as an
#: event on the websocket, which may come after the HTTP request).
TAGS_WAIT_SECONDS = 10.0


@dataclass
class RunRules:
    """One flow run's rules: its ids, the blocks and variables it may read, what it made."""

    flow_run_id: str
    deployment_id: str | None = None
    flow_id: str | None = None
    work_queue_id: str | None = None
    work_pool_name: str | None = None
    work_pool_id: str | None = None
    allowed_blocks: frozenset[str] = frozenset()
    allowed_variables: frozenset[str] = frozenset()
    task_runs: set[str] = field(default_factory=set)
    artifacts: set[str] = field(default_factory=set)
    blocks: set[str] = field(default_factory=set)
    leases: set[str] = field(default_factory=set)
    concurrency_limits: set[str] = field(default_factory=set)
    #: This run and its sub-flow runs (a ``@flow`` called inside it: a flow run of its own,
    #: created through the gateway under one of its task runs), and their flows: its own
    #: and those its deployment registered (``identity``), as the API answered them.
    flow_runs: set[str] = field(default_factory=set)
    flows: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.flow_runs.add(self.flow_run_id)
        if self.flow_id:
            self.flows.add(self.flow_id)

    foreign: set[str] = field(default_factory=set)
    #: The tags of the run's own task runs, as first seen (their creation, their events, the API).
    task_tags: dict[str, frozenset[str]] = field(default_factory=dict)
    _tags_seen: asyncio.Event | None = None
    #: Every judged request and event (method, path, verdict) when set: the recording of docs/worker.md.
    record: list[tuple[str, str, str]] | None = None

    # ------------------------------------------------------------------ HTTP

    async def check_http(
        self, method: str, path: str, query: dict[str, str], body: Any, api: ApiReader
    ) -> Refusal | Rebuilt | Answered | None:
        """None: forward as sent; Rebuilt: forward the body built here; Answered: the answer
        to a request the rules made themselves, relayed; Refusal: 403."""
        if isinstance(body, Refusal):  # the body's shape (bodies.parse_bounded)
            verdict: Refusal | Rebuilt | Answered | None = body
        else:
            rel = path.rstrip("/") or "/"
            verdict = await self._judge(method.upper(), rel, body, api)
            if verdict is None:  # admitted: forwarded as rebuilt from the engine's fields
                verdict = engine_fields(method.upper(), rel, body)
        if self.record is not None:
            seen = f"refused: {verdict.rule}" if isinstance(verdict, Refusal) else "admitted"
            self.record.append((method, path, seen))
        return verdict

    async def _judge(
        self, method: str, path: str, body: Any, api: ApiReader
    ) -> Refusal | Rebuilt | Answered | None:
        parts = path.strip("/").split("/")
        what = f"{method} /api{path}"
        if any(p in ("", ".", "..") for p in parts) and path != "/":
            # What is judged is what is forwarded: no segment a URL library would fold away.
            return Refusal("path", f"{what}: empty, '.' and '..' path segments are refused")
        if method == "GET" and path in _OPEN_READS:
            return None
        if parts[0] == "flow_runs":
            return await self._flow_run(method, parts, body, what, api)
        if parts[0] == "task_runs":
            return await self._task_run(method, parts, body, what, api)
        if parts == ["flows"] and method == "POST":
            return await self._register_flow(body, what, api)
        if method == "GET" and len(parts) == 2 and parts[0] in _OWN_OBJECTS:
            return self._own_object(parts, what)
        if parts[:2] == ["v2", "concurrency_limits"]:
            return await self._task_concurrency(method, parts[2:], body, what, api)
        if parts[0] == "logs" and len(parts) == 1 and method == "POST":
            return await self._logs(body, what, api)
        if parts[0] == "artifacts":
            return await self._artifact(method, parts, body, what, api)
        return self._named_read(method, parts, what)

    async def _register_flow(self, body: Any, what: str, api: ApiReader) -> Refusal | Answered:
        """A sub-flow's flow, by name (what ``@flow`` registers; an upsert). Registered with the
        gateway's own body and judged by the API's answer: the flow's id reaches the run only
        when the flow is the run's."""
        made = flow_registration(body, what, self.deployment_id)
        if isinstance(made, Refusal):
            return made
        try:
            status, reply = await api.upstream_post("flows/", made)
        except Exception as e:  # the API is away: the engine retries as it would without us
            return Answered(502, {"detail": f"resoluto gateway: the Prefect API is unreachable: {e}"})
        if status >= 300:  # the API's own refusal of the name, or a busy server's 503
            return Answered(status, reply if reply is not None else {"detail": "no JSON answer"})
        if not owns_flow(reply, self.deployment_id, self.flow_id):
            return not_owned(what, made["name"], self.deployment_id)
        flow_id = str(reply["id"])
        if (
            flow_id != self.flow_id
            and not granted(reply, self.deployment_id)
            and not await self._undeployed(flow_id, api)
        ):
            # A name the deployment registered first that another team has since deployed
            # (first come is not first served for a trusted flow): theirs from then on.
            return not_owned(what, made["name"], self.deployment_id, deployed=True)
        self.flows.add(flow_id)
        return Answered(status, reply)

    async def _undeployed(self, flow_id: str, api: ApiReader) -> bool:
        """No deployment is of this flow (the run's own deployment is of its own flow)."""
        try:
            status, found = await api.upstream_post(
                "deployments/filter", {"flows": {"id": {"any_": [flow_id]}}, "limit": 1}
            )
        except Exception:  # unknown is not undeployed
            return False
        return status == 200 and found == []

    def _own_object(self, parts: list[str], what: str) -> Refusal | None:
        """A read of one flow, deployment, work queue or work pool: the run's own only."""
        kind, ident = parts
        if kind == "flows":
            if ident in self.flows:
                return None
            return Refusal("own-flows", f"{what}: this flow run may read only its own flows")
        mine = {
            "deployments": self.deployment_id,
            "work_queues": self.work_queue_id,
            "work_pools": self.work_pool_name,
        }[kind]
        if mine is not None and ident == mine:
            return None
        return Refusal(
            f"own-{kind}", f"{what}: this flow run may read only its own {kind[:-1].replace('_', ' ')}"
        )

    def _named_read(self, method: str, parts: list[str], what: str) -> Refusal | None:
        """A block or a variable, read by name: only those the run's allow lists name."""
        if (
            parts[:2] == ["block_types", "slug"]
            and len(parts) == 6
            and parts[3:5] == ["block_documents", "name"]
        ):
            ref = f"{parts[2]}/{parts[5]}"
            if method == "GET" and ref in self.allowed_blocks:
                return None
            return _by_setting(
                "allowed-blocks", "allowed_blocks", ref, method, self.allowed_blocks, what, "block"
            )
        if parts[:2] == ["variables", "name"] and len(parts) == 3:
            if method == "GET" and parts[2] in self.allowed_variables:
                return None
            return _by_setting(
                "allowed-variables",
                "allowed_variables",
                parts[2],
                method,
                self.allowed_variables,
                what,
                "variable",
            )
        if parts[0] in ("block_documents", "block_types", "block_schemas", "variables"):
            return Refusal(
                "read-named-only",
                f"{what}: blocks and variables are read by name, and only those in allowed_blocks / "
                "allowed_variables",
            )
        return Refusal("not-this-run", f"{what}: not a request about this flow run")

    async def _flow_run(
        self, method: str, parts: list[str], body: Any, what: str, api: ApiReader
    ) -> Refusal | Rebuilt | None:
        own = self.flow_run_id
        if parts[1:] == ["filter"] and method == "POST":
            # The listing forwarded is the gateway's own, over ids that are all the run's.
            listing = flow_run_listing(body, what)
            if isinstance(listing, Refusal):
                return listing
            if listing.by == "id":
                if all(i in self.flow_runs for i in listing.ids):
                    return Rebuilt(listing.body(list(listing.ids)))
            elif not await self._foreign_task_runs(set(listing.ids), api):
                return Rebuilt(listing.body(list(listing.ids)))  # a sub-flow's earlier run
            return Refusal(
                "own-runs-only",
                f"{what}: a listing of flow runs must name only this flow run's ids (or its own task runs as parents)",
            )
        if parts[1:] == [] and method == "POST":
            made = subflow_run(body, what)
            if isinstance(made, Refusal):
                return made
            if made["flow_id"] not in self.flows:
                return Refusal(
                    "own-sub-flows",
                    f"{what}: flow {made['flow_id']} is neither this run's own nor registered by "
                    "its deployment through this gateway",
                )
            if await self._owns_task_run(made["parent_task_run_id"], api):
                return Rebuilt(made)
            return Refusal(
                "own-sub-flows",
                f"{what}: a flow run may be created only as a sub-flow under this run's task runs",
            )
        if len(parts) < 2 or parts[1] not in self.flow_runs:
            return Refusal("own-flow-run", f"{what}: this flow run may act only on itself ({own})")
        rest = parts[2:]
        if method == "GET" and rest == []:
            return None
        if method == "POST" and rest == ["set_state"]:
            return None
        if method == "PATCH" and rest == ["labels"]:
            return None
        if method == "PATCH" and rest == [] and isinstance(body, dict):
            extra = sorted(set(body) - FLOW_RUN_FIELDS)
            if not extra:
                return None
            return Refusal("own-flow-run-fields", f"{what}: fields {extra} of a flow run are the worker's")
        return Refusal("own-flow-run", f"{what}: not one of the requests a flow run makes about itself")

    async def _task_run(
        self, method: str, parts: list[str], body: Any, what: str, api: ApiReader
    ) -> Refusal | None:
        if parts[1:] == [] and method == "POST":
            if isinstance(body, dict) and str(body.get("flow_run_id")) in self.flow_runs:
                return None
            return Refusal("own-task-runs", f"{what}: a task run may be created only in this flow run")
        if (
            len(parts) >= 2
            and _is_uuid(parts[1])
            and (method, parts[2:]) in (("GET", []), ("POST", ["set_state"]))
        ):
            if await self._owns_task_run(parts[1], api):
                return None
        return Refusal("own-task-runs", f"{what}: only this flow run's own task runs")

    async def _task_concurrency(
        self, method: str, rest: list[str], body: Any, what: str, api: ApiReader
    ) -> Refusal | None:
        """A tagged task takes a slot of each tag's limit around its run (Prefect's engine
        asks even when no limit exists): its own task runs' slots of ``tag:`` limits only."""
        refusal = Refusal(
            "own-task-concurrency", f"{what}: only slots of tag limits, for this run's task runs"
        )
        if method != "POST" or not isinstance(body, dict):
            return refusal
        if rest == ["increment-with-lease"]:
            names = body.get("names")
            holder = body.get("holder")
            if not isinstance(names, list) or not all(
                isinstance(n, str) and n.startswith("tag:") for n in names
            ):
                return refusal
            if not isinstance(holder, dict) or holder.get("type") != "task_run":
                return refusal
            tr = str(holder.get("id"))
            if not await self._owns_task_run(tr, api):
                return refusal
            tags = await self._tags_of(tr, api)
            wanted = {n.removeprefix("tag:") for n in names}
            if tags is None or not wanted <= tags:
                return Refusal(
                    "own-task-concurrency",
                    f"{what}: task run {tr} holds tags {sorted(tags or ())}, not all of {sorted(wanted)}",
                )
            return None
        if rest == ["decrement-with-lease"] and str(body.get("lease_id")) in self.leases:
            return None
        if len(rest) == 3 and rest[0] == "leases" and rest[2] == "renew" and rest[1] in self.leases:
            return None
        return refusal

    async def _logs(self, body: Any, what: str, api: ApiReader) -> Refusal | None:
        if not isinstance(body, list):
            return Refusal("own-logs", f"{what}: logs are a list")
        task_runs: set[str] = set()
        for entry in body:
            if not isinstance(entry, dict) or str(entry.get("flow_run_id")) not in self.flow_runs:
                return Refusal("own-logs", f"{what}: every log line must belong to this flow run")
            tr = entry.get("task_run_id")
            if tr is not None:
                task_runs.add(str(tr))
        foreign = await self._foreign_task_runs(task_runs, api)
        if foreign:
            return Refusal(
                "own-logs", f"{what}: log lines of task runs {sorted(foreign)[:3]}, not this flow run's"
            )
        return None

    async def _artifact(
        self, method: str, parts: list[str], body: Any, what: str, api: ApiReader
    ) -> Refusal | None:
        if parts[1:] == [] and method == "POST" and isinstance(body, dict):
            if str(body.get("flow_run_id")) not in self.flow_runs:
                return Refusal("own-artifacts", f"{what}: an artifact must belong to this flow run")
            tr = body.get("task_run_id")
            if tr is not None and not await self._owns_task_run(str(tr), api):
                return Refusal("own-artifacts", f"{what}: task run {tr} is not one of this flow run's")
            return None
        if len(parts) == 2 and method == "PATCH" and parts[1] in self.artifacts:
            return None  # a progress artifact the run created, updated
        return Refusal("own-artifacts", f"{what}: only creating (and updating) this run's own artifacts")

    def note_response(self, method: str, path: str, body: Any, status: int, reply: Any) -> None:
        """What the run created through the gateway is the run's own: an object is claimed
        only from a 201 Created answering this request (a 200 handing back an existing one
        never is), and the allowed blocks it read (their ``loaded`` events name them by id)."""
        if status >= 300 or not isinstance(reply, dict) or not reply.get("id") and "lease_id" not in reply:
            return
        rel = path.rstrip("/")
        if method.upper() == "GET" and rel.startswith("/block_types/slug/"):
            self.blocks.add(str(reply["id"]))
            return
        if method.upper() != "POST":
            return
        rid = str(reply.get("id"))
        if rel == "/task_runs":
            # A 200 is an existing task run: the run's own only if the API says it is in it.
            if status == 201 or str(reply.get("flow_run_id")) in self.flow_runs:
                self.task_runs.add(rid)
                tags = reply.get("tags")
                if isinstance(tags, list):
                    self._note_tags(rid, tags)
        elif rel == "/flow_runs" and status == 201:
            self.flow_runs.add(rid)
        elif rel == "/artifacts" and status == 201:
            self.artifacts.add(rid)
        elif rel == "/v2/concurrency_limits/increment-with-lease" and reply.get("lease_id"):
            self.leases.add(str(reply["lease_id"]))  # a lease is new with every answer
            limits = reply.get("limits")  # their acquired/released events name them
            for limit in limits if isinstance(limits, list) else []:
                if isinstance(limit, dict) and limit.get("id"):
                    self.concurrency_limits.add(str(limit["id"]))

    def strip_response(self, path: str, reply: Any) -> Any:
        """A work pool as the run reads it: without its base job template (the pool's
        defaults for every run, secrets included), which the engine does not need."""
        if (
            path.strip("/").startswith("work_pools/")
            and isinstance(reply, dict)
            and "base_job_template" in reply
        ):
            return {**reply, "base_job_template": {}}
        return reply

    async def _owns_task_run(self, task_run_id: str, api: ApiReader) -> bool:
        return not await self._foreign_task_runs({task_run_id}, api)

    async def _foreign_task_runs(self, ids: set[str], api: ApiReader) -> set[str]:
        """Which of ``ids`` are not the run's. Ours if made through this gateway, or if the API
        says it is this run's; an id the API does not know yet (its creation is on its way
        as an event) is claimed. The unknown ones are asked in one filtered query."""
        bad = {i for i in ids if i in self.foreign or not _is_uuid(i)}
        unknown = sorted(ids - bad - self.task_runs)
        if not unknown:
            return bad
        if len(unknown) > MAX_IDS:
            return bad | set(unknown)
        query = {"task_runs": {"id": {"any_": unknown}}, "limit": len(unknown)}
        status, reply = await api.upstream_post("task_runs/filter", query)
        if status != 200 or not isinstance(reply, list):
            return bad | set(unknown)  # not judged: refused, the engine retries
        known: dict[str, Any] = {str(r.get("id")): r for r in reply if isinstance(r, dict)}
        for tr in unknown:
            found = known.get(tr)
            if found is None or str(found.get("flow_run_id")) in self.flow_runs:
                self.task_runs.add(tr)
                if found is not None and isinstance(found.get("tags"), list):
                    self._note_tags(tr, found["tags"])
            else:
                self.foreign.add(tr)
                bad.add(tr)
        return bad

    def _note_tags(self, task_run_id: str, tags: list[Any]) -> None:
        if task_run_id not in self.task_tags:  # as first seen: later claims change nothing
            self.task_tags[task_run_id] = frozenset(str(t) for t in tags)
            if self._tags_seen is not None:
                self._tags_seen.set()

    async def _tags_of(self, task_run_id: str, api: ApiReader) -> frozenset[str] | None:
        """The task run's tags, once its creation (or the API) says them."""
        deadline = time.monotonic() + TAGS_WAIT_SECONDS
        while task_run_id not in self.task_tags:
            status, reply = await api.upstream_get(f"task_runs/{task_run_id}")
            if status == 200 and isinstance(reply, dict) and isinstance(reply.get("tags"), list):
                self._note_tags(task_run_id, reply["tags"])
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._tags_seen = self._tags_seen or asyncio.Event()
            self._tags_seen.clear()
            try:
                await asyncio.wait_for(self._tags_seen.wait(), timeout=min(left, 1.0))
            except TimeoutError:
                pass
        return self.task_tags.get(task_run_id)

    # ------------------------------------------------------------------ events

    async def check_event(self, event: Any, api: ApiReader) -> Refusal | None:
        verdict = await self._judge_event(event, api)
        if self.record is not None:
            name = str(event.get("event")) if isinstance(event, dict) else "?"
            self.record.append(("EVENT", name, "admitted" if verdict is None else f"refused: {verdict.rule}"))
        return verdict

    async def _judge_event(self, event: Any, api: ApiReader) -> Refusal | None:
        if not isinstance(event, dict) or not isinstance(event.get("resource"), dict):
            return Refusal("own-events", "an event that is not a Prefect event")
        name = str(event.get("event", ""))
        rid = str(event["resource"].get("prefect.resource.id", ""))
        what = f"event {name!r} about {rid!r}"
        related = event.get("related") or []
        if not isinstance(related, list) or not all(isinstance(r, dict) for r in related):
            return Refusal("own-events", f"{what}: malformed related resources")
        roles = {str(r.get("prefect.resource.role")): str(r.get("prefect.resource.id")) for r in related}
        # Each related resource a lookup in the run's own sets; its task runs one query for all
        # (one each, and a rebuilt set per entry, made a 2 MB event seconds of the worker's CPU).
        related_task_runs: set[str] = set()
        for r in related:
            ref = str(r.get("prefect.resource.id", ""))
            if ref.startswith("prefect.task-run."):
                related_task_runs.add(ref.removeprefix("prefect.task-run."))
            elif not await self._own_resource(ref, api, related=True):
                return Refusal("own-events", f"{what}: related resource {ref!r} is not this run's")
        foreign = await self._foreign_task_runs(related_task_runs, api) if related_task_runs else set()
        if foreign:
            ref = f"prefect.task-run.{sorted(foreign)[0]}"
            return Refusal("own-events", f"{what}: related resource {ref!r} is not this run's")
        named = background_in(event.get("payload"))
        if named is not None:
            return Refusal(
                "no-background-tasks",
                f"{what}: state_details.{named} would make a background task run (refused)",
            )
        if rid.startswith("prefect.flow-run.") and rid.removeprefix("prefect.flow-run.") in self.flow_runs:
            return None
        if rid.startswith("prefect.task-run."):
            tr = rid.removeprefix("prefect.task-run.")
            payload = event.get("payload") or {}
            inner = payload.get("task_run") if isinstance(payload, dict) else None
            inner = inner if isinstance(inner, dict) else {}
            if roles.get("flow-run", "").removeprefix("prefect.flow-run.") not in self.flow_runs:
                return Refusal(
                    "own-events", f"{what}: a task-run event must name this flow run as its flow-run"
                )
            if (
                str(inner.get("id", tr)) != tr
                or str(inner.get("flow_run_id", self.flow_run_id)) not in self.flow_runs
            ):
                return Refusal("own-events", f"{what}: its task run payload names another run")
            if await self._owns_task_run(tr, api):
                tags = inner.get("tags")
                if isinstance(tags, list):
                    self._note_tags(tr, tags)
                return None
            return Refusal("own-events", f"{what}: task run {tr} belongs to another flow run")
        kinds = ("prefect.artifact.", "prefect.block-document.", "prefect.concurrency-limit.")
        if rid.startswith(kinds) and await self._own_resource(rid, api, related=False):
            return None
        return Refusal(
            "own-events", f"{what}: events are admitted only about this flow run and its task runs"
        )

    async def _own_resource(self, ref: str, api: ApiReader, *, related: bool) -> bool:
        kind, _, ident = ref.removeprefix("prefect.").partition(".")
        if kind == "tag":
            return related
        owned: dict[str, set[str]] = {
            "flow-run": self.flow_runs,
            "flow": self.flows,
            "artifact": self.artifacts,
            "block-document": self.blocks,
            "concurrency-limit": self.concurrency_limits,
        }
        if kind in owned:
            return ident in owned[kind]
        one = {
            "deployment": self.deployment_id,
            "work-queue": self.work_queue_id,
            "work-pool": self.work_pool_id,
        }
        if kind in one:
            return bool(one[kind]) and ident == str(one[kind])
        if kind == "block-type":
            return any(ident == ref.split("/", 1)[0] for ref in self.allowed_blocks)
        if kind == "task-run":
            return await self._owns_task_run(ident, api)
        return False

    def events_out_filter(self, message: Any) -> tuple[Any, Refusal | None]:
        """The engine's subscription (``/api/events/out``) narrowed to this flow run's own events."""
        if (
            not isinstance(message, dict)
            or message.get("type") != "filter"
            or not isinstance(message.get("filter"), dict)
        ):
            return None, Refusal("own-events-out", "a subscription must start with a filter message")
        own = f"prefect.flow-run.{self.flow_run_id}"
        flt = dict(message["filter"])
        if not isinstance(flt.get("resource") or {}, dict):
            return None, Refusal("own-events-out", "a subscription's resource filter is a JSON object")
        resource = dict(flt.get("resource") or {})
        ids = resource.get("id")
        if ids is not None and (not isinstance(ids, list) or own not in ids):
            return None, Refusal("own-events-out", "a subscription may follow only this flow run's events")
        resource["id"] = [own]
        flt["resource"] = resource
        return {**message, "filter": flt}, None

    def admits_outgoing(self, event: Any) -> bool:
        rid = _dig(event, "event", "resource", "prefect.resource.id")
        return isinstance(rid, str) and rid.removeprefix("prefect.flow-run.") in self.flow_runs


def _dig(obj: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(k)
    return obj


def _is_uuid(s: str) -> bool:
    """Whether ``s`` is a UUID as the API writes one (lower case, hyphenated): every id the
    run's objects are known by is in that form, so another form of the same id (upper case,
    braces, no hyphens) is refused rather than looked up and missed."""
    return canonical_uuid(s) == s


def _by_setting(
    rule: str, setting: str, name: str, method: str, allowed: frozenset[str], what: str, kind: str
) -> Refusal:
    """A named read off the run's allow list, or a write: the operator reads the rule, the
    run's caller the setting that would allow it (the task runner's words, guest_runner.refusal)."""
    if method == "GET":
        why = f"{what}: {kind} {name!r} is not in this run's {setting} ({_names(allowed)})"
        told = refusal.not_readable(setting, name, allowed, refusal.WORKER)
    else:
        why = f"{what}: {kind} {name!r}: {setting} allows reads only"
        told = refusal.not_writable(setting, name, refusal.WORKER)
    return Refusal(rule, why, told=told, setting=setting)


def _names(names: frozenset[str]) -> str:
    return ", ".join(sorted(names)) or "none"
