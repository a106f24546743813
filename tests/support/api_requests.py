"""Counts the HTTP requests this process sends to the Prefect API, by method and path.

Every Prefect client (sync or async, Prefect's own log worker included) sends through an
httpx transport; counting at the transport counts each request that goes on the wire,
retries included, whoever made it. Used by tests and benchmarks to show what a log line
costs in API requests.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx


class RequestCount:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()
        self.log_post_seconds: list[float] = []  # round trip of each POST /logs/

    @staticmethod
    def key(request: httpx.Request) -> tuple[str, str]:
        path = request.url.path
        # "/api/logs/" on a server, "/logs/" relative to Prefect Cloud's workspace URL
        return request.method, "/logs/" if path.endswith("/logs/") else path

    def record(self, request: httpx.Request, seconds: float) -> None:
        key = self.key(request)
        with self._lock:
            self._counts[key] += 1
            if key == ("POST", "/logs/"):
                self.log_post_seconds.append(seconds)

    def get(self, method: str, path: str) -> int:
        with self._lock:
            return self._counts[(method, path)]

    @property
    def log_posts(self) -> int:
        """Requests that create logs (``POST /logs/``)."""
        return self.get("POST", "/logs/")

    def log_post_median_s(self) -> float | None:
        with self._lock:
            return statistics.median(self.log_post_seconds) if self.log_post_seconds else None


@contextlib.contextmanager
def counting_api_requests() -> Iterator[RequestCount]:
    count = RequestCount()
    sync_send = httpx.HTTPTransport.handle_request
    async_send = httpx.AsyncHTTPTransport.handle_async_request

    def handle_request(self: httpx.HTTPTransport, request: httpx.Request) -> httpx.Response:
        t0 = time.perf_counter()
        try:
            return sync_send(self, request)
        finally:
            count.record(request, time.perf_counter() - t0)

    async def handle_async_request(self: httpx.AsyncHTTPTransport, request: httpx.Request) -> Any:
        t0 = time.perf_counter()
        try:
            return await async_send(self, request)
        finally:
            count.record(request, time.perf_counter() - t0)

    httpx.HTTPTransport.handle_request = handle_request  # type: ignore[method-assign]
    httpx.AsyncHTTPTransport.handle_async_request = handle_async_request  # type: ignore[method-assign]
    try:
        yield count
    finally:
        httpx.HTTPTransport.handle_request = sync_send  # type: ignore[method-assign]
        httpx.AsyncHTTPTransport.handle_async_request = async_send  # type: ignore[method-assign]
