"""The artifacts a flow run's sandbox nodes leave, read back from the session's Prefect API
as the Artifacts page and a task run's Artifacts tab read them. Prefect glue only: the
process runtime (no isolation needed to show what is published)."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
from flows import hostile_tasks as ht
from flows import sample_flows as sf
from prefect import flow
from support.prefect_readback import artifacts_of, client, task_runs

from guest_runner.conduit import LocalConduit
from prefect_resoluto import ResolutoTaskRunner

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect")]
FLOWS = Path(sf.__file__).parent
SECRET = "art-secret-5521"


def _rows(artifact) -> list[dict[str, str]]:
    return json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data


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


def test_a_mapped_flow_leaves_one_keyed_table_and_a_table_per_task_run(tmp_path):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    conduit = LocalConduit(tmp_path / "conduit")

    @flow(
        task_runner=ResolutoTaskRunner(
            runtime="process",
            min_isolation="none",
            conduit=conduit,
            workspace=FLOWS,
            outputs_dir=tmp_path / "outputs",
            secret_env={"ART_SECRET": SECRET},
            warm_pool=0,
        )
    )
    def mapped():
        squares = sf.square.map([1, 2, 3])
        retried = sf.fail_on_first_attempt.submit()
        failed = sf.fail_with.submit(f"bad input {SECRET}")
        failed.wait()
        return [s.result() for s in squares], retried.result(), failed.state.is_failed()

    state = mapped(return_state=True)
    values, retried, failed = state.result()
    assert values == [1, 4, 9] and failed and retried.endswith(".2")
    fr = state.state_details.flow_run_id

    with client() as c:
        of_run = c.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr]))
        )
        flow_run = c.read_flow_run(fr)
    keyed = sorted((a for a in of_run if a.key), key=lambda a: a.created)
    assert {a.key for a in keyed} == {f"resoluto-{flow_run.name}-{str(fr).replace('-', '')[-8:]}"}
    assert all(a.task_run_id is None for a in keyed), "the flow run's table belongs to the flow run"
    assert len(keyed) == 1, "written once, when the flow run ended: not a version per node"
    final = _rows(keyed[-1])
    assert len(final) == 6, final  # 3 squares, 2 attempts, 1 failure: a row per node
    by_status = sorted((r["task run"], r["attempt"], r["status"], r["error"]) for r in final)
    failures = [r for r in by_status if r[2] != "success"]
    # The sandbox's words are inert markdown (tests/test_artifacts.py's link test): escaped.
    assert [f[3] for f in failures if f[3].startswith("ValueError")] == [r"ValueError\: bad input \*\*\*"]
    assert any(f[3] == r"RuntimeError\: first attempt fails on purpose" and f[1] == "1" for f in failures)
    assert keyed[-1].description == "6 sandbox node(s), 4 succeeded, 2 failed (RuntimeError, ValueError)"

    # A failed attempt's task run: its own unkeyed table; a successful attempt leaves none.
    runs = task_runs(fr)
    assert len(runs) == 5
    per_task = {tr.name: sorted(artifacts_of(tr.id), key=lambda a: a.created) for tr in runs}
    descriptions = [a.description for arts in per_task.values() for a in arts]
    assert len(descriptions) == 2 and all(": failure (workload)" in d for d in descriptions), descriptions
    assert all(a.key is None for arts in per_task.values() for a in arts)
    (bad,) = [tr for tr in runs if tr.name.startswith("fail_with")]
    (art,) = per_task[bad.name]
    rows = {r["field"]: r["value"] for r in _rows(art)}
    assert rendered(rows["error"]) == "ValueError: bad input ***"
    assert art.description.startswith(
        f"{bad.name}, attempt 1: failure (workload): ValueError\\: bad input \\*\\*\\*"
    )
    assert rows["node prefix"] == f"run/{fr}/nodes/{bad.id}" and rows["conduit"] == conduit.url  # not clipped
    everything = json.dumps([_rows(a) for a in of_run]) + " ".join(str(a.description) for a in of_run)
    assert SECRET not in everything

    with client() as c:  # the Artifacts page: the latest version of each key, one for this run
        from prefect.client.schemas.filters import ArtifactFilterKey

        latest = c.read_latest_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[keyed[-1].key]))
        )
    assert len(latest) == 1 and latest[0].data == keyed[-1].data


@pytest.mark.sandbox
def test_a_tasks_error_is_no_live_link_or_image_in_the_runners_artifacts(gvisor, tmp_path):
    """Finding 5 (issue 39): a task raising a message in markdown put a live link ("click to
    approve") and a tracking image in the description of the table the runner writes on the
    task run, under the runner's name. Every text the sandbox wrote reads as written, inert."""
    conduit = LocalConduit(tmp_path / "conduit")

    @flow(
        task_runner=ResolutoTaskRunner(
            runtime="gvisor",
            conduit=conduit,
            workspace=FLOWS,
            outputs_dir=tmp_path / "outputs",
            memory="256Mi",
            warm_pool=0,
        )
    )
    def phished() -> bool:
        return ht.raise_markup.submit().wait() is None

    state = phished(return_state=True)
    fr = state.state_details.flow_run_id
    (tr,) = task_runs(fr)
    assert tr.state is not None and tr.state.is_failed()
    (art,) = artifacts_of(tr.id)
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with client() as c:
        (keyed,) = [
            a
            for a in c.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr]))
            )
            if a.key
        ]
    written = [art.description or "", keyed.description or ""]
    written += [v for a in (art, keyed) for row in _rows(a) for v in row.values()]
    live = [(text, found) for text in written if (found := live_markup(text))]
    assert not live, live
    (error,) = [r["value"] for r in _rows(art) if r["field"] == "error"]
    assert rendered(error) == f"ValueError: {ht.PHISHING}"  # shown as the task wrote it
    assert f"ValueError: {ht.PHISHING}" in rendered(art.description or "")
