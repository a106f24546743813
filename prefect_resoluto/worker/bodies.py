"""Bodies the gateway builds itself: what it forwards is serialised from what it parsed.

A sandboxed run's body is never passed through where it could steer the API beyond the
run: a sub-flow's creation and a flow-run listing are parsed into exactly the fields
Prefect 3.9's engine sends there (``FlowRunCreate`` from ``create_flow_run``,
``FlowRunFilter`` from ``load_subflow_run`` and the suspension observer), anything else
is refused naming it, and the body forwarded is built here. Every body is also bounded
before it is parsed: its size per endpoint (checked before it is read) and its nesting.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused: the rule's name and what it saw (the operator's words, in
    the run's logs); ``told``: what the sandbox's caller is told instead, when a setting
    would allow the call (``setting``, guest_runner.refusal)."""

    rule: str
    why: str
    told: str | None = None
    setting: str | None = None

    def __post_init__(self) -> None:
        # Both quote the sandbox's text (a path, an id, a name), and both leave as UTF-8 (a
        # JSON answer, a log line): a lone surrogate in them would fail the refusal itself.
        object.__setattr__(self, "why", utf8_safe(self.why))
        if self.told is not None:
            object.__setattr__(self, "told", utf8_safe(self.told))


def utf8_safe(text: str) -> str:
    """``text`` with what UTF-8 cannot hold (lone surrogates) as ``\\udXXX`` escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass(frozen=True)
class Answered:
    """An admitted request the gateway made upstream itself: its answer, relayed as is."""

    status: int
    body: Any


@dataclass(frozen=True)
class Rebuilt:
    """An admitted request whose body the gateway forwards as built here, not as received."""

    body: Any


#: A body's nesting (objects and arrays inside each other) and its number of them: what
#: ``json.loads`` would otherwise turn into a RecursionError, or a few GB of small dicts.
MAX_DEPTH = 32
MAX_CONTAINERS = 100_000
#: Ids one request may name (a listing, a batch of logs): one upstream query answers them.
MAX_IDS = 200
#: Rows a listing by parent task runs may ask for: Prefect's own default page
#: (PREFECT_API_DEFAULT_LIMIT); the engine asks for one (``load_subflow_run``).
MAX_LISTED = 200
#: Bytes of a body, per endpoint (the rest: ``DEFAULT_CAP``). Prefect's log batches are at
#: most 3 MB (PREFECT_LOGGING_TO_API_BATCH_SIZE) and an artifact is the run's own markdown.
BODY_CAPS = {("POST", "/logs"): 6 << 20, ("POST", "/artifacts"): 4 << 20, ("POST", "/flow_runs"): 2 << 20}
DEFAULT_CAP = 1 << 20

#: A JSON string, or an unterminated one to the end: possessive, and every start matches, so
#: one linear pass (a backtracking form took minutes on ``"`` then ``\\"`` x 500 000).
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*+(?:"|\\?\Z)', re.DOTALL)
#: A surrogate's escape: a body naming one is checked for a lone one (never UTF-8).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def body_cap(method: str, rel: str) -> int:
    return BODY_CAPS.get((method.upper(), rel.rstrip("/") or "/"), DEFAULT_CAP)


NOT_JSON = "a body that is not JSON in UTF-8 (the engine's always is)"


def parse_bounded(raw: bytes) -> Any:
    """The body as JSON (None when there is none), or a Refusal when it is not JSON in UTF-8,
    nests deeper than MAX_DEPTH or holds more than MAX_CONTAINERS objects and arrays. Strings
    are blanked and everything but brackets dropped by C-speed passes before the one count in
    Python."""
    if not raw:
        return None
    try:
        # Strictly UTF-8 (the engine's JSON always is), before anything reads it: json.loads
        # would read bytes as UTF-16 or -32 too, which the byte patterns below do not.
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return Refusal("body-shape", NOT_JSON)
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if len(brackets) > 2 * MAX_CONTAINERS:
        return Refusal("body-shape", f"a body of more than {MAX_CONTAINERS} objects and arrays")
    depth = 0
    for b in brackets:
        depth += 1 if b in b"[{" else -1
        if depth > MAX_DEPTH:
            return Refusal("body-shape", f"a body nested deeper than {MAX_DEPTH}")
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        # Never forwarded as sent: the API's parser may read it as something else (bytes of
        # UTF-16 are valid UTF-8 with NULs between, and JSON to a parser that sniffs them).
        return Refusal("body-shape", NOT_JSON)
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return Refusal("body-shape", "a string holding a lone surrogate (no UTF-8 text, no engine's)")
    return body


# --------------------------------------------------------------------------- a sub-flow's creation

#: The tag on every flow run the gateway creates (a sub-flow made inside a sandbox): what
#: operators' automations and filters tell such runs by.
SANDBOXED_TAG = "resoluto.sandboxed"

#: ``FlowRunCreate`` as the engine's ``create_flow_run`` sends it for a sub-flow
#: (``exclude_unset``): no deployment, pool, queue, job variables, idempotency key.
SUBFLOW_FIELDS = frozenset(
    {
        "flow_id",
        "flow_version",
        "name",
        "parameters",
        "context",
        "tags",
        "parent_task_run_id",
        "state",
        "empirical_policy",
    }
)
_STATE_FIELDS = frozenset({"type", "name", "message", "state_details", "data", "timestamp"})
_POLICY_FIELDS = frozenset({"retries", "retry_delay"})


def subflow_run(body: Any, what: str) -> dict[str, Any] | Refusal:
    """The sub-flow run the gateway creates: Pending, in no pool or queue, with no job
    variables: no worker polls it, and only its parent's engine runs it. Tagged
    :data:`SANDBOXED_TAG` whatever tags the run sent."""
    rule = "own-sub-flows"
    if not isinstance(body, dict):
        return Refusal(rule, f"{what}: a flow run's creation is a JSON object")
    extra = sorted(set(body) - SUBFLOW_FIELDS)
    if extra:
        return Refusal(rule, f"{what}: fields {extra} are not the engine's for a sub-flow (refused)")
    flow_id, parent = canonical_uuid(body.get("flow_id")), canonical_uuid(body.get("parent_task_run_id"))
    if flow_id is None or parent is None:
        return Refusal(rule, f"{what}: a sub-flow names its flow_id and parent_task_run_id")
    state = body.get("state")
    if state is not None:
        if not isinstance(state, dict):
            return Refusal(rule, f"{what}: a sub-flow's state is a JSON object")
        if set(state) - _STATE_FIELDS:
            return Refusal(rule, f"{what}: state fields {sorted(set(state) - _STATE_FIELDS)} refused")
        if state.get("type") != "PENDING":
            return Refusal(rule, f"{what}: a sub-flow starts Pending, not {state.get('type')!r}")
    policy = body.get("empirical_policy") or {}
    if not isinstance(policy, dict) or set(policy) - _POLICY_FIELDS:
        return Refusal(rule, f"{what}: empirical_policy fields beyond {sorted(_POLICY_FIELDS)} refused")
    retries, delay = policy.get("retries"), policy.get("retry_delay") or 0
    if not (retries is None or _small_int(retries)) or not _small_int(delay):
        return Refusal(rule, f"{what}: empirical_policy holds retries/retry_delay as small integers")
    tags = body.get("tags") or []
    if not isinstance(tags, list) or not all(isinstance(t, str) and len(t) <= 256 for t in tags):
        return Refusal(rule, f"{what}: tags are a list of strings")
    name, version = body.get("name"), body.get("flow_version")
    if not (name is None or isinstance(name, str)) or not (version is None or isinstance(version, str)):
        return Refusal(rule, f"{what}: name and flow_version are strings")
    params, context = body.get("parameters") or {}, body.get("context") or {}
    if not isinstance(params, dict) or not isinstance(context, dict):
        return Refusal(rule, f"{what}: parameters and context are objects")
    out: dict[str, Any] = {
        "flow_id": flow_id,
        "parent_task_run_id": parent,
        "name": name,
        "flow_version": version,
        "parameters": params,
        "context": context,
        "tags": [*tags, SANDBOXED_TAG] if SANDBOXED_TAG not in tags else tags,
        "state": {"type": "PENDING", "name": "Pending"},
        "empirical_policy": {"retries": retries, "retry_delay": delay},
    }
    return out


# --------------------------------------------------------------------------- a listing of flow runs


@dataclass(frozen=True)
class FlowRunListing:
    """``POST /flow_runs/filter`` as the engine sends it: by ids, or by parent task runs."""

    by: str  # "id" or "parent_task_run_id"
    ids: tuple[str, ...]
    state: dict[str, list[str]] | None
    sort: str | None
    limit: int | None
    offset: int

    def body(self, ids: list[str]) -> dict[str, Any]:
        """The filter forwarded: the gateway's own, over ``ids`` (already the run's own)."""
        runs: dict[str, Any] = {self.by: {"any_": ids}}
        if self.state:
            runs["state"] = {k: {"any_": v} for k, v in self.state.items()}
        # No more rows than can match: a listing by id has at most one per id (its answer is
        # bounded by what the run names, not by the limit it sends), one by parents at most
        # Prefect's own page.
        most = len(ids) if self.by == "id" else MAX_LISTED
        limit = min(self.limit or most, most)
        out: dict[str, Any] = {"flow_runs": runs, "limit": limit, "offset": self.offset}
        if self.sort:
            out["sort"] = self.sort
        return out


_TOP = frozenset(
    {
        "flows",
        "flow_runs",
        "task_runs",
        "deployments",
        "work_pools",
        "work_pool_queues",
        "sort",
        "limit",
        "offset",
    }
)
_SORTS = frozenset(
    {
        "ID_DESC",
        "START_TIME_ASC",
        "START_TIME_DESC",
        "EXPECTED_START_TIME_ASC",
        "EXPECTED_START_TIME_DESC",
        "NAME_ASC",
        "NAME_DESC",
        "NEXT_SCHEDULED_START_TIME_ASC",
        "END_TIME_DESC",
    }
)
_STATE_TYPES = frozenset(
    {"SCHEDULED", "PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "CRASHED", "PAUSED", "CANCELLING"}
)


def flow_run_listing(body: Any, what: str) -> FlowRunListing | Refusal:
    rule = "own-runs-only"
    if not isinstance(body, dict):
        return Refusal(rule, f"{what}: a listing is a JSON object")
    extra = sorted(set(body) - _TOP)
    others = sorted(k for k in _TOP - {"flow_runs", "sort", "limit", "offset"} if body.get(k) is not None)
    if extra or others:
        return Refusal(rule, f"{what}: fields {extra + others} are not the engine's (refused)")
    runs = body.get("flow_runs")
    if not isinstance(runs, dict):
        return Refusal(rule, f"{what}: a listing names flow_runs by id or by parent task run")
    if runs.get("operator", "and_") != "and_":
        return Refusal(rule, f"{what}: operator {runs.get('operator')!r} refused (only and_)")
    keys = set(runs) - {"operator"}
    by = [k for k in ("id", "parent_task_run_id") if k in keys]
    unknown = sorted(keys - {"id", "parent_task_run_id", "state"})
    if unknown or len(by) != 1:
        return Refusal(
            rule,
            f"{what}: flow_runs filters {unknown or sorted(keys)} refused (one of id, parent_task_run_id)",
        )
    cond = runs[by[0]]
    ids = cond.get("any_") if isinstance(cond, dict) else None
    if (
        not isinstance(cond, dict)
        or set(cond) - {"any_", "operator"}
        or cond.get("operator", "and_") != "and_"
        or not isinstance(ids, list)
        or not ids
        or len(ids) > MAX_IDS
        or any(canonical_uuid(i) is None for i in ids)
    ):
        return Refusal(rule, f"{what}: flow_runs.{by[0]} is {{any_: [1..{MAX_IDS} ids]}} and nothing else")
    state = _state_filter(runs.get("state"))
    if isinstance(state, str):
        return Refusal(rule, f"{what}: {state}")
    sort, limit, offset = body.get("sort"), body.get("limit"), body.get("offset") or 0
    if sort is not None and (not isinstance(sort, str) or sort not in _SORTS):
        return Refusal(rule, f"{what}: sort {sort!r} refused")
    if not (limit is None or _small_int(limit)) or not _small_int(offset):
        return Refusal(rule, f"{what}: limit and offset are small integers")
    return FlowRunListing(by[0], tuple(str(canonical_uuid(i)) for i in ids), state, sort, limit, offset)


def _state_filter(state: Any) -> dict[str, list[str]] | None | str:
    if state is None:
        return None
    if not isinstance(state, dict) or set(state) - {"type", "name", "operator"}:
        return "flow_runs.state is {type: {any_}, name: {any_}}"
    out: dict[str, list[str]] = {}
    for k in ("type", "name"):
        cond = state.get(k)
        if cond is None:
            continue
        vals = cond.get("any_") if isinstance(cond, dict) else None
        if (
            not isinstance(cond, dict)
            or set(cond) - {"any_"}
            or not isinstance(vals, list)
            or not all(isinstance(v, str) for v in vals)
        ):
            return f"flow_runs.state.{k} is {{any_: [...]}}"
        if k == "type" and set(vals) - _STATE_TYPES:
            return f"state types {sorted(set(vals) - _STATE_TYPES)} refused"
        out[k] = [str(v)[:64] for v in vals[:16]]
    return out or None


def canonical_uuid(value: Any) -> str | None:
    """``value`` as the API writes a UUID (lower case, hyphenated), or None if it is none."""
    if not isinstance(value, str):
        return None
    try:
        return str(uuid.UUID(value))
    except ValueError:
        return None


def _small_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1_000_000


# --------------------------------------------------------------------------- every other admitted body

#: The fields Prefect 3.9's client sends to the other endpoints a run may write to (its
#: ``TaskRunCreate``, ``ArtifactCreate``/``ArtifactUpdate``, ``LogCreate``, ``StateCreate``
#: and the concurrency client's bodies). ``*`` stands for one id in the path.
_STATE = frozenset({"type", "name", "message", "state_details", "data", "timestamp", "id"})
_LOG = frozenset({"name", "level", "message", "timestamp", "flow_run_id", "task_run_id", "worker_id"})
_FIELDS: dict[tuple[str, str], frozenset[str]] = {
    ("POST", "task_runs"): frozenset(
        {
            "id",
            "name",
            "flow_run_id",
            "task_key",
            "dynamic_key",
            "cache_key",
            "cache_expiration",
            "task_version",
            "empirical_policy",
            "tags",
            "labels",
            "task_inputs",
            "state",
        }
    ),
    ("POST", "artifacts"): frozenset(
        {"key", "type", "description", "data", "metadata_", "flow_run_id", "task_run_id"}
    ),
    ("PATCH", "artifacts/*"): frozenset({"data", "description", "metadata_"}),
    ("POST", "flow_runs/*/set_state"): frozenset({"state", "force"}),
    ("POST", "task_runs/*/set_state"): frozenset({"state", "force"}),
    ("POST", "v2/concurrency_limits/increment-with-lease"): frozenset(
        {"names", "slots", "mode", "lease_duration", "holder"}
    ),
    ("POST", "v2/concurrency_limits/decrement-with-lease"): frozenset({"lease_id"}),
    ("POST", "v2/concurrency_limits/leases/*/renew"): frozenset({"lease_duration"}),
}


#: ``StateDetails`` as Prefect's client sends them for a run it runs itself: all its fields
#: but the two that hand a task run to someone else (below). A field outside this set is
#: dropped (Prefect's versions differ in which they send; the server ignores unknown ones).
_STATE_DETAILS = frozenset(
    {
        "flow_run_id",
        "task_run_id",
        "child_flow_run_id",
        "scheduled_time",
        "cache_key",
        "cache_expiration",
        "untrackable_result",
        "pause_timeout",
        "pause_reschedule",
        "pause_key",
        "run_input_keyset",
        "refresh_cache",
        "retriable",
        "transition_id",
        "traceparent",
        "deployment_concurrency_lease_id",
    }
)
#: What makes a task run a background one: Prefect's server enqueues a task run proposed
#: Scheduled with ``deferred`` for whichever task worker serves its key (``prefect task
#: serve``, on a host the run has no business on), and that worker reads its parameters by
#: ``task_parameters_id``. An in-flow task run is run by its flow's engine, never deferred.
BACKGROUND_DETAILS = ("deferred", "task_parameters_id")


def background_detail(details: Any) -> str | None:
    """The ``state_details`` field that would hand the run to a task worker, if set (any value
    but null/false: the server's pydantic reads ``"yes"`` or ``1`` as true)."""
    if not isinstance(details, dict):
        return None
    for k in BACKGROUND_DETAILS:
        if details.get(k) not in (None, False):
            return k
    return None


def background_in(payload: Any) -> str | None:
    """A background field set in any ``state_details`` a payload holds (an event's states and
    its ``task_run``, which Prefect's task-run recorder writes to the API's database as sent)."""
    todo = [payload]
    while todo:  # the payload is bounded (parse_bounded): a walk, not a recursion
        node = todo.pop()
        if isinstance(node, dict):
            named = background_detail(node.get("state_details"))
            if named is not None:
                return named
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return None


def task_run_state(state: Any, what: str) -> dict[str, Any] | Refusal:
    """A task run's proposed state as forwarded: the engine's fields, ``state_details`` rebuilt
    from :data:`_STATE_DETAILS`; a background (deferred) state is refused."""
    if not isinstance(state, dict):
        return Refusal("engine-fields", f"{what}: a state is a JSON object")
    details = state.get("state_details")
    if details is not None and not isinstance(details, dict):
        return Refusal("engine-fields", f"{what}: state.state_details is a JSON object")
    named = background_detail(details)
    if named is not None:
        return Refusal(
            "no-background-tasks",
            f"{what}: state_details.{named} would hand the task run to a task worker outside "
            "this sandbox (background tasks are refused)",
        )
    out = {k: state[k] for k in _STATE if k in state and k != "state_details"}
    if details is not None:
        out["state_details"] = {k: details[k] for k in _STATE_DETAILS if k in details}
    return out


#: Fields of its own flow run the engine updates (``flow_version``, ``empirical_policy``
#: when it starts; ``name`` for a templated run name); the rest (infrastructure pid, job
#: variables, work queue) are the worker's and the server's.
FLOW_RUN_FIELDS = frozenset({"flow_version", "empirical_policy", "name"})
#: The one label the engine sets on its own flow run (``update_flow_run_labels``: its trace
#: context), and the bound on its value.
_ENGINE_LABELS = frozenset({"__OTEL_TRACEPARENT"})
MAX_LABEL = 1024
#: ``FlowRunPolicy`` as the engine sends it back with a flow's retries (``update_flow_run``).
_POLICY_NUMBERS = ("max_retries", "retries", "retry_delay_seconds", "retry_delay")
_RETRY_TYPES = (None, "in_process", "reschedule")


def _own_labels(body: Any, what: str) -> Rebuilt | Refusal:
    """The labels a run sets on itself: only the engine's trace context, a string."""
    if (
        not isinstance(body, dict)
        or set(body) - _ENGINE_LABELS
        or not all(isinstance(v, str) and len(v) <= MAX_LABEL for v in body.values())
    ):
        return Refusal(
            "engine-fields", f"{what}: a run sets only its own {sorted(_ENGINE_LABELS)} label, a string"
        )
    return Rebuilt(dict(body))


def _own_flow_run_update(body: Any, what: str) -> Rebuilt | Refusal:
    """A run's update of itself (its rules admit only these keys): each value of the type the
    engine sends, rebuilt."""
    refused = Refusal(
        "engine-fields",
        f"{what}: name and flow_version are strings, empirical_policy Prefect's FlowRunPolicy",
    )
    if not isinstance(body, dict) or set(body) - FLOW_RUN_FIELDS:
        return refused
    out: dict[str, Any] = {}
    for k in ("name", "flow_version"):
        if k in body:
            if not (body[k] is None or isinstance(body[k], str) and len(body[k]) <= MAX_LABEL):
                return refused
            out[k] = body[k]
    if "empirical_policy" in body:
        policy = body["empirical_policy"]
        keys = {*_POLICY_NUMBERS, "pause_keys", "resuming", "retry_type"}
        if not isinstance(policy, dict) or set(policy) - keys:
            return refused
        for k in _POLICY_NUMBERS:
            v = policy.get(k)
            number = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1_000_000
            if not (v is None or number):
                return refused
        pause = policy.get("pause_keys")
        if not (pause is None or isinstance(pause, list) and all(isinstance(p, str) for p in pause)):
            return refused
        resuming, retry_type = policy.get("resuming"), policy.get("retry_type")
        if not (resuming is None or isinstance(resuming, bool)) or not (
            retry_type is None or isinstance(retry_type, str) and retry_type in _RETRY_TYPES
        ):
            return refused
        out["empirical_policy"] = {k: policy[k] for k in keys if k in policy}
    return Rebuilt(out)


#: The longest lease of concurrency slots a run may take: Prefect's engine's default, which
#: it renews while the task runs.
MAX_LEASE_SECONDS = 300.0


def engine_fields(method: str, path: str, body: Any) -> Rebuilt | Refusal | None:
    """An admitted body rebuilt from the engine's fields of its endpoint (a field it does not
    send is refused, naming it); None where the endpoint has no table here."""
    parts = path.strip("/").split("/")
    shape = "/".join("*" if canonical_uuid(p) is not None else p for p in parts)
    what = f"{method} /api{path}"
    if (method, shape) == ("POST", "logs") and isinstance(body, list):
        extra = sorted({k for e in body if isinstance(e, dict) for k in e} - _LOG)
        if extra:
            return Refusal("engine-fields", f"{what}: log fields {extra} are not the engine's (refused)")
        return Rebuilt([{k: e[k] for k in _LOG if k in e} for e in body])
    if (method, shape) == ("PATCH", "flow_runs/*/labels"):
        return _own_labels(body, what)
    if (method, shape) == ("PATCH", "flow_runs/*"):
        return _own_flow_run_update(body, what)
    allowed = _FIELDS.get((method, shape))
    if allowed is None:
        return None
    if not isinstance(body, dict):  # not JSON (or encoded) is never forwarded as sent
        return Refusal("engine-fields", f"{what}: the body is a JSON object")
    extra = sorted(set(body) - allowed)
    state = body.get("state") if "set_state" in shape or shape == "task_runs" else None
    if isinstance(state, dict):
        extra += [f"state.{k}" for k in sorted(set(state) - _STATE)]
    if extra:
        return Refusal("engine-fields", f"{what}: fields {extra} are not the engine's (refused)")
    out = {k: body[k] for k in body}
    if "force" in out and not isinstance(out["force"], bool):
        return Refusal("engine-fields", f"{what}: force is true or false")
    if shape.startswith(("task_runs", "flow_runs")) and "state" in body and body["state"] is not None:
        rebuilt = task_run_state(body["state"], what)
        if isinstance(rebuilt, Refusal):
            return rebuilt
        out["state"] = rebuilt
    if shape == "v2/concurrency_limits/increment-with-lease":
        slots, mode, holder = out.get("slots", 1), out.get("mode", "concurrency"), out.get("holder")
        if not _small_int(slots) or slots < 1 or mode not in ("concurrency", "rate_limit"):
            return Refusal(
                "engine-fields", f"{what}: slots is a small positive integer, mode concurrency or rate_limit"
            )
        if holder is not None:
            if not isinstance(holder, dict) or set(holder) - {"type", "id"}:
                return Refusal("engine-fields", f"{what}: a holder is {{type, id}}")
            out["holder"] = {k: holder[k] for k in ("type", "id") if k in holder}
    if shape.startswith("v2/concurrency_limits") and "lease_duration" in out:
        lease = out["lease_duration"]
        if not isinstance(lease, (int, float)) or isinstance(lease, bool) or not 0 < lease < float("inf"):
            return Refusal("engine-fields", f"{what}: lease_duration is a number of seconds")
        # The engine's own lease (renewed while its task runs): a run's slot is never held
        # for longer by a lease it chose, after the run is gone.
        out["lease_duration"] = min(lease, MAX_LEASE_SECONDS)
    return Rebuilt(out)
