"""The wire contract shared by host and guest: key layout, chunk naming, object shapes.

Nothing else in either package spells a conduit key or serialises a wire object.
Encodings match the reference implementation byte for byte: compact JSON in the
field order of its models for events and results, ``{"total_chunks": N}`` for the
manifest, and chunks of newline-terminated JSON lines.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any, Dict, List, Optional

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

_CHUNK_RE = re.compile(r"(?:^|/)events-(\d{6,})\.jsonl$")
# Identifiers become path segments of conduit keys, so they are held to a safe alphabet.
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


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
) -> Dict[str, Any]:
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


def encode_event(ev: Dict[str, Any]) -> str:
    return _dumps({k: ev[k] for k in EVENT_FIELDS})


def decode_event(line: str) -> Dict[str, Any]:
    """Parse one JSONL line into an event, filling the reference model's defaults."""
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise WireError(f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise WireError("an event line must be a JSON object")
    for req in ("run_id", "span_id", "kind", "event", "ts"):
        if req not in obj:
            raise WireError(f"event is missing required field {req!r}")
    if obj["event"] not in EVENT_KINDS:
        raise WireError(f"unknown event {obj['event']!r}")
    if not isinstance(obj["ts"], (int, float)) or isinstance(obj["ts"], bool):
        raise WireError("event field 'ts' must be a number")
    obj.setdefault("parent_span_id", "")
    obj.setdefault("name", "")
    obj.setdefault("status", "")
    obj.setdefault("data", {})
    if not isinstance(obj["data"], dict):
        raise WireError("event field 'data' must be an object")
    return obj


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
) -> Dict[str, Any]:
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


def encode_result(result: Dict[str, Any]) -> bytes:
    return _dumps({k: result[k] for k in RESULT_FIELDS}).encode("utf-8")


def decode_result(raw: bytes) -> Dict[str, Any]:
    try:
        obj = json.loads(raw.decode("utf-8"))
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
    for k in ("observed_phase", "reason", "substrate_logs"):
        out[k] = str(obj.get(k, "") or "")
    return out


def encode_manifest(total_chunks: int) -> bytes:
    return json.dumps({"total_chunks": int(total_chunks)}).encode("utf-8")


def decode_manifest(raw: bytes) -> int:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise WireError(f"_manifest.json is not valid JSON ({e})") from None
    total = obj.get("total_chunks") if isinstance(obj, dict) else None
    if not isinstance(total, int) or isinstance(total, bool) or total < 0:
        raise WireError(f'_manifest.json must be {{"total_chunks": <int >= 0>}}, got {obj!r}')
    return total
