"""``prefect-resoluto render``: what one node would send, without a cluster or a gateway.

Kubernetes: the NetworkPolicy, Secret and Pod as YAML. Solari: the create request body
and the guest command as JSON. Secret values are redacted in both.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from prefect_resoluto.cli.common import EXIT_OK, UsageError
from prefect_resoluto.cli.plan import floor, plan_node

if TYPE_CHECKING:
    from prefect_resoluto.runtimes.base import SandboxRuntime


def render_runtime(args: argparse.Namespace, options: dict[str, Any]) -> SandboxRuntime:
    """The remote runtime to render for, built but never probed (no cluster needed)."""
    from prefect_resoluto.runtimes.base import IsolationTooWeak, check_isolation

    if args.runtime == "solari":
        from prefect_resoluto.runtimes.solari import SolariRuntime

        try:
            return SolariRuntime(**options)
        except (TypeError, ValueError) as e:
            raise UsageError(f"solari runtime: {e}") from None
    if (args.runtime or "kubernetes") != "kubernetes":
        raise UsageError(
            f"render only supports --runtime kubernetes or solari (got {args.runtime!r}); local "
            "runtimes have no objects to render"
        )
    try:
        from prefect_resoluto.runtimes.kubernetes import KubernetesRuntime
    except ImportError as e:
        raise UsageError(f"render needs the kubernetes runtime, which cannot be imported here: {e}") from None
    if args.image:
        options.setdefault("image", args.image)
    try:
        rt = KubernetesRuntime(**options)
    except (TypeError, ValueError) as e:
        raise UsageError(f"kubernetes runtime: {e}") from None
    try:
        check_isolation(rt, floor(args.min_isolation))
    except IsolationTooWeak as e:
        raise UsageError(str(e)) from None
    return rt


def main(args: argparse.Namespace) -> int:
    if args.runtime == "solari":
        return _render_solari(args)
    try:
        from prefect_resoluto.runtimes.kubernetes.render import render_yaml
    except ImportError as e:
        raise UsageError(
            f"render needs the kubernetes runtime's renderer (prefect_resoluto.runtimes.kubernetes.render), "
            f"which is not available here: {e}"
        ) from None
    from prefect_resoluto.node.spec import launch_spec

    plan = plan_node(args, render_runtime, fresh=False)
    launch = launch_spec(plan.spec, plan.conduit)  # exactly what drive_node would launch
    try:
        text = render_yaml(launch, plan.runtime)  # type: ignore[arg-type]
    except (ValueError, RuntimeError) as e:
        raise UsageError(f"cannot render: {plan.redactor.text(str(e))}") from None
    sys.stdout.write(plan.redactor.text(text))
    sys.stdout.flush()
    return EXIT_OK


def _render_solari(args: argparse.Namespace) -> int:
    """The create request body and the guest command the Solari runtime would send, as JSON."""
    from prefect_resoluto.node.spec import launch_spec

    plan = plan_node(args, render_runtime, fresh=False)
    launch = launch_spec(plan.spec, plan.conduit)
    try:
        doc = plan.runtime.render(launch)  # type: ignore[attr-defined]
    except (ValueError, RuntimeError) as e:
        raise UsageError(f"cannot render: {plan.redactor.text(str(e))}") from None
    sys.stdout.write(plan.redactor.text(json.dumps(doc, indent=2)) + "\n")
    sys.stdout.flush()
    return EXIT_OK
