"""What a Solari session's state means for its node (no request: the session's loop observed it).

The one side effect: a node held for admission says so once in the task run's logs, and
once more when a slot frees, so a user waiting on a busy organisation sees why.
"""

from __future__ import annotations

import logging
import time

from prefect_resoluto.runtimes.base import SandboxStatus
from prefect_resoluto.runtimes.solari.session import Session

logger = logging.getLogger(__name__)


def session_status(s: Session, base_url: str | None) -> SandboxStatus:
    if s.unstartable:
        return SandboxStatus("pending", unstartable=True, reason=s.unstartable)
    if s.lost:
        return SandboxStatus("unknown", gone=True, infrastructure=True, reason=s.lost)
    if s.state == "admission":
        if s.waiting_since is not None:
            waited = time.monotonic() - s.waiting_since
            if not s.waiting_logged:
                s.waiting_logged = True
                task_log(
                    logging.WARNING,
                    f"waiting for a Solari slot: the organisation is at its session cap (429 from "
                    f"{base_url}); the node starts when a slot frees",
                )
            return SandboxStatus(
                "pending", reason=f"waiting for a Solari slot ({waited:.0f}s, {s.admission_waits} attempt(s))"
            )
        return SandboxStatus("pending", reason="creating the Solari sandbox")
    if s.waiting_logged:
        s.waiting_logged = False
        task_log(logging.INFO, f"a Solari slot freed: sandbox {s.gw_id} created")
    if s.state == "staging":
        return SandboxStatus("pending", reason=f"staging the guest runner into {s.gw_id}")
    if s.finished:
        if s.exited and s.exit_code not in (0, None):
            return SandboxStatus(
                "failed", exit_code=s.exit_code, reason=f"the guest exited with code {s.exit_code}"
            )
        if s.exited or (s.relay is not None and s.relay.done):
            return SandboxStatus("succeeded", exit_code=s.exit_code, reason="the guest command exited")
        if s.destroyed:
            return SandboxStatus("unknown", gone=True, reason=f"sandbox {s.gw_id} was destroyed")
        return SandboxStatus(
            "unknown",
            gone=True,
            infrastructure=True,
            reason=f"the Solari session {s.gw_id} ended without an exit",
        )
    return SandboxStatus("running", reason=f"Solari sandbox {s.gw_id}")


def task_log(level: int, message: str) -> None:
    """Into the task run's logs when called from a task run's thread (status() is), else ours."""
    try:
        from prefect.context import TaskRunContext
        from prefect.logging import get_run_logger

        if TaskRunContext.get() is not None:
            get_run_logger().log(level, message)
            return
    except Exception:  # no Prefect, or no run context: the module logger will do
        pass
    logger.log(level, message)
