"""Solari runtime: one hosted micro-VM per node, through the official ``solari-sandbox`` SDK.

Each node gets its own hardware-isolated VM from a Solari gateway (REST for the
sandbox's lifecycle, a control WebSocket for its commands and files). The SDK does all
of the talking; this module decides *when* to talk and what a gateway answer means for
the node.

Two conduit modes:

``relay`` (default)
    The VM needs no network and holds no credentials. Through the files API the host
    writes the guest runner (the files of :func:`~prefect_resoluto.runtimes.guest_bundle.build_guest_bundle`)
    and the node's inbox into the VM, starts ``python3 -m guest_runner`` there against a
    local-filesystem store inside the VM, and mirrors every object the guest writes --
    event chunks in order, ``result.json``, ``outbox/*``, ``_manifest.json`` last, each
    exactly once -- into the run's own conduit (local directory or S3). The run's conduit
    ends up holding the same objects under the same keys as with any other runtime, so
    the tail, ``events`` replay and the Prefect glue do not know the difference.

``direct``
    The guest reaches an S3 conduit itself (for large outputs); the VM's network must
    reach the store. Store credentials are minted per node with STS when
    ``store_role_arn`` is set (scoped to the node's prefix, as in the Kubernetes runtime);
    otherwise the host's own conduit credentials are passed in the guest command's env.

Liveness stays ours: the gateway session is kept alive (``set_timeout``) for as long as
the host watches the node, and the SDK never gets a deadline that could kill a live
node -- the silence watchdog in :mod:`prefect_resoluto.node.drive` decides. A control channel
that drops is reconnected; a sandbox that is gone (404) or no longer running is *lost*,
with the gateway's words as the reason. HTTP 429 (the organisation at its session cap)
holds the node for admission -- it waits with backoff and says so in the task's logs --
while 401/403/402 make it unstartable at once with the setting to fix.

The SDK is async and its sync wrapper cannot run inside a running event loop (a Prefect
async task has one), so every SDK call runs on one event loop in a thread of our own
(:mod:`.sdk`, which also restores the seed's HTTP retry rules under the SDK). One node's
life on that loop is :mod:`.session`, the mirror out of the VM :mod:`.relay`, what a
gateway's refusal means :mod:`.errors`, what launch sends :mod:`.request`, and what a
session's state means :mod:`.status`; this module composes them behind the runtime seam.

Where the SDK diverges from the gateway's wire contract (``solari-sdk-wire-protocol.md``)
in a way that matters here, the workaround is marked ``SDK divergence N`` with the
number used in ``docs/backends.md``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Coroutine, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from guest_runner import wire

if TYPE_CHECKING:
    from guest_runner.conduit import Conduit


from prefect_resoluto.runtimes._sts import mint_node_credentials
from prefect_resoluto.runtimes.base import (
    Availability,
    IsolationLevel,
    LaunchError,
    LaunchSpec,
    SandboxHandle,
    SandboxRuntime,
    SandboxStatus,
)
from prefect_resoluto.runtimes.capabilities import Capabilities
from prefect_resoluto.runtimes.solari.errors import gateway_status, gateway_words
from prefect_resoluto.runtimes.solari.request import (
    MANAGED_BY,
    MANAGED_BY_KEY,
    SANDBOX_ID_KEY,
    VmLayout,
    create_request,
    guest_command,
    guest_secrets,
)
from prefect_resoluto.runtimes.solari.sdk import loop, make_http_client
from prefect_resoluto.runtimes.solari.session import (
    DriveSettings,
    Session,
    SessionDriver,
    forget,
    kill,
    lookup,
    register,
)
from prefect_resoluto.runtimes.solari.status import session_status

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

CONDUIT_MODES = ("relay", "direct")
DEFAULT_GUEST_DIR = "/tmp/resoluto"


def _check_options(conduit_mode: str, session_timeout_s: float, guest_dir: str) -> None:
    if conduit_mode not in CONDUIT_MODES:
        raise ValueError(f"conduit_mode must be one of {CONDUIT_MODES}, got {conduit_mode!r}")
    if session_timeout_s <= 0:
        raise ValueError("session_timeout_s must be positive (seconds)")
    if not str(guest_dir).startswith("/"):
        raise ValueError(f"guest_dir must be an absolute path inside the VM, got {guest_dir!r}")


class SolariConfigError(LaunchError):
    """The runtime is not configured well enough to talk to a gateway."""


class SolariRuntime(SandboxRuntime):
    """One Solari micro-VM per node, created through the official SDK."""

    name: ClassVar[str] = "solari"
    # The relay mode serves a local conduit: the host mirrors objects into it. The VM is on
    # someone else's machine: sweep is a gateway call, it has its own network. The host_*
    # answers are those of the one flag they once shared (supports_local_conduit).
    capabilities: ClassVar[Capabilities] = Capabilities(
        on_host=False,
        options=frozenset(
            {
                "base_url",
                "api_key",
                "template",
                "conduit_mode",
                "session_timeout_s",
                "lifecycle",
                "metadata",
                "envs",
                "cpu",
                "mem_mb",
                "disk_gb",
                "guest_dir",
                "python",
                "admission_backoff_max_s",
                "admission_patience_s",
                "capacity_retries",
                "reconnect_patience_s",
                "relay_poll_min_s",
                "relay_poll_max_s",
                "view_interval_s",
                "store_role_arn",
                "store_sts_endpoint",
                "store_credentials_ttl_s",
                "rpc_timeout_s",
            }
        ),
    )
    # status() reads what the session's own loop observed (exit frame, gateway view, relay):
    # no request per check, so as often as a local runtime.
    status_interval: ClassVar[float] = 0.2

    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: Any = None,
        template: str | None = None,
        conduit_mode: str = "relay",
        session_timeout_s: float = 300.0,
        lifecycle: Mapping[str, Any] | None = None,
        metadata: Mapping[str, str] | None = None,
        envs: Mapping[str, str] | None = None,
        cpu: int | None = None,
        mem_mb: int | None = None,
        disk_gb: int | None = None,
        guest_dir: str = DEFAULT_GUEST_DIR,
        python: str = "python3",
        admission_backoff_max_s: float = 10.0,
        admission_patience_s: float | None = None,
        capacity_retries: int = 5,
        reconnect_patience_s: float = 60.0,
        relay_poll_min_s: float = 0.01,
        relay_poll_max_s: float = 0.25,
        view_interval_s: float = 5.0,
        store_role_arn: str | None = None,
        store_sts_endpoint: str | None = None,
        store_credentials_ttl_s: int = 3600,
        rpc_timeout_s: float = 120.0,
    ) -> None:
        _check_options(conduit_mode, session_timeout_s, guest_dir)
        self.base_url = (base_url or os.environ.get("SOLARI_BASE_URL") or "").rstrip("/") or None
        secret = api_key.get_secret_value() if hasattr(api_key, "get_secret_value") else api_key
        self._api_key: str | None = secret or os.environ.get("SOLARI_API_KEY") or None
        self.template = template
        self.conduit_mode = conduit_mode
        self.session_timeout_s = float(session_timeout_s)
        self.lifecycle = dict(lifecycle) if lifecycle else None
        self.metadata = {str(k): str(v) for k, v in (metadata or {}).items()}
        self.envs = {str(k): str(v) for k, v in (envs or {}).items()}
        self.cpu, self.mem_mb, self.disk_gb = cpu, mem_mb, disk_gb
        self.guest_dir = str(guest_dir).rstrip("/")
        self.python: str = python
        self.admission_backoff_max_s = float(admission_backoff_max_s)
        self.admission_patience_s = admission_patience_s
        self.capacity_retries = int(capacity_retries)
        self.reconnect_patience_s = float(reconnect_patience_s)
        self.relay_poll_min_s = float(relay_poll_min_s)
        self.relay_poll_max_s = float(relay_poll_max_s)
        self.view_interval_s = float(view_interval_s)
        self.store_role_arn = store_role_arn
        self.store_sts_endpoint = store_sts_endpoint
        self.store_credentials_ttl_s = int(store_credentials_ttl_s)
        # Bounds one control-channel call (not the node): a hung call is treated like a dropped
        # channel (checked by id, reconnected), so a silent gateway cannot stall the relay for the
        # SDK's default 300 s.
        self.rpc_timeout_s = float(rpc_timeout_s)
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._conduits: dict[str, Any] = {}

    def __repr__(self) -> str:  # never the key
        return f"SolariRuntime(base_url={self.base_url!r}, template={self.template!r}, mode={self.conduit_mode!r})"

    @property
    def isolation(self) -> IsolationLevel:
        return IsolationLevel.VM

    # -- configuration ----------------------------------------------------------------------

    def _config_problem(self) -> str:
        try:
            import solari_sandbox  # noqa: F401
        except ImportError as e:
            return (
                f"the Solari SDK is not installed ({e}); pip install 'prefect-resoluto[solari]' "
                "(solari-sandbox)"
            )
        if not self.base_url:
            return (
                "no gateway base URL: set base_url (runtime option, SandboxBlock solari_base_url) or "
                "SOLARI_BASE_URL, e.g. https://api.getsolari.com"
            )
        if not self._api_key:
            return "no API key: set api_key (runtime option, SandboxBlock solari_api_key) or SOLARI_API_KEY"
        return ""

    def _sdk(self) -> Any:
        problem = self._config_problem()
        if problem:
            raise SolariConfigError(problem)
        with self._client_lock:
            if self._client is None:
                base_url, key, rpc_ms = self.base_url, self._api_key, int(self.rpc_timeout_s * 1000)
                assert base_url and key  # _config_problem() found both

                async def make() -> Any:
                    from solari_sandbox.sandbox_client import SandboxClient

                    return SandboxClient(
                        api_key=key,
                        base_url=base_url,
                        http=make_http_client(base_url),
                        call_timeout_ms=rpc_ms,
                    )

                self._client = loop().run(make())
            return self._client

    def _run(self, coro: Coroutine[Any, Any, _T], timeout: float | None = 120.0) -> _T:
        return loop().run(coro, timeout)

    def availability(self) -> Availability:
        problem = self._config_problem()
        if problem:
            return Availability(False, problem)
        try:
            client = self._sdk()
            page = self._run(self._probe(client), timeout=30)
        except Exception as e:
            status = gateway_status(e)
            hint = ""
            if status in (401, 403):
                hint = " -- check api_key / SOLARI_API_KEY"
            elif status == 402:
                hint = " -- the organisation's plan does not allow sandboxes"
            http = f"HTTP {status} " if status else ""
            return Availability(
                False,
                f"gateway {self.base_url} did not answer a read-only request: "
                f"{http}{type(e).__name__}: {gateway_words(e)}{hint}",
            )
        return Availability(
            True,
            detail=f"gateway {self.base_url} answered (GET /sandboxes, "
            f"{len(page.get('sandboxes', []))} listed); conduit mode "
            f"{self.conduit_mode}, template {self.template or '(default)'}",
        )

    @staticmethod
    async def _probe(client: Any) -> dict[str, Any]:
        """A read-only request: the list (which sweep needs too), else a GET by a made-up id --
        a 404 from an authenticated GET still proves the gateway and the key."""
        from solari_core.errors import NotFoundError

        try:
            page: dict[str, Any] = await client.list(limit=1)
            return page
        except NotFoundError:
            pass
        try:
            await client.get("resoluto-doctor:probe:none.0")
        except NotFoundError:
            return {"sandboxes": []}
        return {"sandboxes": []}

    # -- run preparation ------------------------------------------------------------------

    def prepare(self, conduit: Conduit, run_id: str) -> None:
        """Remember the run's conduit: the relay mirrors the VM's objects into it."""
        self._conduits[run_id] = conduit

    def check_spec(self, spec: LaunchSpec) -> None:
        super().check_spec(spec)
        if self.conduit_mode == "direct" and spec.store.kind != "s3":
            raise LaunchError(self._direct_needs_s3(spec.store.kind))

    @staticmethod
    def _direct_needs_s3(kind: str) -> str:
        return (
            f"conduit_mode='direct' needs an S3 conduit the VM can reach (got a {kind or 'local'} conduit); "
            "use conduit_mode='relay' (the default) to keep a local conduit: the host then relays every "
            "object out of the VM"
        )

    def _run_conduit(self, spec: LaunchSpec) -> Any:
        conduit = self._conduits.get(spec.run_id)
        if conduit is not None:
            return conduit
        # Not prepared (a caller other than drive_node): the conduit the node's env names.
        from guest_runner.conduit import LocalConduit
        from guest_runner.conduit.registry import conduit_from_env

        if spec.conduit_root is not None:
            return LocalConduit(spec.conduit_root)
        return conduit_from_env(spec.env)

    # -- rendering: what launch would send -------------------------------------------------

    @property
    def _layout(self) -> VmLayout:
        return VmLayout(self.guest_dir)

    def create_request(self, spec: LaunchSpec) -> dict[str, Any]:
        """The ``CreateSandboxRequest`` body for ``spec``, exactly as the SDK puts it on the wire."""
        return create_request(
            spec,
            template=self.template,
            cpu=self.cpu,
            mem_mb=self.mem_mb,
            disk_gb=self.disk_gb,
            metadata=self.metadata,
            envs=self.envs,
            session_timeout_s=self.session_timeout_s,
            lifecycle=self.lifecycle,
        )

    def guest_command(self, spec: LaunchSpec, secret_env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """``cmd.start`` params for ``spec``: ``python3 -m guest_runner`` with the node's env."""
        return guest_command(
            spec, self._layout, relay=self.conduit_mode == "relay", python=self.python, secret_env=secret_env
        )

    def render(self, spec: LaunchSpec) -> dict[str, Any]:
        """What launch would send, as JSON-able data, the key and every secret value redacted."""
        self._check(spec)
        secrets = self._secret_env(spec, mint=False)
        command = self.guest_command(spec, {k: "<redacted>" for k in secrets})
        return {
            "runtime": self.name,
            "base_url": self.base_url,
            "authorization": "Bearer <redacted>" if self._api_key else None,
            "conduit_mode": self.conduit_mode,
            "create": self.create_request(spec),
            "command": command,
        }

    def _check(self, spec: LaunchSpec) -> None:
        self.check_spec(spec)
        for var, value in ((wire.ENV_RUN_ID, spec.run_id), (wire.ENV_NODE_ID, spec.node_id)):
            if not value:
                raise LaunchError(f"the node's environment lacks {var}")

    def _secret_env(self, spec: LaunchSpec, *, mint: bool) -> dict[str, str]:
        return guest_secrets(
            spec,
            relay=self.conduit_mode == "relay",
            store_role_arn=self.store_role_arn,
            mint=(lambda: self._mint_store_credentials(spec)) if mint else None,
        )

    def _mint_store_credentials(self, spec: LaunchSpec) -> dict[str, str]:
        """Short-lived credentials that reach only this node's prefix (STS AssumeRole + session policy)."""
        return mint_node_credentials(
            role_arn=self.store_role_arn,
            bucket=spec.store.bucket,
            prefix=spec.store.prefix.strip("/"),
            session_name=spec.sandbox_id,
            ttl_s=self.store_credentials_ttl_s,
            sts_endpoint=self.store_sts_endpoint,
            region=spec.store.region or None,
            # The host's heartbeat (prefect_resoluto.node.heartbeat) lies outside the prefix.
            read_only_keys=[k for k in [spec.env.get(wire.ENV_HOST_BEAT_KEY, "")] if k],
        )

    # -- launch ---------------------------------------------------------------------------

    def _driver(self) -> SessionDriver:
        return SessionDriver(
            DriveSettings(
                base_url=self.base_url,
                session_timeout_s=self.session_timeout_s,
                admission_backoff_max_s=self.admission_backoff_max_s,
                admission_patience_s=self.admission_patience_s,
                capacity_retries=self.capacity_retries,
                reconnect_patience_s=self.reconnect_patience_s,
                relay_poll_min_s=self.relay_poll_min_s,
                relay_poll_max_s=self.relay_poll_max_s,
                view_interval_s=self.view_interval_s,
            ),
            self._layout,
        )

    def launch(self, spec: LaunchSpec) -> SandboxHandle:
        self._check(spec)
        client = self._sdk()
        conduit = self._run_conduit(spec) if self.conduit_mode == "relay" else None
        secrets = self._secret_env(spec, mint=True)
        rel = spec.rel_prefix
        inbox: dict[str, bytes] = {}
        if conduit is not None:
            for key in conduit.list_prefix(rel + "/"):
                inbox[key] = conduit.get(key)
        s = Session(
            spec_id=spec.sandbox_id,
            mode=self.conduit_mode,
            run_id=spec.run_id,
            rel_prefix=rel,
            create=self.create_request(spec),
            command=self.guest_command(spec, secrets),
            conduit=conduit,
            inbox=inbox,
        )
        register(s)
        # The first create answers here, so a refused key or plan fails the launch at once; a
        # 429 returns a handle that waits for admission in the background.
        first: concurrent.futures.Future[str] = concurrent.futures.Future()
        s.task = loop().spawn(self._driver().drive(client, s, first))
        try:
            verdict = first.result(timeout=300)
        except concurrent.futures.TimeoutError:
            verdict = ""
        if s.unstartable and verdict == "refused":
            forget(s)
            raise LaunchError(s.unstartable)
        return SandboxHandle(
            id=spec.sandbox_id,
            runtime=self.name,
            labels=dict(spec.labels),
            data={"base_url": self.base_url, "mode": self.conduit_mode},
        )

    # -- status -----------------------------------------------------------------------------

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        s = lookup(handle.id)
        if s is None:
            return SandboxStatus(
                "unknown", gone=True, reason=f"sandbox {handle.id} is not known to this process"
            )
        return session_status(s, self.base_url)

    # -- destroy / sweep / logs ---------------------------------------------------------------

    def destroy(self, handle: SandboxHandle) -> None:
        s = lookup(handle.id)
        if s is None:
            return
        s.destroyed = True
        client = self._sdk()

        async def reap() -> None:
            task = s.task
            await kill(client, s)
            if task is not None and not task.done():
                task.cancel()
            # A create still in flight when we gave up may land later: find it by its label.
            if s.gw_id is None:
                page = await client.list(metadata={SANDBOX_ID_KEY: s.spec_id})
                for view in page.get("sandboxes", []):
                    await client.kill(view.sandboxId)

        try:
            self._run(reap(), timeout=60)
        finally:
            handle.data["destroyed"] = True
            s.sbx = s.cmd = s.conduit = None

    def sweep(self, labels: dict[str, str]) -> int:
        client = self._sdk()
        wanted = {**{str(k): str(v) for k, v in labels.items()}, MANAGED_BY_KEY: MANAGED_BY}

        async def reap() -> int:
            n = 0
            async for view in client.list_all(metadata=wanted):
                await client.kill(view.sandboxId)
                n += 1
            return n

        n = self._run(reap(), timeout=300)
        if n:
            logger.info("solari runtime: swept %d sandbox(es) matching %s", n, wanted)
        return n

    def logs(self, handle: SandboxHandle, tail: int = 200) -> str:
        s = lookup(handle.id)
        if s is None:
            return f"(no output recorded for {handle.id} in this process)"
        lines = list(s.output) + [v for v in s.partial.values() if v]
        head = f"[solari sandbox {s.gw_id or '(not created)'}, {s.reconnects} reconnect(s)]"
        return "\n".join([head, *lines[-max(1, int(tail)) :]])
