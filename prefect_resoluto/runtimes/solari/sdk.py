"""Plumbing under the official Solari SDK: an event loop of our own and the seed's HTTP retry rules.

The SDK is async and its sync wrapper cannot run inside a running event loop (a Prefect
async task has one), so every SDK object lives on one loop in a daemon thread. Where the
SDK diverges from the gateway's wire contract, the workaround is marked ``SDK divergence N``
(numbered as in docs/backends.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import threading
import urllib.request
from collections.abc import Coroutine
from typing import Any, TypeVar
from urllib.parse import urlparse

_T = TypeVar("_T")

# The statuses the SDK retries itself on an idempotent request (solari_core/_http.py).
_SDK_RETRIED = frozenset({502, 503, 504, 507})


# -- one event loop of our own ---------------------------------------------------------------


class LoopThread:
    """An asyncio loop in a daemon thread; every SDK object lives and is used on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="resoluto-solari", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        if threading.current_thread() is self.thread:
            raise RuntimeError("SolariRuntime: a blocking call from the SDK's own loop would deadlock")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)


_LOOP: LoopThread | None = None
_LOOP_LOCK = threading.Lock()


def loop() -> LoopThread:
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or not _LOOP.thread.is_alive():
            _LOOP = LoopThread()
        return _LOOP


# -- the HTTP policy the seed asks for, under the SDK ----------------------------------------


def backoff_s(attempt: int) -> float:
    """The seed's ``min(150 * 2^attempt, 8000) + rand(0..250)`` ms."""
    return min(0.15 * 2.0**attempt, 8.0) + random.random() * 0.25


def make_http_client(base_url: str, max_retries: int = 5) -> Any:
    """The ``httpx.AsyncClient`` handed to the SDK, with the seed's retry rules restored."""
    import httpx

    class SeedRetryPolicy(httpx.AsyncBaseTransport):
        def __init__(self) -> None:
            # SDK divergence 10: httpx trusts proxy variables (and websockets uses a proxy by default).
            # Choose the proxy the way the WebSocket side does (urllib's rules, NO_PROXY honoured),
            # never for a loopback gateway, and keep this retry policy in front of it either way.
            url = urlparse(base_url)
            proxy = None
            if url.hostname not in ("127.0.0.1", "localhost", "::1") and not urllib.request.proxy_bypass(
                url.netloc
            ):
                proxy = urllib.request.getproxies().get(url.scheme)
            self._inner = httpx.AsyncHTTPTransport(proxy=proxy)
            self.retried = 0

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            idempotent = request.method in ("GET", "DELETE") or "idempotency-key" in request.headers
            attempt = 0
            while True:
                resp = await self._inner.handle_async_request(request)
                status = resp.status_code
                # SDK divergence 2: the SDK retries only 502/503/504/507, the seed every 5xx of an
                # idempotent request. Retry the others here, with the same request (and so the same
                # Idempotency-Key); the SDK's own list is left to the SDK so attempts do not multiply.
                if idempotent and status >= 500 and status not in _SDK_RETRIED and attempt < max_retries:
                    await resp.aread()
                    await resp.aclose()
                    await asyncio.sleep(backoff_s(attempt))
                    attempt += 1
                    self.retried += 1
                    continue
                if status == 429:
                    # SDK divergence 1: a 429 whose body says "retryable": true is retried by the SDK;
                    # the seed says 429 (the organisation at its session cap) is never retried. Clear
                    # the flag so the SDK raises ConcurrencyLimitError at once and our admission wait
                    # (which says so in the task's logs) is the only one.
                    body = await resp.aread()
                    await resp.aclose()
                    try:
                        parsed = json.loads(body or b"null")
                    except ValueError:
                        parsed = None
                    if isinstance(parsed, dict) and parsed.get("retryable") is True:
                        parsed["retryable"] = False
                        body = json.dumps(parsed).encode()
                    headers = [
                        (k, v)
                        for k, v in resp.headers.items()
                        if k.lower() not in ("content-length", "content-encoding", "transfer-encoding")
                    ]
                    return httpx.Response(status, headers=headers, content=body, request=request)
                return resp

        async def aclose(self) -> None:
            await self._inner.aclose()

    return httpx.AsyncClient(transport=SeedRetryPolicy(), trust_env=False)
