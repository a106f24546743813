"""Prefect calls inside a sandboxed task (issue 34): artifacts appear on the task run and flow
run as under ThreadPoolTaskRunner (relayed through the node's events, created by the host),
and what a sandbox does not serve fails at once with an error saying so -- never an
ephemeral server started in the sandbox, never a wait on an API. Against a real Prefect API,
on gVisor, and on the process runtime where isolation is not the point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flows import prefect_call_flows as pcf
from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner
from support.prefect_readback import artifacts_of, client, task_runs, times_out_of_order

from guest_runner.conduit import LocalConduit
from guest_runner.prefect_api import MAX_ARTIFACT_BYTES, MAX_ARTIFACTS
from prefect_resoluto import ResolutoTaskRunner

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect")]
FLOWS = Path(pcf.__file__).parent
SECRET = "relay-secret-8817"


def sandboxed(tmp_path: Path, runtime: str, **kw) -> ResolutoTaskRunner:
    return ResolutoTaskRunner(
        runtime=runtime,
        min_isolation="none",
        conduit=LocalConduit(tmp_path / "conduit"),
        workspace=FLOWS,
        outputs_dir=tmp_path / "outputs",
        **kw,
    )


# gVisor only: the process runtime's path of the same calls is this module's other tests'
# (artifacts relayed and refused, a flow run's artifacts against ThreadPool's) and
# test_refusal_parity.py's (a read refused under the task runner, with others allowed).
@pytest.fixture(params=[pytest.param("gvisor", marks=pytest.mark.sandbox)])
def runtime(request) -> str:
    request.getfixturevalue("gvisor")
    return request.param


def shown(artifact) -> tuple:
    """What the UI shows of an artifact: key, type, description, data (rows parsed)."""
    data = artifact.data
    if artifact.type == "table" and isinstance(data, str):
        data = json.loads(data)
    return (artifact.key, artifact.type, artifact.description, json.dumps(data, sort_keys=True))


def by_task(flow_run_id) -> dict[str, list[tuple]]:
    """Each task run's artifacts (by task name), in creation order, and the flow run's."""
    out = {}
    for tr in task_runs(flow_run_id):
        arts = sorted(artifacts_of(tr.id), key=lambda a: a.created)
        assert all(str(a.flow_run_id) == str(flow_run_id) for a in arts), "on the task's flow run"
        out[tr.name.rsplit("-", 1)[0]] = [shown(a) for a in arts]
    return out


def all_artifacts_of(task_run_id) -> list:
    """Every artifact of a task run (the API answers at most 200 per request)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterTaskRunId

    found: list = []
    with client() as c:
        while page := c.read_artifacts(
            artifact_filter=ArtifactFilter(task_run_id=ArtifactFilterTaskRunId(any_=[task_run_id])),
            offset=len(found),
            limit=200,
        ):
            found += page
    return found


def run_reports(task_runner) -> tuple:
    @flow(task_runner=task_runner)
    def reporting() -> list:
        return [pcf.reports.submit(3).result(), pcf.areports.submit(4).result()]

    state = reporting(return_state=True)
    assert state.result() == [3, 4]
    return state.state_details.flow_run_id


def test_artifacts_made_in_a_task_are_a_threads_and_its_times_in_order(tmp_path, runtime):
    threads_run = run_reports(ThreadPoolTaskRunner())
    sandbox_run = run_reports(sandboxed(tmp_path, runtime))
    # Issue 41: a task run (sync and async) is created before it starts, and starts before it
    # ends. Under threads Prefect's recorder creates it after it started, so only the rest.
    assert times_out_of_order(task_runs(sandbox_run, expect=2)) == []
    assert times_out_of_order(task_runs(threads_run, expect=2), created_first=False) == []
    threads, sandbox = by_task(threads_run), by_task(sandbox_run)
    assert set(threads) == {"reports", "areports"}
    assert len(threads["reports"]) == 7 and len(threads["areports"]) == 3, threads
    assert sandbox == threads
    progress = [a for a in threads["reports"] if a[1] == "progress"]
    assert progress == [("progress-1", "progress", "done", "100")]


def test_what_a_sandbox_does_not_serve_fails_at_once_saying_so(tmp_path, runtime):
    @flow(task_runner=sandboxed(tmp_path, runtime))
    def calling() -> list:
        return [pcf.unserved.submit().result(), pcf.aunserved.submit().result()]

    sync, asynchronous = calling()
    calls = {
        **{f"sync {k}": v for k, v in sync.items()},
        **{f"async {k}": v for k, v in asynchronous.items()},
    }
    assert len(calls) == 7, calls
    for name, call in calls.items():
        assert call.get("type") == "PrefectAPIUnavailable", (name, call)
        assert "inside a sandbox" in call["message"], (name, call)
        assert "ResolutoTaskRunner" in call["message"], (name, call)
        # "At once": refused before any request left the task and with no wait of its thread;
        # what it replaces waits 20 s or more (an ephemeral server's start, or Prefect's client
        # trying the API again with backoff), so counts, not seconds, which a load stretches.
        assert (call["sends"], call["sleeps"]) == (0, 0), (name, call)
    # the words of guest_runner.refusal, as a flow run of a resoluto pool is told (test_refusal_parity.py)
    assert calls["sync variable"]["message"] == (
        "Prefect variable 'some-variable' is not readable inside a sandbox: add it to allowed_variables "
        "(ResolutoTaskRunner(allowed_variables=[...]) or its sandbox block; allowed here: none)"
    )
    assert calls["async variable"]["message"] == calls["sync variable"]["message"]
    assert calls["sync variable_set"]["message"] == (
        "Prefect variable 'some-variable' is not writable inside a sandbox (Variable.set): allowed_variables "
        "(ResolutoTaskRunner(allowed_variables=[...]) or its sandbox block) allows reads only; write it "
        "from the flow, outside the sandbox"
    )
    assert calls["sync secret"]["message"].startswith(
        "Prefect block 'secret/some-secret' is not readable inside a sandbox: add it to allowed_blocks ("
    )
    assert calls["sync block_save"]["message"].startswith(
        "Prefect block 'new-secret' is not writable inside a sandbox (Block.save): allowed_blocks ("
    )
    assert calls["sync client"]["message"].startswith(
        "reading or changing flow runs is not available inside a sandboxed task"
    )


def test_a_task_that_floods_artifacts_is_refused_and_loses_nothing_else(tmp_path):
    """10 000 forged artifact lines and one of 8 MB, past the guest's own checks: the host
    takes the first MAX_ARTIFACTS, refuses the rest saying why, and the task's log line and
    return value arrive."""
    from test_drop_in import logs

    @flow(task_runner=sandboxed(tmp_path, "process"))
    def flooding():
        return pcf.forges.submit(10_000, 8 * 1024 * 1024).result()

    state = flooding(return_state=True)
    assert state.result() == "done"
    (tr,) = task_runs(state.state_details.flow_run_id)
    arts = all_artifacts_of(tr.id)
    assert len(arts) == MAX_ARTIFACTS
    assert sorted(a.data for a in arts) == sorted(f"forged {i}" for i in range(MAX_ARTIFACTS))
    messages = [r.message for r in logs(task_run_id=tr.id)]
    refused = [m for m in messages if m.startswith("artifact")]
    # Two refusals, one per bound; the API orders them by timestamp, which may tie.
    assert len(refused) == 2, refused
    (too_big,) = [m for m in refused if m.startswith("artifact refused: ")]
    assert f"({MAX_ARTIFACT_BYTES} bytes)" in too_big
    assert (
        f"artifacts refused: a sandboxed task may relay at most {MAX_ARTIFACTS} artifacts (creations and "
        "progress updates) per attempt; the rest of this attempt's are not created"
    ) in refused
    assert len(refused) == 2, refused  # told once, not 9 000 times
    assert "still here" in messages


def test_a_task_over_the_bounds_is_told_by_an_exception_of_its_own(tmp_path):
    """Through Prefect's functions the guest refuses first, in the task: a table of ~3 MB."""

    @flow(task_runner=sandboxed(tmp_path, "process"))
    def flooding():
        return pcf.floods.submit(2, 30_000).result()

    told = flooding()
    assert told.startswith("ArtifactRefused: artifact refused: ")
    assert f"({MAX_ARTIFACT_BYTES} bytes)" in told and "output_paths" in told


def test_a_flow_runs_artifacts_are_the_users_plus_one_runner_table(tmp_path):
    """The Artifacts tab of a flow run of 9 tasks with the summary on: ThreadPool's artifacts,
    plus the runner's one table (one version, written when the flow run ends); no artifact on
    a successful task run but the user's."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    def run(task_runner) -> tuple[list, list]:
        @flow(task_runner=task_runner)
        def many() -> list:
            return [f.result() for f in pcf.reports.map(range(1, 10))]

        state = many(return_state=True)
        assert state.result() == list(range(1, 10))
        fr = state.state_details.flow_run_id
        with client() as c:
            arts = c.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr])), limit=200
            )
        return [shown(a) for a in arts if not (a.key or "").startswith("resoluto-")], [
            a for a in arts if a.key == "resoluto-many"
        ]

    threads, none = run(ThreadPoolTaskRunner())
    users, ours = run(sandboxed(tmp_path, "process", summary_artifact=True))
    assert none == [] and len(threads) == 9 * 7
    assert sorted(users, key=repr) == sorted(threads, key=repr)
    assert len(ours) == 1 and ours[0].task_run_id is None, ours
    assert ours[0].description.startswith("9 sandbox nodes, 9 succeeded; process; flow run ")
    assert len(json.loads(ours[0].data)) == 9


def test_allowed_variables_and_blocks_read_as_on_threads_and_values_are_redacted(tmp_path, runtime, capsys):
    from prefect.blocks.system import Secret
    from prefect.variables import Variable
    from test_drop_in import logs

    Variable.set("relay-region", "eu-west-9", overwrite=True)
    Secret(value=SECRET).save("relay-token", overwrite=True)

    def run(task_runner) -> tuple:
        @flow(task_runner=task_runner)
        def reading() -> tuple:
            return (
                pcf.reads.submit("relay-region", "relay-token", "secret/relay-token").result(),
                pcf.areads.submit("relay-region", "relay-token").result(),
            )

        state = reading(return_state=True)
        return state.result(), state.state_details.flow_run_id

    threads, _ = run(ThreadPoolTaskRunner())
    allowed = {
        "allowed_variables": ["relay-region", "missing-variable"],
        "allowed_blocks": ["secret/relay-token", "secret/missing-secret"],
    }
    sandbox, fr = run(sandboxed(tmp_path, runtime, **allowed))
    assert sandbox == threads
    assert threads[0] == {
        "variable": "eu-west-9",
        "default": "dflt",
        "secret": SECRET,
        "block": SECRET,
        "missing block": "ValueError: Unable to find block document named missing-secret for block type secret",
    }
    assert threads[1] == ["eu-west-9", SECRET]
    lines = [r.message for r in logs(flow_run_id=fr)]
    assert "the secret is ***" in lines and not any(SECRET in m for m in lines), lines
    # A variable is not a secret in Prefect: shown as a thread shows it.
    assert "the variable is eu-west-9" in lines, lines
    # Prefect's collections, loaded with the blocks in a sandbox without this package: quiet.
    assert "Failed to load collection" not in capsys.readouterr().out
