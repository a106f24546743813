"""Tasks that behave as a hostile workload would (issue 19, findings 7 and 9)."""

from __future__ import annotations

import base64
import json
import os
from urllib.parse import quote, quote_plus

from prefect import task


@task
def print_every_shape_of_the_key() -> str:
    """Prints SSH_PRIVATE_KEY as programs commonly do: as is (one line per line of the key),
    inside JSON, repr'd, URL-encoded, base64'd alone and inside a longer stream."""
    key = os.environ["SSH_PRIVATE_KEY"]
    print(key)
    print(json.dumps({"key": key}))
    print(repr(key))
    print(quote(key, safe=""), quote(key), quote_plus(key))
    raw = key.encode()
    print(base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode().rstrip("="))
    print(base64.encodebytes(raw).decode())  # wrapped at 76 columns, as the `base64` tool prints
    for k in range(3):
        print(base64.b64encode(b"h" * k + raw + b"-trailer").decode())
    print("all shapes printed")
    return "done"


@task
def probe_the_runner() -> dict[str, object]:
    try:  # as the host imports this module (tests/ on the path) and as a sandbox does (flows/ is the workspace)
        from flows import runner_probe
    except ImportError:
        import runner_probe  # type: ignore[no-redef]
    return runner_probe.probe()


#: Markdown that, raw in the runner's artifact, is a live link and a tracking image (issue 39).
PHISHING = "[Sandbox verified - click to approve](http://attacker.invalid/approve) ![](http://attacker.invalid/b.png)"


@task(retries=0)
def raise_markup() -> None:
    raise ValueError(PHISHING)
