"""The Kubernetes API as the runtime uses it: one pinned connection, retries, errors that say what to do.

* **Context pinning** -- a kubeconfig's *current* context is whatever someone last
  switched to, so it is refused unless the operator pins one (``context=`` /
  ``RESOLUTO_SANDBOX_KUBECONTEXT``) or accepts the ambient one explicitly
  (``RESOLUTO_SANDBOX_ALLOW_AMBIENT_CONTEXT=1``). Inside a pod without a kubeconfig the
  in-cluster service account is used.
* **One retry layer** -- 429/5xx and connection errors are retried with jittered
  exponential back-off; a ``Retry-After`` pauses the runtime's rate limit
  (:mod:`.ratelimit`, which every attempt waits on) for every caller; urllib3's own
  retries are off so attempts do not multiply. A create retried after a lost answer that then sees 409 asks
  ``on_conflict`` whether the object is the one this runtime wrote.
* **Errors** -- every refusal becomes a :class:`KubernetesApiError` naming the verb, the
  resource, the namespace and the fix (RBAC verb, missing namespace, admission policy...).

The client library is imported only when a connection is made.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from prefect_resoluto.runtimes.base import RuntimeUnavailable
from prefect_resoluto.runtimes.kubernetes.ratelimit import RateLimiter

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


class KubernetesApiError(RuntimeError):
    """The API server refused or failed a request; the message says what to do."""

    def __init__(
        self, message: str, *, status: int | None = None, verb: str = "", resource: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.verb = verb
        self.resource = resource


class KubernetesConfigError(RuntimeUnavailable):
    """No usable, explicitly chosen cluster connection (context pinning, kubeconfig)."""


class KubernetesApi:
    """A lazily made, pinned connection to one cluster's API for one namespace."""

    def __init__(
        self,
        *,
        namespace: str,
        context: str | None = None,
        kubeconfig: str | None = None,
        allow_ambient_context: bool = False,
        in_cluster: bool | None = None,
        runtime_class: str = "",
        retries: int = 5,
        retry_base_s: float = 0.25,
        request_timeout_s: float = 30.0,
        api_client: Any = None,
        sleep: Callable[[float], None] = time.sleep,
        limiter: RateLimiter | None = None,
    ) -> None:
        self.namespace = namespace
        self.context = context
        self.kubeconfig = kubeconfig
        self.allow_ambient_context = allow_ambient_context
        self.in_cluster = in_cluster
        #: Named in the hint of an admission refusal that mentions RuntimeClass.
        self.runtime_class = runtime_class
        self.retries = max(1, int(retries))
        self.retry_base_s = float(retry_base_s)
        self.request_timeout_s = float(request_timeout_s)
        self._api_client = api_client
        self._sleep = sleep
        #: Every request waits for a token here; a 429's Retry-After pauses it for all callers.
        self.limiter = limiter or RateLimiter(sleep=lambda seconds: self._sleep(seconds))
        self._lock = threading.Lock()
        self._core_api: Any = None
        self._net_api: Any = None
        #: Where requests go, for messages: "kube context 'x' (pinned) at https://...".
        self.target = "injected API client" if api_client is not None else ""

    # -- the connection -----------------------------------------------------------------------

    def core(self) -> Any:
        """``CoreV1Api`` (connecting on first use; :class:`KubernetesConfigError` when it cannot)."""
        with self._lock:
            if self._core_api is None:
                from kubernetes import client

                if self._api_client is None:
                    self._api_client = self._load_client()
                self._core_api = client.CoreV1Api(self._api_client)
                self._net_api = client.NetworkingV1Api(self._api_client)
            return self._core_api

    def net(self) -> Any:
        """``NetworkingV1Api``, on the same connection as :meth:`core`."""
        self.core()
        return self._net_api

    def timeout(self) -> tuple[float, float]:
        """``_request_timeout`` for every request: (connect, read)."""
        return (min(10.0, self.request_timeout_s), self.request_timeout_s)

    def _load_client(self) -> Any:
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException

        kubeconfig = self.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        paths = [Path(p).expanduser() for p in kubeconfig.split(os.pathsep) if p]
        have_kubeconfig = any(p.is_file() for p in paths)
        in_cluster = self.in_cluster
        if in_cluster is None:
            in_cluster = (
                bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and not have_kubeconfig and not self.context
            )
        if in_cluster:
            cfg = self._configuration()
            try:
                config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
            except ConfigException as e:
                raise KubernetesConfigError(f"in-cluster Kubernetes configuration unusable: {e}") from e
            self.target = f"in-cluster API at {cfg.host}"
            logger.info("kubernetes runtime: in-cluster API at %s (namespace %s)", cfg.host, self.namespace)
            return client.ApiClient(configuration=cfg)
        if not have_kubeconfig:
            raise KubernetesConfigError(
                f"no kubeconfig found at {kubeconfig} and not running inside a cluster; point "
                "KUBECONFIG (or kubeconfig=) at one and pin its context with RESOLUTO_SANDBOX_KUBECONTEXT"
            )
        context = self._context(kubeconfig)
        cfg = self._configuration()
        try:
            config.load_kube_config(
                config_file=kubeconfig, context=context, client_configuration=cfg, persist_config=False
            )  # type: ignore[no-untyped-call]
        except (ConfigException, OSError, ValueError) as e:
            raise KubernetesConfigError(f"kube context {context!r} unusable: {e}") from e
        pinned = "pinned" if self.context else "AMBIENT (RESOLUTO_SANDBOX_ALLOW_AMBIENT_CONTEXT=1)"
        self.target = f"kube context {context!r} ({pinned}) at {cfg.host}"
        if self.context:
            logger.info("kubernetes runtime: %s, namespace %s", self.target, self.namespace)
        else:
            logger.warning(
                "kubernetes runtime: %s -- an unpinned context can launch pods on the wrong cluster",
                self.target,
            )
        return client.ApiClient(configuration=cfg)

    def _context(self, kubeconfig: str) -> str | None:
        """The kube context to use: the pinned one if it exists, the current one only when the
        ambient context is explicitly allowed."""
        from kubernetes import config
        from kubernetes.config.config_exception import ConfigException

        try:
            contexts, current = config.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
        except (ConfigException, OSError, ValueError) as e:
            raise KubernetesConfigError(f"cannot read kubeconfig {kubeconfig}: {e}") from e
        names = sorted(c.get("name", "") for c in contexts or [])
        context = self.context
        if context is None:
            if not self.allow_ambient_context:
                raise KubernetesConfigError(
                    "refusing to use the ambient kube context"
                    + (f" ({current.get('name')!r})" if current else "")
                    + ": pin the cluster with RESOLUTO_SANDBOX_KUBECONTEXT=<context> (or context=...), "
                    "or set RESOLUTO_SANDBOX_ALLOW_AMBIENT_CONTEXT=1 to accept whatever context is "
                    f"current. Contexts in {kubeconfig}: {', '.join(names) or '(none)'}"
                )
            if not current:
                raise KubernetesConfigError(f"kubeconfig {kubeconfig} has no current context")
            context = current.get("name")
        elif context not in names:
            raise KubernetesConfigError(
                f"kube context {context!r} is not in {kubeconfig}; available: {', '.join(names) or '(none)'}"
            )
        return context

    @staticmethod
    def _configuration() -> Any:
        from kubernetes import client

        cfg = client.Configuration()
        # One retry layer, ours (call): it knows which requests are idempotent and backs
        # off; urllib3's own would multiply the attempts and sleep on Retry-After unseen.
        cfg.retries = 0
        return cfg

    # -- requests -------------------------------------------------------------------------------

    def call(
        self,
        verb: str,
        resource: str,
        name: str,
        fn: Callable[[], _T],
        *,
        retry: bool = True,
        on_conflict: Callable[[], _T | None] | None = None,
    ) -> _T:
        """Run one API request; 5xx/429/connection errors are retried when ``retry``.

        ``on_conflict`` makes a create idempotent: after a retried create answers 409, it
        returns the object when it is the one this runtime wrote (else None -> error).
        """
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError as Urllib3Error

        attempts = self.retries if retry else 1
        where = f"{resource}/{name}" if name else resource
        last: BaseException | None = None
        for attempt in range(1, attempts + 1):
            self.limiter.acquire()
            try:
                return fn()
            except ApiException as e:
                status = e.status or 0
                if status == 409 and attempt > 1 and on_conflict is not None:
                    mine = on_conflict()
                    if mine is not None:
                        return mine
                if status in RETRYABLE_STATUS and attempt < attempts:
                    last = e
                    self._backoff(attempt, e)
                    continue
                raise self.error(verb, resource, name, e, attempt) from e
            except (Urllib3Error, OSError) as e:
                if attempt < attempts:
                    last = e
                    self._backoff(attempt, None)
                    continue
                raise KubernetesApiError(
                    f"cannot reach the Kubernetes API server ({self.target or 'not connected'}) to "
                    f"{verb} {where} in namespace {self.namespace!r} after {attempt} attempt(s): {e}",
                    verb=verb,
                    resource=resource,
                ) from e
        raise KubernetesApiError(f"{verb} {where}: gave up: {last}", verb=verb, resource=resource)

    def delete(self, resource: str, name: str, namespace: str | None = None, *, grace_s: int = 5) -> bool:
        """Delete one pod, Secret or NetworkPolicy; False when it was already gone."""
        ns = namespace or self.namespace
        t = self.timeout()
        core, net = self.core(), self.net()
        fn: Callable[[], Any]
        if resource == "pods":
            fn = lambda: core.delete_namespaced_pod(  # noqa: E731
                name, ns, grace_period_seconds=grace_s, propagation_policy="Background", _request_timeout=t
            )
        elif resource == "secrets":
            fn = lambda: core.delete_namespaced_secret(name, ns, _request_timeout=t)  # noqa: E731
        else:
            fn = lambda: net.delete_namespaced_network_policy(name, ns, _request_timeout=t)  # noqa: E731
        try:
            self.call("delete", resource, name, fn)
        except KubernetesApiError as e:
            if e.status == 404:
                return False
            raise
        return True

    def _backoff(self, attempt: int, exc: Any) -> None:
        delay = min(8.0, self.retry_base_s * (2 ** (attempt - 1)))
        retry_after: float | None = None
        header = (getattr(exc, "headers", None) or {}).get("Retry-After")
        try:
            retry_after = float(header) if header else None
        except (TypeError, ValueError):
            retry_after = None
        if retry_after is not None:
            # The server asked this client to wait: every caller waits (the rate limit's
            # pause), and this one's next attempt takes its token after the pause.
            self.limiter.pause(min(max(delay, retry_after), 30.0))
            return
        self._sleep(delay * (0.5 + random.random() / 2))

    def error(self, verb: str, resource: str, name: str, exc: Any, attempts: int) -> KubernetesApiError:
        """The :class:`KubernetesApiError` for an ``ApiException``, with the fix in its message."""
        status = exc.status or 0
        server = status_message(exc)
        ns = self.namespace
        what = f"{resource}/{name}" if name else resource
        if status == 401:
            msg = (
                f"the Kubernetes API server ({self.target}) rejected the credentials (401 Unauthorized): "
                f"{server}. Refresh the kubeconfig's credentials for this context."
            )
        elif status == 403 and re.search(r"cannot \S+ resource", server):
            rbac_verb = "get" if verb == "read logs of" else verb
            rbac_res = "pods/log" if verb == "read logs of" else resource
            msg = (
                f"RBAC: cannot {rbac_verb} {rbac_res} in namespace {ns!r} (403 Forbidden): {server}. "
                f"Grant the identity of {self.target or 'this client'} the verb {rbac_verb!r} on "
                f"{rbac_res!r} in that namespace (see docs/backends.md, 'RBAC')."
            )
        elif status == 403:
            msg = (
                f"the cluster refused to {verb} {what} in namespace {ns!r} (403 Forbidden, an admission "
                f"policy rather than RBAC): {server}"
                + (
                    f". Check that the RuntimeClass {self.runtime_class!r} exists (kubectl get runtimeclass)"
                    if "RuntimeClass" in server
                    else ""
                )
            )
        elif status == 404 and verb in ("create", "list"):
            msg = (
                f"cannot {verb} {resource} in namespace {ns!r}: {server}. Create the namespace first "
                f"(kubectl create namespace {ns}) or set namespace=/RESOLUTO_SANDBOX_NAMESPACE."
            )
        elif status == 409:
            msg = (
                f"cannot {verb} {what} in namespace {ns!r}: an object with that name already exists "
                f"(409 Conflict: {server}). Sandbox names carry a random suffix, so this is another "
                "writer using the same name; nothing of it was changed."
            )
        elif status == 422:
            msg = f"the API server rejected {what} as invalid (422): {server}"
        elif status in RETRYABLE_STATUS:
            msg = (
                f"the Kubernetes API server kept failing to {verb} {what} in namespace {ns!r}: "
                f"{status} {server} (gave up after {attempts} attempt(s))"
            )
        else:
            msg = f"cannot {verb} {what} in namespace {ns!r}: {status} {server}"
        return KubernetesApiError(msg, status=status, verb=verb, resource=resource)


def status_message(exc: Any) -> str:
    """The API server's own words from an ``ApiException`` (its Status ``message``)."""
    body = getattr(exc, "body", None)
    if body:
        try:
            msg = json.loads(body).get("message")
            if msg:
                return str(msg)
        except (ValueError, AttributeError):
            return str(body)[:500]
    return str(getattr(exc, "reason", "") or exc)
