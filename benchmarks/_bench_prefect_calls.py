"""Tasks for the ``prefect_calls`` figure: one that does what a reporting task does with
Prefect's API (two artifacts, an allowed variable and Secret block read), and one that does
nothing, for the sandboxes' own cost."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.blocks.system import Secret
from prefect.variables import Variable


@task
def report(i: int) -> str:
    region = Variable.get("bench-region")
    token = Secret.load("bench-token").get()
    create_markdown_artifact(f"# Report {i}\n\nregion {region}", key=f"report-{i}", description="report")
    create_table_artifact([{"i": i, "sq": i * i}], key=f"table-{i}")
    return f"{region}:{len(token)}"


@task
def plain(i: int) -> str:
    return f"eu-bench:{i}"
