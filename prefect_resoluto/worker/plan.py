"""A whole Prefect flow run as one sandbox node: what the ``resoluto`` worker launches.

Nothing here is async or talks to the Prefect API: the worker (``worker.py``) hands in
the prepared environment and the deployment's code locations, and gets back a
:class:`FlowRunPlan`: the :class:`~prefect_resoluto.node.spec.NodeSpec` plus the runtime to
drive it on, the conduit and the run's API gateway. The one
network decision (how the sandbox reaches the Prefect API, and nothing else) is
:func:`sandbox_network`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from guest_runner import wire
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes._guest_layout import host_interpreter
from prefect_resoluto.runtimes.base import SandboxRuntime
from prefect_resoluto.settings.config import SandboxConfig

if TYPE_CHECKING:
    from guest_runner.conduit import Conduit
    from prefect_resoluto.worker.gateway import ApiGateway

#: The name a sandbox dials for the Prefect API on the worker's own loopback; the egress
#: proxy forwards exactly this name:port to 127.0.0.1:<port> and nothing else of loopback.
API_ALIAS = "prefect-api.resoluto.internal"

LABEL_WORKER = "resoluto.worker"
LABEL_WORKER_INSTANCE = "resoluto.worker-instance"
LABEL_WORK_POOL = "resoluto.work-pool"

# Prefect settings whose values are credentials: the worker's own, never passed into a
# sandbox (its credential is its gateway token).
_SECRET_SETTING = re.compile(r"^PREFECT_\w*(API_KEY|AUTH_STRING|PASSWORD|SECRET|TOKEN)\w*$")
# Settings naming host paths of the worker's own Prefect home: a sandbox has its own.
_HOST_PATH_SETTINGS = ("PREFECT_HOME", "PREFECT_PROFILES_PATH", "PREFECT_LOCAL_STORAGE_PATH")


class SandboxNetworkUnavailable(RuntimeError):
    """The runtime cannot give the flow run a path to the Prefect API."""


@dataclass
class SandboxNetwork:
    """How one flow run's sandbox reaches the API: env to set, allowlist, forwards."""

    env: dict[str, str] = field(default_factory=dict)
    egress: list[str] = field(default_factory=list)
    egress_forward: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FlowRunPlan:
    """Everything the worker decided about a flow run before its launch."""

    spec: NodeSpec
    runtime: SandboxRuntime
    #: Open: the worker closes it once the node is over.
    conduit: Conduit
    config: SandboxConfig
    #: The run's API gateway, serving until the run is over; None when the worker lets its
    #: runs dial the API themselves (the benchmarks' baseline).
    gateway: ApiGateway | None


def egress_forwarding_supported() -> bool:
    """Whether this installation's NodeSpec carries egress forwards (the egress proxy)."""
    return any(f.name == "egress_forward" for f in dataclasses.fields(NodeSpec))


def host_network(runtime: SandboxRuntime) -> bool:
    """The plain process runtime shares the worker's network: nothing to forward."""
    from prefect_resoluto.runtimes.process import ProcessRuntime

    return isinstance(runtime, ProcessRuntime)


def sandbox_network(runtime: SandboxRuntime, api_url: str, egress: list[str]) -> SandboxNetwork:
    """The API (the run's gateway, see gateway.py), reachable from the sandbox as the only
    extra destination.

    * host network (``process``): the URL as it is; the job's allowlist cannot be enforced
      there, so the runtime refuses a non-empty one.
    * a local sandbox: an API on the worker's loopback is dialled as ``API_ALIAS:<port>``
      and forwarded to that one loopback port; any other API host joins the allowlist.
    * a remote sandbox (Kubernetes): the API's address joins the NetworkPolicy allowlist as
      ``<address>/32:<port>``, and is cut out of every other entry (kube_egress.py); the
      worker's loopback is unreachable from a pod, which is said before launch.
    """
    if host_network(runtime):
        return SandboxNetwork(env={"PREFECT_API_URL": api_url}, egress=list(egress))
    parts = urlsplit(api_url)
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host:
        raise SandboxNetworkUnavailable(f"PREFECT_API_URL {api_url!r} is not an http(s) URL")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    loopback = _is_loopback(host)
    if not runtime.capabilities.host_loopback:
        if loopback:
            raise SandboxNetworkUnavailable(
                f"the flow run's API gateway {api_url} is on the worker's loopback, which a {runtime.name} "
                "sandbox on another machine cannot reach; set the `api_gateway_address` job variable to an "
                "address of the worker's host that the sandboxes can reach (the worker never passes its "
                "own API credential into a sandbox instead)"
            )
        if runtime.name != "kubernetes":
            return SandboxNetwork(env={"PREFECT_API_URL": api_url}, egress=[*egress, f"{host}:{port}"])
        return _pod_network(api_url, host, port, egress)
    if not egress_forwarding_supported():
        raise SandboxNetworkUnavailable(
            f"runtime {runtime.name!r} gives a sandbox no network, and this installation of prefect-resoluto "
            "has no egress proxy to forward the Prefect API into it; a flow run cannot report to the API "
            "from there. Use runtime 'process' with min isolation 'none' (trusted flows only), or upgrade "
            "prefect-resoluto to a version with egress forwarding."
        )
    if loopback:
        netloc = f"{API_ALIAS}:{port}"
        url = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
        target = (
            f"[{host}]:{port}" if ":" in host else f"{'127.0.0.1' if host == 'localhost' else host}:{port}"
        )
        return SandboxNetwork(
            env={"PREFECT_API_URL": url}, egress=list(egress), egress_forward={netloc: target}
        )
    return SandboxNetwork(env={"PREFECT_API_URL": api_url}, egress=[*egress, f"{host}:{port}"])


def _pod_network(api_url: str, host: str, port: int, egress: list[str]) -> SandboxNetwork:
    """The worker's host at the gateway's one address and port; the gateway's and every other
    address of the host cut out of every other entry."""
    from prefect_resoluto.worker.kube_egress import (
        GatewayAddressRefused,
        allowlist_without,
        gateway_destination,
        host_networks,
    )

    try:
        dest = gateway_destination(_kube_destination(host))
    except GatewayAddressRefused as e:
        raise SandboxNetworkUnavailable(str(e)) from None
    return SandboxNetwork(
        env={"PREFECT_API_URL": api_url},
        egress=[*allowlist_without(egress, dest, host_networks()), f"{dest}:{port}"],
    )


def check_pod_rules(runtime: SandboxRuntime, spec: NodeSpec, conduit: Conduit) -> None:
    """A worker's flow-run pod on Kubernetes: its DNS and store rules open no address of the
    worker's host either (kube_egress.check_infrastructure_rules); other runtimes: nothing."""
    if runtime.name != "kubernetes":
        return
    from prefect_resoluto.node.spec import launch_spec
    from prefect_resoluto.worker.kube_egress import (
        GatewayAddressRefused,
        check_infrastructure_rules,
        host_networks,
    )

    options = getattr(runtime, "options", None)
    derived = not (getattr(options, "store_egress_cidr", None) or getattr(options, "store_egress_port", None))
    rules = runtime.egress_rules(launch_spec(spec, conduit))  # type: ignore[attr-defined]
    try:
        check_infrastructure_rules(rules, host_networks(), store_derived=derived)
    except GatewayAddressRefused as e:
        raise SandboxNetworkUnavailable(str(e)) from None


def _is_loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _kube_destination(host: str) -> str:
    """A NetworkPolicy names addresses, not host names: resolve here, once per launch."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        addr = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as e:
        raise SandboxNetworkUnavailable(f"cannot resolve the Prefect API host {host!r}: {e}") from None
    return str(addr)


def split_env(
    env: dict[str, str | None], secret_env: dict[str, str]
) -> tuple[dict[str, str], dict[str, str]]:
    """(plain env, secret env) for the sandbox from the worker's prepared job env.

    Prefect's own credential settings in the prepared env are the worker's (Prefect copies
    its settings into every job's env): they are dropped, never passed — the sandbox's
    only credential is its gateway token (:func:`gateway_env`). The API URL is the
    gateway's, set by :func:`sandbox_network`; the worker's own Prefect home paths are
    dropped too (the sandbox gets a fresh one under its HOME)."""
    plain: dict[str, str] = {}
    secret = dict(secret_env)
    for k, v in env.items():
        if v is None or k in _HOST_PATH_SETTINGS or k == "PREFECT_API_URL" or _SECRET_SETTING.match(k):
            continue
        plain[k] = v
    for k in secret:
        plain.pop(k, None)
    return plain, secret


def gateway_env(token: str) -> dict[str, str]:
    """The secret env that makes Prefect's client speak to the gateway with the run's token.

    As ``PREFECT_API_AUTH_STRING`` (not ``PREFECT_API_KEY``): Prefect's client then sends it
    on every HTTP request (``Authorization: Basic``) *and* on its events websocket (the
    ``prefect`` subprotocol's auth message); an API key toward a URL that is not Prefect
    Cloud's reaches the HTTP requests only, and the events (task-run states) would carry
    no credential at all."""
    return {"PREFECT_API_AUTH_STRING": token}


def code_directories(pull_steps: list[dict[str, Any]] | None, deployment_path: str | None) -> list[str]:
    """Host directories holding the deployment's code, as its own pull steps will look for it.

    ``set_working_directory`` steps (``prefect deploy`` and ``flow.from_source`` of a local
    directory) and a storage-less deployment's ``path`` name host directories; they are
    bound read-only at the same path so Prefect's unmodified pull logic finds them. Other
    steps (git clone, cloud storage) fetch through the network, so their hosts belong in the
    job's egress allowlist."""
    found: list[str] = []
    for step in pull_steps or []:
        for name, args in step.items():
            if name.endswith("set_working_directory") and isinstance(args, dict):
                d = args.get("directory")
                if isinstance(d, str) and d.startswith("/") and "{{" not in d:
                    found.append(d)
    if not pull_steps and deployment_path and str(deployment_path).startswith("/"):
        found.append(str(deployment_path))
    return [d for d in dict.fromkeys(found) if Path(d).is_dir()]


def with_code_mounts(cfg: SandboxConfig, runtime_name: str, directories: list[str]) -> SandboxConfig:
    """``cfg`` with the code directories bound read-only, where the runtime can bind them."""
    if not directories:
        return cfg
    from prefect_resoluto.runtimes import RUNTIMES

    if not RUNTIMES[runtime_name].capabilities.takes_extra_ro_paths:
        return cfg  # process sees host paths as they are; images and pods bring their own code
    have = list(cfg.runtime_options.get("extra_ro_paths") or [])
    return cfg.replace(runtime_options={"extra_ro_paths": list(dict.fromkeys(have + directories))})


def engine_argv(command: str | None, runtime: SandboxRuntime, image: str | None) -> list[str]:
    """Prefect's standard flow-run entry point, as Prefect's own process worker runs it,
    through ``guest_runner.engine`` (on every sandbox's PYTHONPATH): the gateway's refusals
    raise what they raise in a sandboxed task. A ``command`` of the job's own runs as it is.

    With the host's interpreter bound into the sandbox (local runtimes without an image)
    that interpreter runs it; an image brings its own ``python``."""
    import shlex

    if command:
        return shlex.split(command)
    python = host_interpreter() if runtime.capabilities.host_python and not image else "python"
    return [python, "-m", wire.WARM_ENGINE_MODULE]


def new_node_id() -> str:
    # Unique per submission: a flow run submitted again (after a crash) must not find the
    # chunks of its earlier sandbox under the same prefix.
    return f"flow-run-{uuid.uuid4().hex[:12]}"


def ui_env() -> dict[str, str]:
    """``PREFECT_UI_URL`` for a flow run's sandbox: the worker's own UI. Without it Prefect
    derives the UI from the sandbox's API URL (the gateway's internal name) and prints a
    "View at http://prefect-api.resoluto.internal:..." link nobody can open."""
    from prefect.settings import PREFECT_UI_URL

    ui = PREFECT_UI_URL.value()
    return {"PREFECT_UI_URL": str(ui)} if ui else {}
