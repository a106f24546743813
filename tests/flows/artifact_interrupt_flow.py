"""A flow interrupted (Ctrl-C from outside) while its task's node artifact is still queued.

argv[1]: ``pending`` (the publication is held until the SIGINT arrives, then goes ahead:
the exit must still publish it) or ``stuck`` (the publication never returns: the exit must
not hang on it). Prints ``TASK <task run id>`` once the task has returned, then waits for
the signal.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import sample_flows as sf  # the workspace module, next to this file
from prefect import flow

from prefect_resoluto import ResolutoTaskRunner
from prefect_resoluto.task_runner import node_artifacts as trm

MODE = sys.argv[1]
interrupted = threading.Event()
publishing = threading.Event()
_publish = trm.publish_node_table


def held_publish(*args: Any, **kwargs: Any) -> None:
    publishing.set()
    if MODE == "stuck":
        threading.Event().wait()  # an API that never answers
    interrupted.wait()
    _publish(*args, **kwargs)


def on_sigint(signum: int, frame: Any) -> None:
    interrupted.set()
    signal.default_int_handler(signum, frame)


trm.publish_node_table = held_publish


@flow(
    task_runner=ResolutoTaskRunner(
        runtime="process",
        min_isolation="none",
        warm_pool=0,
        summary_artifact=True,  # the runner's artifacts are opt-in
        conduit=os.environ["RESOLUTO_TEST_CONDUIT"],
        workspace=Path(__file__).parent,
    )
)
def interrupted_with_a_pending_artifact() -> None:
    fut = sf.fail_with.submit("on purpose")  # a failed task run: its node's table on it
    fut.wait()
    assert fut.state.is_failed()
    publishing.wait()
    print(f"TASK {fut.task_run_id}", flush=True)
    threading.Event().wait()  # until Ctrl-C


if __name__ == "__main__":
    signal.signal(signal.SIGINT, on_sigint)
    interrupted_with_a_pending_artifact()
