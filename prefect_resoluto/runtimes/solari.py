"""Solari runtime: one hosted micro-VM per node, through the official ``solari-sandbox`` SDK.

Each node gets its own hardware-isolated VM from a Solari gateway (REST for the
sandbox's lifecycle, a control WebSocket for its commands and files). The SDK does all
of the talking; this module decides *when* to talk and what a gateway answer means for
the node.

Two conduit modes:

``relay`` (default)
    The VM needs no network and holds no credentials. Through the files API the host
    writes the guest runner (the files of :func:`~prefect_resoluto.guest_bundle.build_guest_bundle`)
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
node -- the silence watchdog in :mod:`prefect_resoluto.node` decides. A control channel
that drops is reconnected; a sandbox that is gone (404) or no longer running is *lost*,
with the gateway's words as the reason. HTTP 429 (the organisation at its session cap)
holds the node for admission -- it waits with backoff and says so in the task's logs --
while 401/403/402 make it unstartable at once with the setting to fix.

The SDK is async and its sync wrapper cannot run inside a running event loop (a Prefect
async task has one), so every SDK call runs on one event loop in a thread of our own
(:mod:`._solari_sdk`, which also restores the seed's HTTP retry rules under the SDK); the
mirror out of the VM is :mod:`._solari_relay`.

Where the SDK diverges from the gateway's wire contract (``solari-sdk-wire-protocol.md``)
in a way that matters here, the workaround is marked ``SDK divergence N`` with the
number used in ``docs/backends.md``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import io
import json
import logging
import math
import os
import random
import tarfile
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from guest_runner import wire
from prefect_resoluto.runtimes._solari_relay import VmRelay
from prefect_resoluto.runtimes._solari_sdk import (
    admission_kind,
    backoff_s,
    gateway_status,
    gateway_words,
    loop,
    make_http_client,
    transient_rpc_error,
)
from prefect_resoluto.runtimes.base import (
    Availability,
    IsolationLevel,
    LaunchError,
    LaunchSpec,
    SandboxHandle,
    SandboxRuntime,
    SandboxStatus,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

MANAGED_BY_KEY = "resoluto.managed-by"
MANAGED_BY = "prefect-resoluto"
SANDBOX_ID_KEY = "resoluto.sandbox-id"
CONDUIT_MODES = ("relay", "direct")
DEFAULT_GUEST_DIR = "/tmp/resoluto"
_STORE_CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
#: How long the relay keeps polling at its fastest after the last new object.
_HOT_S = 0.25


class SolariConfigError(LaunchError):
    """The runtime is not configured well enough to talk to a gateway."""


# -- per-sandbox state -------------------------------------------------------------------------


@dataclass
class _Session:
    spec_id: str
    mode: str
    run_id: str
    rel_prefix: str
    create: dict[str, Any]
    command: dict[str, Any]
    conduit: Any = None  # the run's conduit (relay mode)
    inbox: dict[str, bytes] = field(default_factory=dict)
    gw_id: str | None = None
    sbx: Any = None
    cmd: Any = None
    state: str = "admission"  # admission -> staging -> running -> finished
    waiting_since: float | None = None
    waiting_logged: bool = False
    admission_waits: int = 0
    unstartable: str = ""
    lost: str = ""
    exit_code: int | None = None
    exited: bool = False
    relay: VmRelay | None = None
    finished: bool = False  # nothing more will come from the VM
    reconnects: int = 0
    output: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=2000))
    partial: dict[str, str] = field(default_factory=dict)
    task: concurrent.futures.Future[Any] | None = None
    destroyed: bool = False
    last_keepalive: float = 0.0
    last_view: float = 0.0


_SESSIONS: dict[str, _Session] = {}
_KEEP_REAPED = 64
_SESSIONS_LOCK = threading.Lock()


def _task_log(level: int, message: str) -> None:
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


# -- the runtime ------------------------------------------------------------------------------


class SolariRuntime(SandboxRuntime):
    """One Solari micro-VM per node, created through the official SDK."""

    name: ClassVar[str] = "solari"
    #: The relay mode serves a local conduit: the host mirrors objects into it.
    supports_local_conduit: ClassVar[bool] = True
    #: The VM is on someone else's machine: sweep is a gateway call, it has its own network.
    remote: ClassVar[bool] = True
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
        if conduit_mode not in CONDUIT_MODES:
            raise ValueError(f"conduit_mode must be one of {CONDUIT_MODES}, got {conduit_mode!r}")
        if session_timeout_s <= 0:
            raise ValueError("session_timeout_s must be positive (seconds)")
        if not str(guest_dir).startswith("/"):
            raise ValueError(f"guest_dir must be an absolute path inside the VM, got {guest_dir!r}")
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
        self.python = python
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
            return (f"the Solari SDK is not installed ({e}); pip install 'prefect-resoluto[solari]' "
                    "(solari-sandbox)")
        if not self.base_url:
            return ("no gateway base URL: set base_url (runtime option, SandboxBlock solari_base_url) or "
                    "SOLARI_BASE_URL, e.g. https://api.getsolari.com")
        if not self._api_key:
            return ("no API key: set api_key (runtime option, SandboxBlock solari_api_key) or SOLARI_API_KEY")
        return ""

    def _sdk(self) -> Any:
        problem = self._config_problem()
        if problem:
            raise SolariConfigError(problem)
        with self._client_lock:
            if self._client is None:
                base_url, key, rpc_ms = self.base_url, self._api_key, int(self.rpc_timeout_s * 1000)

                async def make() -> Any:
                    from solari_sandbox import SandboxClient

                    return SandboxClient(api_key=key, base_url=base_url, http=make_http_client(base_url),
                                         call_timeout_ms=rpc_ms)

                self._client = loop().run(make())
            return self._client

    def _run(self, coro: Awaitable[_T], timeout: float | None = 120.0) -> _T:
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
            return Availability(False, f"gateway {self.base_url} did not answer a read-only request: "
                                       f"{http}{type(e).__name__}: {gateway_words(e)}{hint}")
        return Availability(True, detail=f"gateway {self.base_url} answered (GET /sandboxes, "
                                         f"{len(page.get('sandboxes', []))} listed); conduit mode "
                                         f"{self.conduit_mode}, template {self.template or '(default)'}")

    @staticmethod
    async def _probe(client: Any) -> dict[str, Any]:
        """A read-only request: the list (which sweep needs too), else a GET by a made-up id --
        a 404 from an authenticated GET still proves the gateway and the key."""
        from solari_core.errors import NotFoundError

        try:
            return await client.list(limit=1)
        except NotFoundError:
            pass
        try:
            await client.get("resoluto-doctor:probe:none.0")
        except NotFoundError:
            return {"sandboxes": []}
        return {"sandboxes": []}

    # -- run preparation ------------------------------------------------------------------

    def prepare(self, conduit: Any, run_id: str) -> None:
        """Remember the run's conduit: the relay mirrors the VM's objects into it."""
        self._conduits[run_id] = conduit

    def check_spec(self, spec: LaunchSpec) -> None:
        super().check_spec(spec)
        if self.conduit_mode == "direct" and spec.env.get("RESOLUTO_STORE_KIND") != "s3":
            raise LaunchError(self._direct_needs_s3(spec.env.get("RESOLUTO_STORE_KIND", "")))

    @staticmethod
    def _direct_needs_s3(kind: str) -> str:
        return (f"conduit_mode='direct' needs an S3 conduit the VM can reach (got a {kind or 'local'} conduit); "
                "use conduit_mode='relay' (the default) to keep a local conduit: the host then relays every "
                "object out of the VM")

    def _run_conduit(self, spec: LaunchSpec) -> Any:
        run_id = spec.env.get("RESOLUTO_RUN_ID", "")
        conduit = self._conduits.get(run_id)
        if conduit is not None:
            return conduit
        # Not prepared (a caller other than drive_node): the conduit the node's env names.
        from guest_runner.conduit import LocalConduit, conduit_from_env

        if spec.conduit_root is not None:
            return LocalConduit(spec.conduit_root)
        return conduit_from_env(spec.env)

    # -- rendering: what launch would send -------------------------------------------------

    def create_request(self, spec: LaunchSpec) -> dict[str, Any]:
        """The ``CreateSandboxRequest`` body for ``spec``, exactly as the SDK puts it on the wire."""
        res = spec.resources
        cpu = self.cpu if self.cpu is not None else (max(1, math.ceil(res.cpus)) if res.cpus else None)
        mem = self.mem_mb if self.mem_mb is not None else (
            max(1, math.ceil(res.memory_bytes / 2**20)) if res.memory_bytes else None)
        disk = self.disk_gb if self.disk_gb is not None else (
            max(1, math.ceil(res.disk_bytes / 2**30)) if res.disk_bytes else None)
        metadata = {**self.metadata, **{str(k): str(v) for k, v in spec.labels.items()},
                    MANAGED_BY_KEY: MANAGED_BY, SANDBOX_ID_KEY: spec.sandbox_id}
        body: dict[str, Any] = {
            "template": self.template, "kind": "sandbox",
            "cpu": int(cpu) if cpu is not None else None,
            "memMb": int(mem) if mem is not None else None,
            "diskGb": int(disk) if disk is not None else None,
            "envs": dict(self.envs) or None,
            "metadata": metadata,
            "timeoutMs": int(self.session_timeout_s * 1000),
            "lifecycle": self.lifecycle,
        }
        return {k: v for k, v in body.items() if v is not None}

    def guest_command(self, spec: LaunchSpec, secret_env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """``cmd.start`` params for ``spec``: ``python3 -m guest_runner`` with the node's env."""
        rel = wire.node_prefix(spec.env["RESOLUTO_RUN_ID"], spec.env["RESOLUTO_NODE_ID"])
        env = {k: str(v) for k, v in spec.env.items()}
        if self.conduit_mode == "relay":
            for k in [k for k in env if k.startswith("RESOLUTO_STORE_")]:
                del env[k]
            env.update({"RESOLUTO_STORE_KIND": "localfs", "RESOLUTO_STORE_ROOT": self._store_root,
                        "RESOLUTO_STORE_PREFIX": rel})
        env["RESOLUTO_WORKSPACE_DIR"] = self._workspace
        env["PYTHONPATH"] = self._lib_dir + (f":{env['PYTHONPATH']}" if env.get("PYTHONPATH") else "")
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("HOME", self.guest_dir)
        env.update(secret_env if secret_env is not None else spec.secret_env)
        # Secrets of the store (relay: none reach the VM) are redacted like the task's own.
        redact = set(json.loads(env.get("RESOLUTO_SECRET_ENV") or "[]"))
        redact |= {k for k in (secret_env if secret_env is not None else spec.secret_env)}
        if redact:
            env["RESOLUTO_SECRET_ENV"] = json.dumps(sorted(redact), separators=(",", ":"))
        return {"cmd": self.python, "args": ["-m", "guest_runner"], "cwd": self.guest_dir, "env": env}

    def render(self, spec: LaunchSpec) -> dict[str, Any]:
        """What launch would send, as JSON-able data, the key and every secret value redacted."""
        self._check(spec)
        secrets = self._secret_env(spec, None, mint=False)
        command = self.guest_command(spec, {k: "<redacted>" for k in secrets})
        return {
            "runtime": self.name,
            "base_url": self.base_url,
            "authorization": "Bearer <redacted>" if self._api_key else None,
            "conduit_mode": self.conduit_mode,
            "create": self.create_request(spec),
            "command": command,
        }

    @property
    def _store_root(self) -> str:
        return f"{self.guest_dir}/store"

    @property
    def _workspace(self) -> str:
        return f"{self.guest_dir}/workspace"

    @property
    def _lib_dir(self) -> str:
        return f"{self.guest_dir}/lib"

    def _check(self, spec: LaunchSpec) -> None:
        self.check_spec(spec)
        for var in ("RESOLUTO_RUN_ID", "RESOLUTO_NODE_ID"):
            if not spec.env.get(var):
                raise LaunchError(f"the node's environment lacks {var}")

    def _secret_env(self, spec: LaunchSpec, conduit: Any, *, mint: bool) -> dict[str, str]:
        secrets = dict(spec.secret_env)
        if self.conduit_mode == "relay":
            # drive_node hands a local-conduit runtime the host's store credentials; the relay keeps
            # them on the host: the VM holds no credentials at all.
            user = set(json.loads(spec.env.get("RESOLUTO_USER_ENV") or "[]"))
            for k in _STORE_CREDENTIAL_VARS:
                if k not in user:
                    secrets.pop(k, None)
        elif self.store_role_arn and mint:
            for k in _STORE_CREDENTIAL_VARS:
                secrets.pop(k, None)
            secrets.update(self._mint_store_credentials(spec))
        elif self.store_role_arn:
            for k in _STORE_CREDENTIAL_VARS:
                secrets[k] = "<minted at launch>"
        return secrets

    def _mint_store_credentials(self, spec: LaunchSpec) -> dict[str, str]:
        """Short-lived credentials that reach only this node's prefix (STS AssumeRole + session policy)."""
        import boto3

        bucket = spec.env["RESOLUTO_STORE_BUCKET"]
        prefix = (spec.env.get("RESOLUTO_STORE_PREFIX") or "").strip("/")
        policy = json.dumps({"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject"],
             "Resource": [f"arn:aws:s3:::{bucket}/{prefix}/*"]},
            {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [f"arn:aws:s3:::{bucket}"],
             "Condition": {"StringLike": {"s3:prefix": [f"{prefix}/*", prefix]}}},
        ]})
        sts = boto3.client("sts", endpoint_url=self.store_sts_endpoint or None,
                           region_name=spec.env.get("RESOLUTO_STORE_REGION") or None)
        try:
            out = sts.assume_role(RoleArn=self.store_role_arn, RoleSessionName=spec.sandbox_id[:64],
                                  Policy=policy, DurationSeconds=self.store_credentials_ttl_s)
        except Exception as e:
            raise LaunchError(f"cannot mint short-lived store credentials by assuming {self.store_role_arn!r}: "
                              f"{type(e).__name__}: {e}") from e
        finally:
            sts.close()
        c = out["Credentials"]
        return {"AWS_ACCESS_KEY_ID": c["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": c["SecretAccessKey"],
                "AWS_SESSION_TOKEN": c["SessionToken"]}

    # -- launch ---------------------------------------------------------------------------

    def launch(self, spec: LaunchSpec) -> SandboxHandle:
        self._check(spec)
        client = self._sdk()
        conduit = self._run_conduit(spec) if self.conduit_mode == "relay" else None
        secrets = self._secret_env(spec, conduit, mint=True)
        rel = wire.node_prefix(spec.env["RESOLUTO_RUN_ID"], spec.env["RESOLUTO_NODE_ID"])
        inbox: dict[str, bytes] = {}
        if conduit is not None:
            for key in conduit.list_prefix(rel + "/"):
                inbox[key] = conduit.get(key)
        s = _Session(
            spec_id=spec.sandbox_id, mode=self.conduit_mode, run_id=spec.env["RESOLUTO_RUN_ID"],
            rel_prefix=rel, create=self.create_request(spec), command=self.guest_command(spec, secrets),
            conduit=conduit, inbox=inbox,
        )
        with _SESSIONS_LOCK:
            _SESSIONS[spec.sandbox_id] = s
            # Keep the last few reaped sessions (status/logs after destroy), not every one ever run.
            reaped = [k for k, v in _SESSIONS.items() if v.destroyed]
            for k in reaped[: max(0, len(reaped) - _KEEP_REAPED)]:
                del _SESSIONS[k]
        # The first create answers here, so a refused key or plan fails the launch at once; a
        # 429 returns a handle that waits for admission in the background.
        first = concurrent.futures.Future()  # type: ignore[var-annotated]
        s.task = loop().spawn(self._drive(client, s, first))
        try:
            verdict = first.result(timeout=300)
        except concurrent.futures.TimeoutError:
            verdict = ""
        if s.unstartable and verdict == "refused":
            self._forget(s)
            raise LaunchError(s.unstartable)
        return SandboxHandle(id=spec.sandbox_id, runtime=self.name, labels=dict(spec.labels),
                             data={"base_url": self.base_url, "mode": self.conduit_mode})

    async def _drive(self, client: Any, s: _Session, first: concurrent.futures.Future[str]) -> None:
        def answer(verdict: str) -> None:
            if not first.done():
                first.set_result(verdict)

        try:
            if not await self._admit(client, s, answer):
                return
            answer("created")
            if s.destroyed:
                return
            asyncio.ensure_future(self._keepalive(s))
            s.state = "staging"
            await self._stage(s)
            if s.mode == "relay":
                s.relay = VmRelay(s.sbx.files, self._store_root, s.rel_prefix, s.conduit)
            await self._start_command(s)
            s.state = "running"
            await self._watch(client, s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an unexpected error must end as a verdict, not a hung node
            if not (s.lost or s.unstartable):
                if s.state in ("admission", "staging"):
                    words = gateway_words(e)
                    hint = " (the control channel refused the API key: fix api_key or SOLARI_API_KEY)" \
                        if ("401" in words or "403" in words) else ""
                    s.unstartable = f"could not start the Solari sandbox: {type(e).__name__}: {words}{hint}"
                else:
                    s.lost = f"lost contact with the Solari sandbox: {type(e).__name__}: {gateway_words(e)}"
            logger.debug("solari session %s ended with %r", s.spec_id, e)
        finally:
            answer("refused" if s.unstartable else "")
            s.finished = True

    async def _admit(self, client: Any, s: _Session, answer: Callable[[str], None]) -> bool:
        from solari_core.errors import ConcurrencyLimitError, NoCapacityError, SolariConnectionError

        capacity_tries = 0
        attempt = 0
        while not s.destroyed:
            try:
                # The SDK's create carries one Idempotency-Key across its own retries.
                sbx = await client.create(**_create_kwargs(s.create))
            except Exception as e:
                kind = admission_kind(e, ConcurrencyLimitError, NoCapacityError, SolariConnectionError)
                if kind is None:
                    s.unstartable = self._refusal(e)
                    return False
                if kind == "slot":
                    if not await self._wait_for_slot(s, e, answer, attempt):
                        return False
                    attempt += 1
                    continue
                capacity_tries += 1
                if capacity_tries > self.capacity_retries:
                    s.unstartable = (f"the Solari gateway {self.base_url} had no capacity / could not be reached "
                                     f"after {capacity_tries} create attempts: {gateway_words(e)}")
                    return False
                await asyncio.sleep(backoff_s(capacity_tries))
                continue
            s.sbx, s.gw_id = sbx, sbx.id
            if s.destroyed:  # destroyed while the create was in flight: do not leak the VM
                await self._kill(client, s)
                return False
            return True
        return False

    async def _wait_for_slot(self, s: _Session, e: BaseException, answer: Callable[[str], None],
                             attempt: int) -> bool:
        """Held for admission (429): never unstartable, never an infrastructure retry."""
        if s.waiting_since is None:
            s.waiting_since = time.monotonic()
            answer("waiting")
        s.admission_waits += 1
        waited = time.monotonic() - s.waiting_since
        if self.admission_patience_s is not None and waited >= self.admission_patience_s:
            s.unstartable = (f"no Solari slot for {waited:.0f}s (admission_patience_s "
                             f"{self.admission_patience_s:.0f}): {gateway_words(e)}")
            return False
        await asyncio.sleep(min(self.admission_backoff_max_s, 0.2 * 2 ** min(attempt, 6))
                            * (0.5 + random.random() / 2))
        return True

    def _refusal(self, e: BaseException) -> str:
        # SDK divergence 12: a 403 without code NotEntitled is a plain GatewayError, not AuthError
        # (seed: 401/403 are AuthError); judged by status here.
        status = gateway_status(e)
        words = gateway_words(e)
        if status == 402 or (getattr(e, "code", "") or "").startswith("plan_") or type(e).__name__ == "PlanError":
            return (f"the Solari organisation's plan does not allow this sandbox ({status}): {words}. "
                    "Upgrade the plan, or lower cpu/mem_mb/disk_gb/template in the runtime options.")
        if status in (401, 403):
            return (f"the Solari gateway {self.base_url} refused the API key ({status}): {words}. "
                    "Fix api_key (runtime option, SandboxBlock solari_api_key) or SOLARI_API_KEY.")
        if status == 400:
            return f"the Solari gateway rejected the create request (400): {words}. Check the runtime options."
        if status == 404:
            return (f"the Solari gateway {self.base_url} has no such route or template (404): {words}. "
                    "Check base_url and template.")
        return f"the Solari gateway {self.base_url} refused to create the sandbox: {type(e).__name__}: {words}"

    async def _stage(self, s: _Session) -> None:
        """Write the guest runner (and, relaying, the inbox) into the VM through the files API."""
        from prefect_resoluto.guest_bundle import build_guest_bundle

        files = s.sbx.files
        # SDK divergence 6: RPC params carry explicit nulls for unset fields; every fs.write here
        # names its mode so only the gateway's documented optional field is left out.
        dirs = {self.guest_dir, self._lib_dir, self._workspace}
        _, blob = build_guest_bundle()
        members: list[tuple[str, bytes]] = []
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
            for m in tar.getmembers():
                if m.isfile():
                    data = tar.extractfile(m).read()  # type: ignore[union-attr]
                    members.append((f"{self._lib_dir}/{m.name}", data))
                    dirs.add(f"{self._lib_dir}/{m.name.rsplit('/', 1)[0]}")
        if s.mode == "relay":
            dirs.add(f"{self._store_root}/{s.rel_prefix}")
            for key in s.inbox:
                dirs.add(f"{self._store_root}/{key.rsplit('/', 1)[0]}")
        for d in sorted(dirs):
            await files.mkdir(d)
        for path, data in members:
            await files.write(path, data, 0o644)
        for key, data in sorted(s.inbox.items()):
            await files.write(f"{self._store_root}/{key}", data, 0o644)
        s.inbox.clear()

    async def _start_command(self, s: _Session) -> None:
        c = s.command
        # SDK divergence 8: commands.start(timeout_ms=N) arms its deadline even when the exit frame
        # beat the cmd.start reply, then sends a spurious cmd.kill -9: no SDK deadline at all --
        # liveness is the silence watchdog's.
        s.cmd = await s.sbx.commands.start(c["cmd"], args=c["args"], cwd=c["cwd"], env=c["env"])

        def on_data(stream: str, text: str) -> None:
            # SDK divergence 7: output is decoded per chunk with errors="replace"; it is forensics only
            # (events travel through the conduit), so a character split across chunks may show as U+FFFD.
            buf = s.partial.get(stream, "") + text
            *lines, rest = buf.split("\n")
            s.partial[stream] = rest
            s.output.extend(lines)

        s.cmd.on_data(on_data)
        asyncio.ensure_future(self._await_exit(s, s.cmd))

    async def _await_exit(self, s: _Session, cmd: Any) -> None:
        try:
            s.exit_code = await cmd.wait()
            s.exited = True
        except Exception:
            # The channel dropped before cmd.exit: the exit frame is gone with it. The VM's own
            # objects (the manifest) tell the rest; the watch loop reconnects.
            pass

    async def _watch(self, client: Any, s: _Session) -> None:
        delay = self.relay_poll_min_s
        last_progress = time.monotonic()
        lost_channel_at: float | None = None
        while not s.destroyed:
            now = time.monotonic()
            try:
                if now - s.last_view >= self.view_interval_s:
                    s.last_view = now
                    if not await self._still_there(client, s):
                        return
                progressed = False
                if s.relay is not None and not s.relay.done:
                    exited_before = s.exited
                    progressed = await s.relay.step()
                    if not s.relay.done and exited_before:
                        return  # a whole pass after the exit found no manifest: the guest left none
                if (s.relay is not None and s.relay.done) or (s.relay is None and s.exited):
                    return
                lost_channel_at = None
            except Exception as e:
                if not transient_rpc_error(e):
                    raise
                lost_channel_at = lost_channel_at or time.monotonic()
                if not await self._still_there(client, s):
                    return
                if time.monotonic() - lost_channel_at > self.reconnect_patience_s:
                    s.lost = (f"the control channel to Solari sandbox {s.gw_id} dropped and could not be "
                              f"re-established for {self.reconnect_patience_s:.0f}s: {gateway_words(e)}")
                    return
                await asyncio.sleep(backoff_s(min(s.reconnects, 4)))
                try:
                    # SDK divergence 4: client.connect(id) derives the control URL from base_url and
                    # ignores the one the gateway returned; reconnecting the handle itself keeps the
                    # gateway's controlUrl from create.
                    await s.sbx.reconnect()
                    s.reconnects += 1
                except Exception as again:
                    logger.debug("solari reconnect of %s failed: %r", s.gw_id, again)
                continue
            # A busy guest ships a chunk every flush interval (50 ms): stay fast for a few of them
            # after the last new object, then back off while it is quiet (each poll is one RPC).
            if progressed:
                last_progress = time.monotonic()
            if time.monotonic() - last_progress < _HOT_S:
                delay = self.relay_poll_min_s
            else:
                delay = min(self.relay_poll_max_s, delay * 2)
            await asyncio.sleep(delay)

    async def _keepalive(self, s: _Session) -> None:
        """Liveness is ours: while the host watches the node, the gateway keeps the session."""
        while not (s.finished or s.destroyed):
            try:
                await s.sbx.set_timeout(int(self.session_timeout_s * 1000))
                s.last_keepalive = time.monotonic()
            except Exception as e:  # the watch loop judges a gone sandbox; retry soon
                logger.debug("solari set_timeout on %s failed: %r", s.gw_id, e)
                await asyncio.sleep(min(1.0, self.session_timeout_s / 6))
                continue
            await asyncio.sleep(self.session_timeout_s / 3)

    async def _still_there(self, client: Any, s: _Session) -> bool:
        from solari_core.errors import NotFoundError

        try:
            view = await client.get(s.gw_id)
        except NotFoundError as e:
            if not s.destroyed:
                s.lost = f"the Solari sandbox {s.gw_id} is gone (404 from the gateway: {gateway_words(e)})"
            return False
        except Exception as e:  # the gateway itself is unreachable: keep trying, the watchdog decides
            logger.debug("solari GET %s failed: %r", s.gw_id, e)
            return True
        if view.state not in ("running", "starting") and not s.destroyed:
            s.lost = (f"the Solari sandbox {s.gw_id} is no longer running: the gateway reports state "
                      f"{view.state!r} (expires at {view.expiresAt})")
            return False
        return True

    async def _kill(self, client: Any, s: _Session) -> None:
        if s.gw_id:
            await client.kill(s.gw_id)  # idempotent: a 404 counts as done
        if s.sbx is not None:
            try:
                await s.sbx.close()
            except Exception:
                pass

    # -- status -----------------------------------------------------------------------------

    def _session(self, handle: SandboxHandle) -> _Session | None:
        with _SESSIONS_LOCK:
            return _SESSIONS.get(handle.id)

    def status(self, handle: SandboxHandle) -> SandboxStatus:
        s = self._session(handle)
        if s is None:
            return SandboxStatus("unknown", gone=True, reason=f"sandbox {handle.id} is not known to this process")
        if s.unstartable:
            return SandboxStatus("pending", unstartable=True, reason=s.unstartable)
        if s.lost:
            return SandboxStatus("unknown", gone=True, infrastructure=True, reason=s.lost)
        if s.state == "admission":
            if s.waiting_since is not None:
                waited = time.monotonic() - s.waiting_since
                if not s.waiting_logged:
                    s.waiting_logged = True
                    _task_log(logging.WARNING,
                              f"waiting for a Solari slot: the organisation is at its session cap (429 from "
                              f"{self.base_url}); the node starts when a slot frees")
                return SandboxStatus("pending", reason=f"waiting for a Solari slot ({waited:.0f}s, "
                                                       f"{s.admission_waits} attempt(s))")
            return SandboxStatus("pending", reason="creating the Solari sandbox")
        if s.waiting_logged:
            s.waiting_logged = False
            _task_log(logging.INFO, f"a Solari slot freed: sandbox {s.gw_id} created")
        if s.state == "staging":
            return SandboxStatus("pending", reason=f"staging the guest runner into {s.gw_id}")
        if s.finished:
            if s.exited and s.exit_code not in (0, None):
                return SandboxStatus("failed", exit_code=s.exit_code,
                                     reason=f"the guest exited with code {s.exit_code}")
            if s.exited or (s.relay is not None and s.relay.done):
                return SandboxStatus("succeeded", exit_code=s.exit_code, reason="the guest command exited")
            if s.destroyed:
                return SandboxStatus("unknown", gone=True, reason=f"sandbox {s.gw_id} was destroyed")
            return SandboxStatus("unknown", gone=True, infrastructure=True,
                                 reason=f"the Solari session {s.gw_id} ended without an exit")
        return SandboxStatus("running", reason=f"Solari sandbox {s.gw_id}")

    # -- destroy / sweep / logs ---------------------------------------------------------------

    def _forget(self, s: _Session) -> None:
        with _SESSIONS_LOCK:
            _SESSIONS.pop(s.spec_id, None)

    def destroy(self, handle: SandboxHandle) -> None:
        s = self._session(handle)
        if s is None:
            return
        s.destroyed = True
        client = self._sdk()

        async def reap() -> None:
            task = s.task
            await self._kill(client, s)
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
        s = self._session(handle)
        if s is None:
            return f"(no output recorded for {handle.id} in this process)"
        lines = list(s.output) + [v for v in s.partial.values() if v]
        head = f"[solari sandbox {s.gw_id or '(not created)'}, {s.reconnects} reconnect(s)]"
        return "\n".join([head, *lines[-max(1, int(tail)):]])


def _create_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """``client.create`` keyword arguments for a ``CreateSandboxRequest`` body."""
    names = {"memMb": "mem_mb", "diskGb": "disk_gb", "timeoutMs": "timeout_ms"}
    return {names.get(k, k): v for k, v in body.items() if k != "kind"}
