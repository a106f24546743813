"""Warm sandboxes through ResolutoTaskRunner on gVisor, against a real Prefect API.

The pool serves one node per sandbox, says warm or cold in the task's log, holds a
submission with other settings to its own limits, and leaves no sandbox behind: at
runner exit, on a failure elsewhere in the flow, on Ctrl-C, on cancellation of a
deployment run (each checked by the runtime's own listing).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flows import pool_tasks as pt
from flows import real_prefect_tasks as rp
from prefect import flow, task
from support.polling import scaled, wait_for
from support.prefect_cli import flow_child_env
from support.prefect_readback import task_runs
from test_task_runner import FLOWS, logs_of, no_orphans, runner

from guest_runner import wire
from guest_runner.conduit import LocalConduit
from prefect_resoluto import sandbox_options
from prefect_resoluto.runtimes import get_runtime
from prefect_resoluto.runtimes._guest_layout import records
from prefect_resoluto.warm.pool import LABEL_WARM

pytestmark = [pytest.mark.prefect, pytest.mark.sandbox, pytest.mark.usefixtures("prefect")]


@pytest.fixture
def conduit(tmp_path: Path) -> LocalConduit:
    return LocalConduit(tmp_path / "conduit")


def sandbox_line(task_run_id) -> str:
    """How the task run's (last) node got its sandbox, in the warm pool's words
    (``warm sandbox rsl-... (waited ...)``, ``cold sandbox (warm pool off)``): read from the
    runner's line in the task run's logs (``ran in a warm gVisor sandbox rsl-... (...) in
    0.3 s: succeeded``), what a user sees by default."""
    import re

    lines = [x.message for x in logs_of(task_run_id) if x.message.startswith("ran in a ")]
    if not lines:
        raise AssertionError(f"no runner line in the logs of task run {task_run_id}")
    m = re.fullmatch(r"ran in a (warm|cold) \S+ sandbox (.*) in \d+\.\d s: .*", lines[-1])
    if m is None:
        raise AssertionError(f"not a runner line: {lines[-1]!r}")
    return f"{m[1]} sandbox {m[2]}"


def wait_ready() -> None:
    """In a flow: until the live runner's pool has a ready sandbox of every key it warms."""
    from prefect.context import FlowRunContext

    pool = FlowRunContext.get().task_runner._pool
    wait_for(
        lambda: pool._wanted and all(pool.ready_count(k) for k in pool._wanted),
        timeout=120,
        what="a ready warm sandbox",
    )


def idle_warm(rt) -> list[str]:
    return [r.id for r in records(rt.state) if r.labels.get(LABEL_WARM) == "idle"]


def test_a_one_task_flow_starts_two_warm_sandboxes_not_four(gvisor, conduit, tmp_path, monkeypatch):
    """The runner's pool, at its default size: one sandbox ready for the first task and one
    more for a second task if it comes. It restored four (two ahead plus one per node in
    flight), three discarded unused at every one-task flow's end."""
    from prefect_resoluto.warm.pool import WarmPool

    launched: list[str] = []
    launch = WarmPool._launch

    def counted(self, key):
        w = launch(self, key)
        if w is not None:
            launched.append(w.handle.id)
        return w

    monkeypatch.setattr(WarmPool, "_launch", counted)

    @flow(task_runner=runner(conduit, tmp_path))
    def one_task() -> int:
        wait_ready()  # the key's image is made, as a flow run after an earlier one finds it
        return pt.same.submit(7).result()

    state = one_task(return_state=True)
    assert state.result() == 7
    (tr,) = task_runs(state.state_details.flow_run_id)
    line = sandbox_line(tr.id)
    assert line.startswith("warm sandbox rsl-"), line
    assert line.split()[2] in launched
    assert len(launched) <= 2, launched
    no_orphans()


def test_sequential_tasks_get_warm_sandboxes_and_never_share_one(gvisor, conduit, tmp_path):
    @flow(task_runner=runner(conduit, tmp_path, warm_pool=2))
    def three_in_a_row() -> list[bool]:
        out = [pt.mark_tmp.submit().result()]
        for _ in range(2):
            wait_ready()  # a ready one is what a warm node takes; booting ones are left alone
            out.append(pt.mark_tmp.submit().result())
        return out

    state = three_in_a_row(return_state=True)
    assert state.is_completed(), state
    assert state.result() == [False, False, False]  # no task saw another's /tmp
    runs = task_runs(state.state_details.flow_run_id)
    lines = [sandbox_line(r.id) for r in runs]
    # The first may find the pool still empty; later ones find a ready one.
    assert all("warm sandbox rsl-" in line for line in lines[1:]), lines
    assert all("waited" in line or "looked for" in line for line in lines), lines
    no_orphans()  # the idle ones went at runner exit
    files = [p.relative_to(conduit.root).as_posix() for p in conduit.root.rglob("*") if p.is_file()]
    files = [f for f in files if not f.startswith(wire.HOSTS + "/")]  # the host's heartbeat (decision 0017)
    fr = str(state.state_details.flow_run_id)
    assert files and all(f.startswith(f"run/{fr}/") for f in files), files


def test_warm_pool_zero_runs_every_node_cold(gvisor, conduit, tmp_path):
    @flow(task_runner=runner(conduit, tmp_path, warm_pool=0))
    def cold() -> bool:
        return pt.mark_tmp.submit().result()

    state = cold(return_state=True)
    assert state.is_completed(), state
    [run] = task_runs(state.state_details.flow_run_id)
    assert "cold sandbox (warm pool off)" in sandbox_line(run.id)
    no_orphans()


def test_a_key_mismatch_is_held_to_its_own_memory_limit(gvisor, conduit, tmp_path):
    @flow(task_runner=runner(conduit, tmp_path, warm_pool=1))
    def limited() -> tuple[int, str]:
        fine = pt.hog.submit(300).result()
        with sandbox_options(memory="256Mi"):
            try:
                pt.hog.submit(300).result()
                limited_result = "not limited"
            except Exception as e:
                limited_result = f"{type(e).__name__}: {e}"
        return fine, limited_result

    state = limited(return_state=True)
    assert state.is_completed(), state
    fine, limited_result = state.result()
    assert fine == 300
    assert "not limited" not in limited_result
    assert "memory" in limited_result.lower() or "killed" in limited_result.lower(), limited_result
    no_orphans()


def test_a_failure_elsewhere_in_the_flow_destroys_idle_warm_sandboxes(gvisor, conduit, tmp_path):
    rt = get_runtime("gvisor")

    @task
    def host_side_failure():
        raise RuntimeError("the flow breaks")

    @flow(task_runner=runner(conduit, tmp_path, warm_pool=2))
    def breaks():
        wait_for(lambda: idle_warm(rt), timeout=60, what="a warm sandbox")
        host_side_failure()

    state = breaks(return_state=True)
    assert state.is_failed()
    no_orphans()
    # A warm sandbox never assigned leaves nothing (the host's heartbeat is the host's: decision 0017).
    assert [p for p in conduit.root.iterdir() if p.name != wire.HOSTS] == []


def test_a_real_prefect_modules_nodes_share_one_image_and_wait_for_it_not_boot_it_each(
    gvisor, conduit, tmp_path, monkeypatch
):
    """A module needing the real Prefect, on a host with no image for it yet: a 3-way map,
    then a chain of two. Every node runs in a sandbox restored from the module's one image,
    with Prefect pre-imported (none booted cold to import Prefect itself while the image was
    being made, none taking a sandbox without the imports), and the first call's report of
    what it loaded (Prefect's own dependencies) makes no second key and image. Before: each
    of a flow's six real-Prefect nodes paid the import, and three images were made."""
    import json

    images = tmp_path / "images"
    monkeypatch.setenv("RESOLUTO_WARM_IMAGES", str(images))

    @flow(task_runner=runner(conduit, tmp_path))
    def real() -> list:
        from prefect_resoluto.warm import pool

        assert pool.needs_real_prefect(rp.__file__)
        mapped = [f.result() for f in rp.has_variables.map(range(3))]
        return [*mapped, rp.has_variables.submit(3).result(), rp.main_was_preloaded.submit().result()]

    state = real(return_state=True)
    assert state.is_completed(), state
    # the last: a warm call had Prefect's logging set-up (prefect.main) done before the module loaded
    assert state.result() == ["Variable"] * 4 + [True]
    runs = task_runs(state.state_details.flow_run_id)
    lines = [sandbox_line(r.id) for r in runs]
    assert len(lines) == 5 and all(x.startswith("warm sandbox rsl-") for x in lines), lines
    assert not [x for x in lines if "without the module's imports" in x], lines
    made = [json.loads(m.read_text())["key"] for m in images.glob("gvisor/*/meta.json")]
    with_imports = [k["imports"] for k in made if k["imports"]]
    assert len(with_imports) == 1 and "prefect.variables" in with_imports[0], made
    no_orphans()


def test_ctrl_c_destroys_idle_warm_sandboxes_too(gvisor, tmp_path):
    state = tmp_path / "state"
    env = flow_child_env(tmp_path, RESOLUTO_TEST_WARM_POOL="2")
    proc = subprocess.Popen(
        [sys.executable, str(FLOWS / "interruptible_flow.py")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    rt = get_runtime("gvisor", state_dir=state)
    try:
        deadline = time.monotonic() + scaled(120)
        while not (len(rt.list_ids()) >= 3 and idle_warm(rt)):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the sandboxes never started"
            time.sleep(0.05)  # polling the runtime's own listing
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=scaled(90))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rt.list_ids() == [] and rt.containers() == []


def test_cancelling_a_deployment_run_destroys_idle_warm_sandboxes(gvisor, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling
    from test_deployments import serve, stop

    state_dir = tmp_path / "state"
    server, _ = serve(
        tmp_path, tmp_path / "conduit", RESOLUTO_STATE_DIR=str(state_dir), RESOLUTO_TEST_WARM_POOL="2"
    )
    rt = get_runtime("gvisor", state_dir=state_dir)
    try:
        run = run_deployment(
            "served-sandboxed/every-few-seconds", parameters={"count": 2, "linger": 300}, timeout=0
        )
        deadline = time.monotonic() + scaled(180)
        while not (len(rt.list_ids()) >= 3 and idle_warm(rt)):
            assert time.monotonic() < deadline, "the run's sandboxes never started"
            time.sleep(0.1)  # polling the runtime's own listing
        with get_client(sync_client=True) as c:
            c.set_flow_run_state(run.id, Cancelling(), force=True)
            while True:
                fr = c.read_flow_run(run.id)
                if fr.state.type in (StateType.CANCELLED, StateType.CRASHED, StateType.FAILED):
                    break
                assert time.monotonic() < deadline + 60, f"the run was never cancelled: {fr.state}"
                time.sleep(0.2)  # polling the API for the cancellation
        assert fr.state.type == StateType.CANCELLED, fr.state
        while rt.list_ids() and time.monotonic() < deadline + 90:
            time.sleep(0.1)  # the flow-run process reaps on its way out
        assert rt.list_ids() == [] and rt.containers() == []
    finally:
        stop(server)


def test_a_module_s_imports_are_learned_from_its_first_node(gvisor, conduit, tmp_path):
    """The first node reports the installed packages it imported; the next warm sandboxes
    for that module import them before their assignment (seen from the task itself), and
    never the workspace's own modules."""
    from flows import learned_tasks as lt

    @flow(task_runner=runner(conduit, tmp_path, warm_pool=1))
    def learned() -> list[dict[str, bool]]:
        first = lt.import_late.submit().result()
        from prefect.context import FlowRunContext

        pool = FlowRunContext.get().task_runner._pool
        wanted = pool.learned.imports_for(lt.__file__)
        assert "jsonschema" in wanted and not any(
            m.startswith(("pool_tasks", "learned_tasks")) for m in wanted
        )
        wait_ready()
        # The pool warms the learned kind when a node first asks for it; until one is
        # ready, a warm sandbox without the imports serves (not a cold one).
        second = lt.import_late.submit().result()
        wait_ready()
        return [first, second, lt.import_late.submit().result()]

    state = learned(return_state=True)
    assert state.is_completed(), state
    first, second, third = state.result()
    assert first == {"jsonschema": False, "pool_tasks": False}
    assert third == {"jsonschema": True, "pool_tasks": False}
    runs = task_runs(state.state_details.flow_run_id)
    assert "warm sandbox rsl-" in sandbox_line(runs[1].id)
    assert "warm sandbox rsl-" in sandbox_line(runs[-1].id) and "without" not in sandbox_line(runs[-1].id)
    no_orphans()


def test_a_hostile_calls_import_list_never_reaches_the_next_sandbox(gvisor, conduit, tmp_path):
    """A call reports real Prefect, ``unittest.__main__``, ``antigravity``, ``this`` and 200
    made-up names as its imports: none is learned (the host keeps only installed modules it
    can vouch for, never Prefect or a __main__), the next warm sandbox for the module
    pre-imports none of them, and an honest call still teaches jsonschema afterwards."""
    from flows import learned_tasks as lt

    @flow(task_runner=runner(conduit, tmp_path, warm_pool=1))
    def hostile() -> tuple[tuple[str, ...], dict[str, bool], tuple[str, ...]]:
        lt.report_hostile_imports.submit().result()
        from prefect.context import FlowRunContext

        pool = FlowRunContext.get().task_runner._pool
        after_hostile = pool.learned.imports_for(lt.__file__)
        wait_ready()
        seen = lt.hostile_preloaded.submit().result()
        lt.import_late.submit().result()
        return after_hostile, seen, pool.learned.imports_for(lt.__file__)

    state = hostile(return_state=True)
    assert state.is_completed(), state
    after_hostile, seen, after_honest = state.result()
    assert not set(after_hostile) & set(lt.HOSTILE_IMPORTS), after_hostile
    assert seen == dict.fromkeys(lt.HOSTILE_IMPORTS[:4], False)
    assert "jsonschema" in after_honest and not set(after_honest) & set(lt.HOSTILE_IMPORTS)
    no_orphans()


def test_a_zygote_call_holds_nothing_of_the_node_from_before_its_assignment(gvisor, conduit, tmp_path):
    """The warm guest forks the call before it reads its assignment: the child's first
    environment is the sandbox's boot environment (no node id, no secret), the secret
    reaches it after the fork, and it holds no descriptor but its own stdio."""
    from flows import learned_tasks as lt

    @flow(task_runner=runner(conduit, tmp_path, warm_pool=1, secret_env={"POOL_SECRET": "zygote-s3cr3t-9f2"}))
    def zygote() -> dict[str, object]:
        wait_ready()
        return lt.call_process.submit().result()

    state = zygote(return_state=True)
    assert state.is_completed(), state
    got = state.result()
    runs = task_runs(state.state_details.flow_run_id)
    assert "warm sandbox rsl-" in sandbox_line(runs[-1].id)
    assert "guest_runner.warm" in got["cmdline"], got[
        "cmdline"
    ]  # forked from the guest, not a new interpreter
    assert got["secret_now"] and not got["secret_in_first_env"] and not got["node_in_first_env"], got
    assert not [n for n in got["first_env_names"] if n.startswith("AWS_") or n == "POOL_SECRET"], got
    assert set(got["fds"]) <= {0, 1, 2, 3}, got["fds"]  # 3: the listing's own directory
    no_orphans()


def test_tasks_whose_warm_sandboxes_are_reaped_before_their_assignment_all_complete(
    gvisor, conduit, tmp_path
):
    """Issue 39: a warm sandbox the pool lost between a task's pick and its assignment failed
    the task (SandboxUnstartable: "... is not a warm sandbox waiting for an assignment").
    Six tasks at once against a pool of two, which refills meanwhile; the first sandbox any
    of them is about to be assigned is reaped right then (the race's window, forced): every
    task completes, within its one launch (no infrastructure re-launch, nothing failed)."""
    reaped: list[str] = []
    rt = get_runtime("gvisor")

    def reaper(w) -> None:
        if not reaped:
            reaped.append(w.handle.id)
            rt.destroy(w.handle)

    @flow(task_runner=runner(conduit, tmp_path, warm_pool=2, max_workers=6))
    def crowded() -> list[bool]:
        wait_ready()
        from prefect.context import FlowRunContext

        FlowRunContext.get().task_runner._pool.before_assign = reaper
        futures = [pt.mark_tmp.submit() for _ in range(6)]
        return [f.result() for f in futures]

    state = crowded(return_state=True)
    assert state.is_completed(), state
    assert state.result() == [False] * 6
    assert reaped, "no warm sandbox was reaped: the race was never run"
    runs = task_runs(state.state_details.flow_run_id)
    assert len(runs) == 6 and all(r.state.is_completed() for r in runs)
    said = [log.message for r in runs for log in logs_of(r.id)]
    assert not [m for m in said if "re-launching" in m or "could not start" in m], said
    no_orphans()


def test_a_map_takes_one_restore_per_task_and_restores_little_past_its_end(
    gvisor, conduit, tmp_path, monkeypatch
):
    """Issue 42: a 50-way map booted 20 of its nodes cold (each waited a second for a restore,
    then booted its own: twice a restore's CPU) and the pool kept restoring two ahead per node
    in flight to the end, discarded unused at exit. Now the runner's submitted tasks size the
    restores: each task of a map runs in a sandbox restored for it, and past its end one at
    most is restored."""
    from prefect_resoluto.runtimes.gvisor import GVisorRuntime
    from prefect_resoluto.warm.pool import AHEAD_DRAINED

    restored: list[str] = []
    restore = GVisorRuntime.restore

    def counted(self, spec, image, wake=b""):
        handle = restore(self, spec, image, wake)
        restored.append(handle.id)
        return handle

    @flow(task_runner=runner(conduit, tmp_path))
    def mapped() -> list[int]:
        wait_ready()  # the key's image is made, as a flow run after an earlier one finds it
        monkeypatch.setattr(GVisorRuntime, "restore", counted)
        return [f.result() for f in pt.same.map(range(8))]

    state = mapped(return_state=True)
    assert state.is_completed(), state
    assert state.result() == list(range(8))
    lines = [sandbox_line(r.id) for r in task_runs(state.state_details.flow_run_id)]
    assert all(line.startswith("warm sandbox rsl-") for line in lines), lines
    served = {line.split()[2] for line in lines}
    assert len(served) == 8  # one sandbox per task
    # The idle ones restored before the map (wait_ready) served it too; after it, one at
    # most is kept for a next stage (AHEAD_DRAINED), not the lookahead per node in flight.
    assert len(set(restored) - served) <= AHEAD_DRAINED, (restored, lines)
    no_orphans()
