"""The wire contract shared by host and guest: key layout, chunk naming, object shapes,
the guest's ``RESOLUTO_*`` environment and the warm guest's lines.

Nothing else in either package spells a conduit key, serialises a wire object or names
a variable of the guest's environment. Encodings match the reference implementation
byte for byte: compact JSON in the field order of its models for events and results,
``{"total_chunks": N}`` for the manifest, and chunks of newline-terminated JSON lines.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, TypedDict, cast

#: The protocol this code speaks: spec/PROTOCOL.md and the schemas of the reference
#: implementation as released in resoluto-sandbox 0.1.0 (the schemas' copy here:
#: prefect_resoluto/schemas/). No object of that contract has a version field, so nothing
#: on the wire carries it; tests/test_wire_compat.py checks it against the reference it
#: runs both directions with, and scripts/setup.sh installs that release.
WIRE_VERSION = "0.1.0"

INBOX = "inbox"
OUTBOX = "outbox"
RESULT = "result.json"
MANIFEST = "_manifest.json"
TASK = "task.json"
CHUNK_PREFIX = "events-"
CHUNK_SUFFIX = ".jsonl"
ARCHIVE_SUFFIX = ".tar.gz"
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")
OUTPUT_ARCHIVE_NAME = "output"
WORKSPACE_ARCHIVE_NAME = "workspace"

#: A workload line starting with this is a structured log record: JSON with level, logger, msg.
LOG_MARKER = "\x1eresoluto-log:"
#: The most a host reads of one event chunk, and of one line in it (checked before
#: reading: issue 30). A guest runner splits a workload's output lines at
#: MAX_LOG_LINE_BYTES, so its lines (JSON-escaped at most 6x) and its chunks (flushed
#: at 256 KiB) stay far below both.
MAX_CHUNK_BYTES = 32 << 20
MAX_LINE_BYTES = 16 << 20
#: A little over 1 MiB, so that a relayed artifact of MAX_ARTIFACT_BYTES plus its marker
#: is one line.
MAX_LOG_LINE_BYTES = (1 << 20) + (64 << 10)
#: The most a host reads of result.json and of _manifest.json.
MAX_RESULT_BYTES = 16 << 20
MAX_MANIFEST_BYTES = 4096
#: A workload line starting with this is an artifact a task relays (guest_runner.prefect_api):
#: JSON with op ("create" / "update"), id, and the artifact's type, label (Prefect's key),
#: description and data.
#: It travels as a "log" event of kind "artifact" whose data holds it under "artifact" (the
#: reference's readers take any kind and any data object: to them it is a log line).
ARTIFACT_MARKER = "\x1eresoluto-artifact:"
#: At most this many bytes of one relayed artifact's JSON (its data, key, description).
MAX_ARTIFACT_BYTES = 1 << 20

# -- the guest's environment --------------------------------------------------------------
# A host configures a guest (guest_runner.runner) with these variables, as the reference's
# runner is (its spec names RESOLUTO_WORKLOAD_ARGV, RESOLUTO_WORKSPACE_DIR and
# RESOLUTO_OUTPUT_PATHS; the store's and the ids' are its runner's too); the rest are ours.
#: Every variable of the guest's own (its redactor never takes one for a secret by its name).
ENV_NAME_PREFIX = "RESOLUTO_"
#: Where the node's objects live (guest_runner.conduit.registry reads them).
ENV_STORE_NAME_PREFIX = "RESOLUTO_STORE_"
ENV_STORE_KIND = "RESOLUTO_STORE_KIND"
ENV_STORE_ROOT = "RESOLUTO_STORE_ROOT"
ENV_STORE_BUCKET = "RESOLUTO_STORE_BUCKET"
ENV_STORE_ENDPOINT = "RESOLUTO_STORE_ENDPOINT"
ENV_STORE_REGION = "RESOLUTO_STORE_REGION"
ENV_STORE_PREFIX = "RESOLUTO_STORE_PREFIX"
ENV_STORE_WRITE_TOKEN = "RESOLUTO_STORE_WRITE_TOKEN"
ENV_RUN_ID = "RESOLUTO_RUN_ID"
ENV_NODE_ID = "RESOLUTO_NODE_ID"
ENV_WORKLOAD_ARGV = "RESOLUTO_WORKLOAD_ARGV"
ENV_WORKSPACE_DIR = "RESOLUTO_WORKSPACE_DIR"
ENV_OUTPUT_PATHS = "RESOLUTO_OUTPUT_PATHS"
ENV_SETUP_ARGV = "RESOLUTO_SETUP_ARGV"
ENV_CLEANUP_ARGV = "RESOLUTO_CLEANUP_ARGV"
ENV_SECRET_ENV = "RESOLUTO_SECRET_ENV"
ENV_USER_ENV = "RESOLUTO_USER_ENV"
ENV_HEARTBEAT_INTERVAL = "RESOLUTO_HEARTBEAT_INTERVAL"
ENV_EGRESS_PROXY = "RESOLUTO_EGRESS_PROXY"
ENV_EGRESS_CANARY = "RESOLUTO_EGRESS_CANARY"
ENV_EGRESS_PHASES = "RESOLUTO_EGRESS_PHASES"
ENV_EGRESS_CANARY_WORKLOAD = "RESOLUTO_EGRESS_CANARY_WORKLOAD"
ENV_WORKLOAD_USER = "RESOLUTO_WORKLOAD_USER"
ENV_WORKLOAD_PIDNS = "RESOLUTO_WORKLOAD_PIDNS"
#: What the host read of the runner's allowed Prefect variables and blocks
#: (guest_runner.prefect_api), and the declared secrets naming each value it holds.
ENV_PREFECT_READS = "RESOLUTO_PREFECT_READS"
ENV_PREFECT_READ_NAME_PREFIX = "RESOLUTO_PREFECT_READ_"
#: The host's heartbeat (guest_runner.hostwatch): the store key of an object its host
#: rewrites every few seconds, and the seconds it may stay unchanged before the guest
#: takes its host for gone, kills its work and exits. Unset (a reference host): no check.
ENV_HOST_BEAT_KEY = "RESOLUTO_HOST_BEAT_KEY"
ENV_HOST_LOST_AFTER = "RESOLUTO_HOST_LOST_AFTER"
#: Where a sandbox's bootstrap fetches the guest runner from the conduit, and its digest.
ENV_GUEST_BUNDLE_KEY = "RESOLUTO_GUEST_BUNDLE_KEY"
ENV_GUEST_BUNDLE_SHA256 = "RESOLUTO_GUEST_BUNDLE_SHA256"

# -- the warm guest's protocol (guest_runner.warm and the host's prefect_resoluto.warm) -----
#: The node's conduit directory's fixed path in a slotted warm sandbox.
ENV_WARM_SLOT = "RESOLUTO_WARM_SLOT"
#: What the warm guest pre-starts for the call (:func:`warm_call_mode`).
ENV_WARM_CALL = "RESOLUTO_WARM_CALL"
#: "1": a snapshot template.
ENV_WARM_SNAPSHOT = "RESOLUTO_WARM_SNAPSHOT"
#: Set by a warm guest for its pre-started call process (guest_runner.warmcall).
ENV_WARM_ENGINE = "RESOLUTO_WARM_ENGINE"
ENV_WARM_IMPORTS = "RESOLUTO_WARM_IMPORTS"
#: ENV_WARM_CALL's values: the call's interpreter; it pre-importing these modules; or
#: Prefect's flow-run engine (a worker's flow run), whose module the command must run
#: (guest_runner.engine: Prefect's, with the gateway's refusals raised as a task's are).
WARM_CALL_PLAIN = "1"
WARM_CALL_IMPORTS = "import:"
WARM_CALL_ENGINE = "engine"
WARM_ENGINE_MODULE = "guest_runner.engine"
#: Printed (stdout: the sandbox's log) once everything is imported and started.
WARM_READY = "resoluto warm: ready"
#: Printed by a template at the point the host checkpoints it.
WARM_SNAPSHOT_READY = "resoluto warm: snapshot-ready"
#: The one line a restored sandbox reads before it says it is ready.
WARM_WAKE = b'{"wake":1}\n'

EVENT_FIELDS = ("run_id", "span_id", "parent_span_id", "kind", "name", "event", "ts", "status", "data")
RESULT_FIELDS = (
    "node_id",
    "status",
    "exit_code",
    "output_archive",
    "observed_phase",
    "reason",
    "substrate_logs",
)
EVENT_KINDS = ("open", "close", "log")

# \Z, not $: "$" also matches before a final newline ("events-000007.jsonl\n" is no chunk).
_CHUNK_RE = re.compile(r"(?:^|/)events-([0-9]{6,})\.jsonl\Z")
# Identifiers become path segments of conduit keys, so they are held to a safe alphabet.
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")


class SpanEvent(TypedDict):
    """One line of an ``events-*.jsonl`` chunk, as :func:`make_event` builds it and
    :func:`decode_event` returns it (the reference model's defaults filled in).

    A decoded event from a sandbox is untrusted: :func:`decode_event` checks every field
    of this shape (strings, a finite ``ts`` in range, an object ``data``) and the fields of
    ``data`` a host reads (``_check_data``); the rest of ``data`` is as parsed."""

    run_id: str
    span_id: str
    parent_span_id: str
    kind: str
    name: str
    event: str
    ts: float
    status: str
    data: Dict[str, Any]


class NodeResult(TypedDict):
    """``result.json``: the guest's verdict and, appended by a host, what it observed."""

    node_id: str
    status: str
    exit_code: Optional[int]
    output_archive: Optional[str]
    observed_phase: str
    reason: str
    substrate_logs: str


class Manifest(TypedDict):
    """``_manifest.json``: written last, the EOF marker of a node's event stream."""

    total_chunks: int


class WireError(ValueError):
    """An object on the conduit does not follow the wire contract."""


def check_id(value: str, what: str) -> str:
    if not isinstance(value, str) or not _ID_RE.match(value) or ".." in value:
        raise WireError(
            f"{what} {value!r} is not a valid identifier: use 1-128 characters of "
            "letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return value


def node_prefix(run_id: str, node_id: str, base: str = "") -> str:
    """``[<base>/]run/<run_id>/nodes/<node_id>`` (no trailing slash)."""
    key = f"run/{check_id(run_id, 'run id')}/nodes/{check_id(node_id, 'node id')}"
    base = base.strip("/")
    return f"{base}/{key}" if base else key


def run_prefix(run_id: str, base: str = "") -> str:
    key = f"run/{check_id(run_id, 'run id')}"
    base = base.strip("/")
    return f"{base}/{key}" if base else key


def _join(prefix: str, rel: str) -> str:
    prefix = prefix.rstrip("/")
    return f"{prefix}/{rel}" if prefix else rel


#: The hosts' heartbeats live under ``[<base>/]hosts/<writer>/``: outside ``run/``, so no
#: reader of a run's or a node's keys (ours, the reference's) ever meets one.
HOSTS = "hosts"
HOST_BEAT = "beat"
#: The most a guest reads of a heartbeat object (a counter and a tick: a few dozen bytes).
MAX_HOST_BEAT_BYTES = 256


def host_beat_dir(writer: str, base: str = "") -> str:
    """``[<base>/]hosts/<writer>``: the directory of one host writer's heartbeat."""
    key = f"{HOSTS}/{check_id(writer, 'heartbeat writer')}"
    base = base.strip("/")
    return f"{base}/{key}" if base else key


def host_beat_key(writer: str, base: str = "") -> str:
    return _join(host_beat_dir(writer, base), HOST_BEAT)


def host_beat_poll(lost_after: float) -> float:
    """How often a guest reads its host's heartbeat: six reads within the bound."""
    return max(0.05, lost_after / 6.0)


def chunk_key(prefix: str, index: int) -> str:
    if index < 1:
        raise WireError(f"chunk numbers start at 1, got {index}")
    return _join(prefix, f"{CHUNK_PREFIX}{index:06d}{CHUNK_SUFFIX}")


def chunk_index(key: str) -> Optional[int]:
    """The sequence number of a chunk key, or None when the key is not a chunk."""
    m = _CHUNK_RE.search(key)
    return int(m.group(1)) if m else None


def result_key(prefix: str) -> str:
    return _join(prefix, RESULT)


def manifest_key(prefix: str) -> str:
    return _join(prefix, MANIFEST)


def task_key(prefix: str) -> str:
    return _join(prefix, TASK)


def inbox_prefix(prefix: str) -> str:
    return _join(prefix, INBOX) + "/"


def outbox_prefix(prefix: str) -> str:
    return _join(prefix, OUTBOX) + "/"


def _archive_name(name: str) -> str:
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", name):
        raise WireError(f"archive name {name!r} must be a plain file name")
    return name


def inbox_key(prefix: str, name: str) -> str:
    return inbox_prefix(prefix) + _archive_name(name) + ARCHIVE_SUFFIX


def outbox_key(prefix: str, name: str = OUTPUT_ARCHIVE_NAME) -> str:
    return outbox_prefix(prefix) + _archive_name(name) + ARCHIVE_SUFFIX


def is_archive_key(key: str) -> bool:
    return key.endswith(ARCHIVE_SUFFIXES)


def new_span_id() -> str:
    # 16 random hex digits, as uuid4().hex[:16] gave, without importing uuid in every sandbox
    return os.urandom(8).hex()


# pydantic's model_dump_json in the reference: compact separators, UTF-8 kept as is.
# One encoder for the process: json.dumps with options builds a new one per call.
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def make_event(
    run_id: str,
    kind: str,
    event: str,
    *,
    span_id: Optional[str] = None,
    parent_span_id: str = "",
    name: str = "",
    status: str = "",
    data: Optional[Dict[str, Any]] = None,
    ts: Optional[float] = None,
) -> SpanEvent:
    if event not in EVENT_KINDS:
        raise WireError(f"event must be one of {EVENT_KINDS}, got {event!r}")
    return {
        "run_id": run_id,
        "span_id": span_id or new_span_id(),
        "parent_span_id": parent_span_id,
        "kind": kind,
        "name": name,
        "event": event,
        "ts": time.time() if ts is None else float(ts),
        "status": status,
        "data": dict(data or {}),
    }


def encode_event(ev: SpanEvent) -> str:
    fields: Mapping[str, object] = ev
    return _dumps({k: fields[k] for k in EVENT_FIELDS})


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: a float Python reads as infinity
        raise ValueError(f"{text[:40]} is out of range")
    return value


def _loads(text: str) -> Any:
    """json.loads for text a sandbox wrote, as strict as JSON itself: ``NaN``/``Infinity``
    (which Python's json takes by default) and numbers past a float's range are malformed
    input, and so is nesting past the parser's recursion limit (ValueError, never an
    OverflowError or a RecursionError escaping into the host). Integers past 4300 digits
    are refused by the interpreter (ValueError) as they are read."""
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise ValueError("nested too deeply") from None


#: The latest ``ts`` a host takes (the last second of the year 9999, the last a datetime
#: holds); the earliest is the epoch. An emitter stamps its clock's time.
MAX_EVENT_TS = 253402300799.0
#: The most an ``exit_code`` in an event's data may be, either side of zero (a wait status
#: is far smaller; a number past this is junk a host's formatting need not meet).
MAX_EXIT_CODE = 1 << 31
_EVENT_STRINGS = ("run_id", "span_id", "parent_span_id", "kind", "name", "event", "status")


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_data(data: Dict[str, Any]) -> None:
    """The fields of an event's ``data`` a host reads, held to the types its guest writes:
    a log's ``line``, ``level`` and ``logger``, a span's ``argv`` and ``exit_code``, a relayed
    artifact's record. Any other field is the guest's business and passes as parsed."""
    for key in ("line", "level"):
        if key in data and not isinstance(data[key], str):
            raise WireError(f"event field 'data.{key}' must be a string, not {_type_name(data[key])}")
    logger = data.get("logger")
    if logger is not None and not isinstance(logger, str):
        raise WireError(f"event field 'data.logger' must be a string or null, not {_type_name(logger)}")
    argv = data.get("argv")
    if argv is not None and (not isinstance(argv, list) or not all(isinstance(a, str) for a in argv)):
        raise WireError("event field 'data.argv' must be an array of strings")
    code = data.get("exit_code")
    in_range = isinstance(code, int) and not isinstance(code, bool) and abs(code) <= MAX_EXIT_CODE
    if code is not None and not in_range:
        raise WireError(
            f"event field 'data.exit_code' must be an integer within {MAX_EXIT_CODE} of 0, or null"
        )
    if "artifact" in data and not isinstance(data["artifact"], dict):
        raise WireError(f"event field 'data.artifact' must be an object, not {_type_name(data['artifact'])}")


def decode_event(line: str) -> SpanEvent:
    """Parse one JSONL line into an event, filling the reference model's defaults."""
    try:
        obj = _loads(line)
    except ValueError as e:
        raise WireError(f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise WireError("an event line must be a JSON object")
    for req in ("run_id", "span_id", "kind", "event", "ts"):
        if req not in obj:
            raise WireError(f"event is missing required field {req!r}")
    obj.setdefault("parent_span_id", "")
    obj.setdefault("name", "")
    obj.setdefault("status", "")
    obj.setdefault("data", {})
    # Every field a host reads is checked here, once, so no handler of the event meets a
    # value it cannot take (an OverflowError from an infinite ts, a bool for a number).
    for field in _EVENT_STRINGS:
        if not isinstance(obj[field], str):
            raise WireError(f"event field {field!r} must be a string, not {_type_name(obj[field])}")
    if obj["event"] not in EVENT_KINDS:
        raise WireError(f"unknown event {obj['event'][:40]!r}")
    ts = obj["ts"]
    if not _is_number(ts):
        raise WireError(f"event field 'ts' must be a number, not {_type_name(ts)}")
    if not 0 <= ts <= MAX_EVENT_TS:  # compared as is: a huge integer never becomes a float
        raise WireError(f"event field 'ts' must be seconds since the epoch up to {MAX_EVENT_TS:.0f}")
    obj["ts"] = float(ts)
    if not isinstance(obj["data"], dict):
        raise WireError(f"event field 'data' must be an object, not {_type_name(obj['data'])}")
    _check_data(obj["data"])
    return cast(SpanEvent, obj)


def encode_chunk(lines: List[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode("utf-8")


def make_result(
    node_id: str,
    status: str = "failure",
    exit_code: Optional[int] = None,
    output_archive: Optional[str] = None,
    observed_phase: str = "",
    reason: str = "",
    substrate_logs: str = "",
) -> NodeResult:
    if status not in ("success", "failure"):
        raise WireError(f"result status must be 'success' or 'failure', got {status!r}")
    return {
        "node_id": node_id,
        "status": status,
        "exit_code": exit_code,
        "output_archive": output_archive,
        "observed_phase": observed_phase,
        "reason": reason,
        "substrate_logs": substrate_logs,
    }


def encode_result(result: NodeResult) -> bytes:
    fields: Mapping[str, object] = result
    return _dumps({k: fields[k] for k in RESULT_FIELDS}).encode("utf-8")


def decode_result(raw: bytes) -> NodeResult:
    try:
        obj = _loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise WireError(f"result.json is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise WireError("result.json must be a JSON object")
    status = obj.get("status", "failure")
    if status not in ("success", "failure"):
        raise WireError(f"result.json has status {status!r}; expected 'success' or 'failure'")
    exit_code = obj.get("exit_code")
    if exit_code is not None and (not isinstance(exit_code, int) or isinstance(exit_code, bool)):
        raise WireError("result.json field 'exit_code' must be an integer or null")
    out = make_result(str(obj.get("node_id", "")), status, exit_code, obj.get("output_archive"))
    out["observed_phase"] = str(obj.get("observed_phase", "") or "")
    out["reason"] = str(obj.get("reason", "") or "")
    out["substrate_logs"] = str(obj.get("substrate_logs", "") or "")
    return out


def encode_manifest(total_chunks: int) -> bytes:
    manifest: Manifest = {"total_chunks": int(total_chunks)}
    return json.dumps(manifest).encode("utf-8")


def decode_manifest(raw: bytes) -> int:
    try:
        obj = _loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise WireError(f"_manifest.json is not valid JSON ({e})") from None
    total = obj.get("total_chunks") if isinstance(obj, dict) else None
    if not isinstance(total, int) or isinstance(total, bool) or total < 0:
        raise WireError(f'_manifest.json must be {{"total_chunks": <int >= 0>}}, got {obj!r}')
    return total


def warm_call_mode(engine: bool, imports: Sequence[str]) -> str:
    """ENV_WARM_CALL's value for a warm sandbox."""
    if engine:
        return WARM_CALL_ENGINE
    return WARM_CALL_IMPORTS + ",".join(imports) if imports else WARM_CALL_PLAIN


def encode_assignment(env: Dict[str, str], secret_env: Dict[str, str]) -> bytes:
    """A warm guest's assignment: one JSON line on its stdin, never in the conduit."""
    return json.dumps({"env": env, "secret_env": secret_env}, separators=(",", ":")).encode() + b"\n"


def decode_assignment(line: str) -> Dict[str, str]:
    """The environment an assignment gives (its secrets included)."""
    a = json.loads(line)
    if not isinstance(a, dict) or not isinstance(a.get("env"), dict):
        raise ValueError("the assignment must be a JSON object with an 'env' object")
    env = {str(k): str(v) for k, v in a["env"].items()}
    env.update({str(k): str(v) for k, v in (a.get("secret_env") or {}).items()})
    return env
