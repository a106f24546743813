"""A task that reads a Prefect variable and a block it may not read, the way a user's task
does, and says how each read failed: run under ResolutoTaskRunner and inside a flow run of
a ``resoluto`` worker (tests/test_refusal_parity.py), it must fail the same way on both."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from prefect import flow, get_run_logger, task


def _how(read: Callable[[], Any]) -> dict[str, Any]:
    from guest_runner.prefect_api import PrefectAPIUnavailable

    try:
        value = read()
    except PrefectAPIUnavailable as e:  # what a user writes to handle a refusal, on either path
        return {"caught": True, "type": type(e).__name__, "message": str(e), "http": _http(e)}
    except Exception as e:  # noqa: BLE001 - the exception is the result
        return {"caught": False, "type": type(e).__name__, "message": str(e), "http": _http(e)}
    return {"value": repr(value)}


def _http(e: BaseException) -> Any:
    """The HTTP status, for code written against Prefect's own PrefectHTTPStatusError."""
    try:
        from prefect.exceptions import PrefectHTTPStatusError
    except ImportError:  # a sandboxed task may run without the real package loaded
        return None
    return e.response.status_code if isinstance(e, PrefectHTTPStatusError) else None


@task
def reads_refused(variable: str, block: str) -> dict[str, Any]:
    from prefect.blocks.system import Secret
    from prefect.variables import Variable

    return {
        "variable": _how(lambda: Variable.get(variable)),
        "block": _how(lambda: Secret.load(block).get()),
    }


@flow
def refused_reads(variable: str, block: str) -> None:
    get_run_logger().info("FACTS %s", json.dumps(reads_refused(variable, block)))
