"""``prefect-resoluto events``: replay a node's events from the conduit as a span tree.

Works on a finished node, a running one and one whose sandbox is long gone: the
conduit's immutable chunks are the record. A fault (a missing or malformed chunk, a
manifest that disagrees) is reported after everything before it has been printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prefect_resoluto.cli.common import EXIT_FAILED, EXIT_OK, UsageError
from prefect_resoluto.cli.output import BAD, DIM, STATUS_STYLE, STRONG, WARN, Out, TreePrinter, err

if TYPE_CHECKING:
    from guest_runner.conduit import Conduit
    from guest_runner.wire import NodeResult, SpanEvent


class ReplayError(Exception):
    pass


@dataclass
class Replay:
    prefix: str
    chunks: list[int] = field(default_factory=list)
    total_chunks: int | None = None
    manifest_error: str = ""
    outbox: list[str] = field(default_factory=list)


def scan_node(conduit: Conduit, run_id: str, node_id: str) -> Replay:
    from guest_runner import wire
    from guest_runner.conduit import ObjectNotFound
    from prefect_resoluto.node import bounded

    prefix = wire.node_prefix(run_id, node_id)
    keys = conduit.list_prefix(prefix + "/")
    if not keys:
        raise ReplayError(
            f"no objects for node {node_id!r} of run {run_id!r} in {conduit.url} (looked under {prefix}/)"
        )
    rep = Replay(prefix=prefix)
    for key in keys:
        rel = key[len(prefix) + 1 :]
        idx = wire.chunk_index(rel) if "/" not in rel else None
        if idx is not None:
            rep.chunks.append(idx)
        elif rel.startswith(wire.OUTBOX + "/"):
            rep.outbox.append(key)
    rep.chunks.sort()
    try:
        rep.total_chunks = wire.decode_manifest(
            bounded.read(conduit, wire.manifest_key(prefix), wire.MAX_MANIFEST_BYTES, "a manifest")
        )
    except ObjectNotFound:  # the node is still running, or died before it finished
        pass
    except (wire.WireError, bounded.TooLarge) as e:
        rep.manifest_error = f"{wire.manifest_key(prefix)}: {e}"
    return rep


def iter_events(conduit: Conduit, rep: Replay) -> Iterator[SpanEvent]:
    """Events in chunk order; raises ReplayError at the first fault, after yielding all
    that precede it."""
    from guest_runner import wire
    from prefect_resoluto.node.tail import MalformedChunk, TailError, chunk_text_lines

    expected = 1
    for idx in rep.chunks:
        key = wire.chunk_key(rep.prefix, idx)
        if idx != expected:
            raise ReplayError(
                f"{wire.chunk_key(rep.prefix, expected)} is missing (the next chunk present is {key})"
            )
        expected += 1
        try:
            for line_no, line in chunk_text_lines(conduit, key):
                if not line.strip():
                    continue
                try:
                    yield wire.decode_event(line)
                except wire.WireError as e:
                    raise ReplayError(str(MalformedChunk(key, line_no, str(e)))) from None
        except TailError as e:
            raise ReplayError(str(e)) from None
    if rep.manifest_error:
        raise ReplayError(rep.manifest_error)
    if rep.total_chunks is not None and rep.total_chunks != len(rep.chunks):
        raise ReplayError(
            f"{wire.manifest_key(rep.prefix)} declares {rep.total_chunks} chunk(s) but "
            f"{len(rep.chunks)} exist"
        )


def read_egress_events(conduit: Conduit, run_id: str, node_id: str) -> list[SpanEvent]:
    """The proxy's decisions for a node (written by the host, outside the node's prefix)."""
    from guest_runner import wire
    from guest_runner.conduit import ConduitError, ObjectNotFound
    from prefect_resoluto.node.drive import egress_events_key

    try:
        raw = conduit.get(egress_events_key(run_id, node_id))
    except (ObjectNotFound, ConduitError):
        return []
    out = []
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            out.append(wire.decode_event(line))
        except wire.WireError:
            continue
    return out


def read_result(conduit: Conduit, prefix: str) -> NodeResult | None:
    from guest_runner import wire
    from guest_runner.conduit import ObjectNotFound
    from prefect_resoluto.node import bounded

    try:
        raw = bounded.read(conduit, wire.result_key(prefix), wire.MAX_RESULT_BYTES, "a result")
    except ObjectNotFound:
        return None
    except bounded.TooLarge as e:
        raise ReplayError(str(e)) from None
    try:
        return wire.decode_result(raw)
    except wire.WireError as e:
        raise ReplayError(str(e)) from None


def main(args: argparse.Namespace) -> int:
    from urllib.parse import unquote, urlparse

    from guest_runner import wire
    from guest_runner.conduit import ConduitError
    from guest_runner.conduit.registry import conduit_from_url

    parsed = urlparse(args.conduit)
    local = (
        unquote(parsed.path)
        if parsed.scheme == "file"
        else args.conduit
        if args.conduit.startswith("/")
        else ""
    )
    if local and not Path(local).is_dir():
        # A local conduit would create its root: a mistyped URL must not leave directories behind.
        err(f"conduit directory {local} does not exist")
        return EXIT_FAILED
    try:
        conduit = conduit_from_url(args.conduit)
    except (ValueError, ImportError, ConduitError) as e:
        raise UsageError(f"--conduit: {e}") from None

    for value, what in ((args.run_id, "run id"), (args.node_id, "node id")):
        try:
            wire.check_id(value, what)
        except ValueError as e:
            raise UsageError(str(e)) from None

    out = Out(sys.stdout)
    events: list[SpanEvent] = []
    printer = TreePrinter(out, heartbeats=args.heartbeats)
    error = ""
    rep: Replay | None = None
    result: NodeResult | None = None
    try:
        rep = scan_node(conduit, args.run_id, args.node_id)
        if not args.json:
            out.line(
                ("node ", STRONG),
                (args.node_id, STRONG),
                " of run ",
                args.run_id,
                (f" in {conduit.url} ({rep.prefix}/)", DIM),
            )
        for ev in iter_events(conduit, rep):
            events.append(ev)
            if not args.json:
                printer(ev)
        result = read_result(conduit, rep.prefix)
    except ReplayError as e:
        error = str(e)
    except ConduitError as e:
        error = f"conduit {conduit.url}: {e}"
    egress_events = read_egress_events(conduit, args.run_id, args.node_id)
    if egress_events and not args.json:
        out.line((f"-- egress decisions by the run's proxy (host side): {len(egress_events)}", STRONG))
        for ev in egress_events:
            printer(ev)
    if args.json:
        print(
            json.dumps(
                {
                    "run_id": args.run_id,
                    "node_id": args.node_id,
                    "conduit": conduit.url,
                    "prefix": rep.prefix if rep else None,
                    "events": events,
                    "egress": egress_events,
                    "chunks": len(rep.chunks) if rep else 0,
                    "total_chunks": rep.total_chunks if rep else None,
                    "result": result,
                    "outbox": rep.outbox if rep else [],
                    "error": error or None,
                }
            )
        )
    elif rep is not None and not error:
        _print_verdict(out, rep, result, printer)
    if error:
        err(error)
        return EXIT_FAILED
    return EXIT_OK


def _print_verdict(out: Out, rep: Replay, result: NodeResult | None, printer: TreePrinter) -> None:
    c = printer.counts
    state = (
        f"manifest: {rep.total_chunks} chunk(s)"
        if rep.total_chunks is not None
        else "no _manifest.json: the node is still running, or died before it finished"
    )
    out.line(
        f"-- {len(rep.chunks)} chunk(s), {c['events']} event(s) ({c['heartbeats']} heartbeat(s)); ",
        (state, "" if rep.total_chunks is not None else WARN),
    )
    if result is None:
        out.line(("result: none (no result.json)", WARN))
        return
    code = f", exit code {result['exit_code']}" if result.get("exit_code") is not None else ""
    reason = f": {result['reason']}" if result.get("reason") else ""
    status = str(result["status"])
    out.line(("result: ", STRONG), (status, STATUS_STYLE.get(status, BAD)), code, reason)
    if result.get("output_archive"):
        out.line(("outputs: ", STRONG), str(result["output_archive"]))
    for k in ("observed_phase", "substrate_logs"):
        if result.get(k):
            out.line((f"{k.replace('_', ' ')} (guest's word): ", STRONG), str(result[k]))
