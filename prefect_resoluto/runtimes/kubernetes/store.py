"""What a pod needs from the object store: its address (for the NetworkPolicy) and the guest bundle.

Pods reach the run's S3 conduit themselves. The NetworkPolicy must name the store by
address, so it is configured (``store_egress_cidr`` / ``RESOLUTO_STORE_EGRESS_CIDR``) or
the endpoint is resolved here. The guest runner travels as a tarball in the conduit,
uploaded once per run (by ``prepare`` or the run's first launch) and fetched by the pod's
bootstrap command.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from guest_runner import wire
from prefect_resoluto.runtimes.base import LaunchError, LaunchSpec
from prefect_resoluto.runtimes.guest_bundle import build_guest_bundle, guest_bundle_key, upload_guest_bundle
from prefect_resoluto.runtimes.kubernetes.manifests import IPNetwork, parse_network

if TYPE_CHECKING:
    from guest_runner.conduit import Conduit

logger = logging.getLogger(__name__)


def store_egress(
    spec: LaunchSpec, *, cidr: str | None = None, port: int | None = None
) -> tuple[list[IPNetwork], int]:
    """Where pods reach the object store: the configured CIDRs, else the endpoint resolved here."""
    endpoint = spec.store.endpoint
    parsed = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}") if endpoint else None
    default_port = (parsed.port or (80 if parsed.scheme == "http" else 443)) if parsed else 443
    port = port or _int_env("RESOLUTO_STORE_EGRESS_PORT") or default_port
    raw = cidr or os.environ.get("RESOLUTO_STORE_EGRESS_CIDR", "")
    if raw:
        try:
            nets = [parse_network(c) for c in raw.split(",") if c.strip()]
        except ValueError as e:
            raise LaunchError(f"store egress CIDR {raw!r} is not a CIDR list: {e}") from None
        return nets, port
    if parsed is None or not parsed.hostname:
        raise LaunchError(
            "cannot derive the object store's address for the pod's NetworkPolicy: no "
            f"{wire.ENV_STORE_ENDPOINT} (plain AWS S3 has no fixed address). Set store_egress_cidr "
            "(or RESOLUTO_STORE_EGRESS_CIDR), e.g. the CIDR of your S3 VPC endpoint, or allow "
            "'public_https' egress for the node."
        )
    host = parsed.hostname
    try:
        return [parse_network(host)], port
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise LaunchError(
            f"cannot resolve the store endpoint host {host!r} to build the NetworkPolicy ({e}); set "
            "store_egress_cidr / RESOLUTO_STORE_EGRESS_CIDR to the address pods reach the store at"
        ) from None
    nets = sorted({parse_network(str(i[4][0])) for i in infos}, key=str)
    logger.info(
        "kubernetes runtime: store %s resolved here to %s; set store_egress_cidr if pods "
        "reach it at another address (DNAT, in-cluster service)",
        host,
        ", ".join(map(str, nets)),
    )
    return list(nets), port


def store_base(spec: LaunchSpec) -> str:
    """The conduit's base prefix: ``RESOLUTO_STORE_PREFIX`` without the node's own key prefix."""
    prefix = spec.store.prefix.strip("/")
    if not prefix:
        return ""
    suffix = spec.rel_prefix
    if prefix == suffix:
        return ""
    if prefix.endswith("/" + suffix):
        return prefix[: -len(suffix) - 1]
    raise LaunchError(
        f"{wire.ENV_STORE_PREFIX} {prefix!r} does not end with the node's key prefix {suffix!r}"
    )


class GuestBundles:
    """The guest bundle of each run -- (key, sha256) -- uploaded at most once per run."""

    def __init__(self) -> None:
        #: run id -> (key, sha256) of the uploaded bundle.
        self.known: dict[str, tuple[str, str]] = {}
        self._lock = threading.Lock()
        self._upload_lock = threading.Lock()

    def prepare(self, conduit: Conduit, run_id: str) -> None:
        """Upload the run's bundle through the host's own conduit (once)."""
        with self._lock:
            if run_id in self.known:
                return
        key, sha = upload_guest_bundle(conduit, run_id)
        with self._lock:
            self.known[run_id] = (key, sha)

    def for_spec(self, spec: LaunchSpec, *, upload: bool) -> tuple[str, str]:
        """The bundle a node's pod fetches; ``upload`` puts it there (through the node's S3 settings)
        when the run was not prepared, otherwise only its key is computed."""
        run_id = spec.run_id
        with self._lock:
            known = self.known.get(run_id)
        if known is not None:
            return known
        base = store_base(spec)
        if not upload:
            sha, _ = build_guest_bundle()
            return guest_bundle_key(run_id, base, sha), sha
        from guest_runner.conduit.s3 import S3Conduit

        with self._upload_lock:  # concurrent first launches of a run upload once
            with self._lock:
                known = self.known.get(run_id)
            if known is not None:
                return known
            conduit = S3Conduit(
                spec.store.bucket,
                base_prefix=base,
                endpoint_url=spec.store.endpoint or None,
                region=spec.store.region or None,
            )
            try:
                key, sha = upload_guest_bundle(conduit, run_id)
            except Exception as e:
                raise LaunchError(
                    f"cannot upload the guest runner bundle to s3://{spec.store.bucket}/{base}: {e}"
                ) from e
            finally:
                conduit.close()
            with self._lock:
                self.known[run_id] = (key, sha)
        return key, sha


def _int_env(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not a port number") from None
