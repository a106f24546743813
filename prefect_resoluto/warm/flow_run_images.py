"""A worker's flow-run sandboxes, restored from a snapshot instead of booted.

A flow run's sandbox runs ``python -m prefect.engine``: booted, it pays the sandbox's
start and Prefect's imports (seconds of CPU in gVisor) before the engine's first request.
Per kind of flow-run sandbox (runtime and its mounts, resources, conduit) one *template*
boots to where the engine's modules are imported, before any flow run, id or credential
exists (:mod:`guest_runner.warmcall`'s engine mode), is checkpointed once and destroyed
(:mod:`prefect_resoluto.warm.snapshots`); each flow run then gets a sandbox restored from that
image into the network made for it (its namespace and its run's proxy, which is why it is
restored on demand and not kept waiting like the task runner's warm sandboxes), and its
assignment -- the flow run's environment and its gateway token -- on the sandbox's stdin.

The first flow run of a kind boots as before while its image is made in the background;
an image that cannot be made or restored is discarded with a warning and that kind boots.
``RESOLUTO_WARM_SNAPSHOTS=0`` turns it off; a ``command`` other than Prefect's engine
always boots.
"""

from __future__ import annotations

import json
import threading

from guest_runner import wire
from guest_runner.conduit import Conduit
from prefect_resoluto.node.spec import NodeSpec, launch_spec
from prefect_resoluto.runtimes.base import SandboxRuntime
from prefect_resoluto.warm.pool import PoolKey, WarmPool, WarmSandbox
from prefect_resoluto.warm.snapshots import enabled_by_env

ENGINE_ARGS = ["-m", wire.WARM_ENGINE_MODULE]


class FlowRunSnapshots:
    """The worker's images and restores, one pool per kind of flow-run sandbox."""

    def __init__(self, labels: dict[str, str]) -> None:
        """``labels``: carried by every template (the worker's own sweep finds them)."""
        self.labels = labels
        self._pools: dict[str, WarmPool] = {}
        self._lock = threading.Lock()
        self._closed = False

    def take(
        self, spec: NodeSpec, runtime: SandboxRuntime, conduit: Conduit
    ) -> tuple[WarmSandbox | None, str]:
        """A sandbox restored for ``spec`` (ready for its assignment), or (None, why)."""
        if not runtime.capabilities.snapshots:
            return None, ""
        if not enabled_by_env():
            return None, "booted (RESOLUTO_WARM_SNAPSHOTS=0)"
        if spec.argv[1:3] != ENGINE_ARGS:
            return None, "booted (the job's command is not Prefect's engine)"
        pool = self._pool(runtime, conduit)
        if pool is None:
            return None, ""
        key = PoolKey(image=spec.image, resources=spec.resources, engine=True)
        return pool.restore_for(key, spec.network_request(), launch_spec(spec, conduit).labels)

    def _pool(self, runtime: SandboxRuntime, conduit: Conduit) -> WarmPool | None:
        # Runtimes built from the same settings share images; the pool keeps the first
        # instance and only uses the conduit's address (never its connection).
        ident = json.dumps(
            [runtime.name, str(runtime.state), runtime.snapshot_fingerprint(), runtime.python, conduit.url]
        )
        with self._lock:
            if self._closed:
                return None
            pool = self._pools.get(ident)
            if pool is None:
                pool = WarmPool(runtime, conduit, size=1, labels=self.labels, snapshots=True)
                if not pool.enabled or pool.snapshots is None:
                    return None
                self._pools[ident] = pool
            return pool

    def close(self) -> None:
        """Stop any template being made and remove what it left (the worker's teardown)."""
        with self._lock:
            self._closed = True
            pools = list(self._pools.values())
            self._pools.clear()
        for pool in pools:
            pool.close()
