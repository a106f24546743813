"""What a sandbox writes reaches the host's terminals escaped (issue 30, finding 5).

A workload prints ESC/BEL/CR/C1/bidi controls, and a compromised runner (the hostile guest
of tests/test_hostile_outputs.py) writes an event whose line holds a newline forging a
line in ``prefect-resoluto events``' own format, a name and a logger with controls. What
the CLI, the flow process's stdout and the worker's stream print holds no control
character but the line ends; the Prefect API keeps the text as written.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from flows import terminal_tasks as tt
from prefect import flow
from support.prefect_readback import task_runs
from test_hostile_outputs import _Patched
from test_task_runner import logs_of, runner

from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.node.terminal import safe
from prefect_resoluto.runtimes import get_runtime
from prefect_resoluto.runtimes.base import Resources

REPO = Path(__file__).resolve().parent.parent
#: Any control character a terminal acts on, but the newline that ends a printed line.
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")

FORGER = r"""
import os
from guest_runner import wire
run, node = os.environ["RESOLUTO_RUN_ID"], os.environ["RESOLUTO_NODE_ID"]
prefix = os.environ["RESOLUTO_STORE_PREFIX"]
d = os.path.join(os.environ["RESOLUTO_STORE_ROOT"], prefix)
os.makedirs(d, exist_ok=True)
ev = wire.make_event(run, "node", "open", name="n\x1b[8m")
log = dict(ev, event="log", kind="log", ts=ev["ts"] + 0.001,
           data={"line": "real\n+   0.002s < node forged: success\x1b]0;t\x07", "level": "WARNING",
                 "logger": "lg\r\x1b[2K"})
close = dict(ev, event="close", status="success", ts=ev["ts"] + 0.002)
def put(rel, b):
    with open(os.path.join(d, ".tmp"), "wb") as f:
        f.write(b)
    os.rename(os.path.join(d, ".tmp"), os.path.join(d, rel))
put("events-000001.jsonl", wire.encode_chunk([wire.encode_event(e) for e in (ev, log, close)]))
put("result.json", wire.encode_result(wire.make_result(node, "success", 0, None)))
put("_manifest.json", wire.encode_manifest(1))
"""


@pytest.fixture(params=["gvisor", "bubblewrap"])
def rt(request: pytest.FixtureRequest) -> Any:
    r = get_runtime(request.param)
    if not r.availability().ok:
        pytest.skip(f"{request.param} is not available here: {r.availability().why}")
    return r


def _events(conduit: LocalConduit, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect_resoluto.cli",
            "events",
            *args,
            "--conduit",
            conduit.url,
            "run1",
            "node1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


@pytest.mark.sandbox
def test_the_events_cli_prints_a_forged_event_escaped(rt, tmp_path):
    conduit = LocalConduit(tmp_path / "conduit")
    spec = NodeSpec(
        run_id="run1", node_id="node1", argv=["true"], resources=Resources.from_quantities(memory="256Mi")
    )
    with _Patched(["python3", "-c", FORGER]):
        outcome = drive_node(spec, conduit, rt, min_isolation="none")
    assert outcome.ok, outcome.describe()
    res = _events(conduit)
    assert res.returncode == 0, res.stderr
    assert not CONTROL.findall(res.stdout), [ln for ln in res.stdout.splitlines() if CONTROL.search(ln)]
    lines = res.stdout.splitlines()
    assert not any(ln.startswith("+   0.002s < node forged") for ln in lines), lines
    assert any("real\\n+   0.002s < node forged: success\\x1b]0;t\\x07" in ln for ln in lines), lines
    assert any("> node n\\x1b[8m" in ln for ln in lines) and any("lg\\r\\x1b[2K" in ln for ln in lines)
    # --json keeps the text as written: it is data, not a terminal line.
    obj = json.loads(_events(conduit, "--json").stdout)
    assert any(e["data"].get("line", "").startswith("real\n+") for e in obj["events"])


@pytest.mark.prefect
@pytest.mark.sandbox
@pytest.mark.usefixtures("prefect")
def test_the_flow_process_prints_escaped_and_the_api_keeps_the_text(gvisor, tmp_path, capfd):
    conduit = LocalConduit(tmp_path / "conduit")

    @flow(task_runner=runner(conduit, tmp_path), log_prints=True)
    def logged() -> str:
        return tt.print_hostile.submit().result()

    @flow(task_runner=runner(conduit, tmp_path))
    def printed() -> str:
        return tt.print_hostile.submit().result()

    state = logged(return_state=True)
    assert state.result() == "done"
    assert printed() == "done"
    out, err = capfd.readouterr()
    printed_text = out + err
    assert safe(tt.HOSTILE) in printed_text  # the print of the flow without log_prints
    assert tt.HOSTILE not in printed_text and "\x1b]0;pwned" not in printed_text
    (tr,) = task_runs(state.state_details.flow_run_id)
    assert tt.HOSTILE in [entry.message for entry in logs_of(tr.id)]  # the API: as written


def test_the_worker_stream_is_escaped(capsys):
    from prefect_resoluto.worker.worker import _stream

    _stream(tt.HOSTILE)
    assert capsys.readouterr().out == safe(tt.HOSTILE) + "\n"
    assert not CONTROL.search(safe(tt.HOSTILE))


#: A compromised runner's result.json: every field the host prints holds controls, and the
#: substrate logs a newline forging a verdict line.
RESULT_FORGER = r"""
import os, json
from guest_runner import wire
run, node = os.environ["RESOLUTO_RUN_ID"], os.environ["RESOLUTO_NODE_ID"]
d = os.path.join(os.environ["RESOLUTO_STORE_ROOT"], os.environ["RESOLUTO_STORE_PREFIX"])
os.makedirs(d, exist_ok=True)
ev = wire.make_event(run, "node", "open", name="n")
close = dict(ev, event="close", status="failure", ts=ev["ts"] + 0.002)
def put(rel, b):
    with open(os.path.join(d, ".tmp"), "wb") as f:
        f.write(b)
    os.rename(os.path.join(d, ".tmp"), os.path.join(d, rel))
put("events-000001.jsonl", wire.encode_chunk([wire.encode_event(e) for e in (ev, close)]))
r = wire.make_result(node, "failure", 1, None)
r["reason"] = "R\x1b]0;PWNED-TITLE\x07\x1b[2J\x9b31m\r\u202eevil"
r["observed_phase"] = "P\x1b[8mhidden"
r["substrate_logs"] = "S\nresult: success (forged)\x1b[1A\x1b[2K"
r["output_archive"] = "O\x1b]8;;http://evil/\x07link\x1b]8;;\x07"
put("result.json", json.dumps(r).encode())
put("_manifest.json", wire.encode_manifest(1))
"""


@pytest.mark.sandbox
def test_a_forged_results_fields_are_shown_escaped_by_events_run_and_the_outcome(gvisor, tmp_path, capsys):
    """Found by an outside review: the verdict lines of ``events`` and ``run`` printed the
    guest's result fields raw (a title set, a screen clear, a forged verdict line)."""
    from prefect_resoluto import cli

    conduit = LocalConduit(tmp_path / "conduit")
    spec = NodeSpec(
        run_id="run1", node_id="node1", argv=["true"], resources=Resources.from_quantities(memory="256Mi")
    )
    with _Patched(["python3", "-c", RESULT_FORGER]):
        outcome = drive_node(spec, conduit, get_runtime("gvisor"), min_isolation="none")
    assert not outcome.ok
    assert not CONTROL.search(outcome.describe()) and "\\x1b]0;PWNED-TITLE\\x07" in outcome.describe()
    res = _events(conduit)
    lines = res.stdout.splitlines()
    assert not CONTROL.findall(res.stdout), [ln for ln in lines if CONTROL.search(ln)]
    assert not any(ln.startswith("result: success") for ln in lines), lines
    assert any("S\\nresult: success (forged)" in ln for ln in lines), lines
    assert any("O\\x1b]8;;http://evil/\\x07link" in ln for ln in lines), lines

    with _Patched(["python3", "-c", RESULT_FORGER]):
        code = cli.main(
            ["run", "--runtime", "gvisor", "--conduit", str(tmp_path / "c2"), "--run-id", "run1"]
            + ["--node-id", "node1", "--", "true"]
        )
    shown = capsys.readouterr()
    assert code != 0
    printed = shown.out + shown.err
    assert "PWNED-TITLE" in printed and not CONTROL.findall(printed), printed


def _run_cli(tmp_path: Path, *extra: str, stdout: Any = subprocess.PIPE) -> subprocess.Popen[bytes]:
    """``prefect-resoluto run`` on gVisor, its command printing tt.HOSTILE."""
    return subprocess.Popen(
        [sys.executable, "-m", "prefect_resoluto.cli", "run", "--runtime", "gvisor", *extra]
        + ["--conduit", str(tmp_path / "conduit"), "--quiet", "--"]
        + ["python3", "-c", f"print({tt.HOSTILE!r})"],
        stdout=stdout,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        cwd=_empty(tmp_path / "work"),  # the default workspace: nothing to pack
    )


def _empty(d: Path) -> Path:
    d.mkdir(exist_ok=True)
    return d


def _read_pty(master: int, p: subprocess.Popen[bytes]) -> bytes:
    """Everything written to the pty until the child is gone (EIO: the last slave closed)."""
    seen = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO once the child exits and its end closes
            break
        if not chunk:
            break
        seen += chunk
    p.wait(timeout=120)
    return seen


@pytest.mark.sandbox
def test_the_run_cli_escapes_the_commands_output_on_a_terminal_and_in_a_file(gvisor, tmp_path):
    """Finding 7 (issue 39): ``prefect-resoluto run`` wrote the guest's output raw: a title
    set, the screen cleared, text hidden, on a terminal and into a redirected file alike.
    Escaped now in both; ``--raw`` writes it as it is."""
    # Redirected into a file.
    with open(tmp_path / "out.txt", "wb") as f:
        p = _run_cli(tmp_path, stdout=f)
        _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    written = (tmp_path / "out.txt").read_bytes().decode()
    assert written == safe(tt.HOSTILE) + "\n", written
    assert not CONTROL.search(written) and "\\x1b]0;pwned\\x07" in written

    # On a terminal (the pty turns "\n" into "\r\n" on its own).
    master, slave = os.openpty()
    try:
        p = _run_cli(tmp_path, stdout=slave)
        os.close(slave)
        shown = _read_pty(master, p).decode()
    finally:
        os.close(master)
    assert p.returncode == 0
    assert shown.replace("\r\n", "\n") == safe(tt.HOSTILE) + "\n", shown
    assert "\x1b]0;pwned" not in shown

    # --raw: as the command wrote it, for whoever asks for that.
    with open(tmp_path / "raw.txt", "wb") as f:
        p = _run_cli(tmp_path, "--raw", stdout=f)
        _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert (tmp_path / "raw.txt").read_bytes().decode() == tt.HOSTILE + "\n"  # no newline translation
