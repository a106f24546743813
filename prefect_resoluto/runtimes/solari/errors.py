"""What a Solari gateway's answer means for a node: refused, held for admission, or retryable.

The seed's mapping is by HTTP status; the SDK's exception classes are by status *and*
error code, so a few answers arrive as a plain ``GatewayError``. Everything here reads an
exception the seed's way (``SDK divergence N`` as numbered in docs/backends.md) and needs
neither the SDK nor a gateway to be tested.
"""

from __future__ import annotations

_TRANSIENT_RPC = ("SolariConnectionError", "SolariTimeoutError")


def gateway_status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def gateway_words(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    msg = str(exc) or type(exc).__name__
    return f"{msg} ({code})" if code and code not in msg else msg


def admission_kind(e: BaseException, slot: type, capacity: type, connection: type) -> str | None:
    """``"slot"`` for a 429 of any code (the seed: the organisation is at its session cap),
    ``"capacity"`` for no capacity / a gateway that could not be reached, None for a refusal.

    SDK divergence 11: the SDK maps by status *and* code -- a 429 that is not
    ``ConcurrencyLimitExceeded``, or a 503 that is not ``NoCapacity``, comes back as a plain
    ``GatewayError`` -- where the seed maps 429 to the concurrency limit and 503 to no
    capacity. Decide by status here, the seed's way.
    """
    status = gateway_status(e)
    code = str(getattr(e, "code", "") or "").lower()
    if isinstance(e, slot) or status == 429:
        return "slot"
    if (
        isinstance(e, (capacity, connection))
        or status in (502, 503, 504)
        or code in ("no_capacity", "nocapacity")
    ):
        return "capacity"
    return None


def transient_rpc_error(e: BaseException) -> bool:
    """A control-channel failure that a reconnect may cure (a drop, a timeout, a failed send)."""
    text = str(e)
    return type(e).__name__ in _TRANSIENT_RPC or any(
        m in text for m in ("Control channel", "Not connected", "Failed to send")
    )


def refusal(e: BaseException, base_url: str | None) -> str:
    """Why the gateway will never create this sandbox, and the setting to fix (for ``unstartable``)."""
    # SDK divergence 12: a 403 without code NotEntitled is a plain GatewayError, not AuthError
    # (seed: 401/403 are AuthError); judged by status here.
    status = gateway_status(e)
    words = gateway_words(e)
    if status == 402 or (getattr(e, "code", "") or "").startswith("plan_") or type(e).__name__ == "PlanError":
        return (
            f"the Solari organisation's plan does not allow this sandbox ({status}): {words}. "
            "Upgrade the plan, or lower cpu/mem_mb/disk_gb/template in the runtime options."
        )
    if status in (401, 403):
        return (
            f"the Solari gateway {base_url} refused the API key ({status}): {words}. "
            "Fix api_key (runtime option, SandboxBlock solari_api_key) or SOLARI_API_KEY."
        )
    if status == 400:
        return f"the Solari gateway rejected the create request (400): {words}. Check the runtime options."
    if status == 404:
        return (
            f"the Solari gateway {base_url} has no such route or template (404): {words}. "
            "Check base_url and template."
        )
    return f"the Solari gateway {base_url} refused to create the sandbox: {type(e).__name__}: {words}"
