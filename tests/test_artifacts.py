"""The runner's own artifacts (issue 41, "Runner artifacts"), read back from the session's
Prefect API as the Artifacts page and a run's Artifacts tab read them: by default a user's
pages hold only what their own code made; the runner's per-run summary is opt-in
(``summary_artifact``), one collection per flow. The process runtime where isolation is not
the point; gVisor end to end."""

from __future__ import annotations

import html
import json
import re
import uuid
from pathlib import Path

import pytest
from flows import artifact_flows as af
from flows import hostile_tasks as ht
from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner
from support.prefect_readback import artifacts_of, client, task_runs
from test_drop_in import logs

from guest_runner.conduit import LocalConduit
from prefect_resoluto import ResolutoTaskRunner
from prefect_resoluto.task_runner.artifacts import CELL, COLUMNS, flow_key

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect")]
FLOWS = Path(af.__file__).parent
SECRET = "art-secret-5521"


@pytest.fixture(params=["process", pytest.param("gvisor", marks=pytest.mark.sandbox)])
def runtime(request) -> str:
    if request.param == "gvisor":
        request.getfixturevalue("gvisor")
    return request.param


def sandboxed(tmp_path: Path, runtime: str = "process", **kw) -> ResolutoTaskRunner:
    return ResolutoTaskRunner(
        runtime=runtime,
        conduit=LocalConduit(tmp_path / "conduit"),
        workspace=FLOWS,
        outputs_dir=tmp_path / "outputs",
        secret_env={"ART_SECRET": SECRET},
        **({"min_isolation": "none"} if runtime == "process" else {"memory": "256Mi"}),
        **kw,
    )


def the_flow(name: str, task_runner, broken: str | None = None):
    """The browser pass's flow: a mapped task, one failing once then completing, one making
    the user's markdown artifact (and, with ``broken``, one that fails for good)."""

    @flow(name=name, task_runner=task_runner)
    def artifact_check() -> tuple:
        doubled = [f.result() for f in af.double.map([1, 2, 3])]
        again = af.flaky.submit().result()
        total = af.report.submit(doubled).result()
        if broken is not None:
            af.broken.submit(broken).wait()
        return doubled, again, total

    return artifact_check


def _rows(artifact) -> list[dict[str, str]]:
    return json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data


def of_flow_run(fr) -> list:
    """Every artifact of the flow run, its task runs' included (the flow run's Artifacts tab)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with client() as c:
        return c.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr])), limit=200
        )


def collections_of(fr) -> list:
    """The Artifacts page's collections (the latest version of each key) the flow run wrote."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with client() as c:
        return c.read_latest_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr])), limit=200
        )


def versions_of(key: str) -> list:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with client() as c:
        return c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), limit=200)


def task_name(tr) -> str:
    return tr.name.rsplit("-", 1)[0]


def shown(artifact, names: dict) -> tuple:
    """What a user sees of an artifact, the same under any runner: key, type, description,
    data, and the task it belongs to (None: the flow run)."""
    owner = names.get(artifact.task_run_id) if artifact.task_run_id is not None else None
    return (artifact.key, artifact.type, artifact.description, json.dumps(artifact.data), owner)


def test_by_default_a_flow_leaves_only_the_users_artifacts(tmp_path, runtime):
    """The finding: each sandboxed run added a collection of the runner's, and the task that
    failed once and then completed carried a failure table. By default: the thread's
    artifacts, nothing more; the failed attempt is told in its task run's logs."""
    name = f"artifact-check-{uuid.uuid4().hex[:8]}"

    def run(task_runner) -> tuple:
        state = the_flow(name, task_runner)(return_state=True)
        assert state.result() == ([2, 4, 6], "second attempt", 12)
        fr = state.state_details.flow_run_id
        runs = task_runs(fr)
        names = {tr.id: task_name(tr) for tr in runs}
        return fr, runs, sorted((shown(a, names) for a in of_flow_run(fr)), key=repr)

    _, _, threads = run(ThreadPoolTaskRunner())
    fr, runs, ours = run(sandboxed(tmp_path, runtime))
    assert [a[0] for a in threads] == ["totals"]  # the user's one artifact
    assert ours == threads
    assert [a.key for a in collections_of(fr)] == ["totals"], "no collection of the runner's"
    assert not versions_of(flow_key(name)), "the runner wrote no summary"
    (flaky,) = [tr for tr in runs if task_name(tr) == "flaky"]
    assert flaky.state.is_completed() and flaky.run_count == 2
    assert not artifacts_of(flaky.id), "a completed task run carries no failure table"
    # The failed attempt's evidence is in its task run's logs: Prefect's retry line and the
    # runner's line for each node.
    lines = [x.message for x in logs(task_run_id=flaky.id) if x.level >= 20]
    assert any("RuntimeError" in m and "first attempt fails on purpose" in m for m in lines), lines
    told = [m for m in lines if m.startswith("ran in a ")]
    assert len(told) == 2 and told[0].endswith(": failed (workload)") and told[1].endswith(": succeeded"), (
        told
    )


def test_the_summary_is_opt_in_one_collection_per_flow_and_narrow(tmp_path):
    """``summary_artifact=True``: two runs of one flow are two versions of one key (one
    collection on the Artifacts page); a completed task run, even after a failed attempt,
    carries no artifact; a task run that ended failed keeps its node's table; every cell is
    short (the page is 1400 px), the full text in the logs."""
    name = f"Artifact Check {uuid.uuid4().hex[:8]}"  # not a key as written: made one
    long = f"bad input {SECRET} " + "x" * 400
    check = the_flow(name, sandboxed(tmp_path, summary_artifact=True), broken=long)
    frs = []
    for _ in range(2):
        state = check(return_state=True)
        assert state.result() == ([2, 4, 6], "second attempt", 12)
        frs.append(state.state_details.flow_run_id)

    key = flow_key(name)
    assert re.fullmatch(r"resoluto-artifact-check-[0-9a-f]{8}-[0-9a-f]{6}", key), key
    versions = versions_of(key)
    assert sorted(str(v.flow_run_id) for v in versions) == sorted(map(str, frs)), versions
    assert all(v.task_run_id is None for v in versions)
    # The Artifacts page: one collection of the runner's, its latest version the last run's.
    assert sorted(a.key for a in collections_of(frs[-1])) == sorted([key, "totals"])
    assert collections_of(frs[0]) == [], "the first run's versions are no collection of their own"

    fr = frs[-1]
    (table,) = [v for v in versions if v.flow_run_id == fr]
    rows = _rows(table)
    assert all(list(r) == list(COLUMNS) for r in rows), rows
    assert all(len(rendered(v)) <= CELL for r in rows for v in r.values()), rows
    runs = task_runs(fr)
    assert len(rows) == 7  # 3 doubles, 2 attempts of flaky, report, broken
    by_task = sorted((task_name_of(r["task run"]), r["attempt"], r["outcome"]) for r in rows)
    assert ("flaky", "1", "failed (workload)") in by_task and ("flaky", "2", "succeeded") in by_task
    (bad_row,) = [r for r in rows if r["task run"].startswith("broken")]
    assert bad_row["error"].startswith(r"ValueError\: bad input \*\*\* xxx") and bad_row["error"].endswith(
        "…"
    )
    assert table.description.startswith("7 sandbox nodes, 5 succeeded, 2 failed (RuntimeError, ValueError)")

    (flaky,) = [tr for tr in runs if task_name(tr) == "flaky"]
    assert flaky.state.is_completed() and not artifacts_of(flaky.id)
    (bad,) = [tr for tr in runs if task_name(tr) == "broken"]
    (art,) = artifacts_of(bad.id)  # the task run ended failed: its node's table is kept
    assert art.key is None and art.description.startswith(f"{bad.name}: failed (workload): ValueError")
    fields = {r["field"]: r["value"] for r in _rows(art)}
    assert fields["node prefix"] == f"run/{fr}/nodes/{bad.id}"
    assert all(len(rendered(r["value"])) <= CELL for r in _rows(art) if r["field"] == "error"), _rows(art)
    # The full error: in the task run's logs (Prefect's traceback of the exception).
    assert any(long.replace(SECRET, "***") in x.message for x in logs(task_run_id=bad.id))
    everything = json.dumps([_rows(a) for a in of_flow_run(fr) if a.type == "table"])
    everything += " ".join(str(a.description) for a in of_flow_run(fr))
    assert SECRET not in everything


def task_name_of(task_run_name: str) -> str:
    return task_run_name.rsplit("-", 1)[0]


def test_the_summary_setting_is_the_runners_not_a_submissions():
    from prefect_resoluto import sandbox_options

    with pytest.raises(TypeError, match="summary_artifact"):
        with sandbox_options(summary_artifact=True):
            pass


def rendered(markdown: str) -> str:
    """What a CommonMark renderer (as the UI's) shows of ``markdown``, as text."""
    from markdown_it import MarkdownIt

    html_out = MarkdownIt("commonmark").render(markdown)
    return html.unescape(re.sub(r"<[^>]*>", "", html_out)).strip()


def live_markup(markdown: str) -> list[str]:
    """The links, images and raw HTML ``markdown`` renders to, and any bare URL a GFM renderer
    would autolink (a scheme or ``www.`` as written in the source)."""
    from markdown_it import MarkdownIt

    html_out = MarkdownIt("commonmark").render(markdown)
    live = re.findall(r"<(?:a|img|script|iframe)\b[^>]*>", html_out, flags=re.I)
    return live + re.findall(r"(?i)(?:https?:/|www\.)\S*", markdown)


@pytest.mark.sandbox
def test_a_tasks_error_is_no_live_link_or_image_in_the_runners_artifacts(gvisor, tmp_path):
    """Finding 5 (issue 39): a task raising a message in markdown put a live link ("click to
    approve") and a tracking image in the description of the table the runner writes on the
    task run, under the runner's name. Every text the sandbox wrote reads as written, inert."""

    @flow(task_runner=sandboxed(tmp_path, "gvisor", summary_artifact=True))
    def phished() -> bool:
        return ht.raise_markup.submit().wait() is None

    state = phished(return_state=True)
    fr = state.state_details.flow_run_id
    (tr,) = task_runs(fr)
    assert tr.state is not None and tr.state.is_failed()
    (art,) = artifacts_of(tr.id)
    (keyed,) = [a for a in of_flow_run(fr) if a.key]
    written = [art.description or "", keyed.description or ""]
    written += [v for a in (art, keyed) for row in _rows(a) for v in row.values()]
    live = [(text, found) for text in written if (found := live_markup(text))]
    assert not live, live
    (error,) = [r["value"] for r in _rows(art) if r["field"] == "error"]
    assert rendered(error) == f"ValueError: {ht.PHISHING}"[: CELL - 1] + "…"  # as the task wrote it, cut
    assert rendered(error)[:-1] in rendered(art.description or "")
    assert any(ht.PHISHING in x.message for x in logs(task_run_id=tr.id)), "the full text: in the logs"
