"""What the CLI prints, as a real subprocess: plain text on pipes, colour only on a terminal.

A pipe must never see an escape code, whatever the environment says (``FORCE_COLOR``,
a colour ``TERM``), and must still carry everything a user greps for: one line per
doctor row with the whole reason on it, the span tree of a node. On a terminal (a pty
the test opens) the same text comes in colour, and ``NO_COLOR`` turns the colour off.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from test_cli import DEADLINE, Cli, available
from test_cli import cli as _cli_fixture

cli = _cli_fixture  # the CLI fixture of test_cli.py, under its own name here

ESC = "\x1b"
SGR = re.compile(rb"\x1b\[[0-9;]*m")  # a colour or text-style code
# What some tools read as "colour even on a pipe": the CLI must not.
LOUD = {"FORCE_COLOR": "1", "CLICOLOR_FORCE": "1", "TERM": "xterm-256color", "COLUMNS": "60"}


def on_pty(
    cli: Cli,
    *args: str,
    env: dict[str, str] | None = None,
    cols: int = 100,
    when: tuple[bytes, Callable[[], None]] | None = None,
) -> tuple[int, bytes]:
    """Run the CLI with stdout and stderr on a pseudo-terminal of ``cols`` columns;
    ``when=(text, action)`` runs ``action`` once ``text`` has been printed."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, cols, 0, 0))
    # The terminal's size is the pty's: COLUMNS/LINES would override it (an xdist worker's
    # environment has COLUMNS=80 LINES=24, from execnet's pipe).
    env = {k: v for k, v in (env or cli.env).items() if k not in ("COLUMNS", "LINES")}
    p = subprocess.Popen(
        cli.argv(*args),
        cwd=cli.work,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
    )
    os.close(slave)
    seen = b""
    end = time.monotonic() + DEADLINE
    try:
        while time.monotonic() < end:
            if not select.select([master], [], [], 1.0)[0]:
                if p.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                break
            if not chunk:
                break
            seen += chunk
            if when is not None and when[0] in seen:
                when[1]()
                when = None
        code = p.wait(timeout=DEADLINE)
    finally:
        os.close(master)
        if p.poll() is None:
            p.kill()
    return code, seen.replace(b"\r\n", b"\n")


def node(cli: Cli) -> tuple[str, str]:
    """A finished node in the CLI's default conduit: two lines, then exit 3."""
    available("process")
    run_id, node_id = f"r-{uuid.uuid4().hex[:8]}", "n-out"
    res = cli.run(
        "run",
        "--runtime",
        "process",
        "--min-isolation",
        "none",
        "--run-id",
        run_id,
        "--node-id",
        node_id,
        "--",
        "python3",
        "-c",
        "print('alpha'); print('beta'); raise SystemExit(3)",
    )
    assert res.returncode == 3, res.stderr
    return run_id, node_id


def test_pipes_get_plain_text_with_everything_on_it(cli: Cli) -> None:
    env = {**cli.env, **LOUD}
    env.pop("NO_COLOR", None)

    res = cli.run("doctor", env=env)
    report = json.loads(cli.run("doctor", "--json", env=env).stdout)
    assert ESC not in res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].split() == ["RUNTIME", "ISOLATION", "AVAILABLE", "DETAILS", "/", "WHY", "NOT"]
    assert all(ln == ln.rstrip() for ln in lines), "trailing blanks on a pipe"
    for r in report["runtimes"]:
        # One line per runtime, with the whole reason on it: nothing wraps on a pipe, even
        # with COLUMNS=60 in the environment.
        line = next(ln for ln in lines if ln.startswith(r["label"] + " "))
        assert line.split()[1:3] == [r["isolation"] or "?", "yes" if r["available"] else "no"], line
        assert line.endswith(r["detail"] if r["available"] else r["why"]), (line, r)
    assert "egress allowlists (--egress), per runtime:" in lines
    default = next(p for p in report["picks"] if p["default"])
    pick = next(ln for ln in lines if ln.strip().startswith(default["floor"] + " "))
    assert pick.endswith("(default floor)") and (default["label"] or "nothing available") in pick
    assert f"default conduit: {report['default_conduit']}" in lines

    run_id, node_id = node(cli)
    rep = cli.run("events", "--conduit", cli.conduit_url, run_id, node_id, env=env)
    assert rep.returncode == 0, rep.stderr
    assert ESC not in rep.stdout + rep.stderr and "│" not in rep.stdout
    tree = [ln for ln in rep.stdout.splitlines() if ln.startswith("+")]
    assert tree[0].startswith("+   0.000s > node n-out")
    assert any(ln.endswith("    | alpha") for ln in tree), tree  # two levels under the node
    assert any("< workload n-out: failure, exit code 3" in ln for ln in tree), tree
    assert "result: failure, exit code 3" in rep.stdout

    failed = cli.run(
        "run",
        "--runtime",
        "process",
        "--min-isolation",
        "none",
        "--",
        "python3",
        "-c",
        "print('[bold]not markup[/bold]'); raise SystemExit(4)",
        env=env,
    )
    assert failed.returncode == 4
    assert ESC not in failed.stdout + failed.stderr
    assert failed.stdout == "[bold]not markup[/bold]\n"  # the workload's bytes, as printed
    assert "resoluto: " in failed.stderr and "exit 4" in failed.stderr

    swept = cli.run("sweep", "--runtime", "process", "--label", f"t={uuid.uuid4().hex}", env=env)
    assert swept.returncode == 0 and "process: reaped 0 sandbox(es)" in swept.stdout, swept.stderr
    bad = cli.run("run", "--runtime", "firecracker", "--", "true", env=env)
    assert bad.returncode == 2 and bad.stderr.startswith("prefect-resoluto: error: unknown runtime")
    usage = cli.run("--help", env=env)
    for res in (swept, bad, usage):
        assert ESC not in res.stdout + res.stderr, res.args


_LAYOUT = re.compile(r"[\s\u2500-\u257f|]+")


def _without_layout(text: str) -> str:
    return _LAYOUT.sub("", text)


def test_a_terminal_gets_colour_and_no_color_turns_it_off(cli: Cli) -> None:
    run_id, node_id = node(cli)
    env = {**cli.env, "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    plain = {**env, "NO_COLOR": "1"}

    code, coloured = on_pty(cli, "doctor", env=env)
    assert SGR.search(coloured), coloured[:300]
    code_nc, no_colour = on_pty(cli, "doctor", env=plain)
    assert code_nc == code
    assert ESC.encode() not in no_colour, no_colour[:300]
    # The same text, colour (and the blanks padding a coloured cell) aside; both drawn for
    # the same 100-column terminal.
    assert [ln.rstrip() for ln in SGR.sub(b"", coloured).splitlines()] == no_colour.splitlines()
    report = json.loads(cli.run("doctor", "--json").stdout)
    text = no_colour.decode()
    assert all(r["label"] in text for r in report["runtimes"]) and "(default floor)" in text
    table = text[: text.index("egress allowlists")].splitlines()
    assert max(len(ln) for ln in table) <= 100  # the table wraps to the terminal, nothing is cut
    # Each reason whole: a cell wraps (a long word folds where the column ends, and how wide the
    # column is depends on every row), so compare without blanks and the table's rules.
    flat = _without_layout(text)
    cut = [r["why"] for r in report["runtimes"] if r["why"] and _without_layout(r["why"]) not in flat]
    assert not cut, (cut, text)

    # --json is never styled, terminal or not.
    _, js = on_pty(cli, "doctor", "--json", env=env)
    assert json.loads(js) == report

    # events: the tree with guide lines; without colour the piped text, guides aside.
    _, tree = on_pty(cli, "events", "--conduit", cli.conduit_url, run_id, node_id, env=env)
    assert SGR.search(tree) and "│ │ | alpha".encode() in SGR.sub(b"", tree)
    _, tree_nc = on_pty(cli, "events", "--conduit", cli.conduit_url, run_id, node_id, env=plain)
    assert ESC.encode() not in tree_nc
    piped = cli.run("events", "--conduit", cli.conduit_url, run_id, node_id).stdout
    assert tree_nc.decode().replace("│ ", "  ") == piped


def test_progress_line_on_a_terminal_without_colour(cli: Cli, tmp_path: Path) -> None:
    """NO_COLOR keeps the live line (it is not colour) but drops every style code."""
    available("process")
    flag = tmp_path / "go"
    script = (
        "import os, pathlib, time\n"
        "flag, end = pathlib.Path(os.environ['FLAG']), time.monotonic() + 30\n"
        "while not flag.exists() and time.monotonic() < end:\n"
        "    time.sleep(0.01)\n"
        "print('done')\n"
    )
    env = {**cli.env, "TERM": "xterm-256color", "NO_COLOR": "1"}
    code, seen = on_pty(
        cli,
        "run",
        "--runtime",
        "process",
        "--min-isolation",
        "none",
        "--env",
        f"FLAG={flag}",
        "--",
        "python3",
        "-c",
        script,
        env=env,
        when=(b"event(s)", flag.touch),
    )
    assert code == 0, seen
    assert b"\r\x1b[K" in seen and b"on process: " in seen and b"event(s)" in seen, seen
    assert not SGR.search(seen), seen
    assert b"done\n" in seen


def test_help_loads_no_command_and_no_rich_and_doctor_no_prefect(cli: Cli) -> None:
    """``--help`` costs the parser only; the drawing commands load rich, never Prefect."""
    code = (
        "import contextlib, io, sys\n"
        "import prefect_resoluto.cli as c\n"
        "def loaded(*names):\n"
        "    return sorted(m for m in sys.modules if any(m == n or m.startswith(n + '.') for n in names))\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    c.main(['--help'])\n"
        "print(loaded('rich', 'prefect', 'prefect_resoluto.cli.run', 'prefect_resoluto.cli.doctor',\n"
        "             'prefect_resoluto.cli.events', 'prefect_resoluto.cli.output'))\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    c.main(['doctor'])\n"
        "print('rich.table' in sys.modules, 'RUNTIME' in out.getvalue(), loaded('prefect'))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=cli.env, cwd=cli.work, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["[]", "True True []"], res.stdout
