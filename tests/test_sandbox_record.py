"""A sandbox's record (sandbox.json) is saved by whichever thread learns something first."""

from __future__ import annotations

import threading
from pathlib import Path

from prefect_resoluto.runtimes._guest_layout import RECORD_NAME, SandboxRecord


def test_concurrent_saves_of_one_record_never_fail_and_leave_one_whole_record(tmp_path: Path) -> None:
    # The node's status poll and the reaper both remember an exit: two savers of one record.
    rec = SandboxRecord(id="rsl-rec", runtime="process", labels={}, dir=str(tmp_path))
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def saver(code: int) -> None:
        mine = SandboxRecord(**{**rec.__dict__, "exit_code": code})
        start.wait()
        try:
            for _ in range(300):
                mine.save()
        except BaseException as e:  # the test's point: any failure of a save
            errors.append(e)

    threads = [threading.Thread(target=saver, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    saved = SandboxRecord.load(tmp_path)
    assert saved is not None and saved.exit_code in {0, 1, 2, 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == [RECORD_NAME]  # no temporary left behind


def test_a_launch_after_its_state_directory_was_removed_remakes_it(tmp_path: Path) -> None:
    # state_dir() makes the directory once per process (each node asks several times); a
    # directory removed since (a cleanup, a test's rm -rf) is made again by the next launch.
    import shutil
    import sys

    from prefect_resoluto.runtimes.base import LaunchSpec
    from prefect_resoluto.runtimes.process import ProcessRuntime

    rt = ProcessRuntime(state_dir=tmp_path / "state")
    for n in range(2):
        h = rt.launch(LaunchSpec(sandbox_id=f"rsl-remade{n}", env={}, command=[sys.executable, "-c", "pass"]))
        assert (tmp_path / "state" / "process" / f"rsl-remade{n}" / RECORD_NAME).is_file()
        rt.destroy(h)
        shutil.rmtree(tmp_path / "state")
    assert rt.list_ids() == []


def test_only_the_memory_controller_is_asked_for_oom_kills(tmp_path: Path) -> None:
    from prefect_resoluto.runtimes import _cgroup

    dirs = {}
    for controller in ("pids", "cpu,cpuacct", "memory,hugetlb"):
        d = tmp_path / controller / _cgroup.PARENT / "process-rsl-x"
        d.mkdir(parents=True)
        dirs[controller] = d
    # A file of that name elsewhere is not the kernel's: never read as an OOM kill.
    (dirs["pids"] / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    cg = _cgroup.Cgroup(dirs=[str(d) for d in dirs.values()], version=1)
    assert not cg.oom_killed()
    (dirs["memory,hugetlb"] / "memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n"
    )
    assert cg.oom_killed()
