"""``python -m guest_runner.engine``: Prefect's flow-run engine as a worker's flow run runs it.

It is ``python -m prefect.engine`` (the same module, run as ``__main__``) with one thing
more: a request the run's API gateway refuses -- a 403 bearing the gateway's marker header
(:data:`guest_runner.refusal.REFUSED_HEADER`, which the gateway never relays from the API)
-- raises :class:`guest_runner.prefect_api.PrefectAPIUnavailable` with the gateway's words,
as the same call does in a task under ResolutoTaskRunner, instead of Prefect's
``PrefectHTTPStatusError: 403 ...``. The exception is of both classes: an ``except
PrefectAPIUnavailable`` catches it on either path, and code written against Prefect's HTTP
error (``e.response.status_code == 403``) keeps working. Any other answer is Prefect's own.

Standard library only, Python 3.9: Prefect is reached by module name.
"""

from __future__ import annotations

import importlib
import runpy
import sys
import types
from importlib.machinery import ModuleSpec
from typing import Any, Optional

from guest_runner import prefect_api
from guest_runner.refusal import REFUSED_HEADER

#: What a worker's flow-run sandbox runs: ``python -m guest_runner.engine``.
MODULE = "guest_runner.engine"
#: Prefect's own entry point, which this one runs.
PREFECT_ENGINE = "prefect.engine"
#: The Prefect module whose responses raise the refusal.
_CLIENT_BASE = "prefect.client.base"
#: At most this much of the gateway's words in the exception's message.
MAX_MESSAGE = 4000

_refused_class: Optional[type] = None


def refused_class() -> type:
    """``PrefectAPIUnavailable`` that is also Prefect's ``PrefectHTTPStatusError`` (made once
    Prefect is loaded: this module imports nothing of it ahead)."""
    global _refused_class
    if _refused_class is None:
        http_error: Any = importlib.import_module("prefect.exceptions").PrefectHTTPStatusError

        def __init__(self: Any, message: str, *, request: Any, response: Any) -> None:
            http_error.__init__(self, message, request=request, response=response)

        def __reduce__(self: Any) -> Any:
            # A request and response do not pickle: a persisted failure keeps the type and words.
            return (prefect_api.PrefectAPIUnavailable, (str(self),))

        cls = type(
            "PrefectAPIUnavailable",
            (prefect_api.PrefectAPIUnavailable, http_error),
            {
                "__init__": __init__,
                "__reduce__": __reduce__,
                "__module__": __name__,
                "__doc__": "A Prefect API call the flow run's gateway refused (HTTP 403).",
            },
        )
        _refused_class = cls
        globals()["PrefectAPIUnavailable"] = cls  # found by name, as pickle looks classes up
    return _refused_class


def refusal(response: Any) -> Optional[BaseException]:
    """The exception for ``response`` when it is the gateway's refusal, else None."""
    if response.status_code != 403:
        return None
    rule = response.headers.get(REFUSED_HEADER)
    if not rule:
        return None
    detail: Any = None
    try:
        body = response.json()
        detail = body.get("detail") if isinstance(body, dict) else None
    except Exception:  # noqa: BLE001 - the marker decides; the words are the gateway's if it sent any
        pass
    if not isinstance(detail, str) or not detail:
        detail = f"refused by the resoluto gateway (rule {rule})"
    return refused_class()(detail[:MAX_MESSAGE], request=response.request, response=response)  # type: ignore[no-any-return]


def _patch_client_base(base: types.ModuleType) -> None:
    # Both of Prefect's HTTP clients raise through PrefectResponse.raise_for_status.
    cls = base.PrefectResponse
    original = cls.raise_for_status

    def raise_for_status(self: Any) -> Any:
        refused = refusal(self)
        if refused is not None:
            raise refused from None
        return original(self)

    cls.raise_for_status = raise_for_status


_patched = False


class _AfterImport:
    """Patches ``prefect.client.base`` as soon as it is imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> "Optional[ModuleSpec]":
        if fullname != _CLIENT_BASE or _patched:
            return None
        return prefect_api.patched_on_load(fullname, path, _patch_once)


def _patch_once(module: types.ModuleType) -> None:
    global _patched
    if not _patched:
        _patched = True
        _patch_client_base(module)


def install() -> None:
    """Make the gateway's refusals PrefectAPIUnavailable in this process (idempotent): now if
    Prefect's client is loaded (a warm sandbox imported it ahead), else when it is."""
    loaded = sys.modules.get(_CLIENT_BASE)
    if loaded is not None:
        _patch_once(loaded)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def run(argv: "list[str]") -> None:
    """Become ``python -m prefect.engine <argv>``, refusals installed."""
    install()
    sys.argv = [PREFECT_ENGINE, *argv]  # run_module puts the module's file first
    runpy.run_module(PREFECT_ENGINE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    # Run from the module by its name, not from __main__: one copy of its state and class.
    importlib.import_module(MODULE).run(sys.argv[1:])
