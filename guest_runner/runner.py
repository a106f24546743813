"""The in-sandbox runner: inbox -> setup -> workload (streamed) -> outbox -> result -> manifest.

Configured only by environment variables, the same ones as the reference runner:

=========================  ==================================================
RESOLUTO_STORE_KIND        ``localfs`` or ``s3``
RESOLUTO_STORE_ROOT        localfs: the conduit directory as seen in here
RESOLUTO_STORE_BUCKET      s3: bucket (plus _ENDPOINT, _REGION)
RESOLUTO_STORE_PREFIX      the node's key prefix (default run/<run>/nodes/<node>)
RESOLUTO_RUN_ID            run id (the Prefect flow run id)
RESOLUTO_NODE_ID           node id (the task run id, ``.<attempt>`` on retries)
RESOLUTO_WORKLOAD_ARGV     JSON list: the command to run
RESOLUTO_WORKSPACE_DIR     where inbox archives are staged; the command's cwd
RESOLUTO_OUTPUT_PATHS      JSON list of paths/globs collected into the outbox
RESOLUTO_SETUP_ARGV        JSON list, optional: runs before the workload
RESOLUTO_CLEANUP_ARGV      JSON list, optional: runs last, even after a failure
RESOLUTO_SECRET_ENV        JSON list of variable names whose values are redacted
RESOLUTO_HEARTBEAT_INTERVAL  seconds of quiet before a heartbeat record (default 10)
RESOLUTO_EGRESS_PROXY      with an allowlist: the run's proxy (``addr:port``)
RESOLUTO_EGRESS_CANARY     JSON list of ``host:port`` that must be unreachable
RESOLUTO_EGRESS_PHASES     JSON list: ``["setup", "workload"]`` when setup has its own
RESOLUTO_EGRESS_CANARY_WORKLOAD  JSON list: setup-only names, refused after the switch
RESOLUTO_WORKLOAD_USER     ``uid:gid``: setup, workload and cleanup run as that user (privsep)
RESOLUTO_WORKLOAD_PIDNS    ``1``: the sandbox is its own PID namespace (privsep)
RESOLUTO_HOST_BEAT_KEY     the host's heartbeat object (guest_runner.hostwatch)
RESOLUTO_HOST_LOST_AFTER   seconds it may stay unchanged before the node's work is killed
=========================  ==================================================

Exit status is 0 exactly when the workload succeeded. A guest whose host stopped driving
it (its heartbeat unchanged for RESOLUTO_HOST_LOST_AFTER seconds) kills its work, writes a
failed result saying so when it can, and exits (HOST_LOST_EXIT when that takes too long).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from typing import IO, Callable, Dict, List, Mapping, NoReturn, Optional

# archive (tarfile, gzip, shutil ...), tempfile and traceback are imported where they are
# needed: a node without inbox archives or outputs never pays for them, and every
# import is dear in a sandbox (a stat() per sys.path entry, each a trip through gVisor).
from guest_runner import hostwatch, privsep, threads, wire
from guest_runner.conduit import Conduit, ConduitError
from guest_runner.conduit.registry import conduit_from_env
from guest_runner.procs import live as live_processes
from guest_runner.redact import Redactor
from guest_runner.shipper import DEFAULT_HEARTBEAT_INTERVAL, Shipper, Span

# Conduit credentials are for the runner, not for the workload it runs.
_RUNNER_ONLY_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    wire.ENV_STORE_WRITE_TOKEN,
)


#: The guest's exit status when its host is gone and writing the verdict took too long.
HOST_LOST_EXIT = 75
#: Seconds the runner may take to write its verdict once its work is killed for a lost host.
HOST_LOST_GRACE = 10.0


class _Work:
    """The phase process running now, and whether the host was lost (guest_runner.hostwatch)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: "Optional[subprocess.Popen[bytes]]" = None
        self.own_group = False
        self.lost = ""  # why the host is taken for gone; "" while it drives the node


_WORK = _Work()


class ConfigError(ValueError):
    """The RESOLUTO_* environment does not describe a runnable node."""


class NodeConfig:
    def __init__(self, env: Mapping[str, str]) -> None:
        self.run_id = env.get(wire.ENV_RUN_ID, "")
        self.node_id = env.get(wire.ENV_NODE_ID, "")
        if not self.run_id or not self.node_id:
            raise ConfigError(f"{wire.ENV_RUN_ID} and {wire.ENV_NODE_ID} must both be set")
        self.prefix = env.get(wire.ENV_STORE_PREFIX) or wire.node_prefix(self.run_id, self.node_id)
        self.argv = _argv(env, wire.ENV_WORKLOAD_ARGV, required=True) or []
        self.setup_argv = _argv(env, wire.ENV_SETUP_ARGV)
        self.cleanup_argv = _argv(env, wire.ENV_CLEANUP_ARGV)
        self.workspace = env.get(wire.ENV_WORKSPACE_DIR) or None
        self.output_paths = _str_list(env, wire.ENV_OUTPUT_PATHS) or []
        user_env = _str_list(env, wire.ENV_USER_ENV) or []
        self.child_env = {k: v for k, v in env.items() if k not in _RUNNER_ONLY_ENV or k in user_env}
        self.egress = bool(env.get(wire.ENV_EGRESS_PROXY))
        self.egress_phases = _str_list(env, wire.ENV_EGRESS_PHASES) or ["workload"]
        self.env = dict(env)
        # Python children flush line by line, so a print() reaches the conduit at once.
        self.child_env.setdefault("PYTHONUNBUFFERED", "1")


def _str_list(env: Mapping[str, str], name: str) -> Optional[List[str]]:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a JSON list of strings, got {raw[:200]!r}") from None
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ConfigError(f"{name} must be a JSON list of strings, got {raw[:200]!r}")
    return value


def _argv(env: Mapping[str, str], name: str, required: bool = False) -> Optional[List[str]]:
    value = _str_list(env, name)
    if value is None and required:
        raise ConfigError(f'{name} is not set: it must be a JSON list such as ["python3", "main.py"]')
    if value is not None and not value:
        if required:
            raise ConfigError(f"{name} is an empty list: there is no command to run")
        return None
    return value


def _log_record(line: str) -> Optional[Dict[str, str]]:
    """A structured record from the guest's get_run_logger stand-in, or None if it isn't one."""
    try:
        rec = json.loads(line[len(wire.LOG_MARKER) :])
    except ValueError:
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("msg"), str):
        return None
    return {"msg": rec["msg"], "level": str(rec.get("level", "INFO")), "logger": str(rec.get("logger", ""))}


def _artifact_record(line: str) -> Optional[Dict[str, object]]:
    """An artifact a task relayed (guest_runner.prefect_api), or None if it isn't one."""
    try:
        rec = json.loads(line[len(wire.ARTIFACT_MARKER) :])
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def _skip_line(out: IO[bytes]) -> int:
    """Read to the end of the current line without keeping it; the bytes skipped."""
    skipped = 0
    while True:
        piece = out.readline(wire.MAX_LOG_LINE_BYTES)
        skipped += len(piece)
        if not piece or piece.endswith(b"\n"):
            return skipped


def _artifact_line(rec: Dict[str, object]) -> str:
    """What a reader that knows no artifacts shows for one: a log line."""
    if rec.get("op") == "update":
        return f"artifact {rec.get('id')} updated"
    return f"{rec.get('type')} artifact" + (f" {rec.get('label')!r}" if rec.get("label") else "")


def _popen(
    argv: List[str], cwd: Optional[str], env: Dict[str, str], own_group: bool
) -> "subprocess.Popen[bytes]":
    return subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=own_group,
        # Buffered: readline() then takes whole lines out of each read(2) instead of one
        # byte per system call, and still returns as soon as a newline is available.
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        bufsize=-1,
        **privsep.popen_kwargs(),  # as the workload's user when the runtime names one
    )


#: Starts a phase's process: (argv, cwd, env, own_group) -> a Popen with stdout piped.
#: A warm guest (guest_runner.warm) hands the workload an interpreter it started earlier.
Starter = Callable[[List[str], Optional[str], Dict[str, str], bool], "subprocess.Popen[bytes]"]


def _exec_streamed(
    shipper: Shipper,
    span: Span,
    argv: List[str],
    cwd: Optional[str],
    env: Dict[str, str],
    own_group: bool = False,
    start: Starter = _popen,
) -> int:
    """Run ``argv`` with merged stdout/stderr shipped line by line; returns its exit code.
    ``own_group``: in its own process group, all of which is killed when it exits."""
    try:
        proc = start(argv, cwd, env, own_group)
    except FileNotFoundError:
        span.log(f"command not found: {argv[0]}")
        span.outputs["exit_code"] = 127
        span.status = "failure"
        return 127
    except PermissionError:
        span.log(f"permission denied executing {argv[0]}")
        span.outputs["exit_code"] = 126
        span.status = "failure"
        return 126
    with _WORK.lock:
        _WORK.proc, _WORK.own_group = proc, own_group
    if _WORK.lost:
        _kill_work()
    out = proc.stdout
    assert out is not None
    with out:
        # At most MAX_LOG_LINE_BYTES a line: a longer one (a progress bar's \r updates)
        # goes out in pieces, each an event the host reads within its line limit.
        for raw in iter(lambda: out.readline(wire.MAX_LOG_LINE_BYTES), b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if line.startswith(wire.ARTIFACT_MARKER) and not raw.endswith(b"\n"):
                # Longer than any artifact may be: its pieces are neither an artifact nor
                # the task's output. Read past it and say so, as the host would.
                size = len(raw) + _skip_line(out)
                span.log(
                    f"artifact refused: {size} bytes is more than one artifact may hold "
                    f"({wire.MAX_ARTIFACT_BYTES} bytes)",
                    level="ERROR",
                )
                continue
            if line.startswith(wire.LOG_MARKER):
                record = _log_record(line)
                if record is not None:
                    span.log(record.pop("msg"), **record)
                    continue
            elif line.startswith(wire.ARTIFACT_MARKER):
                artifact = _artifact_record(line)
                if artifact is not None:
                    span.log(_artifact_line(artifact), kind="artifact", artifact=artifact)
                    continue
            span.log(line)
    rc = proc.wait()
    with _WORK.lock:
        _WORK.proc = None
    if own_group:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what it left running must not outlive its phase
        except OSError:
            pass
    if rc < 0:
        span.log(f"{argv[0]} was killed by signal {-rc}")
        rc = 128 - rc
    span.outputs["exit_code"] = rc
    if rc != 0:
        span.status = "failure"
    return rc


def run_node(cfg: NodeConfig, conduit: Conduit, shipper: Shipper, start: Starter = _popen) -> wire.NodeResult:
    """Run one node and return its result (not yet written)."""
    result = wire.make_result(cfg.node_id)
    if cfg.workspace:
        workspace = cfg.workspace
    else:
        import tempfile

        workspace = tempfile.mkdtemp(prefix="resoluto-ws-")
    try:
        with shipper.span("", "node", cfg.node_id, {"argv": cfg.argv}) as node:
            os.makedirs(workspace, exist_ok=True)
            keys = [k for k in conduit.list_prefix(wire.inbox_prefix(cfg.prefix)) if wire.is_archive_key(k)]
            staged = len(keys)
            if keys:
                from guest_runner import archive

                # Streamed, by directory fds, all or nothing (guest_runner.archive).
                opens = [(k, (lambda k=k: conduit.get_stream(k))) for k in keys]
                archive.unpack_stream(opens, workspace)
            node.log(f"staged {staged} input archive(s) -> {workspace}", level="DEBUG")
            privsep.give(workspace)
            ok = True
            phased = cfg.egress and "setup" in cfg.egress_phases
            if cfg.egress:
                ok = _egress_check(node, result, cfg.env, wire.ENV_EGRESS_CANARY)
            if ok and cfg.setup_argv:
                with shipper.span(node.span_id, "setup", "setup", {"argv": cfg.setup_argv}) as sp:
                    src = _exec_streamed(
                        shipper, sp, cfg.setup_argv, workspace, cfg.child_env, own_group=bool(phased)
                    )
                # Nothing the setup started runs on into the workload, whatever session or
                # process group it made for itself (a sandbox that is its own PID namespace).
                privsep.kill_leftovers()
                if src != 0:
                    ok = False
                    result.update(
                        {
                            "status": "failure",
                            "exit_code": src,
                            "reason": f"setup command exited {src}; workload skipped",
                        }
                    )
                    node.log(f"setup failed (exit {src}); skipping workload")
            if ok and phased:
                from guest_runner import egress

                why = egress.switch_to_workload(cfg.env)
                if why:
                    ok = False
                    result.update({"status": "failure", "exit_code": None, "reason": why})
                    node.log(why, level="ERROR")
                else:
                    node.log("egress: switched to the workload allowlist")
                    ok = _egress_check(node, result, cfg.env, wire.ENV_EGRESS_CANARY_WORKLOAD)
            if ok:
                with shipper.span(node.span_id, "workload", cfg.node_id, {"argv": cfg.argv}) as sp:
                    rc = _exec_streamed(shipper, sp, cfg.argv, workspace, cfg.child_env, start=start)
                result["exit_code"] = rc
                result["status"] = "success" if rc == 0 else "failure"
                if rc == 127:
                    result["reason"] = f"command not found: {cfg.argv[0]}"
                elif rc != 0:
                    result["reason"] = f"workload exited with code {rc}"
                # Nothing the workload left running may change the tree while it is read.
                privsep.kill_leftovers()
                if cfg.output_paths:
                    from guest_runner import archive

                    # Collected after a failure too: partial outputs and error reports are
                    # evidence. The status stays what the workload said.
                    files, missing = archive.select(workspace, cfg.output_paths)
                    for pattern in missing:
                        if not pattern.startswith(".resoluto/"):  # the Python-call protocol's own files
                            node.log(f"declared output {pattern!r} matched nothing", level="WARNING")
                    if files:
                        key = wire.outbox_key(cfg.prefix)
                        conduit.put(key, archive.pack(workspace, patterns=files))
                        result["output_archive"] = key
                        # The Python-call protocol's own files are not the user's outputs.
                        declared = [f for f in files if not f.startswith(".resoluto/")]
                        node.log(f"collected {len(declared)} output file(s) -> {key}", level="DEBUG")
            if result["status"] != "success":
                node.status = "failure"
    finally:
        if cfg.cleanup_argv and not _WORK.lost:
            try:
                with shipper.span("", "cleanup", "cleanup", {"argv": cfg.cleanup_argv}) as sp:
                    _exec_streamed(shipper, sp, cfg.cleanup_argv, workspace, cfg.child_env)
            except Exception as e:  # cleanup must never mask the workload's verdict
                shipper.log("", f"cleanup failed: {type(e).__name__}: {e}")
    return result


def _egress_check(node: Span, result: wire.NodeResult, env: Mapping[str, str], name: str) -> bool:
    """The fail-closed canary; False (and the result filled in) when egress is open."""
    from guest_runner import egress

    why, checked = egress.canary(env, name)
    if why:
        result.update({"status": "failure", "exit_code": None, "reason": why})
        node.log(f"{why}; the workload was not run", level="ERROR")
        return False
    if checked:
        node.log(f"egress canary: {checked} destination(s) outside the allowlist unreachable, as required")
    return True


def _is_archive_error(e: BaseException) -> bool:
    archive = sys.modules.get("guest_runner.archive")  # never imported: it raised nothing
    return archive is not None and isinstance(e, archive.ArchiveError)


def _crashed(shipper: Shipper, redactor: Redactor, node_id: str, e: BaseException) -> wire.NodeResult:
    """The runner itself broke: still leave a verdict behind."""
    import traceback

    tb = redactor.text(traceback.format_exc())
    try:
        shipper.log(
            "",
            f"guest runner crashed: {type(e).__name__}: {redactor.text(str(e))}",
            kind="error",
            traceback=tb,
        )
    except Exception:
        pass
    return wire.make_result(
        node_id,
        "failure",
        None,
        None,
        reason=f"guest runner crashed: {type(e).__name__}: {redactor.text(str(e))}",
    )


def _descendants(root: int) -> List[int]:
    """Every process below ``root``."""
    procs = live_processes()
    found: List[int] = []
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        kids = [pid for pid, (ppid, _) in procs.items() if ppid == parent and pid not in found]
        found.extend(kids)
        frontier.extend(kids)
    return found


def _group_members(pgid: int) -> List[int]:
    """Every other process of the process group ``pgid`` (orphans of the node included)."""
    return [pid for pid, (_, grp) in live_processes().items() if grp == pgid and pid != os.getpid()]


def _kill_work() -> None:
    """Kill the running phase, everything below the runner, and what the node left
    elsewhere in its sandbox (privsep.kill_leftovers); never the runner itself."""
    with _WORK.lock:
        proc, own_group = _WORK.proc, _WORK.own_group
    if proc is not None and own_group:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    for _ in range(3):  # a process forking while the first pass runs
        # The whole tree is read before anything dies: an orphan is no descendant any more.
        pids = _descendants(os.getpid())
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    if os.getpgrp() == os.getpid():  # the sandbox's group (the process runtime): its orphans too
        for pid in _group_members(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    try:
        privsep.kill_leftovers()
    except privsep.PrivsepError:
        pass


def _watch_host(env: Mapping[str, str], conduit: Conduit, shipper: Shipper) -> Optional[hostwatch.HostWatch]:
    """Start the watch on the host's heartbeat, when the host keeps one."""
    found = hostwatch.settings(env)
    if found is None:
        return None
    key, bound = found

    def lost(idle: float) -> None:
        why = f"the host stopped driving this node (its heartbeat unchanged for {idle:.0f}s)"
        with _WORK.lock:
            _WORK.lost = why
        print(f"resoluto guest: {why}: killing the node's work and exiting", file=sys.stderr, flush=True)
        try:
            shipper.log("", why, kind="error")
        except Exception:  # noqa: BLE001 - the store may be what is gone
            pass
        _kill_work()
        # The verdict is written on the main thread; nothing may keep the sandbox alive
        # if the store hangs.
        timer = threading.Timer(HOST_LOST_GRACE, exit_now, args=(HOST_LOST_EXIT,))
        timer.daemon = True
        timer.start()

    return hostwatch.HostWatch(conduit, key, bound, lost).start()


def _finish(conduit: Conduit, shipper: Shipper, prefix: str, result: wire.NodeResult) -> None:
    shipper.close()
    conduit.put(wire.result_key(prefix), wire.encode_result(result))
    shipper.write_manifest()


def exit_now(code: int) -> "NoReturn":
    """End the guest runner's process once its node is written (the manifest is the last
    object): its own output flushed, without the interpreter's teardown, which frees every
    module and object one by one, for a sandbox
    that is destroyed next. Nothing is left to run: the shipper's thread is joined and the
    conduit closed before ``main`` returns."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe must not change the exit status
            pass
    os._exit(code)


def main(
    env: Optional[Mapping[str, str]] = None,
    conduit: Optional[Conduit] = None,
    start: Starter = _popen,
    beat_conduit: Optional[Conduit] = None,
) -> int:
    """``conduit`` and ``start``: a warm guest's (its node directory mounted elsewhere, its
    call interpreter already started); by default both come from the environment.
    ``beat_conduit``: where the host's heartbeat is read (default: ``conduit``)."""
    env = dict(os.environ if env is None else env)
    _WORK.lost = ""
    # First, before any thread of its own exists (a warm guest's spares: see below): the
    # runner's own process hardened, its credentials out of what the workload's user could
    # read (guest_runner/privsep.py).
    was_hardened = privsep.hardened()
    try:
        privsep.configure(env)
        unisolated = ""
    except privsep.PrivsepError as e:
        unisolated = str(e)
    if privsep.hardened() and not was_hardened:
        # Threads a warm guest started ahead of a hardening that only happens now (its boot
        # had no workload user, its assignment does): no_new_privs and the capability sets
        # are per thread, so they would not carry it. None of them runs the node's work.
        threads.drop()
    redactor = Redactor.from_env(env)
    try:
        if conduit is None:
            conduit = conduit_from_env(env)
    except Exception as e:
        print(f"resoluto guest: cannot open the conduit: {redactor.text(str(e))}", file=sys.stderr)
        return 3
    run_id = env.get(wire.ENV_RUN_ID, "")
    node_id = env.get(wire.ENV_NODE_ID, "")
    try:
        prefix = env.get(wire.ENV_STORE_PREFIX) or wire.node_prefix(run_id, node_id)
    except wire.WireError as e:
        print(f"resoluto guest: {e}", file=sys.stderr)
        return 3
    try:
        # A shorter heartbeat lets a host run with a tight silence window.
        heartbeat = float(env.get(wire.ENV_HEARTBEAT_INTERVAL) or DEFAULT_HEARTBEAT_INTERVAL)
    except ValueError:
        heartbeat = DEFAULT_HEARTBEAT_INTERVAL
    shipper = Shipper(
        conduit, prefix, run_id, redactor=redactor, heartbeat_interval=max(heartbeat, 0.1)
    ).start()
    watch = _watch_host(env, beat_conduit or conduit, shipper)
    try:
        cfg = NodeConfig(env)
        if unisolated:
            raise privsep.PrivsepError(unisolated)
        result = run_node(cfg, conduit, shipper, start)
    except privsep.PrivsepError as e:
        shipper.log("", f"cannot isolate the workload from the runner: {e}", kind="error")
        result = wire.make_result(node_id, "failure", None, None, reason=f"cannot isolate the workload: {e}")
    except ConfigError as e:
        shipper.log("", f"configuration error: {e}", kind="error")
        result = wire.make_result(node_id, "failure", None, None, reason=f"configuration error: {e}")
    except BaseException as e:
        if _is_archive_error(e):
            shipper.log("", f"inbox rejected: {e}", kind="error")
            result = wire.make_result(node_id, "failure", None, None, reason=f"inbox rejected: {e}")
        else:
            result = _crashed(shipper, redactor, node_id, e)
    if watch is not None:
        watch.stop()
    if _WORK.lost:
        result.update({"status": "failure", "reason": _WORK.lost})
    result["reason"] = redactor.text(str(result.get("reason") or ""))
    try:
        _finish(conduit, shipper, prefix, result)
    except ConduitError as e:
        print(
            f"resoluto guest: could not write the result to the conduit: {redactor.text(str(e))}",
            file=sys.stderr,
        )
        return 3
    finally:
        conduit.close()
    return 0 if result["status"] == "success" else 1
