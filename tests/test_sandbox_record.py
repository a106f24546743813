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
