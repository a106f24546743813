"""Prefect's API as a task inside a sandbox meets it: nothing starts one, nothing waits on one.

There is no Prefect API in a sandbox. Left alone, Prefect's client, finding no
``PREFECT_API_URL``, starts an ephemeral server of its own in the sandbox and waits
for it. Once the real package is loaded in a call (:func:`patch`):

- the settings name an API URL that is never contacted, and every request Prefect's HTTP
  clients would send raises :class:`PrefectAPIUnavailable` at once, saying what is not
  available and why (events are not emitted at all);
- artifacts (``create_*_artifact``, ``Artifact.create``, ``update_progress_artifact``)
  are relayed instead: one line on stdout per artifact, which the guest runner ships as
  an event of kind ``artifact`` and the host creates on the task run and its flow run.

Bounded here (a clear error in the task) and again, independently, on the host.
Standard library only: Prefect is reached by module name.
"""

from __future__ import annotations

import importlib
import json
import sys
import threading
import types
import uuid
from importlib.machinery import ModuleSpec, PathFinder
from typing import Any, Callable, Dict, Optional

from guest_runner import refusal
from guest_runner.wire import ARTIFACT_MARKER, ENV_PREFECT_READS, MAX_ARTIFACT_BYTES

#: The API URL Prefect's settings name inside a sandbox: never resolved, never contacted.
UNAVAILABLE_URL = "http://prefect-api.not-available-in-a-sandbox.invalid/api"
#: At most this many artifacts (creations and progress updates) relayed per node.
MAX_ARTIFACTS = 1000
#: The artifact types Prefect's functions make.
ARTIFACT_TYPES = ("markdown", "table", "link", "progress", "image")

WHY = (
    "the task's function runs in a sandbox with no Prefect API (ResolutoTaskRunner); "
    "Prefect keeps every run's state on the host"
)


class PrefectAPIUnavailable(RuntimeError):
    """A Prefect API call made inside a sandboxed task: refused at once, never waited on."""


class ArtifactRefused(ValueError):
    """An artifact over the relay's bounds (count or size)."""


def _what(method: str, path: str) -> str:
    """The Prefect object a request was about, in a user's words."""
    p = path.split("/api/", 1)[-1] if "/api/" in path else path.lstrip("/")
    first = p.split("/", 1)[0]
    named = {
        "variables": "Prefect variables (Variable.get / set)",
        "block_documents": "Prefect blocks (Block.load / save)",
        "block_types": "Prefect blocks (Block.load / save)",
        "block_schemas": "Prefect blocks (Block.load / save)",
        "artifacts": "reading or changing Prefect artifacts",
        "flow_runs": "reading or changing flow runs",
        "task_runs": "reading or changing task runs",
        "deployments": "deployments (run_deployment, reading one)",
        "concurrency_limits": "concurrency limits",
        "v2": "global concurrency limits",
    }
    return named.get(first, f"the Prefect API ({method} /{p})")


def unavailable(what: str) -> PrefectAPIUnavailable:
    return PrefectAPIUnavailable(
        f"{what} is not available inside a sandboxed task: {WHY}. Create artifacts with "
        "prefect.artifacts (relayed to the host), and do anything else with the API in the flow, "
        "passing what the task needs as a parameter."
    )


def _refuse_request(method: str, url: Any) -> PrefectAPIUnavailable:
    return unavailable(_what(str(method), str(getattr(url, "path", url))))


# -- artifacts -------------------------------------------------------------------------
_lock = threading.Lock()
_sent = 0


def relay(message: Dict[str, Any]) -> None:
    """One artifact message on the call's stdout (the guest runner's pipe), checked first."""
    global _sent
    line = json.dumps(message, ensure_ascii=False, default=str)
    if len(line.encode("utf-8")) > MAX_ARTIFACT_BYTES:
        raise ArtifactRefused(
            f"artifact refused: {len(line.encode('utf-8'))} bytes is more than a sandboxed task may "
            f"relay in one artifact ({MAX_ARTIFACT_BYTES} bytes); write the data to a file in "
            "output_paths and link to it instead"
        )
    with _lock:
        if _sent >= MAX_ARTIFACTS:
            raise ArtifactRefused(
                f"artifact refused: a sandboxed task may relay at most {MAX_ARTIFACTS} artifacts "
                "(creations and progress updates) per run"
            )
        _sent += 1
        stream = sys.__stdout__ or sys.stdout
        stream.write(ARTIFACT_MARKER + line + "\n")
        stream.flush()


def _artifact_create(artifact: Any) -> Any:
    """Relay ``artifact`` (a prefect.artifacts.Artifact) and answer as the API would."""
    objects = importlib.import_module("prefect.client.schemas.objects")
    data = artifact.format(_sync=True) if hasattr(artifact, "format") else artifact.data
    local_id = str(uuid.uuid4())
    relay(
        {
            "op": "create",
            "id": local_id,
            "type": artifact.type,
            # Not "key": span data fields named like a secret ("key", "token") are masked.
            "label": artifact.key,
            "description": artifact.description,
            "data": data,
        }
    )
    return objects.Artifact(
        id=uuid.UUID(local_id),
        type=artifact.type,
        key=artifact.key,
        description=artifact.description,
        data=data,
    )


def _progress_update(artifact_id: Any, progress: float, description: Optional[str] = None, **_: Any) -> Any:
    artifacts = importlib.import_module("prefect.artifacts")
    data = artifacts.ProgressArtifact(progress=progress).format(_sync=True)
    message: Dict[str, Any] = {"op": "update", "id": str(artifact_id), "data": data}
    if description:
        message["description"] = description
    relay(message)
    return artifact_id


def _patch_artifacts(module: types.ModuleType) -> None:
    cls = module.Artifact

    def create(self: Any, client: Any = None, _sync: Any = None) -> Any:
        return _artifact_create(self)

    async def acreate(self: Any, client: Any = None) -> Any:
        return _artifact_create(self)

    cls.create = create
    cls.acreate = acreate

    def update(*args: Any, _sync: Any = None, **kwargs: Any) -> Any:
        return _progress_update(*args, **kwargs)

    async def aupdate(*args: Any, **kwargs: Any) -> Any:
        return _progress_update(*args, **kwargs)

    module.update_progress_artifact = update  # type: ignore[attr-defined]
    module.aupdate_progress_artifact = aupdate  # type: ignore[attr-defined]


# -- variables and blocks the runner allows ------------------------------------------------
#: The node's environment variable (a declared secret: delivered at assignment, redacted)
#: holding {"variables": {name: value}, "blocks": {"slug/name": {...}}}: what the host read
#: of the runner's allowed_variables / allowed_blocks when the task started.
READS_ENV = ENV_PREFECT_READS
_reads: Optional[Dict[str, Any]] = None


def reads() -> Dict[str, Any]:
    global _reads
    if _reads is None:
        import os

        try:
            loaded = json.loads(os.environ.get(READS_ENV, "") or "{}")
        except ValueError:
            loaded = {}
        _reads = loaded if isinstance(loaded, dict) else {}
    return _reads


def _allowed(kind: str) -> Dict[str, Any]:
    found = reads().get(kind)
    return found if isinstance(found, dict) else {}


def _not_allowed(setting: str, name: str, allowed: Dict[str, Any]) -> PrefectAPIUnavailable:
    return PrefectAPIUnavailable(refusal.not_readable(setting, name, allowed, refusal.TASK_RUNNER))


def _refused_write(setting: str, name: Any, how: str) -> PrefectAPIUnavailable:
    return PrefectAPIUnavailable(refusal.not_writable(setting, str(name), refusal.TASK_RUNNER, how))


def _variable_get(name: Any, default: Any = None) -> Any:
    variables = _allowed("variables")
    if name not in variables:
        raise _not_allowed("allowed_variables", str(name), variables)
    value = variables[name]
    return default if value is None else value


def _patch_variables(module: types.ModuleType) -> None:
    cls = module.Variable

    def get(cls_: Any, name: str, default: Any = None, _sync: Any = None) -> Any:
        return _variable_get(name, default)

    async def aget(cls_: Any, name: str, default: Any = None) -> Any:
        return _variable_get(name, default)

    def writer(what: str) -> Any:
        def refuse(cls_: Any, name: Any = None, *args: Any, **kwargs: Any) -> Any:
            raise _refused_write("allowed_variables", name, what)

        async def arefuse(cls_: Any, name: Any = None, *args: Any, **kwargs: Any) -> Any:
            raise _refused_write("allowed_variables", name, what)

        return refuse, arefuse

    cls.get, cls.aget = classmethod(get), classmethod(aget)
    for verb in ("set", "unset"):
        sync, asynchronous = writer(f"Variable.{verb}")
        setattr(cls, verb, classmethod(sync))
        setattr(cls, "a" + verb, classmethod(asynchronous))


def _block_load(cls: Any, name: str) -> Any:
    if cls.__name__ == "Block" and "/" in name:
        ref = name
    else:
        ref = f"{cls.get_block_type_slug()}/{name}"
    blocks = _allowed("blocks")
    found = blocks.get(ref)
    if not isinstance(found, dict):
        raise _not_allowed("allowed_blocks", ref, blocks)
    error = found.get("error")
    if isinstance(error, dict):  # what loading it on the host raised (a block that does not exist)
        message = str(error.get("message", ""))
        raise (ValueError(message) if error.get("type") == "ValueError" else PrefectAPIUnavailable(message))
    target: Any = importlib.import_module(str(found.get("module")))
    for part in str(found.get("qualname")).split("."):
        target = getattr(target, part)
    return target.model_validate(found.get("data") or {})


def _patch_blocks(module: types.ModuleType) -> None:
    cls = module.Block

    def load(cls_: Any, name: str, validate: bool = True, client: Any = None, _sync: Any = None) -> Any:
        return _block_load(cls_, name)

    async def aload(cls_: Any, name: str, validate: bool = True, client: Any = None) -> Any:
        return _block_load(cls_, name)

    def writer(what: str) -> Any:
        def refuse(self: Any, name: Any = None, *args: Any, **kwargs: Any) -> Any:
            raise _refused_write("allowed_blocks", name, what)

        async def arefuse(self: Any, name: Any = None, *args: Any, **kwargs: Any) -> Any:
            raise _refused_write("allowed_blocks", name, what)

        return refuse, arefuse

    cls.load, cls.aload = classmethod(load), classmethod(aload)
    sync, asynchronous = writer("Block.save")
    cls.save, cls.asave = sync, asynchronous
    sync, asynchronous = writer("Block.delete")
    cls.delete, cls.adelete = classmethod(sync), classmethod(asynchronous)


# -- the client ------------------------------------------------------------------------
def _patch_client(base: types.ModuleType) -> None:
    async def asend(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        raise _refuse_request(request.method, request.url)

    def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        raise _refuse_request(request.method, request.url)

    base.PrefectHttpxAsyncClient.send = asend
    base.PrefectHttpxSyncClient.send = send


def _patch_settings() -> None:
    """Name an API that is never contacted, so no ephemeral server is started; for this
    process and every thread it starts (the global settings, not a context var)."""
    context = importlib.import_module("prefect.context")
    settings = importlib.import_module("prefect.settings")
    current = getattr(context, "GLOBAL_SETTINGS_CONTEXT")  # noqa: B009 - read at call time, as Prefect does
    updated = current.settings.copy_with_update(updates={settings.PREFECT_API_URL: UNAVAILABLE_URL})
    setattr(context, "GLOBAL_SETTINGS_CONTEXT", current.model_copy(update={"settings": updated}))  # noqa: B010


def _patch_events(utilities: types.ModuleType) -> None:
    # Events would go to a websocket on the API's URL from a background thread.
    utilities.should_emit_events = lambda: False  # type: ignore[attr-defined]


_PATCHES: Dict[str, Callable[[types.ModuleType], None]] = {
    "prefect.client.base": _patch_client,
    "prefect.artifacts": _patch_artifacts,
    "prefect.events.utilities": _patch_events,
    "prefect.variables": _patch_variables,
    "prefect.blocks.core": _patch_blocks,
}
_patched: "set[str]" = set()


def patch_loaded() -> None:
    """Patch the modules of :data:`_PATCHES` already imported (idempotent)."""
    for name, fn in _PATCHES.items():
        module = sys.modules.get(name)
        if module is not None and name not in _patched:
            _patched.add(name)
            fn(module)


def patched_on_load(
    fullname: str, path: Any, patch: "Callable[[types.ModuleType], None]"
) -> "Optional[ModuleSpec]":
    """The spec of ``fullname`` whose loading runs ``patch`` on the module right after it."""
    spec = PathFinder.find_spec(fullname, path)
    if spec is None or spec.loader is None:
        return None
    exec_module = spec.loader.exec_module

    def exec_and_patch(module: types.ModuleType) -> None:
        exec_module(module)
        patch(module)

    spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
    return spec


def find_spec(fullname: str, path: Any) -> "Optional[ModuleSpec]":
    """The spec of a module of :data:`_PATCHES` whose loading patches it; None for others."""
    if fullname not in _PATCHES or fullname in _patched or fullname in sys.modules:
        return None

    def once(module: types.ModuleType) -> None:
        if fullname not in _patched:
            _patched.add(fullname)
            _PATCHES[fullname](module)

    return patched_on_load(fullname, path, once)


class _AfterImport:
    """A meta path finder that patches a module of :data:`_PATCHES` as soon as it is imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        return find_spec(fullname, path)


_installed = False


def patch() -> None:
    """Called once the real ``prefect`` is imported in a call (guest_runner.standin)."""
    global _installed
    if not _installed:
        _installed = True
        _patch_settings()
        sys.meta_path.insert(0, _AfterImport())
    patch_loaded()
