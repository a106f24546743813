"""A worker's flow runs on gVisor restored from a snapshot of Prefect's imported engine
(prefect_resoluto/warm/flow_run_images.py), end to end: a real `prefect worker start`
process, deployments on its pool, evidence from the API, the conduit, the image on disk
and the runtime's own listing.

The first flow run of a kind boots while its image is made; the runs after it are
restored into a network made for them, and must behave as a booted one does: reach the
run's API gateway and nothing else, see their own settings, secrets and ids, leave
nothing behind -- and the image must hold nothing of any run.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.polling import wait_for
from test_worker import (
    Worker,
    create_pool,
    deploy,
    facts,
    final_run,
    gone,
    logs_with,
    needs_egress,
    run_logs,
    running_worker,
    sandbox_ids,
    schedule,
    started,
)

from prefect_resoluto.egress import netns

pytestmark = [pytest.mark.prefect, pytest.mark.sandbox, pytest.mark.usefixtures("prefect"), needs_egress]
GVISOR = {"runtime": "gvisor", "min_isolation": "user-kernel", "memory": "1Gi"}
SECRET = "restored-secret-4410"


@pytest.fixture(scope="module")
def snapshot_worker(prefect_api: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A worker of its own (its own state directory: no image exists before its first run)."""
    from prefect_resoluto.runtimes import get_runtime

    if not get_runtime("gvisor").availability().ok:
        pytest.skip("gVisor is not available here")
    tmp = tmp_path_factory.mktemp("snapshot-worker")
    with running_worker(create_pool(cli=False), tmp) as w:
        yield w


def engine_images(state: Path) -> list[Path]:
    """Committed images of flow-run (engine) templates in the worker's gVisor state."""
    root = state / "gvisor" / "snapshots"
    found = []
    for meta in root.glob("*/meta.json") if root.is_dir() else []:
        try:
            if json.loads(meta.read_text())["key"].get("engine"):
                found.append(meta.parent)
        except (OSError, ValueError, KeyError):
            continue
    return found


def restored_run(worker: Worker, dep: str, **parameters: Any) -> Any:
    """A run of ``dep`` once the kind's image exists: the first run boots and has it made."""
    if not engine_images(worker.state_dir):
        first = schedule(dep, marker="boots")
        fr = final_run(first.id, worker)
        assert fr.state.is_completed(), (fr.state, worker.output()[-6000:])
        logs_with(first.id, "snapshot image is being made")
        wait_for(
            lambda: engine_images(worker.state_dir),
            timeout=600,
            what="the flow-run template's image",
            max_delay=1.0,
        )
    return schedule(dep, **parameters)


def restored_lingering_run(worker: Worker, tmp_path: Path) -> tuple[Any, str]:
    """A restored run of a 600 s flow, started: (the run, its sandbox's id)."""
    dep = deploy(worker.pool, "worker_flows.py:linger", tmp_path / "conduit", **GVISOR)
    run = restored_run(worker, dep, seconds=600)
    started(run.id)
    logs_with(run.id, "restored sandbox")
    (sandbox,) = sandbox_ids(worker.state_dir, "gvisor", run.id)
    return run, sandbox


def test_a_flow_run_restored_from_the_engine_snapshot_runs_as_a_booted_one(
    gvisor: Any, tmp_path: Path, snapshot_worker: Worker
) -> None:
    from prefect.blocks.system import Secret

    worker = snapshot_worker
    block_id = Secret(value={"WORKER_TEST_SECRET": "never-shown-7731"}).save(f"snap-{uuid.uuid4().hex[:6]}")
    dep = deploy(
        worker.pool,
        "worker_flows.py:where_am_i",
        tmp_path / "conduit",
        secret_env_block={"$ref": {"block_document_id": str(block_id)}},
        **GVISOR,
    )
    run = restored_run(worker, dep, marker="restored")
    fr = final_run(run.id, worker)
    assert fr.state.is_completed(), (fr.state, worker.output()[-6000:])
    logs = logs_with(run.id, "restored sandbox")
    f = facts(run.id)
    # Its own ids, its own secret, the API through the run's gateway, gVisor's own stack.
    assert f["run_id"] == str(run.id) and f["node_id"].startswith("flow-run-"), f
    assert f["secret_seen"] is True, f
    assert f["api_url"].startswith("http://prefect-api.resoluto.internal:"), f
    assert "lo" in f["interfaces"] and len(f["interfaces"]) <= 2, f
    (line,) = [m for m in logs if "restored sandbox" in m]
    sandbox = line.split("restored sandbox ", 1)[1].split()[0]
    assert all("never-shown-7731" not in m for m in run_logs(run.id))
    assert "never-shown-7731" not in worker.output()
    # The worker's console tells what helps (issue 34): no runpy warning about the engine
    # imported ahead, the allowed egress (the API's connections) at DEBUG, a "View at" link
    # to the UI the worker knows, not to the gateway's internal name.
    out = worker.output()
    assert "'prefect.engine' found in sys.modules" not in out, out[-6000:]
    assert "egress allowed" not in out, out[-6000:]
    views = [line for line in out.splitlines() if "View at " in line]  # console only, not the API
    assert views and all("resoluto.internal" not in m for m in views), views
    # Nothing left: the runtime's listing, runsc's containers, the sandbox's namespace.
    wait_for(
        lambda: sandbox_ids(worker.state_dir, "gvisor", run.id) == [],
        timeout=60,
        what="the restored run's sandbox to go",
    )
    from prefect_resoluto.runtimes import get_runtime

    rt = get_runtime("gvisor", state_dir=worker.state_dir)
    assert [c["id"] for c in rt.containers()] == [], rt.containers()  # type: ignore[attr-defined]
    assert f"{netns.SANDBOX_PREFIX}{sandbox}" not in netns.list_namespaces()
    # The image was made before any run it served: no run id, no node id, no secret in it.
    (image,) = engine_images(worker.state_dir)
    for p in image.iterdir():
        data = p.read_bytes()
        for needle in (str(run.id), f["node_id"], "never-shown-7731"):
            assert needle.encode() not in data, f"{needle!r} found in {p}"


def test_cancelling_a_restored_flow_run_destroys_its_sandbox(
    gvisor: Any, tmp_path: Path, snapshot_worker: Worker
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    worker = snapshot_worker
    run, sandbox = restored_lingering_run(worker, tmp_path)
    with get_client(sync_client=True) as c:
        c.set_flow_run_state(run.id, Cancelling(), force=True)
    fr = final_run(run.id, worker, timeout=120)
    assert fr.state.is_cancelled(), fr.state
    assert gone(worker.state_dir, "gvisor", sandbox, None), "the restored sandbox outlived the cancellation"
    assert f"{netns.SANDBOX_PREFIX}{sandbox}" not in netns.list_namespaces()


def test_a_corrupt_engine_image_is_discarded_with_a_warning_the_run_boots_and_a_new_one_is_made(
    gvisor: Any, tmp_path: Path, snapshot_worker: Worker
) -> None:
    worker = snapshot_worker
    dep = deploy(worker.pool, "worker_flows.py:where_am_i", tmp_path / "conduit", **GVISOR)
    first = restored_run(worker, dep, marker="before")  # an image exists from here on
    assert final_run(first.id, worker).state.is_completed()
    (image,) = engine_images(worker.state_dir)
    pages = max((p for p in image.iterdir() if p.name != "meta.json"), key=lambda p: p.stat().st_size)
    with open(pages, "r+b") as f:  # one byte of the image changed: its digest no longer matches
        f.seek(pages.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    run = schedule(dep, marker="after-corruption")
    fr = final_run(run.id, worker)
    assert fr.state.is_completed(), (fr.state, worker.output()[-6000:])
    logs_with(run.id, "booted (its snapshot image is being made")
    assert f"discarding the warm-sandbox image {image}" in worker.output(), worker.output()[-4000:]
    assert facts(run.id)["run_id"] == str(run.id)
    wait_for(
        lambda: (
            engine_images(worker.state_dir)
            and engine_images(worker.state_dir) != [image]
            or (image.exists() and engine_images(worker.state_dir) == [image] and _intact(image))
        ),
        timeout=600,
        what="a new image in place of the corrupt one",
        max_delay=1.0,
    )


def _intact(image: Path) -> bool:
    from prefect_resoluto.warm.snapshots import _image_digest

    try:
        return json.loads((image / "meta.json").read_text())["sha256"] == _image_digest(image)
    except (OSError, ValueError, KeyError):
        return False


def test_stopping_the_worker_destroys_a_restored_run_and_leaves_only_the_image(
    gvisor: Any, tmp_path: Path, snapshot_worker: Worker
) -> None:
    """Last in this module: it stops the module's worker."""
    from prefect.client.orchestration import get_client

    from prefect_resoluto.runtimes import get_runtime

    worker = snapshot_worker
    run, sandbox = restored_lingering_run(worker, tmp_path)
    worker.stop()
    with get_client(sync_client=True) as c:
        fr = c.read_flow_run(run.id)
    assert fr.state.is_crashed() and "worker stopped" in (fr.state.message or ""), fr.state
    rt = get_runtime("gvisor", state_dir=worker.state_dir)
    assert rt.list_ids() == [] and rt.containers() == [], worker.output()[-4000:]  # type: ignore[attr-defined]
    assert f"{netns.SANDBOX_PREFIX}{sandbox}" not in netns.list_namespaces()
    snapshots = worker.state_dir / "gvisor" / "snapshots"
    assert [p.name for p in snapshots.iterdir() if p.name.startswith(".tmp-")] == []
    assert engine_images(worker.state_dir), "the image outlives the worker: the next one restores from it"
