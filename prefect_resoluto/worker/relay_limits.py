"""How much of the Prefect API's answers one run's gateway relays and holds (issue 39).

An answer is the server's, but what is in it is often the run's own making: sixty sub-flow
runs of 2 MB each make one listing of them 117 MB, and the gateway runs in the worker,
which every run of the pool shares. So every answer the gateway takes from the API is
bounded before it is read:

* **per answer**: at most :attr:`Limits.max_answer` bytes (``RESOLUTO_GATEWAY_MAX_ANSWER``
  on the worker). A longer declared length is refused before a byte of the body is read;
  an answer without one is cut where it passes the cap.
* **read**: an answer the gateway parses (a creation it claims for the run, a work pool it
  strips, an ownership check of its rules) is held whole only up to :data:`MAX_READ`;
  every other answer (reads and listings, :func:`streamed`) goes to the sandbox chunk by
  chunk, never held.
* **per run**: the answers of one run in flight at once hold at most
  :attr:`Limits.run_budget` bytes between them (``RESOLUTO_GATEWAY_RUN_BUDGET``); an answer
  waits for its share, and after :data:`BUDGET_WAIT` seconds is refused (503, which the
  engine retries). Each run has its own budget: one run's answers never wait for another's.

A refusal is an :class:`AnswerRefused`: an HTTP status and a message naming the limit and
its setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20
#: The worker's settings (environment variables, in bytes) and their defaults.
MAX_ANSWER_ENV = "RESOLUTO_GATEWAY_MAX_ANSWER"
RUN_BUDGET_ENV = "RESOLUTO_GATEWAY_RUN_BUDGET"
DEFAULT_MAX_ANSWER = 32 * MIB
DEFAULT_RUN_BUDGET = 64 * MIB
#: Bytes of an answer the gateway parses. Those are creations echoing their request (at most
#: bodies.BODY_CAPS, 6 MiB), a work pool, and its rules' ownership queries.
MAX_READ = 8 * MIB
#: Seconds an answer waits for its run's budget before it is refused.
BUDGET_WAIT = 30.0
#: Reads of one object by id, and listings, whose answers the gateway's rules never look at
#: (``RunRules.note_response`` and ``strip_response`` read creations, block documents and
#: work pools: none of them may be here, or a big one would pass unread).
_STREAMED_GETS = frozenset({"flow_runs", "task_runs", "flows", "deployments", "variables", "work_queues"})


@dataclass(frozen=True)
class AnswerRefused(Exception):
    """An answer the gateway will not relay: the status and message the sandbox gets."""

    status: int
    detail: str

    def __str__(self) -> str:
        return self.detail


@dataclass(frozen=True)
class Limits:
    max_answer: int = DEFAULT_MAX_ANSWER
    run_budget: int = DEFAULT_RUN_BUDGET

    @classmethod
    def from_env(cls) -> Limits:
        return cls(
            max_answer=_bytes_setting(MAX_ANSWER_ENV, DEFAULT_MAX_ANSWER),
            run_budget=_bytes_setting(RUN_BUDGET_ENV, DEFAULT_RUN_BUDGET),
        )

    def cap(self, *, read: bool) -> tuple[int, str]:
        """The bytes one answer may have, and the limit that says so (for its refusal)."""
        caps = [(self.max_answer, f"the gateway's cap per answer ({MAX_ANSWER_ENV})")]
        caps.append((self.run_budget, f"the run's budget for answers in flight ({RUN_BUDGET_ENV})"))
        if read:
            caps.append((MAX_READ, "the gateway's cap on an answer it reads (its rules parse it)"))
        return min(caps)


def _bytes_setting(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 64 * 1024:
        raise ValueError(f"{name}={raw!r}: a number of bytes, at least 65536")
    return int(raw)


def streamed(method: str, rel: str) -> bool:
    """Whether the answer goes to the sandbox unread (chunk by chunk) rather than parsed."""
    parts = rel.strip("/").split("/")
    if method.upper() == "POST":
        return parts[-1] == "filter"
    return method.upper() == "GET" and parts[0] in _STREAMED_GETS


def too_big(size: int, cap: int, limit: str, what: str) -> AnswerRefused:
    return AnswerRefused(
        507,
        f"resoluto gateway: the Prefect API's answer to {what} is {size} bytes or more, over {limit}: "
        f"{cap} bytes; ask for less (a smaller limit, fewer ids)",
    )


class RunBudget:
    """The bytes one run's answers hold at once (on the run's gateway's own event loop)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.held = 0
        self.peak = 0
        self._freed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def hold(self, n: int, what: str) -> AsyncIterator[None]:
        """``n`` bytes of the budget while the block runs (waiting for them, within BUDGET_WAIT)."""
        n = min(n, self.total)  # an answer's cap is never above the budget (Limits.cap)
        async with self._freed:
            try:
                async with asyncio.timeout(BUDGET_WAIT):
                    await self._freed.wait_for(lambda: self.held + n <= self.total)
            except TimeoutError:
                raise AnswerRefused(
                    503,
                    f"resoluto gateway: the answer to {what} waited {BUDGET_WAIT:.0f} s for this run's budget "
                    f"for answers in flight ({RUN_BUDGET_ENV}: {self.total} bytes, all held by its other "
                    "answers)",
                ) from None
            self.held += n
            self.peak = max(self.peak, self.held)
        try:
            yield
        finally:
            async with self._freed:
                self.held -= n
                self._freed.notify_all()


def declared(resp: Any) -> int | None:
    raw = resp.headers.get("content-length")
    return int(raw) if raw is not None and raw.isdigit() else None


async def read_capped(resp: Any, cap: int, limit: str, what: str) -> bytes:
    """The whole (decoded) body of a streamed httpx response, or AnswerRefused past ``cap``:
    a declared length over it is refused before a byte is read."""
    size = declared(resp)
    if size is not None and size > cap:
        raise too_big(size, cap, limit, what)
    buf = bytearray()
    async for chunk in resp.aiter_bytes():
        buf += chunk
        if len(buf) > cap:
            raise too_big(len(buf), cap, limit, what)
    return bytes(buf)


async def chunks_capped(resp: Any, cap: int, limit: str, what: str) -> AsyncIterator[bytes]:
    """The body chunk by chunk, raising AnswerRefused (the relay is cut) past ``cap``."""
    sent = 0
    async for chunk in resp.aiter_bytes():
        sent += len(chunk)
        if sent > cap:
            raise too_big(sent, cap, limit, what)
        yield chunk
