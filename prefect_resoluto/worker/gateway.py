"""One flow run's gateway to the Prefect API: the only credential a sandboxed run holds is its token.

The ``resoluto`` worker starts one :class:`ApiGateway` per flow run, on the host, before
the sandbox. The gateway holds the worker's own credential (:class:`Upstream`: an auth
string as HTTP basic auth, or an API key as a bearer token) and forwards to the real API
what :class:`~prefect_resoluto.worker.rules.RunRules` admits for that one run; the sandbox
gets the gateway's address and a random token for that run only, and the gateway (its
listener, its token) is gone when the run's sandbox is.

HTTP requests are read whole (bounded), judged, and forwarded with the worker's
credential in place of the token; the API's answers are bounded too (``relay_limits``):
reads and listings stream back to the sandbox unread, the rest is read under a cap. The events websocket (``/api/events/in``, where
Prefect's engine sends task-run states) is terminated here: the gateway speaks Prefect's
websocket protocol to the sandbox (the ``prefect`` subprotocol's auth message carries the
token) and its own connection upstream, and relays one judged event at a time. A refusal
is an HTTP 403 (or a dropped event) and a WARNING line in the flow run's own logs, written
with the worker's credential.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import datetime
import hmac
import json
import logging
import secrets
import socket
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from guest_runner.refusal import REFUSED_HEADER, SETTING_HEADER
from prefect_resoluto.worker.bodies import body_cap, parse_bounded
from prefect_resoluto.worker.relay_limits import (
    AnswerRefused,
    Limits,
    RunBudget,
    chunks_capped,
    declared,
    read_capped,
    streamed,
    too_big,
)
from prefect_resoluto.worker.rules import Answered, Rebuilt, Refusal, RunRules

logger = logging.getLogger("prefect_resoluto.worker.gateway")

#: The largest message the gateway takes from the API's event stream (a sandbox's bodies: bodies.py).
MAX_BODY = 16 * 1024 * 1024
#: The largest websocket message a sandbox may send (Prefect's own bound on an event is
#: 1.5 MB, PREFECT_EVENTS_MAXIMUM_SIZE_BYTES).
MAX_EVENT = 2 * 1024 * 1024
#: Refusals written to the run's logs (and to the worker's); after that one line says that
#: more were not, and they are only counted.
MAX_LOGGED_REFUSALS = 100
#: Seconds a request's body may take to arrive, once its head has (a sandbox that sends
#: half a body holds no slot for ever).
BODY_TIMEOUT = 30.0
#: Seconds a connection may take to send a whole request head.
HEAD_TIMEOUT = 15.0
#: Requests of one run the gateway works on at once; more wait their turn.
MAX_CONCURRENT = 8
#: Connections the gateway holds to the API for one run's HTTP (its requests, the answers
#: it streams back, the rules' own reads, refusals' log lines); more wait for one to free.
MAX_UPSTREAM = 2 * MAX_CONCURRENT
#: Events websockets of one run open at once, each one connection upstream (Prefect's
#: engine opens one `/events/in` and a subscription or two per process); more are refused.
MAX_WEBSOCKETS = 4
#: Connections of a sandbox the gateway holds at once (each a descriptor of the worker's,
#: which every run shares); one past it is closed as soon as it is accepted.
MAX_CONNECTIONS = 64
#: The logger name of the gateway's lines in the flow run's logs.
LOGGER_NAME = "prefect_resoluto.gateway"
# Headers of the sandbox's request that are the gateway's business, not the API's.
_DROP_REQUEST = frozenset(
    {
        "host",
        "authorization",
        "cookie",
        "connection",
        "keep-alive",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "accept-encoding",
        # The API reads exactly the bytes judged here: never as something to decode first.
        "content-encoding",
    }
)
#: Methods whose body the engine never sends: none is forwarded (what is not judged is not sent).
_NO_BODY = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})
_DROP_RESPONSE = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-encoding", "content-length", "set-cookie"}
    | {REFUSED_HEADER, SETTING_HEADER}  # the gateway's own marks: an answer of the API's never bears them
)


@dataclass(frozen=True)
class Upstream:
    """The real API and the worker's credential for it (never shown: ``repr`` hides it)."""

    api_url: str
    auth_string: str | None = None
    api_key: str | None = None

    def __repr__(self) -> str:
        return f"Upstream({self.api_url!r}, {self.scheme})"

    @property
    def scheme(self) -> str:
        """Which header the gateway adds (Prefect's own client's choice: the auth string wins)."""
        return "basic" if self.auth_string else "bearer" if self.api_key else "none"

    def headers(self) -> dict[str, str]:
        if self.auth_string:
            token = base64.b64encode(self.auth_string.encode()).decode()
            return {"Authorization": f"Basic {token}"}
        if self.api_key:
            return {"Authorization": f"Bearer {self.api_key}"}
        return {}

    @property
    def cloud_websocket(self) -> bool:
        """Prefect Cloud authenticates its websockets by the bearer header alone; a
        self-hosted server by the ``prefect`` subprotocol's auth message."""
        return bool(self.api_key) and not self.auth_string

    @classmethod
    def from_settings(cls, api_url: str | None = None) -> Upstream:
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY, PREFECT_API_URL

        url = api_url or str(PREFECT_API_URL.value() or "")
        if not url:
            raise ValueError(
                "PREFECT_API_URL is not set for the worker: the sandboxed flow run could not report"
            )
        auth = PREFECT_API_AUTH_STRING.value()
        key = PREFECT_API_KEY.value()
        return cls(
            api_url=url.rstrip("/"),
            auth_string=_plain(auth),
            api_key=_plain(key),
        )


def _plain(value: Any) -> str | None:
    if value is None:
        return None
    raw = value.get_secret_value() if hasattr(value, "get_secret_value") else str(value)
    return raw or None


class ApiGateway:
    """One flow run's gateway: a listener on ``host``, a token, the run's rules."""

    def __init__(
        self,
        flow_run_id: str,
        upstream: Upstream,
        rules: RunRules,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        announce: bool = True,
        limits: Limits | None = None,
    ) -> None:
        self.flow_run_id = flow_run_id
        self.limits = limits or Limits.from_env()
        self.budget = RunBudget(self.limits.run_budget)
        self.upstream = upstream
        self.rules = rules
        self.token = secrets.token_urlsafe(32)
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(MAX_CONNECTIONS)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self.refused = 0
        self.subscriptions = 0  # event subscriptions relayed (narrowed to the run)
        self._announce = announce  # refusals on the worker's own log too (doctor's probe: not)
        self._logged = 0
        self._announced = 0
        self._busy: asyncio.Semaphore | None = None
        self._websockets = 0  # events websockets open (each holds an upstream connection)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Any = None
        self._failure: BaseException | None = None

    # ------------------------------------------------------------------ life cycle

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def start(self) -> ApiGateway:
        import uvicorn

        config = uvicorn.Config(
            self._app(),
            log_config=None,  # the worker's logging stays as it is
            log_level="warning",
            access_log=False,
            lifespan="off",
            ws="websockets-sansio",
            http=_head_timed_protocol(),
            limit_concurrency=4 * MAX_CONCURRENT + 16,  # requests at once: more are answered 503
            backlog=MAX_CONNECTIONS,  # also how many asyncio accepts in one go, before any is closed
            ws_max_size=MAX_EVENT,
            timeout_graceful_shutdown=2,
            server_header=False,
            date_header=False,
        )
        self._server = uvicorn.Server(config)

        def serve() -> None:
            try:
                asyncio.run(self._serve())
            except BaseException as e:  # noqa: BLE001 - reported by start()
                self._failure = e
                self._started.set()

        self._thread = threading.Thread(
            target=serve, name=f"resoluto-gateway-{self.flow_run_id}", daemon=True
        )
        self._thread.start()
        self._started.wait(timeout=30)
        if self._failure is not None or not self._started.is_set():
            self.close()
            raise RuntimeError(f"the API gateway could not start: {self._failure}")
        return self

    async def _serve(self) -> None:
        import httpx

        self._loop = asyncio.get_running_loop()
        self._busy = asyncio.Semaphore(MAX_CONCURRENT)
        async with httpx.AsyncClient(
            base_url=self.upstream.api_url,
            # identity: an answer's declared length is its size, refused before it is read
            # when over the cap (a compressed one is counted as it is decoded)
            headers={**self.upstream.headers(), "Accept-Encoding": "identity"},
            timeout=httpx.Timeout(60.0, connect=15.0),
            limits=httpx.Limits(max_connections=MAX_UPSTREAM, max_keepalive_connections=MAX_CONCURRENT),
            follow_redirects=False,
        ) as client:
            self._client = client
            self._loop.call_soon(self._started.set)
            await self._server.serve(sockets=[self._sock])

    def close(self) -> None:
        """Stop listening and drop every connection: the token dies with the listener."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
            if self._thread.is_alive() and self._server is not None:
                self._server.force_exit = True
                self._thread.join(timeout=15)
        self._sock.close()

    def __enter__(self) -> ApiGateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the app

    def _app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.routing import Route, WebSocketRoute

        methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
        return Starlette(
            routes=[
                WebSocketRoute("/{path:path}", self._websocket),
                Route("/{path:path}", self._http, methods=methods),
            ]
        )

    def _authorized(self, header: str | None) -> bool:
        """The run's token, as Prefect's client sends it: ``Basic b64(token)`` (the token as
        the run's auth string) or ``Bearer token`` (as an API key)."""
        if not header:
            return False
        scheme, _, value = header.strip().partition(" ")
        value = value.strip()
        if scheme.lower() == "bearer":
            return hmac.compare_digest(value.encode(), self.token.encode())
        if scheme.lower() == "basic":
            try:
                decoded = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                return False
            return hmac.compare_digest(decoded, self.token.encode())
        return False

    async def _http(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        if not self._authorized(request.headers.get("authorization")):
            return JSONResponse(
                {
                    "detail": "resoluto gateway: this flow run's token is required (it is valid for one run only)"
                },
                status_code=401,
            )
        path = request.url.path
        if path != "/api" and not path.startswith("/api/"):
            return await self._refuse(
                Refusal("api-only", f"{request.method} {path}: only the Prefect API under /api is forwarded")
            )
        rel = path[len("/api") :] or "/"
        assert self._busy is not None
        async with self._busy:  # one run's requests share a few slots: the rest wait
            return await self._judged(request, rel)

    async def _request_body(self, request: Any, rel: str) -> bytes | Any:
        """The request's body under its cap and time limit, or the answer refusing it."""
        from starlette.responses import JSONResponse

        cap = body_cap(request.method, rel)
        length = request.headers.get("content-length")
        over = JSONResponse({"detail": f"resoluto gateway: request body over {cap} bytes"}, 413)
        if length is not None and (not length.isdigit() or int(length) > cap):
            return over  # refused before a byte of the body is read
        buf = bytearray()
        try:
            async with asyncio.timeout(BODY_TIMEOUT):
                async for chunk in request.stream():
                    buf += chunk
                    if len(buf) > cap:
                        return over
        except TimeoutError:
            return JSONResponse(
                {"detail": f"resoluto gateway: body not sent within {BODY_TIMEOUT:.0f} s"}, 408
            )
        return bytes(buf)

    async def _judged(self, request: Any, rel: str) -> Any:
        from starlette.responses import JSONResponse

        body = await self._request_body(request, rel)
        if not isinstance(body, bytes):
            return body
        parsed = parse_bounded(body)
        try:
            verdict = await self.rules.check_http(
                request.method, rel, dict(request.query_params), parsed, self
            )
        except AnswerRefused as e:  # an ownership check's answer over its cap: not judged
            return await self._answer_refused(e)
        if isinstance(verdict, Refusal):
            return await self._refuse(verdict)
        if isinstance(verdict, Answered):  # the rules made the request themselves (a flow's registration)
            return JSONResponse(verdict.body, status_code=verdict.status)
        if isinstance(verdict, Rebuilt):
            body = json.dumps(verdict.body).encode()  # what the gateway built, never what it received
            parsed = verdict.body
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
        if isinstance(verdict, Rebuilt):
            headers["content-type"] = "application/json"
        upstream = self._client.build_request(
            request.method,
            rel.lstrip("/"),
            params=request.url.query or None,
            content=None if request.method.upper() in _NO_BODY else body or None,
            headers=headers,
        )
        try:
            resp = await self._client.send(upstream, stream=True)
        except Exception as e:  # the API is away: the engine retries as it would without us
            return JSONResponse({"detail": f"resoluto gateway: the Prefect API is unreachable: {e}"}, 502)
        return await self._answer(request, rel, parsed, resp)

    async def _answer(self, request: Any, rel: str, parsed: Any, resp: Any) -> Any:
        """The API's answer to the sandbox: streamed unread where the rules never read it, else
        read under the cap, noted by the rules and stripped; bounded either way."""
        from starlette.responses import Response

        what = f"{request.method} /api{rel}"
        out = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_RESPONSE}
        held = contextlib.AsyncExitStack()
        try:
            held.push_async_callback(resp.aclose)
            if streamed(request.method, rel):  # the rules never read it: to the sandbox unread
                cap, limit = self.limits.cap(read=False)
                size = declared(resp)
                if size is not None and size > cap:
                    raise too_big(size, cap, limit, what)  # before a byte of it is read
                await held.enter_async_context(self.budget.hold(cap if size is None else size, what))
                if size is not None and "content-encoding" not in resp.headers:
                    out["content-length"] = str(size)
                relay = _Relay(resp.status_code, out, chunks_capped(resp, cap, limit, what), held)
                held = contextlib.AsyncExitStack()  # the relay closes what it was handed
                return relay
            cap, limit = self.limits.cap(read=True)
            size = declared(resp)
            async with self.budget.hold(cap if size is None else min(size, cap), what):
                content = await read_capped(resp, cap, limit, what)
                reply = _json(content)
                self.rules.note_response(request.method, rel, parsed, resp.status_code, reply)
                stripped = self.rules.strip_response(rel, reply)
                if stripped is not reply:
                    content = json.dumps(stripped).encode()
            return Response(content, status_code=resp.status_code, headers=out)
        except AnswerRefused as e:
            return await self._answer_refused(e)
        finally:
            await held.aclose()

    async def _answer_refused(self, refused: AnswerRefused) -> Any:
        """An answer over a limit: the sandbox gets the limit's name, the run's logs a line."""
        from starlette.responses import JSONResponse

        await self._note_refusal(Refusal("answer-size", refused.detail))
        return JSONResponse({"detail": refused.detail}, status_code=refused.status)

    async def _websocket(self, ws: Any) -> None:
        path = ws.url.path
        if path not in ("/api/events/in", "/api/events/out"):
            refusal = Refusal(
                "websocket",
                f"websocket {path}: only /api/events/in and /api/events/out (this run's events) are open",
            )
            await self._note_refusal(refusal)
            await _close(ws, 1008, refusal.rule)
            return
        wanted = [p.strip() for h in ws.headers.getlist("sec-websocket-protocol") for p in h.split(",")]
        if "prefect" in wanted:
            await ws.accept(subprotocol="prefect")
            try:
                async with asyncio.timeout(HEAD_TIMEOUT):  # a silent client holds no connection for ever
                    message = json.loads(await ws.receive_text())
            except Exception:
                await _close(ws, 1008, "Expected 'auth' message")
                return
            token = message.get("token") if isinstance(message, dict) else None
            ok = isinstance(message, dict) and message.get("type") == "auth" and isinstance(token, str)
            ok = ok and hmac.compare_digest(str(token).encode("utf-8", "surrogatepass"), self.token.encode())
            if not ok and not self._authorized(ws.headers.get("authorization")):
                await _close(ws, 1008, "Invalid token")
                return
        else:  # a client without Prefect's subprotocol: the token must be in the upgrade
            if not self._authorized(ws.headers.get("authorization")):
                await _close(ws, 1008, "'prefect' subprotocol required")
                return
            await ws.accept()
        if self._websockets >= MAX_WEBSOCKETS:  # counted before any await: no race past it
            refusal = Refusal(
                "websockets",
                f"websocket {path}: this run has {MAX_WEBSOCKETS} events websockets open already, "
                "the most it may hold at once",
            )
            await _close(ws, 1013, f"websockets: at most {MAX_WEBSOCKETS} open at once per flow run")
            await self._note_refusal(refusal)
            return
        self._websockets += 1
        try:
            await self._events(ws, path.rsplit("/", 1)[1], "prefect" in wanted)
        finally:
            self._websockets -= 1

    async def _events(self, ws: Any, stream: str, prefect: bool) -> None:
        """One admitted events websocket, relayed over its own connection upstream."""
        try:
            upstream = await self._open_events_upstream(stream)
        except Exception as e:
            logger.warning("flow run %s: the events websocket upstream failed: %s", self.flow_run_id, e)
            await _close(ws, 1011, "the Prefect API's event stream is unreachable")
            return
        try:
            if prefect:
                await ws.send_text(json.dumps({"type": "auth_success"}))
            if stream == "in":
                await self._relay_events(ws, upstream)
            else:
                await self._relay_subscription(ws, upstream)
        finally:
            await upstream.close()

    async def _open_events_upstream(self, stream: str) -> Any:
        from websockets.asyncio.client import connect
        from websockets.typing import Subprotocol

        url = (
            self.upstream.api_url.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
            + f"/events/{stream}"
        )
        if self.upstream.cloud_websocket:
            return await connect(url, additional_headers=self.upstream.headers(), max_size=MAX_BODY)
        up = await connect(
            url,
            subprotocols=[Subprotocol("prefect")],
            additional_headers=self.upstream.headers(),
            max_size=MAX_BODY,
        )
        await up.send(json.dumps({"type": "auth", "token": self.upstream.auth_string}))
        reply = json.loads(await up.recv())
        if reply.get("type") != "auth_success":
            await up.close()
            raise RuntimeError(f"the API refused the worker's credential on its event stream: {reply}")
        return up

    async def _relay_events(self, ws: Any, upstream: Any) -> None:
        from websockets.exceptions import ConnectionClosed

        # The API closes its side on an event it cannot read: the sandbox's is closed then too,
        # with a reason, not left waiting (nor failed by the next send).
        gone = asyncio.ensure_future(upstream.wait_closed())
        try:
            while True:
                received = asyncio.ensure_future(_receive_text(ws))
                await asyncio.wait({received, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not received.done():
                    received.cancel()
                    await _close(ws, 1011, "the Prefect API closed its event stream")
                    return
                text = received.result()
                if text is None:
                    return
                try:
                    await self._relay_event(text, upstream)
                except ConnectionClosed:
                    await _close(ws, 1011, "the Prefect API closed its event stream")
                    return
        finally:
            gone.cancel()

    async def _relay_event(self, text: str, upstream: Any) -> None:
        """One of the sandbox's events: judged, then forwarded as parsed, or dropped and logged."""
        event = parse_bounded(text.encode("utf-8", "surrogatepass"))  # bounded before parsed, as a body
        try:
            refusal = event if isinstance(event, Refusal) else await self.rules.check_event(event, self)
        except AnswerRefused as e:  # an ownership check's answer over its cap: not judged
            refusal = Refusal("answer-size", e.detail)
        if refusal is not None:
            await self._note_refusal(refusal)
            return  # the engine cannot be told about one event: it is dropped and logged
        # What is judged is what is forwarded: the parsed event, not the text (whose
        # duplicate keys another JSON parser may read the other way).
        await upstream.send(json.dumps(event))

    async def _relay_subscription(self, ws: Any, upstream: Any) -> None:
        """The engine's subscription (its own Suspended events), narrowed to this run."""
        first = await _receive_text(ws)
        if first is None:
            return
        flt = parse_bounded(first.encode("utf-8", "surrogatepass"))
        narrowed, refusal = (None, flt) if isinstance(flt, Refusal) else self.rules.events_out_filter(flt)
        if refusal is not None:
            await self._note_refusal(refusal)
            await _close(ws, 1008, refusal.rule)
            return
        await upstream.send(json.dumps(narrowed))
        self.subscriptions += 1

        async def from_sandbox() -> None:  # nothing is expected after the filter: wait for the close
            while await _receive_text(ws) is not None:
                pass

        closed = asyncio.ensure_future(from_sandbox())
        try:
            while not closed.done():
                recv = asyncio.ensure_future(upstream.recv())
                await asyncio.wait({recv, closed}, return_when=asyncio.FIRST_COMPLETED)
                if not recv.done():
                    recv.cancel()
                    return
                text = recv.result()
                if self.rules.admits_outgoing(_json(text.encode() if isinstance(text, str) else text)):
                    await ws.send_text(text if isinstance(text, str) else text.decode())
        except Exception:  # the upstream closed: so does the sandbox's side
            return
        finally:
            closed.cancel()

    # ------------------------------------------------------------------ refusals

    async def _refuse(self, refusal: Refusal) -> Any:
        from starlette.responses import JSONResponse

        await self._note_refusal(refusal)
        # Marked, so the run's Prefect client raises what a sandboxed task would (guest_runner.engine).
        headers = {REFUSED_HEADER: refusal.rule}
        if refusal.setting:
            headers[SETTING_HEADER] = refusal.setting
        detail = refusal.told or f"refused by the resoluto gateway (rule {refusal.rule}): {refusal.why}"
        return JSONResponse({"detail": detail}, status_code=403, headers=headers)

    async def _note_refusal(self, refusal: Refusal) -> None:
        self.refused += 1
        why = escape_controls(refusal.why)
        if self._announce and self._announced <= MAX_LOGGED_REFUSALS:
            self._announced += 1
            if self._announced > MAX_LOGGED_REFUSALS:
                logger.warning(
                    "flow run %s: more than %d refusals; the rest are counted, not logged",
                    self.flow_run_id,
                    MAX_LOGGED_REFUSALS,
                )
            else:
                logger.warning("flow run %s: refused (rule %s): %s", self.flow_run_id, refusal.rule, why)
        if self._logged > MAX_LOGGED_REFUSALS:
            return
        self._logged += 1
        if self._logged > MAX_LOGGED_REFUSALS:
            message = (
                f"resoluto gateway: more than {MAX_LOGGED_REFUSALS} refusals; the rest are not logged here"
            )
        else:
            message = f"resoluto gateway refused (rule {refusal.rule}): {why}"
        await self.write_log(message, level=logging.WARNING)

    async def write_log(self, message: str, *, level: int = logging.INFO) -> None:
        """A line in the flow run's own logs, sent with the worker's credential."""
        now = datetime.datetime.now(datetime.UTC).isoformat()
        entry = {
            "name": LOGGER_NAME,
            "level": level,
            "message": message,
            "timestamp": now,
            "flow_run_id": self.flow_run_id,
            "task_run_id": None,
        }
        try:
            await self._client.post("logs/", json=[entry])
        except Exception as e:  # the refusal itself stands; only its log line is lost
            logger.debug("could not log a refusal for flow run %s: %s", self.flow_run_id, e)

    async def upstream_get(self, rel: str) -> tuple[int, Any]:
        """A read with the worker's credential (the rules' ownership checks)."""
        return await self._read_upstream(self._client.build_request("GET", rel.lstrip("/")))

    async def upstream_post(self, rel: str, body: Any) -> tuple[int, Any]:
        """A filtered read with the worker's credential (many ids' ownership in one query)."""
        return await self._read_upstream(self._client.build_request("POST", rel.lstrip("/"), json=body))

    async def _read_upstream(self, request: Any) -> tuple[int, Any]:
        """An answer the rules parse: under the read cap and the run's budget, or AnswerRefused."""
        what = f"the gateway's own {request.method} /api/{request.url.path.rsplit('/api/', 1)[-1]}"
        cap, limit = self.limits.cap(read=True)
        try:
            resp = await self._client.send(request, stream=True)
        except Exception as e:  # the API away or slow: nothing judged, so refused (the engine retries)
            logger.info("flow run %s: %s failed: %s", self.flow_run_id, what, e)
            return 0, None
        try:
            size = declared(resp)
            async with self.budget.hold(cap if size is None else min(size, cap), what):
                return resp.status_code, _json(await read_capped(resp, cap, limit, what))
        except AnswerRefused:
            raise
        except Exception as e:  # the answer broke off
            logger.info("flow run %s: %s failed: %s", self.flow_run_id, what, e)
            return 0, None
        finally:
            await resp.aclose()

    def sandbox_url(self, host: str | None = None, port: int | None = None) -> str:
        """The API URL the sandbox dials (``host:port`` as the sandbox sees the gateway)."""
        return f"http://{host or self.host}:{port or self.port}/api"


def probe() -> dict[str, Any]:
    """``doctor``'s check of the gateway, without Prefect or an API: one gateway on loopback
    must refuse a request without its token (401) and one off its rules (403 naming the
    rule), forward one with it, and leave no listener once closed."""
    import os
    import urllib.error
    import urllib.request

    def status(url: str, token: str | None) -> tuple[int, str]:
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    env = os.environ
    credential = (
        "PREFECT_API_AUTH_STRING (basic auth)"
        if env.get("PREFECT_API_AUTH_STRING")
        else "PREFECT_API_KEY (bearer)"
        if env.get("PREFECT_API_KEY")
        else "none in this environment (a worker reads its profile too)"
    )
    out: dict[str, Any] = {"ok": False, "credential": credential, "why": ""}
    try:
        rules = RunRules(flow_run_id=str(uuid.uuid4()))
        with ApiGateway(rules.flow_run_id, Upstream("http://127.0.0.1:9/api"), rules, announce=False) as gw:
            base = f"http://{gw.address}/api"
            no_token = status(f"{base}/flow_runs/{rules.flow_run_id}", None)[0]
            refused, body = status(f"{base}/work_pools/", gw.token)
            forwarded = status(f"{base}/flow_runs/{rules.flow_run_id}", gw.token)[0]
            port = gw.port
        left = loopback_listeners(port)
    except Exception as e:  # a probe never takes doctor down
        out["why"] = f"{type(e).__name__}: {e}"
        return out
    ok = no_token == 401 and refused == 403 and "rule not-this-run" in body and forwarded == 502 and not left
    out.update(
        ok=ok,
        detail=(
            "one per flow run on 127.0.0.1 (kubernetes: the `api_gateway_address` job variable): "
            "refuses a request without the run's token (401) and one off the run's rules (403), "
            "forwards the run's own with the worker's credential, closes with the run"
        ),
        why=""
        if ok
        else f"no token -> {no_token}, off the rules -> {refused}, own run -> {forwarded}, "
        f"listener left after close: {left}",
    )
    return out


def gateway_summary(gateway: ApiGateway) -> str:
    """The flow run's first log line: where its API is, and what it may read."""
    rules = gateway.rules
    blocks = ", ".join(sorted(rules.allowed_blocks)) or "none"
    variables = ", ".join(sorted(rules.allowed_variables)) or "none"
    credential = {"basic": "the worker's auth string", "bearer": "the worker's API key"}.get(
        gateway.upstream.scheme
    )
    upstream = (
        f"which adds {credential} to what it passes on" if credential else "the API takes no credential"
    )
    return (
        f"This flow run reaches the Prefect API only through its resoluto gateway ({gateway.address}, "
        f"{upstream}): it holds a token valid for this run only and no "
        "credential of the worker's. It may act on itself and its task runs (states, logs, artifacts, "
        f"events) and read its deployment and flow; blocks it may read: {blocks}; variables: {variables}. "
        "Anything else is refused (HTTP 403) and logged here."
    )


class _Relay:
    """An answer streamed from the API to the sandbox as it arrives (an ASGI response): what
    it holds (the upstream answer, the run's budget) is let go when it ends, however it ends."""

    def __init__(
        self, status: int, headers: dict[str, str], chunks: Any, held: contextlib.AsyncExitStack
    ) -> None:
        self.status, self.headers, self.chunks, self.held = status, headers, chunks, held

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
            await send({"type": "http.response.start", "status": self.status, "headers": raw})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except AnswerRefused as e:
            # Past the cap with no declared length: its head is sent, so the answer is cut
            # (the connection drops; the client sees an incomplete answer, never a wrong one).
            logger.warning("%s", escape_controls(e.detail))
            raise
        finally:
            await self.chunks.aclose()
            await self.held.aclose()


async def _close(ws: Any, code: int, reason: str) -> None:
    with contextlib.suppress(Exception):  # the sandbox may be gone already
        await ws.close(code=code, reason=reason)


_CONTROLS = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]}


async def _receive_text(ws: Any) -> str | None:
    """The sandbox's next text frame; None once it closed, or after a binary frame (no
    engine's: the socket is closed, 1003). Starlette's ``receive_text`` raises KeyError on one."""
    from starlette.websockets import WebSocketDisconnect

    try:
        message = await ws.receive()
    except (WebSocketDisconnect, RuntimeError):
        return None
    if message.get("type") != "websocket.receive":
        return None
    text = message.get("text")
    if isinstance(text, str):
        return text
    await _close(ws, 1003, "events are text frames")
    return None


def escape_controls(text: str) -> str:
    """``text`` with its control characters (a terminal's escapes among them) as ``\\xNN``:
    a refused path or field is the sandbox's text, and the worker's log is a terminal's."""
    return text.translate(_CONTROLS)


def _head_timed_protocol() -> type:
    """uvicorn's h11 protocol, closing a connection whose request head is not complete
    within HEAD_TIMEOUT (uvicorn itself waits for ever), and one past MAX_CONNECTIONS as
    soon as it is accepted (uvicorn's `limit_concurrency` holds it open to answer 503)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimed(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            # every live connection of this gateway, HTTP or websocket, is in this set
            if len(self.connections) > MAX_CONNECTIONS:
                transport.abort()  # its descriptor is closed on the loop's next turn
                return
            self._arm()

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT, self._head_late)

        def _head_late(self) -> None:
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()  # no complete head since the last response

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and self._head_timer is not None:
                self._head_timer.cancel()  # a head arrived: the body has its own timeout
                self._head_timer = None

        def handle_websocket_upgrade(self, event: Any) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()  # the websocket protocol owns the connection now
                self._head_timer = None
            super().handle_websocket_upgrade(event)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._head_timer is None and not self.transport.is_closing():
                self._arm()  # keep-alive: the next head is timed too

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

    return HeadTimed


def _json(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


def loopback_listeners(port: int) -> bool:
    """Whether anything still accepts connections on 127.0.0.1:``port``."""
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0
