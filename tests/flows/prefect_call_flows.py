"""Tasks that call Prefect's API the way a Prefect user's tasks do: artifacts of every kind
(relayed to the host in a sandbox), and calls a sandbox does not serve, each with what it
sent and waited."""

from __future__ import annotations

import contextlib
import time

from prefect import task
from prefect.artifacts import (
    acreate_markdown_artifact,
    acreate_progress_artifact,
    acreate_table_artifact,
    aupdate_progress_artifact,
    create_image_artifact,
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)


@task
def reports(n: int) -> int:
    create_markdown_artifact(f"# Report {n}\n\nall good", key=f"report-{n}", description="the report")
    create_markdown_artifact("unkeyed *notes*")
    create_table_artifact([{"x": i, "y": i * i} for i in range(n)], key="squares", description="squares")
    create_table_artifact({"a": [1, 2], "b": ["x", "y"]})
    create_link_artifact("https://example.com/r", link_text="the link", key="link-1", description="a link")
    progress = create_progress_artifact(10.0, key="progress-1", description="starting")
    update_progress_artifact(progress, 55.5)
    update_progress_artifact(progress, 100.0, description="done")
    create_image_artifact("https://example.com/i.png", key="image-1", description="an image")
    return n


@task
async def areports(n: int) -> int:
    await acreate_markdown_artifact(f"async {n}", key="async-report", description="async")
    await acreate_table_artifact([[1, 2], [3, 4]], description="async table")
    progress = await acreate_progress_artifact(0.0)
    await aupdate_progress_artifact(progress, 42.0)
    return n


@task
def leaks(secret_name: str) -> None:
    import os

    create_markdown_artifact(f"the token is {os.environ[secret_name]}", key="leaky")


@task
def floods(count: int, rows: int) -> str:
    """A hostile task: ``count`` artifacts, then one table of ``rows`` rows; says what raised."""
    told = []
    for i in range(count):
        try:
            create_markdown_artifact(f"flood {i}")
        except Exception as e:  # noqa: BLE001 - the refusal is what this task reports
            told.append(f"{type(e).__name__}: {e}")
            break
    try:
        create_table_artifact([{"i": i, "pad": "x" * 100} for i in range(rows)])
    except Exception as e:  # noqa: BLE001
        told.append(f"{type(e).__name__}: {e}")
    return "\n".join(told)


@contextlib.contextmanager
def _sends_and_waits():
    """Counts, during a call, what would make it slow however idle the host: each request
    handed to an HTTP transport (a try at an API) and each sleep of this thread (a backoff, a
    wait for a server to come up)."""
    import asyncio
    import threading

    import anyio
    import httpx

    me = threading.get_ident()
    seen = {"sends": 0, "sleeps": 0}
    sync_sleep, async_sleep, anyio_sleep = time.sleep, asyncio.sleep, anyio.sleep
    sync_send, async_send = httpx.HTTPTransport.handle_request, httpx.AsyncHTTPTransport.handle_async_request

    def slept() -> None:
        if threading.get_ident() == me:
            seen["sleeps"] += 1

    def sleep(seconds):
        slept()
        return sync_sleep(seconds)

    async def asleep(seconds, *args, **kwargs):
        slept()
        return await async_sleep(seconds, *args, **kwargs)

    async def anyio_asleep(seconds):
        slept()
        return await anyio_sleep(seconds)

    def send(transport, request):
        seen["sends"] += 1
        return sync_send(transport, request)

    async def asend(transport, request):
        seen["sends"] += 1
        return await async_send(transport, request)

    time.sleep, asyncio.sleep, anyio.sleep = sleep, asleep, anyio_asleep
    httpx.HTTPTransport.handle_request, httpx.AsyncHTTPTransport.handle_async_request = send, asend
    try:
        yield seen
    finally:
        time.sleep, asyncio.sleep, anyio.sleep = sync_sleep, async_sleep, anyio_sleep
        httpx.HTTPTransport.handle_request, httpx.AsyncHTTPTransport.handle_async_request = (
            sync_send,
            async_send,
        )


def _refused(fn) -> dict:
    with _sends_and_waits() as seen:
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - the exception is the result
            return {"type": type(e).__name__, "message": str(e), **seen}
    return {"value": repr(value), **seen}


@task
def unserved() -> dict:
    """Prefect calls a sandbox does not serve, each with what it raised, sent and waited."""
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect.variables import Variable

    def read_flow_runs():
        with get_client(sync_client=True) as client:
            return client.read_flow_runs(limit=1)

    return {
        "variable": _refused(lambda: Variable.get("some-variable")),
        "variable_set": _refused(lambda: Variable.set("some-variable", "v", overwrite=True)),
        "secret": _refused(lambda: Secret.load("some-secret").get()),
        "block_save": _refused(lambda: Secret(value="s" * 8).save("new-secret")),
        "client": _refused(read_flow_runs),
    }


@task
async def aunserved() -> dict:
    from prefect.client.orchestration import get_client
    from prefect.variables import Variable

    out = {}
    with _sends_and_waits() as seen:
        try:
            await Variable.aget("some-variable")
        except Exception as e:  # noqa: BLE001
            out["variable"] = {"type": type(e).__name__, "message": str(e)}
    out["variable"].update(seen)
    with _sends_and_waits() as seen:
        try:
            async with get_client() as client:
                await client.read_flow_runs(limit=1)
        except Exception as e:  # noqa: BLE001
            out["client"] = {"type": type(e).__name__, "message": str(e)}
    out["client"].update(seen)
    return out


#: What guest_runner.prefect_api writes before an artifact's JSON (spelled here: a hostile
#: task writes its own lines, past any check of the guest's).
ARTIFACT_MARKER = "\x1eresoluto-artifact:"


@task
def forges(count: int, big_bytes: int) -> str:
    """A hostile task: one artifact line of ``big_bytes``, then ``count`` of them, written
    straight to stdout; then a log line and a return value that must still arrive."""
    import json

    from prefect import get_run_logger

    def line(i: int, data: str) -> str:
        rec = {
            "op": "create",
            "id": str(i),
            "type": "markdown",
            "label": None,
            "description": None,
            "data": data,
        }
        return ARTIFACT_MARKER + json.dumps(rec)

    print(line(-1, "x" * big_bytes), flush=True)
    for i in range(count):
        print(line(i, f"forged {i}"), flush=True)
    print(ARTIFACT_MARKER + json.dumps({"op": "update", "id": "not-mine", "data": 1.0}), flush=True)
    print(line(-2, "").replace('"markdown"', '"executable"'), flush=True)
    get_run_logger().info("still here")
    return "done"


@task
def reads(variable: str, secret: str, block_ref: str) -> dict:
    """What a task reads of Prefect's variables and blocks, and what a missing one raises."""
    from prefect import get_run_logger
    from prefect.blocks.core import Block
    from prefect.blocks.system import Secret
    from prefect.variables import Variable

    value = Secret.load(secret).get()
    get_run_logger().info("the secret is %s", value)
    get_run_logger().info("the variable is %s", Variable.get(variable))  # not a secret: shown
    try:
        Secret.load("missing-secret")
        missing = None
    except Exception as e:  # noqa: BLE001 - what it raises is the point
        missing = f"{type(e).__name__}: {e}"
    return {
        "variable": Variable.get(variable),
        "default": Variable.get("missing-variable", default="dflt"),
        "secret": value,
        "block": Block.load(block_ref).get(),
        "missing block": missing,
    }


@task
async def areads(variable: str, secret: str) -> list:
    from prefect.blocks.system import Secret
    from prefect.variables import Variable

    return [await Variable.aget(variable), (await Secret.aload(secret)).get()]
