"""A ready-made task that runs a command in a sandbox and returns what it did."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import task

from prefect_resoluto.node.outcome import NodeOutcome, WorkloadFailed
from prefect_resoluto.task_runner.holds import KeptOutput, describe


@dataclass
class CommandResult:
    argv: list[str]
    exit_code: int | None
    output: str
    files: dict[str, Path] = field(default_factory=dict)
    output_dir: Path | None = None
    node_id: str = ""
    conduit_prefix: str = ""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class CommandFailed(WorkloadFailed):
    def __init__(self, result: CommandResult, outcome: NodeOutcome) -> None:
        tail = "\n".join(result.output.splitlines()[-20:])
        super().__init__(
            f"command {result.argv!r} exited with code {result.exit_code} in sandbox node {result.node_id}"
            + (f"\n--- last output ---\n{tail}" if tail else ""),
            outcome,
        )
        self.result = result


def _run_command(
    argv: list[str],
    output_paths: list[str] | None = None,
    env: dict[str, str] | None = None,
    secret_env: dict[str, str] | None = None,
    check: bool = True,
) -> CommandResult:
    from prefect_resoluto.task_runner.runner import active_runner

    active = active_runner()
    if active is None:
        raise RuntimeError(
            "run_command runs its command in a sandbox and needs the flow's task runner to be "
            "ResolutoTaskRunner: @flow(task_runner=ResolutoTaskRunner(...))"
        )
    runner, overrides = active
    cfg = runner.config.replace(**overrides)
    cfg = cfg.replace(
        output_paths=list(output_paths) if output_paths is not None else None, env=env, secret_env=secret_env
    )
    # The host keeps a bounded part of the output, however much the command writes.
    kept = KeptOutput(cfg.log_allowance_bytes)
    outcome = runner.run_node(task_name="run_command", argv=list(argv), cfg=cfg, line_sink=kept)
    if kept.dropped_lines:
        from prefect.logging import get_run_logger

        get_run_logger().warning(
            "%s of the command's output not kept in its result: the host keeps at most %.1f MiB "
            "of it, from its start and its end (setting log_allowance)",
            describe(kept.dropped_lines, kept.dropped_bytes),
            cfg.log_allowance_bytes / 2**20,
        )
    if outcome.infrastructure_failure:
        outcome.raise_for_failure()
    result = CommandResult(
        argv=list(argv),
        exit_code=outcome.exit_code,
        output=kept.text(),
        files=dict(outcome.output_files),
        output_dir=outcome.output_dir,
        node_id=outcome.node_id,
        conduit_prefix=outcome.conduit_prefix,
    )
    if check and not result.ok:
        raise CommandFailed(result, outcome)
    if not result.ok:
        logging.getLogger("prefect_resoluto").info("command exited %s (check=False)", result.exit_code)
    return result


_run_command.__resoluto_command__ = True  # type: ignore[attr-defined]

run_command: Any = task(name="run_command")(_run_command)
"""``run_command.submit(["make", "test"], output_paths=["reports/**"])`` -> CommandResult."""
