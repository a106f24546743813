"""Issue 19, findings 7 and 9, through the real path: a hostile workload's prints of a
secret never reach Prefect's logs or the conduit in any usual shape, and the workload
cannot read the guest runner's credentials nor write the node's conduit directory, on
every local runtime (gVisor, bubblewrap, podman), cold and warm."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from urllib.parse import quote, quote_plus

import pytest
from flows import hostile_tasks as ht
from prefect import flow
from support.prefect_readback import task_runs
from test_pool_runner import sandbox_line, wait_ready
from test_task_runner import FLOWS, logs_of, runner

from guest_runner import wire
from guest_runner.conduit import LocalConduit
from guest_runner.redact import MIN_SECRET_LEN
from prefect_resoluto import ResolutoTaskRunner
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes import get_runtime

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD_UID = (65534, 65534, 65534)


def _pem() -> str:
    body = base64.b64encode(uuid.uuid4().bytes * 12).decode()
    lines = [body[i : i + 64] for i in range(0, len(body), 64)]
    return (
        "-----BEGIN OPENSSH PRIVATE KEY-----\n" + "\n".join(lines) + "\n-----END OPENSSH PRIVATE KEY-----\n"
    )


def _shapes(key: str) -> list[str]:
    """What must never be readable: every line, and the whole key in each encoding (the
    base64 forms reduced to the characters the key alone determines)."""
    raw = key.encode()
    out = [line for line in key.splitlines() if len(line) >= MIN_SECRET_LEN]
    out += [json.dumps(key)[1:-1], repr(key)[1:-1], quote(key, safe=""), quote(key), quote_plus(key)]
    out += [base64.b64encode(raw).decode()[:-4], base64.urlsafe_b64encode(raw).decode()[:-4]]
    out += [line for line in base64.encodebytes(raw).decode().splitlines() if len(line) >= MIN_SECRET_LEN]
    for k in range(3):
        stream = base64.b64encode(b"h" * k + raw + b"-trailer").decode()
        out.append(stream[-(-8 * k // 6) : (8 * (k + len(raw))) // 6])
    return out


def _conduit_bytes(root: Path) -> list[tuple[str, bytes]]:
    return [(str(p), p.read_bytes()) for p in root.rglob("*") if p.is_file()]


# -- finding 7: the shapes of a secret ----------------------------------------------------------


@pytest.mark.prefect
@pytest.mark.sandbox
@pytest.mark.usefixtures("prefect")
def test_every_shape_of_a_multi_line_secret_is_redacted_from_prefect_logs_and_the_conduit(gvisor, tmp_path):
    key = _pem()
    conduit = LocalConduit(tmp_path / "conduit")

    @flow(task_runner=runner(conduit, tmp_path, secret_env={"SSH_PRIVATE_KEY": key}), log_prints=True)
    def leaks_the_key() -> str:
        return ht.print_every_shape_of_the_key.submit().result()

    state = leaks_the_key(return_state=True)
    assert state.is_completed(), state
    (tr,) = task_runs(state.state_details.flow_run_id)
    messages = [entry.message for entry in logs_of(tr.id)]
    assert any("all shapes printed" in m for m in messages), messages  # the task did print
    assert sum("***" in m for m in messages) >= 8, messages
    shapes = _shapes(key)
    leaked = [(s, m) for m in messages for s in shapes if s in m]
    assert leaked == [], leaked[:3]
    files = _conduit_bytes(conduit.root)
    assert files
    in_files = [(name, s) for name, data in files for s in shapes if s.encode() in data]
    assert in_files == [], in_files[:3]


def test_a_declared_secret_too_short_to_redact_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match=r"secret_env 'PIN': a secret value shorter than 4 characters"):
        ResolutoTaskRunner(conduit=LocalConduit(tmp_path / "c"), runtime="process", secret_env={"PIN": "123"})
    # the CLI: the same refusal, naming the variable, and nothing reaches a conduit
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "prefect-resoluto"),
            "run",
            "--runtime",
            "process",
            "--min-isolation",
            "none",
        ]
        + ["--conduit", (tmp_path / "cli").as_uri(), "--secret-env", "PIN=123", "--", "true"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
    )
    assert proc.returncode != 0 and "'PIN'" in proc.stderr and "too short" not in proc.stdout, proc
    assert "shorter than 4 characters" in proc.stderr, proc.stderr
    assert not (tmp_path / "cli").exists() or not any((tmp_path / "cli").rglob("*.jsonl"))


# -- finding 9: the workload cannot read the runner's credentials ---------------------------------


_cleanups: list[Path] = []


@pytest.fixture(autouse=True)
def _remove_state_dirs():
    yield
    while _cleanups:
        shutil.rmtree(_cleanups.pop(), ignore_errors=True)


class CredentialedConduit(LocalConduit):
    """A local conduit whose guest needs credentials (as an S3 one's does): the runner
    gets them, the workload must not."""

    def __init__(self, root: Path, creds: dict[str, str]) -> None:
        super().__init__(root)
        self.creds = creds

    def guest_credentials(self) -> dict[str, str]:
        return dict(self.creds)


def _runtime(name: str, tmp_path: Path):
    if name == "process-as-nobody":
        if os.geteuid() != 0:
            pytest.skip("the process runtime's workload_user needs this host to run as root")
        # The workload's user must reach its workspace: a state directory it can traverse
        # (pytest's own tmp_path is under a 0700 directory).
        state = Path(tempfile.mkdtemp(prefix="rsl-privsep-", dir="/tmp"))
        state.chmod(0o711)
        _cleanups.append(state)
        return get_runtime("process", workload_user="65534:65534", state_dir=state)
    rt = get_runtime(name)
    if not rt.availability().ok:
        pytest.skip(f"{name} is not available on this machine: {rt.availability().why}")
    return rt


def _probe_report(lines: list[str]) -> dict:
    (report,) = [json.loads(line[len("PROBE ") :]) for line in lines if line.startswith("PROBE ")]
    return report


def _assert_confined(report: dict, secrets: list[str]) -> None:
    # What the workload got out of the runner first (what a leak looks like), then who it was.
    flat = json.dumps(report)
    assert not [s for s in secrets if s in flat], flat[:2000]
    for where in ("runner_environ", "pid1_environ"):
        got = report[where]
        assert got.startswith("denied") or not got.strip("\0").replace("read ", ""), (where, got[:300])
    for where in ("runner_mem", "pid1_mem"):
        assert report[where].startswith("denied"), (where, report[where])
    assert report["conduit_write"].startswith("denied"), report
    assert str(report["conduit_listing"]).startswith("denied"), report
    assert report["workspace_write"] == "wrote", report  # its own workspace stays its own
    assert tuple(report["uid"]) == WORKLOAD_UID and tuple(report["gid"]) == WORKLOAD_UID, report
    assert report["groups"] == [], report
    assert report["runner_uid"].split()[0] == "0", report  # it is the runner, as root, next door
    for k, v in report["caps"].items():
        assert v in ("", "0000000000000000"), (k, report)
    assert report["no_new_privs"] in ("", "1"), report  # gVisor's status has no such line


@pytest.mark.parametrize(
    "runtime",
    [
        pytest.param("gvisor", marks=pytest.mark.sandbox),
        pytest.param("bubblewrap", marks=pytest.mark.sandbox),
        pytest.param("container", marks=pytest.mark.sandbox),
        "process-as-nobody",
    ],
)
def test_a_hostile_workload_cannot_read_the_runners_credentials_or_write_its_conduit(runtime, tmp_path):
    rt = _runtime(runtime, tmp_path)
    token, key = f"write-token-{uuid.uuid4().hex}", f"aws-{uuid.uuid4().hex}"
    conduit = CredentialedConduit(
        tmp_path / "conduit", {"RESOLUTO_STORE_WRITE_TOKEN": token, "AWS_SECRET_ACCESS_KEY": key}
    )
    spec = NodeSpec(
        run_id=f"run-{uuid.uuid4().hex[:8]}",
        node_id="hostile",
        argv=["python3", "runner_probe.py"],
        workspace=FLOWS,
        output_paths=["forged-by-the-workload.txt"],
    )
    lines: list[str] = []
    outcome = drive_node(
        spec,
        conduit,
        rt,
        min_isolation="none" if runtime.startswith("process") else "namespace",
        on_event=lambda ev: lines.append(str((ev.get("data") or {}).get("line", ""))),
    )
    assert outcome.ok, (outcome.describe(), lines)
    _assert_confined(_probe_report(lines), [token, key])
    node_dir = conduit.root / "run" / spec.run_id / "nodes" / spec.node_id
    assert node_dir.is_dir() and not (node_dir / "forged-by-the-workload.txt").exists()
    # its workspace file came back as a declared output: the runner reads what the user wrote
    assert outcome.output_dir is not None and (outcome.output_dir / "forged-by-the-workload.txt").exists()
    leaked = [
        name for name, data in _conduit_bytes(conduit.root) if token.encode() in data or key.encode() in data
    ]
    assert leaked == []


@pytest.mark.prefect
@pytest.mark.sandbox
@pytest.mark.usefixtures("prefect")
def test_a_warm_call_process_is_the_unprivileged_user_from_before_its_assignment(gvisor, tmp_path):
    conduit = LocalConduit(tmp_path / "conduit")
    secret = f"warm-{uuid.uuid4().hex}"

    @flow(task_runner=runner(conduit, tmp_path, warm_pool=1, secret_env={"POOL_SECRET": secret}))
    def warm_probe() -> dict:
        wait_ready()
        return ht.probe_the_runner.submit().result()

    state = warm_probe(return_state=True)
    assert state.is_completed(), state
    report = state.result()
    (tr,) = task_runs(state.state_details.flow_run_id)
    assert "warm sandbox rsl-" in sandbox_line(tr.id)  # the pre-started call ran it
    _assert_confined(report, [])


def test_a_runner_that_cannot_switch_users_fails_the_node_before_the_workload_runs(tmp_path):
    """Fail closed: asked for a workload user it cannot become (root without CAP_SETUID,
    as in a sandbox that took every capability away), the runner runs nothing."""
    from support.guest import guest_env

    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.skip("needs setpriv and root to start a runner that is root without capabilities")
    conduit = LocalConduit(tmp_path / "conduit")
    env = guest_env(
        conduit.root, "r1", "n1", ["sh", "-c", "echo THE-WORKLOAD-RAN"], RESOLUTO_WORKLOAD_USER="65534:65534"
    )
    proc = subprocess.run(
        ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--", sys.executable, "-m", "guest_runner"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
    )
    assert proc.returncode == 1, proc
    result = json.loads(conduit.get("run/r1/nodes/n1/result.json"))
    assert result["status"] == "failure", result
    assert "cannot isolate the workload" in result["reason"] and "CAP_SETUID" in result["reason"], result
    events = b"".join(conduit.get(k) for k in conduit.list_prefix("run/r1/nodes/n1/") if wire.chunk_index(k))
    assert b"THE-WORKLOAD-RAN" not in events and b"cannot isolate the workload" in events
