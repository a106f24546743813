"""Tasks that reach out of their sandbox, for the egress tests (the workspace imports this)."""

from __future__ import annotations

import urllib.request

from prefect import task


@task
def fetch(url: str) -> str:
    """The body of ``url``, or the error (a refused name is an answer, not a crash)."""
    try:
        return urllib.request.urlopen(url, timeout=20).read().decode()
    except Exception as e:
        return f"ERROR {type(e).__name__}: {e}"
