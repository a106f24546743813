"""Drop-in fidelity: a sandboxed task behaves like the same task under ThreadPoolTaskRunner.

Every test runs against a real Prefect API; sandboxed tasks run on gVisor, except those
about Prefect glue alone, on the `process` runtime (each says so). Where it makes sense,
the same flow also runs under Prefect's own ThreadPoolTaskRunner and the two are compared.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path
from typing import Any

import pytest
from flows import dropin_flows as df
from flows import parity_flows as pf
from flows import real_prefect_flows as rf
from flows import sample_flows as sf
from prefect import flow, tags, task
from prefect.task_runners import ThreadPoolTaskRunner
from support.guest import plumbing_in
from support.prefect_readback import artifacts_of, client, task_runs

from guest_runner.conduit import LocalConduit
from prefect_resoluto import ResolutoTaskRunner, sandbox_options
from prefect_resoluto.task_runner.call_spec import RemoteTaskError

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect")]

FLOWS = Path(df.__file__).parent
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def conduit(tmp_path: Path) -> LocalConduit:
    return LocalConduit(tmp_path / "conduit")


def runner(conduit: LocalConduit, tmp_path: Path, **kw) -> ResolutoTaskRunner:
    kw.setdefault("runtime", "gvisor")
    return ResolutoTaskRunner(conduit=conduit, workspace=FLOWS, outputs_dir=tmp_path / "outputs", **kw)


def logs(**filters) -> list:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterTaskRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    f = (
        LogFilter(task_run_id=LogFilterTaskRunId(any_=[filters["task_run_id"]]))
        if "task_run_id" in filters
        else LogFilter(flow_run_id=LogFilterFlowRunId(any_=[filters["flow_run_id"]]))
    )
    with client() as c:
        return c.read_logs(log_filter=f, sort=LogSort.TIMESTAMP_ASC)


def raised(future) -> BaseException:
    """In a flow: what a task's future raises (BaseExceptions too, as under threads)."""
    try:
        future.result()
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt/SystemExit are the point
        return e
    raise AssertionError("the task was expected to fail")


# -- 1: no secret leaks through an exception ---------------------------------------------------
@pytest.mark.sandbox
def test_a_secret_in_an_exception_is_redacted_from_logs_state_outbox_outputs_and_artifacts(
    gvisor, conduit, tmp_path
):
    secret = f"tok-{uuid.uuid4().hex}"

    @flow(task_runner=runner(conduit, tmp_path, secret_env={"API_TOKEN": secret}, summary_artifact=True))
    def leaky():
        e = raised(df.leak_secret.submit())
        return type(e).__name__, str(e), repr(e)

    state = leaky(return_state=True)
    name, text, rep = state.result()
    assert name == "RuntimeError" and "boom ***" in text and secret not in text + rep
    fr = state.state_details.flow_run_id
    (tr,) = task_runs(fr)
    assert tr.state.is_failed() and "boom ***" in tr.state.message and secret not in tr.state.message
    every_log = [entry.message for entry in logs(flow_run_id=fr)]
    assert any("boom ***" in m for m in every_log) and not any(secret in m for m in every_log)
    # the outbox in the conduit, and what the guest wrote into it
    outbox = [k for k in conduit.list_prefix(f"run/{fr}/") if k.endswith(".tar.gz") and "/outbox/" in k]
    assert outbox
    with tarfile.open(fileobj=io.BytesIO(conduit.get(outbox[0]))) as tar:
        error = json.loads(tar.extractfile(".resoluto/error.json").read())
    assert error["message"] == "boom ***" and secret not in json.dumps(error)
    assert not any(secret.encode() in conduit.get(k) for k in conduit.list_prefix(f"run/{fr}/"))
    # the outputs directory on the host
    written = [p for p in (tmp_path / "outputs").rglob("*") if p.is_file()]
    assert any(p.name == "error.json" for p in written)
    assert not any(secret.encode() in p.read_bytes() for p in written)
    # the node's table (the runner's artifacts are opt-in; the task run ended failed)
    arts = artifacts_of(tr.id)
    assert arts and not any(secret in json.dumps(a.data) + str(a.description) for a in arts)


def test_the_host_redacts_again_what_a_guest_left_in_clear(tmp_path):
    """Prefect glue only: a guest that ignored redaction (an old or hostile one) still
    cannot get a secret into the exception, the state message or the outputs directory."""
    from guest_runner.redact import Redactor
    from prefect_resoluto.task_runner import call_spec

    secret = "s3cr3t-value-123"
    err = tmp_path / ".resoluto" / "error.json"
    err.parent.mkdir()
    err.write_text(
        json.dumps(
            {
                "type": "ValueError",
                "module": "builtins",
                "qualname": "ValueError",
                "exception": True,
                "message": f"bad {secret}",
                "traceback": f"Traceback ...\nValueError: bad {secret}\n",
            }
        )
    )
    with pytest.raises(ValueError) as info:
        call_spec.read_outcome(tmp_path, redactor=Redactor([secret]))
    assert secret not in str(info.value) and "bad ***" in str(info.value)
    assert secret not in err.read_text() and "bad ***" in err.read_text()


@pytest.mark.parametrize(
    "message",
    [{"s3cr3t-value-123": 1}, 86753091234567, ["x", {"k": "s3cr3t-value-123"}]],
    ids=["a-key", "a-number", "nested"],
)
def test_the_host_redacts_a_message_that_is_not_text(tmp_path, message):
    """error.json's message as an object keyed by the secret, or the secret as a number:
    the redactor masks text, and the host made these text only after it; the task's
    exception and the rewritten error.json carried the secret."""
    from guest_runner.redact import Redactor
    from prefect_resoluto.task_runner import call_spec

    secrets = ["s3cr3t-value-123", "86753091234567"]
    err = tmp_path / ".resoluto" / "error.json"
    err.parent.mkdir(parents=True)
    err.write_text(
        json.dumps({"type": "ValueError", "module": "builtins", "qualname": "ValueError", "message": message})
    )
    with pytest.raises(ValueError) as info:
        call_spec.read_outcome(tmp_path, redactor=Redactor(secrets))
    for secret in secrets:
        assert secret not in str(info.value) and secret not in err.read_text()


class FrozenError(Exception):
    """An exception class that refuses new attributes, as a frozen attrs one does."""

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen")


def test_an_exception_class_that_refuses_the_hosts_attributes_fails_the_task_as_a_remote_error(tmp_path):
    """error.json naming a loaded class whose instances refuse attributes (a frozen attrs
    exception, like referencing's): the host's rebuilt exception sets its own on it, and
    reading the outcome raised that class's AttributeError instead of the task's failure."""
    from prefect_resoluto.task_runner import call_spec

    err = tmp_path / ".resoluto" / "error.json"
    err.parent.mkdir(parents=True)
    record = {"type": "FrozenError", "module": __name__, "qualname": "FrozenError", "message": "m"}
    err.write_text(json.dumps(record))
    with pytest.raises(call_spec.RemoteTaskError, match="FrozenError"):
        call_spec.read_outcome(tmp_path)


# -- 2: exception types survive ---------------------------------------------------------------
def retry_on_value_error(task, task_run, state) -> bool:
    try:
        state.result()
    except ValueError:
        return True
    except Exception:
        return False
    return False


def retry_on_type_error(task, task_run, state) -> bool:
    try:
        state.result()
    except TypeError:
        return True
    except Exception:
        return False
    return False


#: The task runs _exception_flow makes: six submits.
EXCEPTION_FLOW_TASKS = 6


def _exception_flow(task_runner):
    @flow(task_runner=task_runner)
    def exceptions():
        out: dict[str, Any] = {}
        try:
            df.raise_value_error.submit("bad input 42").result()
        except ValueError as e:  # the except clause a user writes under threads
            out["value_error"] = e
        out["quota"] = raised(df.raise_quota.submit(12))
        out["chained"] = raised(df.raise_chained.submit())
        out["group"] = raised(df.raise_group.submit())
        raised(
            df.raise_value_error.with_options(
                retries=1, retry_delay_seconds=0, retry_condition_fn=retry_on_value_error
            ).submit("retry me")
        )
        raised(
            df.raise_value_error.with_options(
                retries=1, retry_delay_seconds=0, retry_condition_fn=retry_on_type_error
            ).submit("do not retry")
        )
        return out

    return exceptions


def test_exceptions_keep_their_type_and_the_remote_traceback(conduit, tmp_path):
    # Prefect glue (exceptions rebuilt from the call protocol, the same out of any sandbox): on
    # `process` (issue 21); a gVisor task's traceback is test_task_runner.py's and the next one's.
    state = _exception_flow(runner(conduit, tmp_path, runtime="process", min_isolation="none"))(
        return_state=True
    )
    out = state.result()
    ve = out["value_error"]
    assert isinstance(ve, ValueError) and isinstance(ve, RemoteTaskError)
    assert ve.remote_type == "ValueError" and ve.remote_message == "bad input 42"
    assert (
        'dropin_flows.py", line' in ve.remote_traceback and "raise ValueError(message)" in ve.remote_traceback
    )
    assert "guest_runner" not in ve.remote_traceback  # from the task's own frame down
    assert repr(ve) == "ValueError('bad input 42')" and str(ve) == "bad input 42"
    shown = [
        r.state.message
        for r in task_runs(state.state_details.flow_run_id)
        if "bad input 42" in r.state.message
    ]
    assert shown == ["Task run encountered an exception ValueError: bad input 42"]  # a thread's words
    quota = out["quota"]  # the task module's own class, with its own constructor
    assert isinstance(quota, df.QuotaExceeded) and isinstance(quota, RemoteTaskError)
    assert str(quota) == "used 12 of 10"
    chained = out["chained"]
    assert isinstance(chained, LookupError) and "KeyError: 'missing'" in chained.remote_traceback
    assert "direct cause" in chained.remote_traceback
    # the cause is rebuilt too, so a logged traceback tells "raise ... from ..." as a thread's
    assert isinstance(chained.__cause__, KeyError) and chained.__cause__.__traceback__ is not None
    group = out["group"]  # not rebuilt: the remote text is kept
    assert type(group) is RemoteTaskError and group.remote_type == "ExceptionGroup"
    assert "ValueError: one" in group.remote_traceback and "TypeError: two" in group.remote_traceback

    # every task run the flow submitted: the last one's may still be on its way to the API
    runs = task_runs(state.state_details.flow_run_id, expect=EXCEPTION_FLOW_TASKS)
    retried = [r for r in runs if r.run_count == 2]
    assert len(retried) == 1, [
        (r.name, r.run_count) for r in runs
    ]  # only the retry condition that matches the type retries
    # the same flow under Prefect's own thread pool gives the same states and run counts
    th = _exception_flow(ThreadPoolTaskRunner())(return_state=True)
    th_runs = task_runs(th.state_details.flow_run_id, expect=EXCEPTION_FLOW_TASKS)
    assert sorted((r.state.type, r.run_count) for r in th_runs) == sorted(
        (r.state.type, r.run_count) for r in runs
    )
    assert isinstance(th.result()["quota"], df.QuotaExceeded)


# -- 3: KeyboardInterrupt / SystemExit crash, as under threads ------------------------------------
def _crash_flow(task_runner):
    @flow(task_runner=task_runner)
    def crashing():
        return [
            type(raised(t)).__mro__[0].__name__
            for t in (df.interrupt.submit(), df.exit_with.submit(0), df.exit_with.submit(3))
        ]

    return crashing


def test_keyboard_interrupt_and_system_exit_crash_the_task_run_without_retries(conduit, tmp_path):
    # Prefect glue (the task run's states, as under threads): on `process` (issue 21).
    sandboxed = _crash_flow(runner(conduit, tmp_path, runtime="process", min_isolation="none"))(
        return_state=True
    )
    threaded = _crash_flow(ThreadPoolTaskRunner())(return_state=True)
    assert sandboxed.is_completed() and threaded.is_completed()
    assert sandboxed.result() == threaded.result() == ["KeyboardInterrupt", "SystemExit", "SystemExit"]
    s_runs, t_runs = (
        task_runs(sandboxed.state_details.flow_run_id, expect=3),
        task_runs(threaded.state_details.flow_run_id, expect=3),
    )
    assert [r.state.type.value for r in s_runs] == ["CRASHED"] * 3
    assert [(r.state.type, r.run_count) for r in s_runs] == [(r.state.type, r.run_count) for r in t_runs]
    assert all(r.run_count == 1 for r in s_runs)  # retries=2 on both tasks: a crash is not retried
    messages = sorted(r.state.message for r in s_runs)
    assert messages == sorted(r.state.message for r in t_runs)


# -- 4: the stand-in's import orders ---------------------------------------------------------------
ORDER_MODULES = [
    "prefect",
    "prefect.logging",
    "prefect.client.schemas",
    "prefect.context",
    "prefect.runtime",
    "prefect.futures",
    "prefect.variables",
]

_ORDER_PROBE = """
import importlib, sys
from guest_runner import standin
if sys.argv[1] == "real":
    standin.use_real_prefect()
else:
    standin.install()
first = sys.argv[2]
order = [first] + [m for m in {modules!r} if m != first]
for name in order:
    importlib.import_module(name)
from prefect import task, flow, get_run_logger, tags
from prefect.logging import get_run_logger as logging_get_run_logger
assert get_run_logger is logging_get_run_logger is standin.get_run_logger
for name, module in sorted(sys.modules.items()):
    if name.startswith("prefect.") and module is not None:
        parent, _, child = name.rpartition(".")
        bound = getattr(sys.modules[parent], child, None)
        assert bound is module or not isinstance(bound, type(sys)), f"{{name}} is not bound on {{parent}}"
assert not isinstance(sys.modules["prefect"], standin._LazyModule)
@task
def t(x):
    return x + 1
print("ok", t(1))
"""


@pytest.mark.parametrize("path", ["standin", "real"])
@pytest.mark.parametrize("first", ORDER_MODULES)
def test_every_import_order_works_in_the_stand_in_and_the_real_package(path, first):
    """Guest side only (no sandbox, no API): a fresh interpreter per order."""
    probe = _ORDER_PROBE.format(modules=ORDER_MODULES)
    proc = subprocess.run(
        [sys.executable, "-c", probe, path, first],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "PYTHONPATH": str(ROOT),
            "PATH": "/usr/bin:/bin",
            "PREFECT_HOME": "/nonexistent-prefect-home-for-probe",
        },
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok 2"), proc.stderr[-3000:]


# -- 5 and 6: run context in the sandbox; nested task calls ------------------------------------------
def _context_flow(task_runner):
    @flow(task_runner=task_runner)
    def with_context(n: int = 3, label: str = "x"):
        with tags("alpha", "beta"):
            a = df.context_probe.submit()
            b = rf.context_probe_real.submit()
        nested = df.nested_calls.submit(n).result()
        nested_real = rf.nested_calls_real.submit(n).result()
        return a.result(), b.result(), nested, nested_real

    return with_context


def test_tags_and_prefect_runtime_reach_the_sandbox_and_nested_tasks_run_inline(conduit, tmp_path):
    # Prefect glue, not isolation: the context crosses as it does into any sandbox (the node's
    # env and the call), so the cheapest real runtime shows it; gVisor's own is tested above.
    state = _context_flow(runner(conduit, tmp_path, runtime="process", min_isolation="none"))(
        return_state=True
    )
    standin_ctx, real_ctx, nested, nested_real = state.result()
    th = _context_flow(ThreadPoolTaskRunner())(return_state=True)
    th_standin, th_real, th_nested, th_nested_real = th.result()

    fr = state.state_details.flow_run_id
    runs = {r.name.rsplit("-", 1)[0]: r for r in task_runs(fr)}
    for ctx, threaded, task_name in (
        (standin_ctx, th_standin, "context_probe"),
        (real_ctx, th_real, "context_probe_real"),
    ):
        tr = runs[task_name]
        assert ctx["tags"] == ["alpha", "beta"] == threaded["tags"]
        assert ctx["task_run"]["id"] == str(tr.id) and ctx["task_run"]["name"] == tr.name
        assert ctx["task_run"]["task_name"] == task_name == threaded["task_run"]["task_name"]
        assert ctx["task_run"]["run_count"] == 1 == threaded["task_run"]["run_count"]
        assert ctx["task_run"]["parameters"] == {} == threaded["task_run"]["parameters"]
        assert sorted(ctx["task_run"]["tags"]) == ["alpha", "beta"] == sorted(threaded["task_run"]["tags"])
        assert ctx["flow_run"]["id"] == str(fr) and ctx["flow_run"]["flow_name"] == "with-context"
        assert ctx["flow_run"]["parameters"] == {"n": 3, "label": "x"} == threaded["flow_run"]["parameters"]
        assert ctx["flow_run"]["tags"] == threaded["flow_run"]["tags"] == []
        assert ctx["deployment"] == {"id": None, "name": None} == threaded["deployment"]
        assert ctx["real_prefect_loaded"] is True
    assert nested == th_nested == {"direct": 6, "submitted": 8, "mapped": [6, 8, 10]}
    assert nested_real == th_nested_real == {"direct": 9, "submitted": 12, "mapped": [9, 12]}
    # nested calls ran inside the parent's sandbox: no task runs of their own, one line each
    assert set(runs) == {"context_probe", "context_probe_real", "nested_calls", "nested_calls_real"}
    for parent, child in (("nested_calls", "double"), ("nested_calls_real", "triple")):
        msgs = [entry.message for entry in logs(task_run_id=runs[parent].id)]
        inline = [m for m in msgs if "runs inline in this sandbox" in m]
        assert len(inline) == 1 and f"nested task {child!r}" in inline[0], msgs  # one line per nested task


# -- 7: max_workers ------------------------------------------------------------------------------
def test_max_workers_follows_prefects_thread_pool_setting():
    """Prefect glue only: the setting is read as ThreadPoolTaskRunner reads it."""
    from prefect.settings import PREFECT_TASKS_RUNNER_THREAD_POOL_MAX_WORKERS, temporary_settings

    from prefect_resoluto.task_runner.runner import default_max_workers

    assert ResolutoTaskRunner()._max_workers == default_max_workers()
    with temporary_settings({PREFECT_TASKS_RUNNER_THREAD_POOL_MAX_WORKERS: 3}):
        r = ResolutoTaskRunner()
        assert r._max_workers == 3 == ThreadPoolTaskRunner()._max_workers
        assert (
            ResolutoTaskRunner(max_workers=7)._max_workers
            == 7
            == ThreadPoolTaskRunner(max_workers=7)._max_workers
        )
    assert r.duplicate()._max_workers == 3  # duplicate() keeps what __init__ read


# -- 8, 9, 11: what the logs show ------------------------------------------------------------------
RUNNER_LINE = re.compile(
    r"ran in a (warm|cold) gVisor sandbox (\(.*\)|rsl-\S+ \(.*\)) in \d+\.\d s: (succeeded|failed \(workload\))"
)


@pytest.mark.sandbox
def test_a_failure_shows_a_threads_records_with_the_sandboxs_frames(gvisor, conduit, tmp_path):
    """On gVisor, where the task's file is /workspace/... in the sandbox: the records are a
    thread's, record for record, the traceback naming the host's copy of the file."""

    def records_of(task_runner) -> list[tuple[int, str, str]]:
        @flow(task_runner=task_runner)
        def failing():
            return raised(df.raise_value_error.submit("bad input 7"))

        state = failing(return_state=True)
        (tr,) = task_runs(state.state_details.flow_run_id)
        assert tr.state.message == "Task run encountered an exception ValueError: bad input 7"
        return [(r.level, r.name, r.message) for r in logs(task_run_id=tr.id)]

    ours = records_of(runner(conduit, tmp_path))
    threads = records_of(ThreadPoolTaskRunner())
    runner_lines = [r for r in ours if RUNNER_LINE.fullmatch(r[2])]
    assert len(runner_lines) == 1 and runner_lines[0][:2] == (20, "prefect.task_runs")
    assert [r for r in ours if r not in runner_lines] == threads
    (err,) = [m for level, _, m in ours if level >= 40 and "Traceback" in m]
    assert err.splitlines()[0] == "Task run failed with exception: ValueError('bad input 7')"
    assert f'File "{FLOWS / "dropin_flows.py"}", line 32, in raise_value_error' in err
    assert "/workspace" not in err and not plumbing_in(err), err


@pytest.mark.sandbox
def test_a_task_shows_one_short_runner_line_and_the_flow_one_runner_line(gvisor, conduit, tmp_path):
    r = runner(conduit, tmp_path, max_workers=3)

    @flow(task_runner=r, log_prints=True)
    def quiet():
        square = sf.square.submit(3)
        with sandbox_options(output_paths=["out/*.txt"]):
            report = sf.write_report.submit("q")
        return square.result(), report.result()

    state = quiet(return_state=True)
    fr = state.state_details.flow_run_id
    runs = {t.name.rsplit("-", 1)[0]: t for t in task_runs(fr)}
    for name, user_lines in (("square", ["squaring 3"]), ("write_report", [])):
        info = [x.message for x in logs(task_run_id=runs[name].id) if x.level >= 20]
        # the task's own lines (its prints: the flow logs prints), one runner line, the state
        assert info[:-2] == user_lines and info[-1] == "Finished in state Completed()", info
        assert RUNNER_LINE.fullmatch(info[-2]), info
    flow_lines = [
        x.message for x in logs(flow_run_id=fr) if x.task_run_id is None and "ResolutoTaskRunner" in x.message
    ]
    assert len(flow_lines) == 1, flow_lines
    assert "runtime gvisor" in flow_lines[0] and "isolation user-kernel" in flow_lines[0]
    assert f"conduit {conduit.url}" in flow_lines[0] and "max_workers 3" in flow_lines[0]


def test_collected_output_count_leaves_out_the_call_protocol_files(tmp_path):
    """Guest side only: the guest runner's own line counts declared outputs."""
    from support.guest import PY, guest_env

    ws = tmp_path / "ws"
    ws.mkdir()
    cmd = "mkdir -p out .resoluto && echo r > out/a.txt && echo '{}' > .resoluto/return.json"
    env = guest_env(
        tmp_path / "conduit",
        "r1",
        "n1",
        ["sh", "-c", cmd],
        RESOLUTO_WORKSPACE_DIR=str(ws),
        RESOLUTO_OUTPUT_PATHS=json.dumps(["out/*.txt", ".resoluto/return.json"]),
    )
    subprocess.run([PY, "-m", "guest_runner"], env=env, check=True, timeout=60)
    conduit = LocalConduit(tmp_path / "conduit")
    lines = [
        json.loads(line)["data"].get("line", "")
        for k in conduit.list_prefix("run/r1/nodes/n1/events-")
        for line in conduit.get(k).decode().splitlines()
    ]
    collected = [x for x in lines if x.startswith("collected")]
    assert len(collected) == 1 and collected[0].startswith("collected 1 output file(s)"), lines


# -- 10: artifacts ---------------------------------------------------------------------------------
def test_a_retried_task_that_completed_has_no_runner_artifact_and_its_flow_one_version(conduit, tmp_path):
    # Prefect glue (artifacts per attempt): on `process` (issue 21; issue 41: opt-in).
    @flow(
        task_runner=runner(conduit, tmp_path, runtime="process", min_isolation="none", summary_artifact=True)
    )
    def retrying():
        return sf.fail_on_first_attempt.submit().result()

    state = retrying(return_state=True)
    fr = state.state_details.flow_run_id
    (tr,) = task_runs(fr)
    assert tr.state.is_completed() and not artifacts_of(tr.id), "a completed task run: no runner artifact"
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with client() as c:  # what the Artifacts page lists: the latest artifact of each key
        latest = c.read_latest_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr]))
        )
    assert len(latest) == 1 and latest[0].key == "resoluto-retrying"
    table = json.loads(latest[0].data) if isinstance(latest[0].data, str) else latest[0].data
    assert [(r["attempt"], r["outcome"]) for r in table] == [("1", "failed (workload)"), ("2", "succeeded")]
    assert all(r["sandbox"] in ("warm", "cold") for r in table), table
    with client() as c:  # written once, when the flow run ended: one version of this run
        from prefect.client.schemas.filters import ArtifactFilterKey

        versions = c.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[latest[0].key]), flow_run_id=ArtifactFilterFlowRunId(any_=[fr])
            )
        )
    assert len(versions) == 1


# -- 12: block form ---------------------------------------------------------------------------------
def test_the_registered_block_schema_offers_choices_with_readable_names():
    """Prefect glue only: what Prefect's UI renders the sandbox block's form from."""
    from prefect_resoluto.blocks import LocalConduitBlock, S3ConduitBlock, SandboxBlock

    for block in (LocalConduitBlock, S3ConduitBlock, SandboxBlock):
        block.register_type_and_schema()
    with client() as c:
        block_type = c.read_block_type_by_slug("resoluto-sandbox")
        schema = c.get_most_recent_block_schema_for_block_type(block_type.id).fields
    props = schema["properties"]
    runtime_enum = props["runtime"]["enum"]  # a plain select, no "| null" toggle
    assert {"gvisor", "container", "kubernetes", "bubblewrap", "process"} <= set(runtime_enum)
    assert props["min_isolation"]["enum"] == ["vm", "user-kernel", "namespace", "none"]
    choices = {o["$ref"].rsplit("/", 1)[-1]: o.get("title") for o in props["conduit"]["anyOf"] if "$ref" in o}
    assert set(choices.values()) == {"Local directory", "S3 bucket"}
    assert set(choices) <= set(schema["definitions"])  # every choice still resolves in the stored schema
    assert props["pids"]["default"] == 4096 and "disk" in props
    with pytest.raises(ValueError, match="runtime"):
        SandboxBlock(runtime="gvisr")
    assert SandboxBlock(min_isolation="user_kernel").min_isolation == "user-kernel"


# -- 13: sane defaults -----------------------------------------------------------------------------
@pytest.mark.sandbox
def test_a_sandbox_gets_4gib_2_cpus_and_sized_scratch_by_default(gvisor, conduit, tmp_path):
    @flow(task_runner=runner(conduit, tmp_path))
    def limits():
        default = df.read_limits.submit()
        with sandbox_options(memory="1Gi", disk="256Mi"):
            small = df.read_limits.submit()
        return default.result(), small.result()

    default, small = limits()
    gib = 1024**3
    assert default["tmp_bytes"] == default["workspace_bytes"] == 4 * gib
    assert small["tmp_bytes"] == small["workspace_bytes"] == 256 * 1024**2
    assert small["mem_total_kib"] < default["mem_total_kib"] <= 4 * gib // 1024


@pytest.mark.sandbox
def test_a_task_over_its_memory_limit_is_stopped_and_told_which_setting(gvisor, conduit, tmp_path):
    """Past its memory limit (256Mi here: the default 4Gi reaches the sandbox, above, and the
    words for it are below; 4 GiB touched page by page in gVisor was ~30 s of CPU)."""
    from prefect_resoluto.node.outcome import SandboxKilled

    @flow(task_runner=runner(conduit, tmp_path, infrastructure_retries=0, memory="256Mi"))
    def hungry():
        return raised(df.hog_memory.submit(1))

    state = hungry(return_state=True)
    e = state.result()
    assert isinstance(e, SandboxKilled)
    assert (
        "OOM-killed" in str(e) and "memory limit is 256Mi, set by" in str(e) and "`memory` setting" in str(e)
    )
    (tr,) = task_runs(state.state_details.flow_run_id)
    assert tr.state.is_failed() and "`memory` setting" in tr.state.message


def test_the_default_memory_limit_is_named_as_the_default():
    from prefect_resoluto.runtimes.base import memory_hint
    from prefect_resoluto.settings.config import SandboxConfig

    hint = memory_hint(SandboxConfig().resources)
    assert "memory limit is 4Gi (the default), set by the `memory` setting" in hint, hint
    assert "(the default)" not in memory_hint(SandboxConfig().replace(memory="2Gi").resources)


def test_pids_and_disk_are_settable_and_reach_the_sandbox_config(tmp_path):
    """Prefect glue and bundle only: the gVisor bundle carries the limits."""
    from prefect_resoluto.node.spec import NodeSpec, launch_spec
    from prefect_resoluto.runtimes.gvisor import GVisorRuntime
    from prefect_resoluto.settings.config import SandboxConfig

    r = ResolutoTaskRunner(pids=64, disk="1Gi", memory="2Gi", cpus="1")
    cfg = SandboxConfig().replace(**r._options)
    res = cfg.resources
    assert (res.pids, res.disk_bytes, res.memory_bytes, res.cpus) == (64, 1024**3, 2 * 1024**3, 1.0)
    assert SandboxConfig().resources.memory_bytes == 4 * 1024**3 and SandboxConfig().resources.cpus == 2.0
    with pytest.raises(ValueError, match="pids"):
        ResolutoTaskRunner(pids=0)
    spec = launch_spec(
        NodeSpec(run_id="r", node_id="n", argv=["true"], resources=res), LocalConduit(tmp_path / "c")
    )
    from prefect_resoluto.runtimes._guest_layout import guest_layout

    bundle = GVisorRuntime().bundle_config(spec, guest_layout(spec, python="python3"))
    assert bundle["linux"]["resources"]["pids"] == {"limit": 64}
    sizes = {m["destination"]: m.get("options", []) for m in bundle["mounts"] if m["type"] == "tmpfs"}
    assert f"size={1024**3}" in sizes["/tmp"] and f"size={1024**3}" in sizes["/workspace"]


# -- values keep their types across the sandbox's boundary -------------------------------------------
def _typed_values() -> list[Any]:
    import datetime as dt
    import decimal
    from pathlib import Path as P

    return [
        (1, "two", (3.0, None)),
        {1, 2, 3},
        frozenset({"a"}),
        dt.date(2026, 12, 6),
        dt.datetime(2026, 12, 6, 11, 30, 5, 120, tzinfo=dt.timezone(dt.timedelta(hours=2))),
        dt.time(23, 59, 1),
        dt.timedelta(days=-2, seconds=7, microseconds=3),
        decimal.Decimal("10.10"),
        uuid.UUID("12345678-1234-5678-1234-567812345678"),
        P("/data/in.csv"),
        b"\x00raw\xff",
        {1: "one", (2, 3): ["x"], "$resoluto": "a key like the tag"},
        [{"nested": ({"deep": b""},)}],
    ]


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_parameters_and_return_values_keep_their_types_as_under_a_thread(conduit, tmp_path):
    """Tuples, sets, dates, times, Decimals, UUIDs, paths, bytes and non-text dict keys, with
    no annotation to go by: the sandboxed task gets and returns what a thread's does.
    Prefect glue, not isolation: on the `process` runtime."""

    def echo_flow(task_runner):
        @flow(task_runner=task_runner)
        def echo_all() -> list:
            return [f.result() for f in [df.echo_value.submit(v) for v in _typed_values()]]

        return echo_all

    sandboxed = echo_flow(runner(conduit, tmp_path, runtime="process", min_isolation="none"))()
    threaded = echo_flow(ThreadPoolTaskRunner())()
    for got, want in zip(sandboxed, threaded, strict=True):
        assert same(got, want), (got, want)


def _ending(state: Any) -> tuple:
    """What a flow sees of a task run's final state: its type, name, message, and its
    value or the exception reading it raises."""
    try:
        got: Any = ("value", state.result())
    except BaseException as e:
        got = ("raised", type(e).__name__, isinstance(e, df.QuotaExceeded), str(e))
    return state.type.value, state.name, state.message, got


def test_returned_states_and_exceptions_passed_or_returned_end_as_under_a_thread(conduit, tmp_path):
    """A task that returns a state ends in it (`return Failed(message=...)`, a Completed
    named "Skipped" with data, a Cancelled, a Failed holding its exception); a task given a
    failed upstream through `allow_failure` gets the upstream's exception, of the task
    module's own class; a task may return exceptions as values. Each as under a thread.
    Prefect glue: on the `process` runtime."""
    from prefect import allow_failure

    def ends_flow(task_runner):
        @flow(task_runner=task_runner)
        def ends() -> dict:
            states = [df.end_in_state.submit(k) for k in ("failed", "skipped", "cancelled", "with")]
            for s in states:
                s.wait()
            upstream = df.raise_quota.submit(3)
            seen = df.inspect_upstream.submit(allow_failure(upstream)).result()
            values = df.return_exceptions.submit().result()
            return {
                "states": [_ending(s.state) for s in states],
                "allow_failure": seen,
                "values": [
                    (type(v).__name__, isinstance(v, (ValueError, df.QuotaExceeded)), str(v)) for v in values
                ],
            }

        return ends

    sandboxed = ends_flow(runner(conduit, tmp_path, runtime="process", min_isolation="none"))()
    threaded = ends_flow(ThreadPoolTaskRunner())()
    assert sandboxed == threaded
    assert threaded["states"][0][:3] == ("FAILED", "Failed", "told to fail")
    assert threaded["allow_failure"]["is_own_class"] is True


OBJECTS_MODELS = """
import enum
from dataclasses import dataclass, field
from typing import Optional
from pydantic import BaseModel

class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"

class Row(BaseModel):
    id: int
    mode: Mode = Mode.FAST

@dataclass
class Point:
    x: int
    y: int

@dataclass
class Line:
    a: Point
    b: Point
    label: Optional[str] = None
    seen: int = field(default=0, init=False)
"""

OBJECTS_FLOW = """
import json, os, sys
from typing import Optional
from prefect import flow, task
from prefect.task_runners import ThreadPoolTaskRunner
from prefect_resoluto import ResolutoTaskRunner
from models import Line, Mode, Point, Row

class Local(Exception):
    pass

def shape(v):
    if isinstance(v, (list, tuple)):
        return [type(v).__name__, [shape(x) for x in v]]
    if isinstance(v, dict):
        return ["dict", {str(k): shape(x) for k, x in v.items()}]
    if hasattr(v, "__dataclass_fields__"):
        return [type(v).__name__, {k: shape(getattr(v, k)) for k in v.__dataclass_fields__}]
    if hasattr(v, "model_fields"):
        return [type(v).__name__, {k: shape(getattr(v, k)) for k in type(v).model_fields}]
    return [type(v).__name__, repr(v)]

@task
def untyped(value):
    return [shape(value), value]

@task
def typed(rows: list[Row], opt: Optional[Row], mode: Mode, by: dict[str, Line], pts: tuple[Point, ...]) -> list[Row]:
    return [shape(rows), shape(opt), shape(mode), shape(by), shape(pts), rows]

VALUES = [Row(id=1), Mode.SLOW, Point(1, 2), Line(Point(1, 2), Point(3, 4), "l"), [Row(id=2, mode=Mode.SLOW)], {"k": Point(5, 6)}]

def run(runner):
    @flow(task_runner=runner)
    def objects():
        got = [untyped(v) for v in VALUES]
        got.append(typed([Row(id=3)], None, Mode.FAST, {"a": Line(Point(0, 0), Point(1, 1))}, (Point(7, 8),)))
        got.append(typed([], Row(id=4), Mode.SLOW, {}, ()))
        return shape(got)
    return objects()

if __name__ == "__main__":
    env = os.environ
    sandboxed = run(ResolutoTaskRunner(runtime="process", min_isolation="none", conduit=env["CONDUIT"], outputs_dir=env["OUTPUTS"]))
    print("RESULT", json.dumps({"sandboxed": sandboxed, "threaded": run(ThreadPoolTaskRunner())}), flush=True)
"""


def test_models_dataclasses_and_enums_cross_as_themselves_with_or_without_annotations(tmp_path):
    """A pydantic model, a dataclass (nested ones, a field out of its constructor) and an
    enum member, the user's own (a module beside the flow), passed and returned with no
    annotation, and given to annotated parameters (``list[Row]``, ``Optional[Row]``,
    ``dict[str, Line]``, ``tuple[Point, ...]``): the sandboxed task gets and returns what a
    thread's does, types all the way down. Run as users run a flow file; on `process`."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "models.py").write_text(OBJECTS_MODELS)
    (ws / "flow.py").write_text(OBJECTS_FLOW)
    said = run_script([sys.executable, "flow.py"], ws, tmp_path)
    got = json.loads(next(ln for ln in said.splitlines() if ln.startswith("RESULT "))[len("RESULT ") :])
    assert got["sandboxed"] == got["threaded"]
    assert '"Line"' in json.dumps(got["threaded"]) and '"Mode"' in json.dumps(got["threaded"])


def test_a_python_tasks_call_files_are_not_left_on_the_host_and_its_declared_outputs_are(conduit, tmp_path):
    """Every Python task's value came back through files under the outputs directory, one
    directory a node, kept forever: a second copy of the conduit's outbox. Once read they
    go; a failed call's (redacted) exception record and a task's declared outputs stay.
    Prefect glue: on the `process` runtime."""
    from prefect_resoluto import output_files

    @flow(task_runner=runner(conduit, tmp_path, runtime="process", min_isolation="none"))
    def leaves() -> tuple[str, str]:
        df.double.submit(2).result()
        failed = df.raise_value_error.submit("on purpose")
        failed.wait()
        with sandbox_options(output_paths=["out/*.txt"]):
            note = df.write_note.submit("kept")
        written = note.result()
        return written, str(output_files(note)[written])

    written, kept = leaves()
    outputs = tmp_path / "outputs"
    left = sorted(p for p in outputs.rglob("*") if not p.is_dir())
    assert [p.name for p in left if p != Path(kept)] == ["error.json"], left
    assert Path(kept) in left and Path(kept).read_text() == "kept", left
    assert len(list(outputs.glob("*/*"))) == 2  # the failed node's and the writer's: no other
    assert written == "out/kept.txt"
    # Each node's outbox in the conduit still holds its call files: the evidence stays.
    outboxes = [p for p in (tmp_path / "conduit").rglob("outbox/*.tar.gz")]
    assert len(outboxes) >= 3


# -- a flow script without `if __name__ == "__main__":` ----------------------------------------------
def run_script(argv: list[str], cwd: Path, tmp_path: Path) -> str:
    """A flow script run as users run one, against the test's API, with its conduit and
    outputs under ``tmp_path`` (``CONDUIT``, ``OUTPUTS``); what it said, once it succeeded."""
    from prefect.settings import PREFECT_API_URL

    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        "CONDUIT": str(tmp_path / "conduit"),
        "OUTPUTS": str(tmp_path / "outputs"),
    }
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-4000:]
    return said


UNGUARDED_SCRIPT = """
import json, os
from prefect import flow, task
from prefect_resoluto import ResolutoTaskRunner

CALLS = []

@task
def work(i: int) -> int:
    CALLS.append(i)  # a fresh sandbox each: 1, unless the flow ran again in it
    return len(CALLS)

@flow(task_runner=ResolutoTaskRunner(
    runtime="process", min_isolation="none", conduit=os.environ.get("CONDUIT"),
    outputs_dir=os.environ.get("OUTPUTS"),
))
def pipeline(n: int):
    return [f.result() for f in work.map(range(n))]

print("RESULT", json.dumps(pipeline(4)), flush=True)
"""


def test_a_script_that_calls_its_flow_unguarded_runs_each_task_once(tmp_path):
    """The script is run as users run it (``python script.py``) against the test's API.
    Prefect glue, not isolation: on the `process` runtime, as the guest's import is the same
    on every runtime. Before, each task's sandbox ran the whole flow inline first."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "script.py").write_text(UNGUARDED_SCRIPT)
    said = run_script([sys.executable, "script.py"], ws, tmp_path)
    results = [line for line in said.splitlines() if line.startswith("RESULT ")]
    assert results == ["RESULT [1, 1, 1, 1]"], said[-4000:]  # the host's line, once


CLIMBING_SCRIPT = """
import os
from prefect import flow, task
from prefect_resoluto import ResolutoTaskRunner

@task
def kernel() -> str:
    import sys
    return os.uname().release + " " + sys.prefix

@flow(task_runner=ResolutoTaskRunner(
    runtime="gvisor", conduit=os.environ.get("CONDUIT"), outputs_dir=os.environ.get("OUTPUTS"),
))
def probe() -> str:
    return kernel.submit().result()

if __name__ == "__main__":
    print("KERNEL", probe(), flush=True)
"""


@pytest.mark.sandbox
def test_a_flow_started_through_a_path_with_dotdot_runs_its_tasks_in_gvisor(gvisor, tmp_path):
    """``../.venv/bin/python flow.py`` gives an ``sys.executable`` that climbs out of a
    directory: inside the sandbox that directory is not there, and runsc could not load the
    interpreter (every node failed: "failed to load .../../.venv/bin/python")."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "probe.py").write_text(CLIMBING_SCRIPT)
    # As `cd benchmarks && ../.venv/bin/python ...`: from a directory beside the virtualenv.
    venv = Path(sys.prefix)
    beside = next(d for d in sorted(venv.parent.iterdir()) if d.is_dir() and d != venv)
    climbing = f"../{venv.name}/{Path(sys.executable).relative_to(venv)}"
    assert os.path.samefile(beside / climbing, sys.executable), climbing
    said = run_script([climbing, str(ws / "probe.py")], beside, tmp_path)
    (line,) = [ln for ln in said.splitlines() if ln.startswith("KERNEL ")]
    release, prefix = line.split()[1:]
    assert release != os.uname().release, "the task ran on the host's kernel, not gVisor's"
    assert prefix == sys.prefix, "the task ran on another interpreter than the flow's"


# -- Prefect's own generic task-runner checks, on a sandboxed runner ----------------------------------
def test_the_runner_works_outside_a_flow_as_prefects_generic_tests_use_it(conduit, tmp_path):
    """As Prefect's ThreadPoolTaskRunner tests drive a runner: entered directly, tasks
    submitted with a parameters dict, tags from the submitting context. Prefect glue alone:
    on the `process` runtime (issue 21)."""
    sandboxed = runner(conduit, tmp_path, runtime="process", min_isolation="none")
    results = {}
    for name, task_runner in (("threads", ThreadPoolTaskRunner()), ("sandbox", sandboxed)):
        with task_runner as r:
            plain = r.submit(sf.square, {"x": 3})
            with tags("tag1"):
                probe = r.submit(df.context_probe, {})
            results[name] = (plain.result(), probe.result())
    (square, probe), (th_square, th_probe) = results["sandbox"], results["threads"]
    assert square == th_square == 9
    assert probe["tags"] == th_probe["tags"] == ["tag1"]
    assert probe["flow_run"] == th_probe["flow_run"] and probe["deployment"] == th_probe["deployment"]
    assert probe["task_run"]["task_name"] == th_probe["task_run"]["task_name"] == "context_probe"


def test_an_image_without_prefect_still_gives_tasks_their_run_context_and_nested_calls(tmp_path):
    """Guest side only: the interpreter runs without site-packages (``-S``), as in the
    guest image, which has no Prefect. The stand-ins answer from call.json's context."""
    import shutil

    ws = tmp_path / "ws"
    (ws / ".resoluto").mkdir(parents=True)
    shutil.copy(FLOWS / "dropin_flows.py", ws)
    context = {
        "tags": ["a", "b"],
        "task_run": {
            "id": "t1",
            "name": "context_probe-1",
            "task_name": "context_probe",
            "run_count": 2,
            "parameters": {},
            "tags": ["a", "b"],
        },
        "flow_run": {
            "id": "f1",
            "name": "brave-fox",
            "flow_name": "f",
            "tags": ["nightly"],
            "parameters": {"n": 3},
        },
        "deployment": {"id": "d1", "name": "prod"},
    }
    out = {}
    for qualname, params in (("context_probe", {}), ("nested_calls", {"x": 2})):
        (ws / ".resoluto" / "call.json").write_text(
            json.dumps(
                {"file": "dropin_flows.py", "qualname": qualname, "parameters": params, "context": context}
            )
        )
        proc = subprocess.run(
            [sys.executable, "-S", "-m", "guest_runner.call", ".resoluto/call.json"],
            cwd=ws,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out[qualname] = json.loads((ws / ".resoluto" / "return.json").read_text())["value"]
        if qualname == "nested_calls":
            assert "nested task 'double'" in proc.stdout and "runs inline in this sandbox" in proc.stdout
    probe = out["context_probe"]
    assert probe["real_prefect_loaded"] is False  # nothing of Prefect was there to load
    assert probe["tags"] == ["a", "b"] and probe["task_run"] == context["task_run"]
    assert probe["flow_run"] == context["flow_run"] and probe["deployment"] == context["deployment"]
    assert out["nested_calls"] == {"direct": 4, "submitted": 6, "mapped": [4, 6, 8]}


#: What a thread's run context holds and a sandbox's cannot (parity_flows.reads_what_a_sandbox_has_not).
NOT_IN_SANDBOX = ("client", "result_store", "flow", "task_runner", "job_variables", "flow_run.context")


def assert_not_in_sandbox(said: dict) -> None:
    assert set(said) == set(NOT_IN_SANDBOX), said
    for name, text in said.items():
        field = name.rsplit(".", 1)[-1]
        assert (
            text.startswith("NotInSandbox: ") and f".{field} is not available inside a sandboxed task" in text
        ), (
            name,
            text,
        )


def test_what_a_sandboxs_run_context_cannot_hold_fails_clearly(conduit, tmp_path):
    """A client, a result store, the flow, the task runner and the flow run's fields the host
    does not send (job_variables may carry a deployment's secrets) raise, naming the field;
    never None. Prefect glue alone: on the `process` runtime (the real package loads)."""

    @flow(task_runner=runner(conduit, tmp_path, runtime="process", min_isolation="none"))
    def reading() -> dict:
        return pf.reads_what_a_sandbox_has_not.submit().result()

    assert_not_in_sandbox(reading())


def test_an_image_without_prefect_gives_a_task_its_run_context_objects_from_the_hosts_run(tmp_path):
    """Guest side, without site-packages (``-S``), as in the guest image, which has no Prefect:
    the stand-in's get_run_context(), TaskRunContext.get() and FlowRunContext.get() answer from
    the context the host builds for a real task run (here: its second attempt, on a thread)."""
    import shutil

    from prefect.context import TaskRunContext

    from prefect_resoluto.task_runner.python_calls import DeploymentNames, run_context

    @task(retries=1, retry_delay_seconds=0, tags=["reads-context"], name="reads_run_context")
    def hosts_view(label: str) -> dict:
        ctx = TaskRunContext.get()
        if ctx.task_run.run_count < 2:
            raise ValueError("first attempt")
        return run_context(ctx, {"label": label}, DeploymentNames())

    @flow
    def reading(n: int = 3, label: str = "x") -> dict:
        return hosts_view.submit(label).result()

    state = reading(return_state=True)
    context = state.result()
    (tr,) = task_runs(state.state_details.flow_run_id)
    with client() as c:
        fr = c.read_flow_run(state.state_details.flow_run_id)

    ws = tmp_path / "ws"
    (ws / ".resoluto").mkdir(parents=True)
    shutil.copy(FLOWS / "parity_flows.py", ws)
    out = {}
    for qualname, params in (("reads_run_context", {"label": "x"}), ("reads_what_a_sandbox_has_not", {})):
        (ws / ".resoluto" / "call.json").write_text(
            json.dumps(
                {"file": "parity_flows.py", "qualname": qualname, "parameters": params, "context": context}
            )
        )
        proc = subprocess.run(
            [sys.executable, "-S", "-m", "guest_runner.call", ".resoluto/call.json"],
            cwd=ws,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr + (ws / ".resoluto" / "error.json").read_text()
        out[qualname] = json.loads((ws / ".resoluto" / "return.json").read_text())["value"]
    assert out["reads_run_context"] == {
        "run_is_task_context": True,
        "task_run": {
            "id": str(tr.id),
            "id_type": "UUID",
            "name": tr.name,
            "run_count": 2,
            "tags": ["reads-context"],
            "flow_run_id": str(fr.id),
        },
        "same_task_run": True,
        "task_name": "reads_run_context",
        "parameters": {"label": "x"},
        "flow_run": {"id": str(fr.id), "name": fr.name, "parameters": {"n": 3, "label": "x"}},
    }
    assert_not_in_sandbox(out["reads_what_a_sandbox_has_not"])
