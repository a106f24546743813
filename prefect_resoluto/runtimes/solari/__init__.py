"""The Solari runtime: one hosted micro-VM per node, through the official ``solari-sandbox`` SDK.

One job per module:

* :mod:`.request` -- the create request, the guest command and its secrets for one node (pure);
* :mod:`.errors` -- what a gateway's error means: refused, held for admission, retryable (pure);
* :mod:`.sdk` -- an event loop of our own for the SDK and the seed's HTTP retry rules under it;
* :mod:`.session` -- one node's life on that loop: admission, staging, the command, keep-alive;
* :mod:`.relay` -- the mirror of the node's objects out of the VM into the run's conduit;
* :mod:`.status` -- what a session's state means for the node;
* :mod:`.runtime` -- :class:`SolariRuntime` (launch/status/destroy/sweep/logs), composing them.
"""

from prefect_resoluto.runtimes.solari.request import MANAGED_BY, MANAGED_BY_KEY, SANDBOX_ID_KEY
from prefect_resoluto.runtimes.solari.runtime import (
    CONDUIT_MODES,
    DEFAULT_GUEST_DIR,
    SolariConfigError,
    SolariRuntime,
)
from prefect_resoluto.runtimes.solari.session import _SESSIONS as _SESSIONS  # live sessions (tests read them)

__all__ = [
    "CONDUIT_MODES",
    "DEFAULT_GUEST_DIR",
    "MANAGED_BY",
    "MANAGED_BY_KEY",
    "SANDBOX_ID_KEY",
    "SolariConfigError",
    "SolariRuntime",
]
