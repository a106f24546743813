"""A task whose output would drive a terminal (tests/test_terminal_output.py)."""

from __future__ import annotations

from prefect import task

#: Sets the window title (OSC ... BEL), clears the screen, returns the cursor to hide "ok".
HOSTILE = "ok\x1b]0;pwned\x07\x1b[2J\rhidden\x9b31m\u202edesrever"


@task
def print_hostile() -> str:
    print(HOSTILE)
    return "done"
