"""Which flows are a sandboxed run's own: its deployment's flow, and the flows its deployment's
runs registered through a gateway.

A flow is only a name in Prefect, and ``POST /flows/`` an upsert: whoever names an existing
flow gets its id back. So the gateway never forwards the run's body there. It sends its own
``{"name", "labels": {REGISTERED_BY: <deployment id>}}`` with the worker's credential and
reads the answer: the flow is the run's when it is the run's own flow or when the API says
its mark is this deployment's. The mark lives in Prefect (every worker of the pool, and one
restarted, reads the same), it is written only by the insert that creates the flow (the
upsert leaves an existing flow's labels alone, and ``PATCH /flows`` changes tags only), and
a sandbox never chooses it. There is no check-then-create to race: whichever insert wins
names the flow's deployment, and the loser reads the winner's mark in its own answer.

An operator shares a flow with another deployment (a sub-flow several deployments call, or
one registered before the mark existed) by the flow's tag ``GRANT_TAG + <deployment id>``:
tags are changed with ``PATCH /flows/<id>``, which no sandboxed run may send.
"""

from __future__ import annotations

from typing import Any

from prefect_resoluto.worker.bodies import Refusal

__all__ = ["GRANT_TAG", "REGISTERED_BY", "flow_registration", "granted", "not_owned", "owns_flow"]

#: The label the gateway sets on a flow it creates: the deployment whose run registered it.
REGISTERED_BY = "resoluto.registered-by-deployment"

#: A flow tag (the operator's: ``PATCH /flows/<id>``) that makes the flow a deployment's too.
GRANT_TAG = "resoluto.deployment:"

_RULE = "own-flows"
#: Prefect's own bound on a name is its database column; a longer one is no engine's flow.
MAX_NAME = 1024


def flow_registration(body: Any, what: str, deployment_id: str | None) -> dict[str, Any] | Refusal:
    """The body the gateway registers a flow with: the name the engine sent, the gateway's mark.
    ``tags`` and ``labels`` are admitted only as the engine sends them (empty)."""
    if not isinstance(body, dict):
        return Refusal(_RULE, f"{what}: a flow's registration is a JSON object")
    extra = sorted(set(body) - {"name", "tags", "labels"})
    chosen = [k for k in ("tags", "labels") if body.get(k)]
    if extra or chosen:
        return Refusal(
            _RULE,
            f"{what}: fields {extra + chosen} are not the engine's (a flow's tags and labels are "
            "the gateway's to set, never a sandboxed run's)",
        )
    name = body.get("name")
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        return Refusal(_RULE, f"{what}: a flow is registered by a name (a string)")
    if deployment_id is None:
        return Refusal(
            _RULE,
            f"{what}: this run has no deployment, so a flow it registers could not be marked as "
            "its own (a resoluto pool runs only deployments' runs)",
        )
    return {"name": name, "labels": {REGISTERED_BY: deployment_id}}


def owns_flow(reply: Any, deployment_id: str | None, own_flow_id: str | None) -> bool:
    """Whether the flow the API answered with is the run's: its own, marked as its deployment's,
    or granted to its deployment by an operator's tag."""
    if not isinstance(reply, dict) or not reply.get("id"):
        return False
    if own_flow_id is not None and str(reply["id"]) == own_flow_id:
        return True
    if deployment_id is None:
        return False
    labels = reply.get("labels")
    if isinstance(labels, dict) and labels.get(REGISTERED_BY) == deployment_id:
        return True
    return granted(reply, deployment_id)


def granted(reply: Any, deployment_id: str | None) -> bool:
    """Whether an operator's tag shares the flow the API answered with with this deployment."""
    tags = reply.get("tags") if isinstance(reply, dict) else None
    return deployment_id is not None and isinstance(tags, list) and GRANT_TAG + deployment_id in tags


def not_owned(what: str, name: str, deployment_id: str | None, *, deployed: bool = False) -> Refusal:
    """The refusal of a flow that is someone else's: says why, never the flow's id."""
    why = (
        "is deployed by another deployment"
        if deployed
        else f"exists and was not created by this run's deployment ({deployment_id})"
    )
    return Refusal(
        _RULE,
        f"{what}: flow {name!r} {why}; a sandboxed run may use only its own flow and the "
        "undeployed flows its deployment registered (an operator shares one by tagging it "
        f"{GRANT_TAG}<deployment id>)",
    )
