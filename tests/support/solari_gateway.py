"""A loopback stand-in for a Solari sandbox gateway (REST + control WebSocket on 127.0.0.1).

It holds the official SDK to the gateway's wire contract (``solari-sdk-wire-protocol.md``)
instead of echoing what the client expects:

- every REST request and every control-WebSocket upgrade must carry ``Authorization:
  Bearer <key>`` (401 otherwise); ``POST /sandboxes`` must carry ``Idempotency-Key``
  (400 otherwise) and a retried create with the same key gets the same sandbox;
- create bodies are checked against ``CreateSandboxRequest``: only its fields, no
  ``null``, integer ``cpu``/``memMb``/``diskGb``, string-valued ``envs``/``metadata``;
- session ids have the seed's shape ``<pool>:<vm>:<org>.<sig>`` and a path that names
  one with a bare ``:`` instead of ``%3A`` is refused;
- 429 (session cap, or injected), 503 and other 5xx are answered on demand and counted;
- outgoing frames are newline-delimited JSON, several per WebSocket message and split
  across messages, with v1 stream frames and non-JSON lines interleaved; a command's
  first ``cmd.data`` (and, for a quick command, its ``cmd.exit``) is sent *before* the
  ``cmd.start`` reply; a socket can be dropped mid-command.

Behind it each sandbox is real: a directory is its filesystem (VM path ``/x`` is
``<dir>/x``) and commands run for real -- as host processes (``executor="process"``,
for protocol tests) or in a gVisor sandbox through the project's gVisor runtime
(``executor="gvisor"``), with the sandbox directory mounted at ``/conduit`` and the
command's paths translated to it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CREATE_FIELDS = {
    "template",
    "kind",
    "cpu",
    "memMb",
    "diskGb",
    "envs",
    "metadata",
    "timeoutMs",
    "fromSnapshot",
    "lifecycle",
    "volumes",
    "resolution",
    "record",
}
STATES_LIVE = ("starting", "running")


@dataclass
class Request:
    method: str
    raw_path: str
    headers: dict[str, str]
    body: Any
    status: int = 0


@dataclass
class Command:
    cmd_id: str
    proc: Any = None  # subprocess.Popen, or (runtime, handle) for gVisor
    exit_code: int | None = None
    done: threading.Event = field(default_factory=threading.Event)
    pumps: list[threading.Thread] = field(default_factory=list)


@dataclass
class Sandbox:
    id: str
    root: Path
    metadata: dict[str, str]
    body: dict[str, Any]
    timeout_ms: int
    expires_at: float
    state: str = "running"
    commands: dict[str, Command] = field(default_factory=dict)
    sockets: list[Any] = field(default_factory=list)


class Fault:
    def __init__(self, status: int, times: int, body: dict[str, Any] | None) -> None:
        self.status, self.times, self.body = status, times, body


class SolariGateway:
    def __init__(
        self,
        root: Path,
        *,
        api_key: str = "sk-test-loopback",
        executor: str = "process",
        org: str = "org-loop",
        max_sessions: int | None = None,
        hazards: bool = True,
        seed: int = 11,
    ) -> None:
        if executor not in ("process", "gvisor"):
            raise ValueError(executor)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.api_key = api_key
        self.executor = executor
        self.org = org
        self.max_sessions = max_sessions
        self.hazards = hazards
        self._rng = random.Random(seed)
        self._secret = os.urandom(16)
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.sandboxes: dict[str, Sandbox] = {}
        self.requests: list[Request] = []
        self.ws_upgrades: list[dict[str, Any]] = []
        self.rpc_frames: list[dict[str, Any]] = []
        self.idempotency_keys: list[str | None] = []
        self.answers: Counter[tuple[str, int]] = Counter()
        self._faults: dict[str, list[Fault]] = {}
        self._drop_after_reads: dict[str, int] = {}
        self.drops = 0
        #: Refuse every control-WebSocket upgrade with 401 (a key valid for REST only).
        self.refuse_upgrades = False
        #: Answer GET /sandboxes (the list) with 404, as a gateway with only the seed's core routes.
        self.list_route = True
        #: How often each framing hazard was put on the wire.
        self.hazard_counts: Counter[str] = Counter()
        self._gvisor: Any = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self._reaper_stop = threading.Event()

    # -- control knobs ----------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail(self, op: str, status: int, times: int = 1, body: dict[str, Any] | None = None) -> None:
        """Answer the next ``times`` requests of ``op`` (create/get/list/delete/timeout) with ``status``."""
        with self.lock:
            self._faults.setdefault(op, []).append(Fault(status, times, body))

    def drop_socket_after_reads(self, sandbox_id: str, reads: int) -> None:
        """Close the sandbox's control socket(s) abruptly after ``reads`` more fs.read calls."""
        with self.lock:
            self._drop_after_reads[sandbox_id] = reads

    def kill_vm(self, sandbox_id: str) -> None:
        """The VM dies from outside (an operator, the host): processes gone, sockets closed, 404."""
        self._destroy(sandbox_id, "killed from outside")

    def wait_for(self, predicate: Any, timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                got = predicate()
                if got:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the stand-in gateway never reached the awaited state")
                self.changed.wait(min(left, 0.5))

    def live(self) -> list[Sandbox]:
        with self.lock:
            return [s for s in self.sandboxes.values() if s.state in STATES_LIVE]

    def bodies_seen(self) -> list[tuple[str, str]]:
        """Every request body and client RPC frame as (what, JSON text)."""
        with self.lock:
            out = [
                (f"{r.method} {r.raw_path}", json.dumps(r.body)) for r in self.requests if r.body is not None
            ]
            out += [(f"rpc {f.get('method')}", json.dumps(f)) for f in self.rpc_frames]
            return out

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> SolariGateway:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # As a real gateway does (Go sets it on every connection): a frame split across two
        # messages must not wait for the delayed ACK of the first (Nagle). Accepted sockets inherit it.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        # ws="websockets": the implementation that offers the ASGI denial response (a 401 on the upgrade).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = uvicorn.Config(
                self._app(), log_level="warning", ws="websockets", lifespan="off", ws_max_size=2**31
            )
            config.load()
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="solari-standin", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the stand-in gateway did not start")
            time.sleep(0.01)
        threading.Thread(target=self._reap_expired, daemon=True).start()
        return self

    def stop(self) -> None:
        self._reaper_stop.set()
        for sid in list(self.sandboxes):
            self._destroy(sid, "gateway stopped")
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)

    def _reap_expired(self) -> None:
        while not self._reaper_stop.wait(0.2):
            now = time.time()
            for s in list(self.sandboxes.values()):
                if s.state in STATES_LIVE and now > s.expires_at:
                    self._destroy(s.id, "session timeout expired")

    # -- ids and paths ----------------------------------------------------------------------

    def _new_id(self) -> str:
        vm = f"vm-{uuid.uuid4().hex[:12]}"
        body = f"pool-lo1:{vm}:{self.org}"
        sig = hmac.new(self._secret, body.encode(), hashlib.sha256).hexdigest()[:16]
        return f"{body}.{sig}"

    def _valid_id(self, sid: str) -> bool:
        body, _, sig = sid.rpartition(".")
        want = hmac.new(self._secret, body.encode(), hashlib.sha256).hexdigest()[:16]
        return body.count(":") == 2 and hmac.compare_digest(sig, want)

    @staticmethod
    def vm_path(s: Sandbox, path: Any) -> Path:
        if not isinstance(path, str) or not path.startswith("/"):
            raise _RpcError("EINVAL", f"path must be absolute, got {path!r}")
        p = (s.root / path.lstrip("/")).resolve()
        if p != s.root.resolve() and s.root.resolve() not in p.parents:
            raise _RpcError("EACCES", f"{path} escapes the sandbox")
        return p

    # -- the ASGI app -----------------------------------------------------------------------

    def _app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request as HttpRequest
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route, WebSocketRoute
        from starlette.websockets import WebSocket, WebSocketDisconnect

        gw = self

        def answer(op: str, rec: Request, status: int, body: Any) -> Response:
            rec.status = status
            with gw.changed:
                gw.answers[(op, status)] += 1
                gw.changed.notify_all()
            if body is None:
                return Response(status_code=status)
            return JSONResponse(body, status_code=status)

        async def record(request: HttpRequest, op: str) -> tuple[Request, Response | None]:
            raw = await request.body()
            body: Any = None
            if raw:
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = raw.decode("utf-8", "replace")
            raw_path = request.scope.get("raw_path", b"").decode() or request.url.path
            if request.url.query:
                raw_path += "?" + request.url.query
            rec = Request(request.method, raw_path, {k.lower(): v for k, v in request.headers.items()}, body)
            with gw.lock:
                gw.requests.append(rec)
            if rec.headers.get("authorization") != f"Bearer {gw.api_key}":
                return rec, answer(
                    op, rec, 401, {"code": "Unauthorized", "message": "invalid or missing API key"}
                )
            if rec.headers.get("accept") != "application/json":
                return rec, answer(
                    op, rec, 400, {"code": "BadRequest", "message": "Accept must be application/json"}
                )
            if raw and rec.headers.get("content-type") != "application/json":
                return rec, answer(
                    op, rec, 400, {"code": "BadRequest", "message": "a body needs Content-Type"}
                )
            if not raw and "content-type" in rec.headers:
                return rec, answer(
                    op, rec, 400, {"code": "BadRequest", "message": "Content-Type without a body"}
                )
            with gw.lock:
                faults = gw._faults.get(op) or []
                if faults:
                    f = faults[0]
                    f.times -= 1
                    if f.times <= 0:
                        faults.pop(0)
                    return rec, answer(
                        op,
                        rec,
                        f.status,
                        f.body
                        or {
                            "code": {429: "ConcurrencyLimitExceeded", 503: "NoCapacity"}.get(
                                f.status, "Internal"
                            ),
                            "message": f"stand-in: injected {f.status}",
                            "retryable": f.status in (429, 503),
                        },
                    )
            return rec, None

        def session_of(request: HttpRequest, rec: Request, op: str) -> tuple[Sandbox | None, Response | None]:
            sid = request.path_params["sid"]
            seg = rec.raw_path.split("?")[0].split("/")[2]
            if ":" in seg or "%3A" not in seg:
                return None, answer(
                    op,
                    rec,
                    400,
                    {"code": "BadSessionId", "message": f"session id must be escaped (%3A), got {seg!r}"},
                )
            if not gw._valid_id(sid):
                return None, answer(op, rec, 404, {"code": "NotFound", "message": f"no session {sid}"})
            with gw.lock:
                s = gw.sandboxes.get(sid)
            if s is None or s.state not in STATES_LIVE:
                return None, answer(op, rec, 404, {"code": "NotFound", "message": f"sandbox {sid} not found"})
            return s, None

        def view(s: Sandbox) -> dict[str, Any]:
            b = s.body
            return {
                "sandboxId": s.id,
                "kind": "sandbox",
                "state": s.state,
                "metadata": dict(s.metadata),
                "expiresAt": _iso(s.expires_at),
                "cpu": b.get("cpu", 2),
                "memMb": b.get("memMb", 2048),
                "diskGb": b.get("diskGb", 10),
            }

        async def create(request: HttpRequest) -> Response:
            rec, refused = await record(request, "create")
            key = rec.headers.get("idempotency-key")
            with gw.lock:
                gw.idempotency_keys.append(key)
            if refused is not None:
                return refused
            if not key:
                return answer(
                    "create",
                    rec,
                    400,
                    {"code": "IdempotencyKeyRequired", "message": "POST /sandboxes needs an Idempotency-Key"},
                )
            problem = _check_create(rec.body)
            if problem:
                return answer("create", rec, 400, {"code": "ValidationError", "message": problem})
            with gw.lock:
                for s in gw.sandboxes.values():
                    if s.body.get("_idem") == key:
                        return answer("create", rec, 200, _created(gw, s))
                if gw.max_sessions is not None and len(gw.live()) >= gw.max_sessions:
                    return answer(
                        "create",
                        rec,
                        429,
                        {
                            "code": "ConcurrencyLimitExceeded",
                            "retryable": True,
                            "message": f"organisation {gw.org} is at its cap of {gw.max_sessions} live sessions",
                        },
                    )
                sid = gw._new_id()
                root = gw.root / sid.split(":")[1]
                root.mkdir(parents=True)
                timeout_ms = int(rec.body.get("timeoutMs") or 300_000)
                s = Sandbox(
                    id=sid,
                    root=root,
                    metadata=dict(rec.body.get("metadata") or {}),
                    body={**rec.body, "_idem": key},
                    timeout_ms=timeout_ms,
                    expires_at=time.time() + timeout_ms / 1000,
                )
                gw.sandboxes[sid] = s
            return answer("create", rec, 200, _created(gw, s))

        async def get_one(request: HttpRequest) -> Response:
            rec, refused = await record(request, "get")
            if refused is not None:
                return refused
            s, refused = session_of(request, rec, "get")
            return refused or answer("get", rec, 200, view(s))  # type: ignore[arg-type]

        async def delete_one(request: HttpRequest) -> Response:
            rec, refused = await record(request, "delete")
            if refused is not None:
                return refused
            s, refused = session_of(request, rec, "delete")
            if refused is not None:
                return refused
            gw._destroy(s.id, "killed by the client")  # type: ignore[union-attr]
            return answer("delete", rec, 200, {"ok": True})

        async def set_timeout(request: HttpRequest) -> Response:
            rec, refused = await record(request, "timeout")
            if refused is not None:
                return refused
            s, refused = session_of(request, rec, "timeout")
            if refused is not None:
                return refused
            ms = (rec.body or {}).get("timeoutMs")
            if not isinstance(ms, int) or isinstance(ms, bool) or ms <= 0:
                return answer(
                    "timeout", rec, 400, {"code": "ValidationError", "message": "timeoutMs must be > 0"}
                )
            s.timeout_ms, s.expires_at = ms, time.time() + ms / 1000  # type: ignore[union-attr]
            return answer("timeout", rec, 200, {"expiresAt": _iso(s.expires_at)})  # type: ignore[union-attr]

        async def list_all(request: HttpRequest) -> Response:
            rec, refused = await record(request, "list")
            if refused is not None:
                return refused
            if not gw.list_route:
                return answer("list", rec, 404, {"code": "NotFound", "message": "no such route"})
            want = {
                k[len("metadata.") :]: v for k, v in request.query_params.items() if k.startswith("metadata.")
            }
            out = [view(s) for s in gw.live() if all(s.metadata.get(k) == v for k, v in want.items())]
            limit = request.query_params.get("limit")
            if limit:
                out = out[: int(limit)]
            return answer("list", rec, 200, {"sandboxes": out})

        async def control(ws: WebSocket) -> None:
            sid = ws.path_params["sid"]
            raw_path = ws.scope.get("raw_path", b"").decode()
            auth = ws.headers.get("authorization")
            entry = {
                "raw_path": raw_path,
                "authorized": auth == f"Bearer {gw.api_key}" and not gw.refuse_upgrades,
                "sandbox": sid,
            }
            with gw.changed:
                gw.ws_upgrades.append(entry)
                gw.changed.notify_all()
            s = gw.sandboxes.get(sid)
            if not entry["authorized"] or s is None or s.state not in STATES_LIVE or ":" in raw_path:
                status = 401 if not entry["authorized"] else 404
                try:
                    await ws.send_denial_response(JSONResponse({"code": "Denied"}, status_code=status))
                except RuntimeError:
                    await ws.close(code=1008)
                return
            await ws.accept()
            conn = _Conn(gw, s, ws)
            s.sockets.append(conn)
            sender = asyncio.ensure_future(conn.pump())
            try:
                while True:
                    text = await ws.receive_text()
                    conn.rx += text
                    while "\n" in conn.rx:
                        line, conn.rx = conn.rx.split("\n", 1)
                        if line.strip():
                            await conn.handle(json.loads(line))
            except (WebSocketDisconnect, RuntimeError, _Dropped):
                pass
            finally:
                conn.closed = True
                sender.cancel()
                if conn in s.sockets:
                    s.sockets.remove(conn)

        return Starlette(
            routes=[
                Route("/sandboxes", create, methods=["POST"]),
                Route("/sandboxes", list_all, methods=["GET"]),
                Route("/sandboxes/{sid}", get_one, methods=["GET"]),
                Route("/sandboxes/{sid}", delete_one, methods=["DELETE"]),
                Route("/sandboxes/{sid}/timeout", set_timeout, methods=["POST"]),
                WebSocketRoute("/control/{sid}", control),
            ]
        )

    # -- teardown of one VM ---------------------------------------------------------------

    def _destroy(self, sid: str, why: str) -> None:
        with self.changed:
            s = self.sandboxes.get(sid)
            if s is None or s.state == "gone":
                return
            s.state = "gone"
            self.changed.notify_all()
        for c in list(s.commands.values()):
            self._kill_command(c)
        for conn in list(s.sockets):
            conn.drop()
        shutil.rmtree(s.root, ignore_errors=True)
        with self.lock:
            self.sandboxes.pop(sid, None)

    def _kill_command(self, c: Command) -> None:
        if isinstance(c.proc, subprocess.Popen):
            if c.proc.poll() is None:
                try:
                    os.killpg(c.proc.pid, 9)
                except OSError:
                    pass
        elif c.proc is not None:
            rt, handle = c.proc
            try:
                rt.destroy(handle)
            except Exception:
                pass

    # -- running a command "in the VM" ----------------------------------------------------------

    def translate(self, s: Sandbox, value: str, inside: str) -> str:
        """A VM path (its first segment exists in the sandbox directory) as seen by the executor."""
        parts = value.split(":")
        out = []
        for p in parts:
            first = p.lstrip("/").split("/", 1)[0]
            if p.startswith("/") and first and (s.root / first).exists():
                out.append(inside.rstrip("/") + p)
            else:
                out.append(p)
        return ":".join(out)

    def gvisor(self) -> Any:
        if self._gvisor is None:
            from prefect_resoluto.runtimes import get_runtime

            self._gvisor = get_runtime("gvisor")
        return self._gvisor


class _RpcError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class _Dropped(Exception):
    pass


class _Conn:
    """One control WebSocket: a frame writer with the seed's framing hazards, and the RPCs."""

    def __init__(self, gw: SolariGateway, s: Sandbox, ws: Any) -> None:
        self.gw, self.s, self.ws = gw, s, ws
        self.rx = ""
        self.out: asyncio.Queue[str | None] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self.sent_messages = 0

    def send(self, frame: dict[str, Any]) -> None:
        """Queue a frame (thread-safe)."""
        line = json.dumps(frame) + "\n"
        if self.closed:
            return
        self.loop.call_soon_threadsafe(self.out.put_nowait, line)

    def drop(self, injected: bool = False) -> None:
        if not self.closed:
            self.closed = True
            if injected:
                with self.gw.changed:
                    self.gw.drops += 1
                    self.gw.changed.notify_all()
            self.loop.call_soon_threadsafe(self.out.put_nowait, None)

    async def pump(self) -> None:
        rng = self.gw._rng
        while True:
            first = await self.out.get()
            batch = [first]
            while not self.out.empty():
                batch.append(self.out.get_nowait())
            if None in batch:
                keep = batch[: batch.index(None)]
                if keep:
                    await self.ws.send_text("".join(keep))
                await self.ws.close(code=1011, reason="stand-in: socket dropped")
                return
            if self.gw.hazards:
                noisy: list[str] = []
                for line in batch:
                    if rng.random() < 0.15:
                        noisy.append("stand-in: this line is not JSON\n")
                    if rng.random() < 0.1:
                        noisy.append(
                            json.dumps({"id": "v1-legacy", "stream": "stdout", "data": "legacy"}) + "\n"
                        )
                    noisy.append(line)
                text = "".join(noisy)
                counts = self.gw.hazard_counts
                counts["non_json_lines"] += text.count("stand-in: this line is not JSON")
                counts["v1_frames"] += text.count('"v1-legacy"')
                cuts = (
                    sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 3))))
                    if len(text) > 1
                    else []
                )
                pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            else:
                pieces = ["".join(batch)]
            for p in pieces:
                if self.gw.hazards:
                    if not p.endswith("\n"):
                        self.gw.hazard_counts["frames_split"] += 1
                    if p.count("\n") > 1:
                        self.gw.hazard_counts["messages_packed"] += 1
                await self.ws.send_text(p)
                self.sent_messages += 1

    async def handle(self, frame: dict[str, Any]) -> None:
        gw = self.gw
        with gw.changed:
            gw.rpc_frames.append(frame)
            gw.changed.notify_all()
        fid, method, params = frame.get("id"), frame.get("method"), frame.get("params") or {}
        if not isinstance(fid, str):
            return
        try:
            result = await self._call(method, params, fid)
        except _RpcError as e:
            self.send({"id": fid, "ok": False, "error": {"code": e.code, "message": e.message}})
        except _Dropped:
            raise
        else:
            if result is not None:
                self.send({"id": fid, "ok": True, "result": result})
        if method == "fs.read":
            with gw.lock:
                left = gw._drop_after_reads.get(self.s.id)
                if left is not None:
                    left -= 1
                    if left <= 0:
                        gw._drop_after_reads.pop(self.s.id, None)
                        self.drop(injected=True)
                    else:
                        gw._drop_after_reads[self.s.id] = left

    async def _call(self, method: str, p: dict[str, Any], fid: str) -> Any:
        s, gw = self.s, self.gw
        if s.state not in STATES_LIVE:
            raise _RpcError("Gone", "the sandbox is gone")
        if method == "fs.mkdir":
            gw.vm_path(s, p.get("path")).mkdir(parents=True, exist_ok=True)
            return {"ok": True}
        if method == "fs.write":
            path = gw.vm_path(s, p.get("path"))
            if not path.parent.is_dir():
                raise _RpcError("ENOENT", f"no directory {path.parent.name!r} for {p.get('path')}")
            path.write_bytes(base64.b64decode(p.get("base64") or ""))
            if p.get("mode") is not None:
                os.chmod(path, int(p["mode"]))
            return {"ok": True}
        if method == "fs.read":
            path = gw.vm_path(s, p.get("path"))
            if not path.is_file():
                raise _RpcError("ENOENT", f"no such file: {p.get('path')}")
            return {"base64": base64.b64encode(path.read_bytes()).decode()}
        if method == "fs.list":
            path = gw.vm_path(s, p.get("path"))
            if not path.is_dir():
                raise _RpcError("ENOENT", f"no such directory: {p.get('path')}")
            entries = []
            for child in sorted(path.iterdir()):
                try:
                    st = child.stat()
                except FileNotFoundError:
                    continue  # renamed away while listing
                entries.append({"name": child.name, "dir": child.is_dir(), "size": st.st_size})
            return {"entries": entries}
        if method == "fs.stat":
            path = gw.vm_path(s, p.get("path"))
            if not path.exists():
                raise _RpcError("ENOENT", f"no such file: {p.get('path')}")
            st = path.stat()
            return {
                "name": path.name,
                "dir": path.is_dir(),
                "size": st.st_size,
                "mode": st.st_mode & 0o7777,
                "modTimeMs": int(st.st_mtime * 1000),
            }
        if method == "fs.remove":
            path = gw.vm_path(s, p.get("path"))
            if path.is_dir():
                shutil.rmtree(path) if p.get("recursive") else path.rmdir()
            elif path.exists():
                path.unlink()
            return {"ok": True}
        if method == "cmd.start":
            return await self._start(p)
        if method == "cmd.kill":
            c = s.commands.get(p.get("cmdId") or "")
            if c is None:
                raise _RpcError("NotFound", "no such command")
            gw._kill_command(c)
            return {"ok": True}
        if method == "cmd.stdin":
            return {"ok": True}
        raise _RpcError("UnknownMethod", f"the stand-in does not implement {method!r}")

    async def _start(self, p: dict[str, Any]) -> dict[str, Any]:
        s, gw = self.s, self.gw
        cmd, args, cwd, env = p.get("cmd"), p.get("args") or [], p.get("cwd"), p.get("env") or {}
        if not isinstance(cmd, str) or not cmd:
            raise _RpcError("EINVAL", "cmd must be a non-empty string")
        if not all(isinstance(v, str) for v in env.values()):
            raise _RpcError("EINVAL", "env values must be strings")
        cmd_id = f"c{len(s.commands) + 1}"
        c = Command(cmd_id)
        s.commands[cmd_id] = c
        if gw.executor == "process":
            inside = str(s.root)
            argv = [gw.translate(s, cmd, inside)] + [gw.translate(s, a, inside) for a in args]
            # The VM's image is assumed to carry the flow's interpreter (as a user's template would).
            full_env = {
                "PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
                "HOME": inside,
            }
            full_env.update({k: gw.translate(s, v, inside) for k, v in env.items()})
            try:
                c.proc = subprocess.Popen(
                    argv,
                    cwd=gw.translate(s, cwd, inside) if cwd else inside,
                    env=full_env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
            except OSError as e:
                raise _RpcError("ENOEXEC", f"cannot start {cmd!r}: {e}") from None
            for stream, pipe in (("stdout", c.proc.stdout), ("stderr", c.proc.stderr)):
                t = threading.Thread(target=self._pump_pipe, args=(cmd_id, stream, pipe), daemon=True)
                t.start()
                c.pumps.append(t)
            threading.Thread(target=self._wait_process, args=(c,), daemon=True).start()
        else:
            await asyncio.get_running_loop().run_in_executor(None, self._start_gvisor, c, cmd, args, cwd, env)
        # The ordering hazard: output pumps start before the reply is sent.
        self.send(
            {
                "type": "cmd.data",
                "cmdId": cmd_id,
                "stream": "stderr",
                "base64": base64.b64encode(f"[stand-in] {cmd_id} started\n".encode()).decode(),
            }
        )
        gw.hazard_counts["data_before_reply"] += 1
        await asyncio.get_running_loop().run_in_executor(None, c.done.wait, 0.05)
        if c.done.is_set():
            gw.hazard_counts["exit_before_reply"] += 1
        return {"cmdId": cmd_id}

    def _pump_pipe(self, cmd_id: str, stream: str, pipe: Any) -> None:
        for chunk in iter(lambda: pipe.read1(4096), b""):
            self.send(
                {
                    "type": "cmd.data",
                    "cmdId": cmd_id,
                    "stream": stream,
                    "base64": base64.b64encode(chunk).decode(),
                }
            )

    def _wait_process(self, c: Command) -> None:
        code = c.proc.wait()
        for t in c.pumps:  # the exit frame comes after the command's last output
            t.join(5)
        self._exited(c, code)

    def _exited(self, c: Command, code: int) -> None:
        c.exit_code = code
        c.done.set()
        # Streams belong to the connection the command was started on (a dropped socket loses them).
        self.send({"type": "cmd.exit", "cmdId": c.cmd_id, "exitCode": code})
        with self.gw.changed:
            self.gw.changed.notify_all()

    def _start_gvisor(
        self, c: Command, cmd: str, args: list[str], cwd: str | None, env: dict[str, str]
    ) -> None:
        from prefect_resoluto.runtimes.base import LaunchSpec

        s, gw = self.s, self.gw
        inside = "/conduit"
        secret_names = set(json.loads(env.get("RESOLUTO_SECRET_ENV") or "[]"))
        plain = {k: gw.translate(s, v, inside) for k, v in env.items() if k not in secret_names}
        secret = {k: v for k, v in env.items() if k in secret_names}
        wrapper = ["env", "-C", gw.translate(s, cwd or "/", inside)]
        wrapper += [f"{k}={v}" for k, v in sorted(plain.items())]
        wrapper += [cmd, *[gw.translate(s, a, inside) for a in args]]
        spec = LaunchSpec(
            sandbox_id=f"sgw-{s.id.split(':')[1]}-{c.cmd_id}",
            env={},
            secret_env=secret,
            conduit_root=s.root,
            conduit_subdir="",
            command=wrapper,
        )
        rt = gw.gvisor()
        handle = rt.launch(spec)
        c.proc = (rt, handle)
        threading.Thread(target=self._wait_gvisor, args=(c, rt, handle), daemon=True).start()

    def _wait_gvisor(self, c: Command, rt: Any, handle: Any) -> None:
        while True:
            st = rt.status(handle)
            if st.terminal or st.gone:
                break
            time.sleep(0.02)
        try:
            text = rt.logs(handle, tail=400)
        except Exception:
            text = ""
        if text:
            self.send(
                {
                    "type": "cmd.data",
                    "cmdId": c.cmd_id,
                    "stream": "stdout",
                    "base64": base64.b64encode(text.encode()).decode(),
                }
            )
        try:
            rt.destroy(handle)
        except Exception:
            pass
        self._exited(c, st.exit_code if st.exit_code is not None else -1)


def _created(gw: SolariGateway, s: Sandbox) -> dict[str, Any]:
    return {
        "sandboxId": s.id,
        "kind": "sandbox",
        "controlUrl": f"ws://127.0.0.1:{gw.port}/control/{_escape(s.id)}",
        "expiresAt": _iso(s.expires_at),
    }


def _escape(sid: str) -> str:
    from urllib.parse import quote

    return quote(sid, safe="-_.!~*'()")  # encodeURIComponent


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _check_create(body: Any) -> str:
    """Why ``body`` is not a valid ``CreateSandboxRequest`` (empty when it is)."""
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    unknown = set(body) - CREATE_FIELDS
    if unknown:
        return f"unknown field(s) {sorted(unknown)}"
    for k, v in body.items():
        if v is None:
            return f"{k} is null: omit unset fields"
    for k in ("cpu", "memMb", "diskGb", "timeoutMs"):
        if k in body and (not isinstance(body[k], int) or isinstance(body[k], bool) or body[k] <= 0):
            return f"{k} must be a positive integer, got {body[k]!r}"
    for k in ("envs", "metadata"):
        if k in body and (
            not isinstance(body[k], dict)
            or not all(isinstance(a, str) and isinstance(b, str) for a, b in body[k].items())
        ):
            return f"{k} must map strings to strings"
    if body.get("kind", "sandbox") not in ("sandbox", "desktop"):
        return "kind must be sandbox or desktop"
    if body.get("kind", "sandbox") == "sandbox" and ("record" in body or "resolution" in body):
        return "RecordingRequiresDesktop: record/resolution are desktop-only"
    if "template" in body and not isinstance(body["template"], str):
        return "template must be a string"
    return ""
