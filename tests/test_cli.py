"""The `prefect-resoluto` CLI, run as a real subprocess against real sandboxes.

Every invocation gets HOME, XDG_CACHE_HOME and RESOLUTO_STATE_DIR inside tmp_path, so
runs, conduits and sandbox records never mix with other tests (or other engineers).
Synchronisation is by reading the CLI's output or by conditions, never by sleeping.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from prefect_resoluto.runtimes import best_available, get_runtime
from prefect_resoluto.runtimes.base import IsolationLevel, LaunchSpec, SandboxRuntime

REPO = Path(__file__).resolve().parents[1]
SECRET = "s3cr3t-value-xyz"
DEADLINE = 60.0


@dataclass
class Cli:
    env: dict[str, str]
    work: Path  # the cwd of every invocation
    conduit: Path

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "prefect_resoluto.cli", *args]

    def run(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args),
            cwd=self.work,
            env=env or self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def popen(self, *args: str, **kw: object) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.argv(*args),
            cwd=self.work,
            env=self.env,
            text=True,  # type: ignore[call-overload]
            stdin=subprocess.DEVNULL,
            **kw,
        )

    @property
    def conduit_url(self) -> str:
        return self.conduit.as_uri()


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cli:
    # The same settings in this process, so runtimes built here see what the CLI sees.
    for key, sub in (("HOME", "home"), ("XDG_CACHE_HOME", "cache"), ("RESOLUTO_STATE_DIR", "state")):
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(key, str(tmp_path / sub))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return Cli(env=env, work=work, conduit=tmp_path / "cache" / "prefect-resoluto" / "conduit")


def available(name: str, **options: object) -> SandboxRuntime:
    rt = get_runtime(name, **options)
    avail = rt.availability()
    if not avail.ok:
        pytest.skip(f"runtime {name} is not available on this machine: {avail.why}")
    return rt


def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    (ws / "data").mkdir(parents=True)
    (ws / "data" / "in.txt").write_text("input from the host")
    return ws


def last_json(stdout: str) -> dict:
    lines = stdout.rstrip("\n").split("\n")
    return json.loads(lines[-1])


def one_line_error(res: subprocess.CompletedProcess[str]) -> str:
    err = res.stderr.strip()
    assert "\n" not in err, f"expected one line on stderr, got:\n{err}"
    assert err.startswith("prefect-resoluto: error: "), err
    return err


# ----------------------------------------------------------------------------- import cost


def test_cli_import_never_loads_prefect(cli: Cli) -> None:
    code = (
        "import contextlib, io, sys\n"
        "import prefect_resoluto.cli as c\n"
        "at_import = sorted(m for m in sys.modules if m == 'prefect' or m.startswith('prefect.'))\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    c.main(['doctor', '--json'])\n"
        "after_doctor = sorted(m for m in sys.modules if m == 'prefect' or m.startswith('prefect.'))\n"
        "print(at_import, after_doctor)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=cli.env, cwd=cli.work, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[] []", res.stdout


# ----------------------------------------------------------------------------- run, per runtime

WORKLOAD = (
    "import os, pathlib\n"
    "src = pathlib.Path('data/in.txt').read_text()\n"
    "pathlib.Path('out/deep').mkdir(parents=True)\n"
    "pathlib.Path('out/result.txt').write_text(src.upper())\n"
    "pathlib.Path('out/deep/n.txt').write_text('7')\n"
    "pathlib.Path('not-declared.txt').write_text('stays behind')\n"
    "for i in range(1, 6):\n"
    "    print('line', i, os.environ['GREETING'])\n"
    "print('secret is', os.environ['API_TOKEN'])\n"
)

RUNTIME_CASES = [
    pytest.param("gvisor", {}, [], id="gvisor", marks=pytest.mark.sandbox),
    pytest.param(
        "bubblewrap", {}, ["--min-isolation", "namespace"], id="bubblewrap", marks=pytest.mark.sandbox
    ),
    pytest.param("process", {}, ["--min-isolation", "none"], id="process"),
    pytest.param(
        "container", {"oci_runtime": "runsc"}, [], id="container-podman-runsc", marks=pytest.mark.sandbox
    ),
]


@pytest.mark.parametrize(("name", "options", "extra"), RUNTIME_CASES)
def test_run_streams_copies_outputs_and_reports_json(
    cli: Cli, tmp_path: Path, name: str, options: dict, extra: list[str]
) -> None:
    available(name, **options)
    ws = workspace(tmp_path)
    res = cli.run(
        "run",
        "--runtime",
        name,
        *extra,
        "--workspace",
        str(ws),
        "--output",
        "out/**",
        "--env",
        "GREETING=hi",
        "--secret-env",
        f"API_TOKEN={SECRET}",
        "--memory",
        "512Mi",
        "--cpus",
        "1",
        "--json",
        "--",
        "python3",
        "-c",
        WORKLOAD,
    )
    assert res.returncode == 0, res.stderr
    *lines, _ = res.stdout.rstrip("\n").split("\n")
    assert lines == [f"line {i} hi" for i in range(1, 6)] + ["secret is ***"]
    out = last_json(res.stdout)
    assert out["status"] == "success" and out["exit_code"] == 0 and out["failure"] is None
    assert out["runtime"] == name
    node_dir = cli.work / "resoluto-outputs" / out["node_id"]
    assert out["output_dir"] == str(node_dir)
    assert set(out["output_files"]) == {"out/result.txt", "out/deep/n.txt"}
    assert (node_dir / "out" / "result.txt").read_text() == "INPUT FROM THE HOST"
    assert (node_dir / "out" / "deep" / "n.txt").read_text() == "7"
    assert not (node_dir / "not-declared.txt").exists()
    assert SECRET not in res.stdout + res.stderr
    assert "\x1b[K" not in res.stderr  # no progress indicator: stderr is not a terminal
    assert f"succeeded on {name}" in res.stderr


def test_exit_code_propagates_and_outputs_still_come_back(cli: Cli, tmp_path: Path) -> None:
    available("bubblewrap")
    ws = workspace(tmp_path)
    code = (
        "import pathlib, sys; pathlib.Path('report.txt').write_text('partial'); print('failing'); sys.exit(3)"
    )
    res = cli.run(
        "run",
        "--runtime",
        "bubblewrap",
        "--min-isolation",
        "namespace",
        "--workspace",
        str(ws),
        "--output",
        "report.txt",
        "--json",
        "--",
        "python3",
        "-c",
        code,
    )
    assert res.returncode == 3, res.stderr
    out = last_json(res.stdout)
    assert res.stdout.split("\n")[0] == "failing"
    assert out["status"] == "failure" and out["exit_code"] == 3 and out["failure"] == "workload"
    assert (cli.work / "resoluto-outputs" / out["node_id"] / "report.txt").read_text() == "partial"
    assert "exit code 3" in res.stderr and "events --conduit" in res.stderr

    # A command that does not exist: 127, as a shell reports it.
    res = cli.run("run", "--runtime", "process", "--min-isolation", "none", "--", "no-such-command-here")
    assert res.returncode == 127, res.stderr


def test_sandbox_killed_from_outside_is_an_infrastructure_failure(cli: Cli) -> None:
    from prefect_resoluto.runtimes._guest_layout import records

    rt = available("process")
    run_id, node_id = f"r-{uuid.uuid4().hex[:8]}", "n-killed"
    p = cli.popen(
        "run",
        "--runtime",
        "process",
        "--min-isolation",
        "none",
        "--json",
        "--run-id",
        run_id,
        "--node-id",
        node_id,
        "--",
        "python3",
        "-c",
        "import time; print('ready', flush=True); time.sleep(300)",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        (rec,) = records(rt.state)  # type: ignore[attr-defined]
        assert rec.pid is not None
        os.killpg(rec.pid, signal.SIGKILL)  # the whole sandbox, guest runner included
        out, err = p.communicate(timeout=DEADLINE)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 125, err
    outcome = json.loads(out.rstrip("\n").split("\n")[-1])
    assert outcome["status"] == "failure" and outcome["failure"] in ("killed", "lost", "no_result"), outcome
    assert "infrastructure failure; exit 125" in err

    # The forensics path: the events up to the kill are still there, without a verdict.
    rep = cli.run("events", "--conduit", cli.conduit_url, run_id, node_id)
    assert rep.returncode == 0, rep.stderr
    assert "| ready" in rep.stdout and "no _manifest.json" in rep.stdout
    assert "result: none" in rep.stdout


def test_lines_stream_while_the_workload_runs(cli: Cli, tmp_path: Path) -> None:
    """The second line is only printed after the test saw the first one on the CLI's stdout."""
    available("process")
    flag = tmp_path / "go"
    code = (
        "import os, pathlib, time\n"
        "print('first', flush=True)\n"
        "flag, end = pathlib.Path(os.environ['FLAG']), time.monotonic() + 30\n"
        "while not flag.exists() and time.monotonic() < end:\n"
        "    time.sleep(0.01)\n"
        "print('second' if flag.exists() else 'gave up waiting')\n"
    )
    p = cli.popen(
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
        code,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert p.stdout is not None
        assert p.stdout.readline() == "first\n"
        flag.touch()
        rest, err = p.communicate(timeout=DEADLINE)
    finally:
        if p.poll() is None:
            p.kill()
    assert rest == "second\n", err
    assert p.returncode == 0


def test_interrupt_reaps_the_sandbox_and_exits_130(cli: Cli) -> None:
    rt = available("process")
    p = cli.popen(
        "run",
        "--runtime",
        "process",
        "--min-isolation",
        "none",
        "--",
        "python3",
        "-c",
        "import time; print('ready', flush=True); time.sleep(300)",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        assert len(rt.list_ids()) == 1  # type: ignore[attr-defined]
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=DEADLINE)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert "interrupted" in err and "reaped" in err
    assert rt.list_ids() == []  # type: ignore[attr-defined]


def test_progress_indicator_only_on_a_terminal(cli: Cli, tmp_path: Path) -> None:
    available("process")
    flag = tmp_path / "go"
    code = (
        "import os, pathlib, time\n"
        "flag, end = pathlib.Path(os.environ['FLAG']), time.monotonic() + 30\n"
        "while not flag.exists() and time.monotonic() < end:\n"
        "    time.sleep(0.01)\n"
        "print('done')\n"
    )
    master, slave = pty.openpty()
    p = cli.popen(
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
        code,
        stdout=subprocess.PIPE,
        stderr=slave,
    )
    os.close(slave)
    seen = b""
    try:
        end = time.monotonic() + DEADLINE
        while b"event(s)" not in seen and time.monotonic() < end:  # a spinner frame was drawn
            if select.select([master], [], [], 1.0)[0]:
                seen += os.read(master, 4096)
        flag.touch()
        out, _ = p.communicate(timeout=DEADLINE)
        while select.select([master], [], [], 0)[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(master)
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0
    assert out == "done\n"  # stdout stays clean
    assert b"\r\x1b[K" in seen and b"on process: " in seen


# ----------------------------------------------------------------------------- bad input


def _bad_cases(tmp: Path) -> list[tuple[list[str], list[str]]]:
    (tmp / "a-file").write_text("x")
    return [
        (["--runtime", "firecracker"], ["unknown runtime 'firecracker'", "gvisor", "bubblewrap", "process"]),
        (["--runtime", "process"], ["'none'", "'process'", "--min-isolation none"]),
        (["--runtime", "bubblewrap"], ["'namespace'", "'bubblewrap'", "--min-isolation namespace"]),
        (["--workspace", str(tmp / "missing")], ["does not exist", "missing"]),
        (["--workspace", str(tmp / "a-file")], ["not a directory"]),
        (["--memory", "lots"], ["--memory", "'lots'"]),
        (["--cpus", "many"], ["--cpus", "'many'"]),
        (["--output", "../escape/**"], ["--output", "escapes the workspace"]),
        (["--output", "/etc/passwd"], ["--output", "relative to the workspace"]),
        (["--env", "NOEQUALS"], ["--env 'NOEQUALS'", "KEY=VALUE"]),
        (["--env", "=value"], ["--env '=value'"]),
        (["--min-isolation", "hyper"], ["unknown isolation level 'hyper'"]),
        (["--conduit", "ftp://example/x"], ["--conduit", "unsupported conduit URL"]),
        (["--run-id", "../x"], ["--run-id", "not a valid identifier"]),
        (["--nonsense"], ["unrecognized arguments: --nonsense"]),
    ]


def test_bad_input_is_one_line_and_exit_2(cli: Cli, tmp_path: Path) -> None:
    for args, expected in _bad_cases(tmp_path):
        res = cli.run("run", *args, "--", "python3", "-c", "print(1)")
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        err = one_line_error(res)
        for piece in expected:
            assert piece in err, (args, err)
        assert res.stdout == ""
    # Empty argv, with and without the separator.
    for args in (
        ["run", "--runtime", "process", "--min-isolation", "none"],
        ["run", "--runtime", "process", "--min-isolation", "none", "--"],
    ):
        res = cli.run(*args)
        assert res.returncode == 2 and "no command given" in one_line_error(res)
    assert not (cli.conduit / "run").exists()  # nothing was put, nothing launched


def test_missing_runtime_binary_is_reported_with_the_reason(cli: Cli, tmp_path: Path) -> None:
    empty = tmp_path / "empty-path"
    empty.mkdir()
    env = {**cli.env, "PATH": str(empty)}
    for args, binary in (
        (["--runtime", "gvisor"], "runsc"),
        (["--runtime", "bubblewrap", "--min-isolation", "namespace"], "bwrap"),
    ):
        res = cli.run("run", *args, "--", "true", env=env)
        assert res.returncode == 2, res.stderr
        err = one_line_error(res)
        assert "unavailable here" in err and binary in err, err


# ----------------------------------------------------------------------------- doctor


def test_doctor_agrees_with_the_runtimes(cli: Cli) -> None:
    res = cli.run("doctor", "--json")
    report = json.loads(res.stdout)
    rows = report["runtimes"]
    names = {r["name"] for r in rows if not r["options"]}
    assert names >= {"process", "bubblewrap", "gvisor", "container"}
    for r in rows:
        try:
            rt = get_runtime(r["name"], **r["options"])
        except Exception as e:  # then doctor must say it cannot be configured
            assert not r["available"] and "cannot be configured" in r["why"], (r, e)
            continue
        avail = rt.availability()
        assert r["available"] == avail.ok, (r, avail)
        assert r["isolation"] == rt.isolation.label
        if not avail.ok:
            assert r["why"] == avail.why and r["why"]
    for p in report["picks"]:
        rt = best_available(p["floor"])
        assert p["runtime"] == (rt.name if rt else None), p
        if rt is not None:
            assert IsolationLevel.parse(p["isolation"]) >= IsolationLevel.parse(p["floor"])
    default = best_available()
    assert report["default_pick"] == (default.name if default else None)
    assert res.returncode == (0 if default else 1)

    text = cli.run("doctor")
    assert text.returncode == res.returncode
    for r in rows:
        assert r["label"] in text.stdout
    assert "(default floor)" in text.stdout
    # the resoluto worker's API gateway: started, refusing without its token and off its rules, closed
    assert report["api_gateway"]["ok"], report["api_gateway"]
    assert "API gateway of the resoluto worker: works" in text.stdout, text.stdout


# ----------------------------------------------------------------------------- events


def test_events_replays_a_finished_node_and_flags_a_malformed_chunk(cli: Cli) -> None:
    available("process")
    run_id, node_id = f"r-{uuid.uuid4().hex[:8]}", "n-events"
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
        "print('alpha'); print('beta')",
    )
    assert res.returncode == 0, res.stderr
    assert get_runtime("process").list_ids() == []  # type: ignore[attr-defined]  # the sandbox is gone

    rep = cli.run("events", "--conduit", cli.conduit_url, run_id, node_id)
    assert rep.returncode == 0, rep.stderr
    lines = rep.stdout.splitlines()
    tree = [ln for ln in lines if ln.startswith("+")]
    assert tree[0].startswith("+   0.000s > node n-events")

    def indent(fragment: str) -> int:
        line = next(ln for ln in tree if fragment in ln)
        body = line.split("s ", 1)[1]
        return len(body) - len(body.lstrip(" "))

    assert indent("> node") < indent("> workload") < indent("| alpha")
    assert indent("| alpha") == indent("| beta")
    assert indent("< workload n-events: success, exit code 0") == indent("> workload")
    assert [ln for ln in tree if "| alpha" in ln or "| beta" in ln][0].endswith("alpha")
    assert "result: success, exit code 0" in rep.stdout

    js = cli.run("events", "--json", "--conduit", cli.conduit_url, run_id, node_id)
    obj = json.loads(js.stdout)
    assert js.returncode == 0 and obj["error"] is None and obj["result"]["status"] == "success"
    logged = [e["data"]["line"] for e in obj["events"] if e["event"] == "log" and e["kind"] == "log"]
    assert logged.index("alpha") < logged.index("beta")

    # The same node id again is refused: conduit objects are immutable evidence.
    again = cli.run(
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
        "true",
    )
    assert again.returncode == 2 and "already has objects" in one_line_error(again)

    # A planted node: chunk 1 is good, chunk 2 breaks on its second line.
    src = cli.conduit / "run" / run_id / "nodes" / node_id / "events-000001.jsonl"
    good = src.read_text().splitlines()
    bad_dir = cli.conduit / "run" / run_id / "nodes" / "n-bad"
    bad_dir.mkdir()
    (bad_dir / "events-000001.jsonl").write_text("\n".join(good[:2]) + "\n")
    (bad_dir / "events-000002.jsonl").write_text(good[2] + "\n{this is not json\n")
    broken = cli.run("events", "--conduit", cli.conduit_url, run_id, "n-bad")
    assert broken.returncode == 1
    err = one_line_error(broken)
    assert f"run/{run_id}/nodes/n-bad/events-000002.jsonl" in err and "line 2" in err, err
    assert "> node n-events" in broken.stdout  # what came before the fault was printed

    missing = cli.run("events", "--conduit", cli.conduit_url, run_id, "n-none")
    assert missing.returncode == 1 and "no objects" in one_line_error(missing)
    typo = cli.work / "no-such-conduit"
    res = cli.run("events", "--conduit", typo.as_uri(), run_id, node_id)
    assert res.returncode == 1 and "does not exist" in one_line_error(res)
    assert not typo.exists()  # replaying never creates a conduit


# ----------------------------------------------------------------------------- sweep


def _sleeper(rt: SandboxRuntime, labels: dict[str, str]) -> str:
    sid = f"sw-{uuid.uuid4().hex[:10]}"
    rt.launch(LaunchSpec(sandbox_id=sid, env={}, labels=labels, command=["sleep", "300"]))
    return sid


@pytest.mark.sandbox
def test_sweep_reaps_matching_sandboxes_and_leaves_others(cli: Cli) -> None:
    tag = uuid.uuid4().hex[:8]
    rts = [get_runtime("process")]
    bw = get_runtime("bubblewrap")
    if bw.availability().ok:
        rts.append(bw)
    mine = {rt.name: _sleeper(rt, {"sweep": tag, "who": "mine"}) for rt in rts}
    other = {rt.name: _sleeper(rt, {"sweep": tag, "who": "other"}) for rt in rts}
    try:
        res = cli.run("sweep", "--label", f"sweep={tag}", "--label", "who=mine")
        assert res.returncode == 0, res.stderr
        for rt in rts:
            assert f"{rt.name}: reaped 1 sandbox(es)" in res.stdout, res.stdout
            ids = rt.list_ids()  # type: ignore[attr-defined]
            assert mine[rt.name] not in ids and other[rt.name] in ids
        assert "gvisor:" in res.stdout and "container:" in res.stdout  # every local runtime was asked
        assert "kubernetes" not in res.stdout  # remote ones only when named

        js = cli.run("sweep", "--json", "--runtime", "process", "--label", f"sweep={tag}")
        assert json.loads(js.stdout)["reaped"] == {"process": 1}
        assert other["process"] not in get_runtime("process").list_ids()  # type: ignore[attr-defined]
    finally:
        for rt in rts:
            rt.sweep({"sweep": tag})


# ----------------------------------------------------------------------------- render


def test_render_prints_kubernetes_yaml_without_secrets(cli: Cli) -> None:
    pytest.importorskip(
        "prefect_resoluto.runtimes.kubernetes.render", reason="the kubernetes renderer is not present"
    )
    res = cli.run(
        "render",
        "--runtime",
        "kubernetes",
        "--image",
        "python:3.12-slim",
        "--conduit",
        "s3://bucket/base?endpoint_url=http://127.0.0.1:9000",
        "--secret-env",
        f"API_TOKEN={SECRET}",
        "--memory",
        "256Mi",
        "--",
        "python3",
        "-c",
        "print(1)",
    )
    assert res.returncode == 0, res.stderr
    for kind in ("NetworkPolicy", "Secret", "Pod"):
        assert f"kind: {kind}" in res.stdout
    assert SECRET not in res.stdout
    local = cli.run("render", "--runtime", "kubernetes", "--", "true")
    assert local.returncode == 2 and "local conduit" in one_line_error(local)
