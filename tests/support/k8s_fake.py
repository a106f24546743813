"""A loopback stand-in for the Kubernetes API server and kubelet, for the runtime's tests.

It serves exactly what :class:`prefect_resoluto.runtimes.kubernetes.KubernetesRuntime`
uses -- pods (create / get / list / delete, ``log``), networkpolicies and secrets
(create / get / list / delete / merge-patch) in namespaces that exist -- and enforces
the contract the real server would, instead of echoing:

* every request body is checked against the official client's models: a field the
  model does not declare is a 400 (strict field validation), a body the models cannot
  hold (missing required field, wrong type) a 422, like the server's own decoding;
* server-side validation a real cluster applies: DNS names, label keys and values,
  namespace of the body vs the URL, env names, one of value/valueFrom, quantities,
  volume mounts naming declared volumes, ipBlock CIDRs and ``except`` inside them,
  protocols and ports, base64 Secret data, immutable Secrets, the RuntimeClass
  admission check (a pod naming an unknown RuntimeClass is forbidden);
* 404 for missing objects and namespaces, 409 on a name collision, labelSelector
  parsing (``=``, ``==``, ``!=``, ``in``, ``notin``, exists, ``!``) with 400 on bad syntax;
* uid, resourceVersion, creationTimestamp, generation and a Pending status filled in
  like a real server; ownerReferences garbage-collected (background) when the owner goes;
* bearer-token authentication when the fake is given a token (401 otherwise).

Tests script the rest: per-pod phase transitions (:meth:`FakeKube.schedule`,
:meth:`~FakeKube.set_running`, :meth:`~FakeKube.terminate`, :meth:`~FakeKube.image_pull_backoff`,
:meth:`~FakeKube.unschedulable`, :meth:`~FakeKube.oom_kill`, :meth:`~FakeKube.evict`,
:meth:`~FakeKube.node_lost`, :meth:`~FakeKube.delete_externally`) and injected failures
(:meth:`~FakeKube.fail`: any status on any verb/resource, N times).

Everything a genuine kube-apiserver can show is tested against one instead
(tests/test_kubernetes_cluster.py, with tests/support/k8s_node_agent.py running the pods); this
stand-in stays for pod states neither Kubernetes 1.20 nor the agent produce.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import ipaddress
import itertools
import json
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import kubernetes.client.models as k8s_models
from kubernetes.client import ApiClient, Configuration

RESOURCES = {
    # resource: (kind, apiVersion, model, list kind, path prefix)
    "pods": ("Pod", "v1", "V1Pod", "PodList", "/api/v1"),
    "secrets": ("Secret", "v1", "V1Secret", "SecretList", "/api/v1"),
    "networkpolicies": (
        "NetworkPolicy",
        "networking.k8s.io/v1",
        "V1NetworkPolicy",
        "NetworkPolicyList",
        "/apis/networking.k8s.io/v1",
    ),
}
_PATH = re.compile(
    r"^(?P<prefix>/api/v1|/apis/networking\.k8s\.io/v1)/namespaces/(?P<ns>[^/]+)/(?P<res>[a-z]+)"
    r"(?:/(?P<name>[^/]+)(?:/(?P<sub>[a-z]+))?)?/?$"
)
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?\d+)?$")
_KNOWN_QUERY = {
    "labelSelector",
    "fieldSelector",
    "limit",
    "continue",
    "resourceVersion",
    "resourceVersionMatch",
    "timeoutSeconds",
    "watch",
    "allowWatchBookmarks",
    "sendInitialEvents",
    "fieldValidation",
    "pretty",
    "dryRun",
    "fieldManager",
    "force",
    "gracePeriodSeconds",
    "propagationPolicy",
    "orphanDependents",
    "ignoreStoreReadErrorWithClusterBreakingPotential",
    "container",
    "tailLines",
    "follow",
    "previous",
    "timestamps",
    "limitBytes",
    "sinceSeconds",
    "sinceTime",
    "insecureSkipTLSVerifyBackend",
    "stream",
}


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiError(Exception):
    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.details = details or {}
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            out["details"] = self.details
        return out


# -- schema checks against the official client's models ------------------------------------------


def unknown_fields(data: Any, type_name: str, path: str = "") -> list[str]:
    """Paths of fields in ``data`` that the client model ``type_name`` does not declare."""
    if data is None:
        return []
    m = re.match(r"^Optional\[(.*)\]$", type_name)
    if m:
        return unknown_fields(data, m.group(1), path)
    m = re.match(r"^List\[(.*)\]$", type_name)
    if m:
        if not isinstance(data, list):
            return []
        out: list[str] = []
        for i, item in enumerate(data):
            out += unknown_fields(item, m.group(1), f"{path}[{i}]")
        return out
    m = re.match(r"^Dict\[([^,]*), (.*)\]$", type_name)
    if m:
        if not isinstance(data, dict):
            return []
        out = []
        for k, v in data.items():
            out += unknown_fields(v, m.group(2), f"{path}[{k}]")
        return out
    model = getattr(k8s_models, type_name, None)
    if model is None or not hasattr(model, "attribute_map"):
        return []  # primitives, object, IntOrString, quantities
    if not isinstance(data, dict):
        return []  # a type error; the model's own validation reports it (422)
    by_json = {json_key: attr for attr, json_key in model.attribute_map.items()}
    out = []
    for key, value in data.items():
        sub = f"{path}.{key}" if path else key
        attr = by_json.get(key)
        if attr is None:
            out.append(sub)
            continue
        out += unknown_fields(value, model.openapi_types[attr], sub)
    return out


def decode_model(raw: str, type_name: str) -> Any:
    """Deserialize like the client does; a body the models cannot hold is a 422."""
    try:
        return ApiClient().deserialize(raw, type_name, "application/json")
    except Exception as e:  # pydantic ValidationError, TypeError, ValueError
        first = str(e).splitlines()
        raise ApiError(422, "Invalid", f"{type_name} is invalid: " + " ".join(first[:6])[:1500]) from None


# -- label selectors -----------------------------------------------------------------------------


@dataclass
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        has = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return has
        if self.op == "!":
            return not has
        if self.op in ("=", "in"):
            return has and value in self.values
        return not has or value not in self.values  # "!=", "notin"


def _valid_label_key(key: str) -> bool:
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return False
    return bool(name) and len(name) <= 63 and bool(_LABEL_NAME.match(name))


def _valid_label_value(value: str) -> bool:
    return value == "" or (len(value) <= 63 and bool(_LABEL_NAME.match(value)))


def parse_selector(text: str) -> list[Requirement]:
    """Kubernetes label selector syntax; :class:`ApiError` 400 when malformed."""
    reqs: list[Requirement] = []
    text = text.strip()
    if not text:
        return reqs
    parts: list[str] = []
    depth, cur = 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)

    def bad(why: str) -> ApiError:
        return ApiError(400, "BadRequest", f"unable to parse requirement: {why}")

    for part in parts:
        p = part.strip()
        if not p:
            raise bad(f"found '', expected: identifier in {text!r}")
        m = re.match(r"^(\S+)\s+(in|notin)\s*\((.*)\)$", p)
        if m:
            key, op = m.group(1), m.group(2)
            values = tuple(v.strip() for v in m.group(3).split(",")) if m.group(3).strip() else ()
            if not values:
                raise bad(f"for 'in', 'notin' operators, values set can't be empty ({p!r})")
            req = Requirement(key, op, values)
        elif p.startswith("!"):
            req = Requirement(p[1:].strip(), "!")
        elif "!=" in p:
            k, v = p.split("!=", 1)
            req = Requirement(k.strip(), "!=", (v.strip(),))
        elif "==" in p:
            k, v = p.split("==", 1)
            req = Requirement(k.strip(), "=", (v.strip(),))
        elif "=" in p:
            k, v = p.split("=", 1)
            req = Requirement(k.strip(), "=", (v.strip(),))
        else:
            if re.search(r"[\s()<>]", p):
                raise bad(f"unexpected token in {p!r}")
            req = Requirement(p, "exists")
        if not _valid_label_key(req.key):
            raise bad(f"invalid label key {req.key!r}")
        for v in req.values:
            if not _valid_label_value(v):
                raise bad(
                    f"invalid label value: {v!r}: a valid label must be an empty string or consist "
                    "of alphanumeric characters, '-', '_' or '.'"
                )
        reqs.append(req)
    return reqs


# -- server-side validation ------------------------------------------------------------------------


def _invalid(kind: str, name: str, causes: list[str]) -> ApiError:
    return ApiError(
        422,
        "Invalid",
        f'{kind} "{name}" is invalid: ' + "; ".join(causes),
        {"name": name, "kind": kind.lower(), "causes": [{"message": c} for c in causes]},
    )


def _check_meta(meta: dict[str, Any], causes: list[str]) -> None:
    name = meta.get("name") or ""
    if not name:
        causes.append("metadata.name: Required value: name or generateName is required")
    elif len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        causes.append(
            f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 subdomain must consist "
            "of lower case alphanumeric characters, '-' or '.'"
        )
    for k, v in (meta.get("labels") or {}).items():
        if not _valid_label_key(k):
            causes.append(f"metadata.labels: Invalid value: {k!r}: not a valid label key")
        if not isinstance(v, str) or not _valid_label_value(v):
            causes.append(
                f"metadata.labels: Invalid value: {v!r}: a valid label must be an empty string or "
                "consist of alphanumeric characters, '-', '_' or '.', and must start and end with "
                "an alphanumeric character (max 63)"
            )
    for k in meta.get("annotations") or {}:
        if not _valid_label_key(k):
            causes.append(f"metadata.annotations: Invalid value: {k!r}: not a valid annotation key")
    for i, ref in enumerate(meta.get("ownerReferences") or []):
        for f in ("apiVersion", "kind", "name", "uid"):
            if not ref.get(f):
                causes.append(f"metadata.ownerReferences[{i}].{f}: Invalid value: must not be empty")


def _quantity_ok(q: Any) -> bool:
    return isinstance(q, str) and bool(_QUANTITY.match(q)) or isinstance(q, int)


def _quantity_value(q: Any) -> float:
    s = str(q)
    units = {
        "m": 1e-3,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
        "T": 1e12,
        "P": 1e15,
        "E": 1e18,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
        "Pi": 2**50,
        "Ei": 2**60,
    }
    for u in sorted(units, key=len, reverse=True):
        if s.endswith(u):
            return float(s[: -len(u)]) * units[u]
    return float(s)


def validate_pod(obj: dict[str, Any], causes: list[str]) -> None:
    spec = obj.get("spec") or {}
    containers = spec.get("containers") or []
    if not containers:
        causes.append("spec.containers: Required value")
    if spec.get("restartPolicy") not in (None, "Always", "OnFailure", "Never"):
        causes.append(f"spec.restartPolicy: Unsupported value: {spec.get('restartPolicy')!r}")
    volumes = [v.get("name") for v in spec.get("volumes") or []]
    if len(set(volumes)) != len(volumes):
        causes.append("spec.volumes: Duplicate value")
    for v in volumes:
        if not v or not _DNS_LABEL.match(v):
            causes.append(f"spec.volumes.name: Invalid value: {v!r}")
    seen: set[str] = set()
    for i, c in enumerate(containers):
        where = f"spec.containers[{i}]"
        name = c.get("name", "")
        if not _DNS_LABEL.match(name) or len(name) > 63:
            causes.append(f"{where}.name: Invalid value: {name!r}")
        if name in seen:
            causes.append(f"{where}.name: Duplicate value: {name!r}")
        seen.add(name)
        if not c.get("image"):
            causes.append(f"{where}.image: Required value")
        if c.get("imagePullPolicy") not in (None, "Always", "IfNotPresent", "Never"):
            causes.append(f"{where}.imagePullPolicy: Unsupported value: {c.get('imagePullPolicy')!r}")
        for j, e in enumerate(c.get("env") or []):
            ew = f"{where}.env[{j}]"
            if not _ENV_NAME.match(e.get("name", "")):
                causes.append(
                    f"{ew}.name: Invalid value: {e.get('name')!r}: a valid environment variable name"
                )
            if "value" in e and e.get("valueFrom") is not None:
                causes.append(
                    f"{ew}.valueFrom: Invalid value: may not be specified when `value` is not empty"
                )
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref is not None:
                if not ref.get("name"):
                    causes.append(f"{ew}.valueFrom.secretKeyRef.name: Required value")
                if not ref.get("key") or not _SECRET_KEY.match(ref.get("key", "")):
                    causes.append(f"{ew}.valueFrom.secretKeyRef.key: Invalid value: {ref.get('key')!r}")
        res = c.get("resources") or {}
        for section in ("requests", "limits"):
            for rname, q in (res.get(section) or {}).items():
                if not _quantity_ok(q):
                    causes.append(
                        f"{where}.resources.{section}[{rname}]: Invalid value: {q!r}: quantities "
                        "must match the regular expression"
                    )
        for rname, q in (res.get("requests") or {}).items():
            lim = (res.get("limits") or {}).get(rname)
            if (
                lim is not None
                and _quantity_ok(q)
                and _quantity_ok(lim)
                and _quantity_value(q) > _quantity_value(lim)
            ):
                causes.append(
                    f"{where}.resources.requests: Invalid value: {q!r}: must be less than or equal "
                    f"to {rname} limit of {lim}"
                )
        for j, vm in enumerate(c.get("volumeMounts") or []):
            if vm.get("name") not in volumes:
                causes.append(f"{where}.volumeMounts[{j}].name: Not found: {vm.get('name')!r}")
            if not str(vm.get("mountPath", "")).startswith("/"):
                causes.append(f"{where}.volumeMounts[{j}].mountPath: Invalid value: must be absolute")
        caps = (c.get("securityContext") or {}).get("capabilities") or {}
        for cap in (caps.get("drop") or []) + (caps.get("add") or []):
            if not re.match(r"^[A-Z_]+$", cap):
                causes.append(f"{where}.securityContext.capabilities: Invalid value: {cap!r}")
        sec = c.get("securityContext") or {}
        if sec.get("privileged") and sec.get("allowPrivilegeEscalation") is False:
            causes.append(
                f"{where}.securityContext: Invalid value: cannot set `allowPrivilegeEscalation` "
                "to false and `privileged` to true"
            )
    for t in spec.get("tolerations") or []:
        if t.get("operator") not in (None, "Equal", "Exists"):
            causes.append(f"spec.tolerations.operator: Unsupported value: {t.get('operator')!r}")
        if t.get("effect") not in (None, "", "NoSchedule", "PreferNoSchedule", "NoExecute"):
            causes.append(f"spec.tolerations.effect: Unsupported value: {t.get('effect')!r}")


def _cidr(text: Any, where: str, causes: list[str]) -> Any:
    try:
        return ipaddress.ip_network(str(text), strict=False)
    except ValueError:
        causes.append(f"{where}: Invalid value: {text!r}: must be a valid CIDR")
        return None


def validate_network_policy(obj: dict[str, Any], causes: list[str]) -> None:
    spec = obj.get("spec") or {}
    for pt in spec.get("policyTypes") or []:
        if pt not in ("Ingress", "Egress"):
            causes.append(f"spec.policyTypes: Unsupported value: {pt!r}")
    for direction, peers_key in (("egress", "to"), ("ingress", "from")):
        for i, rule in enumerate(spec.get(direction) or []):
            for j, port in enumerate(rule.get("ports") or []):
                pw = f"spec.{direction}[{i}].ports[{j}]"
                if port.get("protocol") not in (None, "TCP", "UDP", "SCTP"):
                    causes.append(f"{pw}.protocol: Unsupported value: {port.get('protocol')!r}")
                p = port.get("port")
                if isinstance(p, int) and not 0 < p < 65536:
                    causes.append(f"{pw}.port: Invalid value: {p}: must be between 1 and 65535")
            for j, peer in enumerate(rule.get(peers_key) or []):
                pw = f"spec.{direction}[{i}].{peers_key}[{j}]"
                block = peer.get("ipBlock")
                if block is not None and (
                    peer.get("podSelector") is not None or peer.get("namespaceSelector") is not None
                ):
                    causes.append(f"{pw}: Forbidden: may not specify both ipBlock and another peer")
                if block is None:
                    if peer.get("podSelector") is None and peer.get("namespaceSelector") is None:
                        causes.append(f"{pw}: Required value: must specify a peer")
                    continue
                net = _cidr(block.get("cidr"), f"{pw}.ipBlock.cidr", causes)
                for k, ex in enumerate(block.get("except") or []):
                    exn = _cidr(ex, f"{pw}.ipBlock.except[{k}]", causes)
                    if (
                        net is not None
                        and exn is not None
                        and (exn.version != net.version or not exn.subnet_of(net) or exn == net)
                    ):
                        causes.append(
                            f"{pw}.ipBlock.except[{k}]: Invalid value: {ex!r}: must be a strict "
                            "subset of `cidr`"
                        )


def validate_secret(obj: dict[str, Any], causes: list[str]) -> None:
    total = 0
    for k, v in (obj.get("data") or {}).items():
        if not _SECRET_KEY.match(k):
            causes.append(f"data[{k}]: Invalid value: {k!r}: a valid config key")
        try:
            total += len(base64.b64decode(v, validate=True))
        except (binascii.Error, TypeError, ValueError):
            causes.append(f"data[{k}]: Invalid value: illegal base64 data")
    for k in obj.get("stringData") or {}:
        if not _SECRET_KEY.match(k):
            causes.append(f"stringData[{k}]: Invalid value: {k!r}")
    if total > 1024 * 1024:
        causes.append("data: Too long: must have at most 1048576 bytes")


VALIDATORS: dict[str, Callable[[dict[str, Any], list[str]], None]] = {
    "pods": validate_pod,
    "networkpolicies": validate_network_policy,
    "secrets": validate_secret,
}


# -- the fake itself -------------------------------------------------------------------------------


@dataclass
class Request:
    method: str
    path: str
    verb: str
    resource: str
    namespace: str
    name: str
    query: dict[str, str]
    body: Any
    status: int = 0


@dataclass
class _Fault:
    verb: str
    resource: str
    status: int
    times: int
    message: str | None
    retry_after: int | None = None
    after: bool = False


class FakeKube:
    """The API server + kubelet stand-in. Use as a context manager or start()/stop()."""

    def __init__(
        self,
        namespaces: tuple[str, ...] = ("resoluto-sandboxes",),
        runtime_classes: tuple[str, ...] = ("kata", "gvisor"),
        *,
        token: str | None = None,
        user: str = "system:serviceaccount:ci:resoluto",
    ) -> None:
        self.namespaces = set(namespaces)
        self.runtime_classes = set(runtime_classes)
        self.token = token
        self.user = user
        self.objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {r: {} for r in RESOURCES}
        self.requests: list[Request] = []
        self.logs: dict[tuple[str, str], list[str]] = {}
        self._faults: list[_Fault] = []
        self._rv = itertools.count(1000)
        self._lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> FakeKube:
        fake = self

        class Handler(_Handler):
            kube = fake

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="k8s-fake", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> FakeKube:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def configuration(self) -> Configuration:
        cfg = Configuration(host=self.url)
        cfg.retries = 0  # as the runtime configures its own clients: it retries itself
        if self.token:
            cfg.api_key["BearerToken"] = f"Bearer {self.token}"
        return cfg

    def api_client(self) -> ApiClient:
        return ApiClient(configuration=self.configuration())

    def write_kubeconfig(
        self, path: str, contexts: tuple[str, ...] = ("fake",), current: str | None = None
    ) -> str:
        user: dict[str, Any] = {"token": self.token} if self.token else {}
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": user}],
            "contexts": [{"name": c, "context": {"cluster": "fake", "user": "fake"}} for c in contexts],
            "current-context": current if current is not None else contexts[0],
        }
        with open(path, "w") as f:
            json.dump(doc, f)  # JSON is YAML
        return path

    # -- fault injection --------------------------------------------------------------------------

    def fail(
        self,
        verb: str,
        resource: str,
        status: int,
        times: int = 1,
        message: str | None = None,
        retry_after: int | None = None,
        after: bool = False,
    ) -> None:
        """The next ``times`` ``verb`` requests on ``resource`` answer ``status``.

        ``after=True`` applies the request first and then answers the error (a response
        lost on the way back: the object exists, the client saw a failure).
        """
        with self._lock:
            self._faults.append(_Fault(verb, resource, status, times, message, retry_after, after))

    def _take_fault(self, verb: str, resource: str, after: bool = False) -> _Fault | None:
        """The first pending fault for this verb/resource, consumed if it belongs to this phase.

        Faults apply in the order they were scripted, whichever their phase.
        """
        with self._lock:
            for f in self._faults:
                if f.verb == verb and f.resource == resource and f.times > 0:
                    if f.after != after:
                        return None
                    f.times -= 1
                    return f
        return None

    # -- inspection -------------------------------------------------------------------------------

    def get(self, resource: str, name: str, namespace: str = "resoluto-sandboxes") -> dict[str, Any] | None:
        with self._lock:
            obj = self.objects[resource].get((namespace, name))
            return json.loads(json.dumps(obj)) if obj is not None else None

    def names(self, resource: str, namespace: str = "resoluto-sandboxes") -> list[str]:
        with self._lock:
            return sorted(n for ns, n in self.objects[resource] if ns == namespace)

    def calls(self, verb: str | None = None, resource: str | None = None) -> list[Request]:
        with self._lock:
            return [
                r
                for r in self.requests
                if (verb is None or r.verb == verb) and (resource is None or r.resource == resource)
            ]

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
        """Poll ``predicate`` until truthy (returns it) or fail after ``timeout`` seconds."""
        from support.polling import wait_for

        return wait_for(predicate, timeout, what, first_delay=0.005, max_delay=0.1, growth=2)

    # -- scripted pod states ----------------------------------------------------------------------

    def _pod(self, name: str, namespace: str) -> dict[str, Any]:
        pod = self.objects["pods"].get((namespace, name))
        if pod is None:
            raise KeyError(f"no pod {namespace}/{name}")
        return pod

    def _container_name(self, pod: dict[str, Any]) -> str:
        return pod["spec"]["containers"][0]["name"]

    def _touch(self, obj: dict[str, Any]) -> None:
        obj["metadata"]["resourceVersion"] = str(next(self._rv))

    def _set(self, name: str, namespace: str, mutate: Callable[[dict[str, Any]], None]) -> None:
        with self._lock:
            pod = self._pod(name, namespace)
            mutate(pod)
            self._touch(pod)

    def _cstatus(
        self, pod: dict[str, Any], state: dict[str, Any], ready: bool = False
    ) -> list[dict[str, Any]]:
        c = pod["spec"]["containers"][0]
        return [
            {
                "name": c["name"],
                "image": c["image"],
                "imageID": "",
                "ready": ready,
                "restartCount": 0,
                "started": "running" in state,
                "state": state,
            }
        ]

    def schedule(self, name: str, namespace: str = "resoluto-sandboxes", node: str = "fake-node-1") -> None:
        def m(pod: dict[str, Any]) -> None:
            pod["spec"]["nodeName"] = node
            st = pod["status"]
            st["conditions"] = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()}]
            st["hostIP"] = "10.0.0.10"
            st["startTime"] = _now()
            st["containerStatuses"] = self._cstatus(pod, {"waiting": {"reason": "ContainerCreating"}})

        self._set(name, namespace, m)

    def set_running(self, name: str, namespace: str = "resoluto-sandboxes") -> None:
        def m(pod: dict[str, Any]) -> None:
            st = pod["status"]
            st["phase"] = "Running"
            st["podIP"] = "10.244.0.17"
            st["conditions"] = [
                {"type": t, "status": "True", "lastTransitionTime": _now()}
                for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
            ]
            st["containerStatuses"] = self._cstatus(pod, {"running": {"startedAt": _now()}}, ready=True)

        if not self.get("pods", name, namespace)["spec"].get("nodeName"):
            self.schedule(name, namespace)
        self._set(name, namespace, m)

    def terminate(
        self,
        name: str,
        exit_code: int,
        reason: str | None = None,
        message: str | None = None,
        namespace: str = "resoluto-sandboxes",
        pod_reason: str | None = None,
        pod_message: str | None = None,
        disruption: tuple[str, str] | None = None,
    ) -> None:
        def m(pod: dict[str, Any]) -> None:
            st = pod["status"]
            term: dict[str, Any] = {
                "exitCode": exit_code,
                "reason": reason or ("Completed" if exit_code == 0 else "Error"),
                "startedAt": _now(),
                "finishedAt": _now(),
            }
            if message:
                term["message"] = message
            st["phase"] = "Succeeded" if exit_code == 0 and not pod_reason and not disruption else "Failed"
            st["containerStatuses"] = self._cstatus(pod, {"terminated": term})
            conds = [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()},
                {"type": "Ready", "status": "False", "reason": "PodCompleted", "lastTransitionTime": _now()},
            ]
            if disruption:
                conds.append(
                    {
                        "type": "DisruptionTarget",
                        "status": "True",
                        "reason": disruption[0],
                        "message": disruption[1],
                        "lastTransitionTime": _now(),
                    }
                )
            st["conditions"] = conds
            if pod_reason:
                st["reason"] = pod_reason
            if pod_message:
                st["message"] = pod_message

        self._set(name, namespace, m)

    def image_pull_backoff(
        self, name: str, namespace: str = "resoluto-sandboxes", reason: str = "ImagePullBackOff"
    ) -> None:
        def m(pod: dict[str, Any]) -> None:
            image = pod["spec"]["containers"][0]["image"]
            pod["status"]["containerStatuses"] = self._cstatus(
                pod, {"waiting": {"reason": reason, "message": f'Back-off pulling image "{image}"'}}
            )

        self.schedule(name, namespace)
        self._set(name, namespace, m)

    def container_waiting(
        self, name: str, reason: str, message: str, namespace: str = "resoluto-sandboxes"
    ) -> None:
        def m(pod: dict[str, Any]) -> None:
            pod["status"]["containerStatuses"] = self._cstatus(
                pod, {"waiting": {"reason": reason, "message": message}}
            )

        if not self.get("pods", name, namespace)["spec"].get("nodeName"):
            self.schedule(name, namespace)
        self._set(name, namespace, m)

    def unschedulable(self, name: str, message: str, namespace: str = "resoluto-sandboxes") -> None:
        def m(pod: dict[str, Any]) -> None:
            pod["status"]["conditions"] = [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": message,
                    "lastTransitionTime": _now(),
                }
            ]

        self._set(name, namespace, m)

    def oom_kill(self, name: str, namespace: str = "resoluto-sandboxes") -> None:
        self.terminate(name, 137, reason="OOMKilled", namespace=namespace)

    def evict(
        self,
        name: str,
        message: str = "The node was low on resource: memory.",
        namespace: str = "resoluto-sandboxes",
    ) -> None:
        self.terminate(
            name,
            137,
            namespace=namespace,
            pod_reason="Evicted",
            pod_message=message,
            disruption=("TerminationByKubelet", message),
        )

    def node_lost(self, name: str, namespace: str = "resoluto-sandboxes", legacy: bool = False) -> None:
        if legacy:  # older clusters: phase Unknown, reason NodeLost

            def m(pod: dict[str, Any]) -> None:
                pod["status"]["phase"] = "Unknown"
                pod["status"]["reason"] = "NodeLost"
                pod["status"]["message"] = "Node fake-node-1 which was running pod is unresponsive"

            self._set(name, namespace, m)
            return
        self.terminate(
            name,
            137,
            reason="ContainerStatusUnknown",
            message="The container could not be located when the pod was terminated",
            namespace=namespace,
            disruption=("DeletionByPodGC", "PodGC: node no longer exists"),
        )

    def delete_externally(self, name: str, namespace: str = "resoluto-sandboxes") -> None:
        """``kubectl delete pod --grace-period=0 --force``."""
        with self._lock:
            self._remove("pods", namespace, name)

    # -- object store ---------------------------------------------------------------------------

    def _remove(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            obj = self.objects[resource].pop((namespace, name), None)
            if obj is None:
                return None
            uid = obj["metadata"]["uid"]
            for res in RESOURCES:  # background garbage collection of dependents
                for (ns, n), dep in list(self.objects[res].items()):
                    refs = dep["metadata"].get("ownerReferences") or []
                    if ns == namespace and any(r.get("uid") == uid for r in refs):
                        self._remove(res, ns, n)
            return obj

    def _create(self, resource: str, namespace: str, raw: str, body: dict[str, Any]) -> dict[str, Any]:
        kind, api_version, model, _, _ = RESOURCES[resource]
        self._check_body(resource, raw, body)
        meta = body.setdefault("metadata", {})
        name = meta.get("name", "")
        if meta.get("namespace") not in (None, namespace):
            raise ApiError(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the request",
            )
        causes: list[str] = []
        _check_meta(meta, causes)
        VALIDATORS[resource](body, causes)
        if causes:
            raise _invalid(kind, name, causes)
        with self._lock:
            if namespace not in self.namespaces:
                raise ApiError(
                    404,
                    "NotFound",
                    f'namespaces "{namespace}" not found',
                    {"name": namespace, "kind": "namespaces"},
                )
            if resource == "pods":
                rc = body["spec"].get("runtimeClassName")
                if rc is not None and rc not in self.runtime_classes:
                    raise ApiError(
                        403,
                        "Forbidden",
                        f'pods "{name}" is forbidden: pod rejected: RuntimeClass "{rc}" not found',
                    )
            if (namespace, name) in self.objects[resource]:
                raise ApiError(
                    409,
                    "AlreadyExists",
                    f'{resource} "{name}" already exists',
                    {"name": name, "kind": resource},
                )
            meta.update(
                namespace=namespace,
                uid=str(uuid.uuid4()),
                creationTimestamp=_now(),
                resourceVersion=str(next(self._rv)),
            )
            if resource == "networkpolicies":
                meta["generation"] = 1
            if resource == "secrets":
                data = body.setdefault("data", {})
                for k, v in (body.pop("stringData", None) or {}).items():
                    data[k] = base64.b64encode(v.encode()).decode()
                body.setdefault("type", "Opaque")
            if resource == "pods":
                spec = body["spec"]
                spec.setdefault("serviceAccountName", "default")
                spec.setdefault("schedulerName", "default-scheduler")
                spec.setdefault("dnsPolicy", "ClusterFirst")
                spec.setdefault("restartPolicy", "Always")
                for c in spec["containers"]:
                    c.setdefault("terminationMessagePath", "/dev/termination-log")
                    c.setdefault("terminationMessagePolicy", "File")
                    c.setdefault("imagePullPolicy", "IfNotPresent")
                body["status"] = {"phase": "Pending", "qosClass": _qos(spec)}
            self.objects[resource][(namespace, name)] = body
            # What a client reads back must itself be a valid model.
            decode_model(json.dumps(body), model)
        return body

    def _check_body(self, resource: str, raw: str, body: Any) -> None:
        kind, api_version, model, _, _ = RESOURCES[resource]
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body of the request must be a JSON object")
        if body.get("kind") != kind or body.get("apiVersion") != api_version:
            if not body.get("kind"):
                raise ApiError(400, "BadRequest", f"Object 'Kind' is missing in '{raw[:200]}'")
            raise ApiError(
                400,
                "BadRequest",
                f"the API version in the data ({body.get('apiVersion')}) "
                f"does not match the expected API version ({api_version}) "
                f"or kind {body.get('kind')!r} is not {kind!r}",
            )
        extra = unknown_fields(body, model)
        if extra:
            raise ApiError(
                400,
                "BadRequest",
                f'{kind} in version "{api_version.split("/")[-1]}" cannot be '
                "handled as a "
                + kind
                + ": strict decoding error: "
                + ", ".join(f'unknown field "{p}"' for p in extra),
            )
        decode_model(raw, model)

    def _patch(self, resource: str, namespace: str, name: str, content_type: str, raw: str) -> dict[str, Any]:
        kind, _, model, _, _ = RESOURCES[resource]
        if content_type != "application/merge-patch+json":
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the fake supports only application/merge-patch+json, got {content_type!r}",
            )
        try:
            patch = json.loads(raw)
        except ValueError as e:
            raise ApiError(400, "BadRequest", f"invalid JSON patch: {e}") from None
        with self._lock:
            current = self.objects[resource].get((namespace, name))
            if current is None:
                raise ApiError(
                    404, "NotFound", f'{resource} "{name}" not found', {"name": name, "kind": resource}
                )
            merged = _merge_patch(json.loads(json.dumps(current)), patch)
            for fixed in ("uid", "creationTimestamp", "namespace", "name"):
                if merged["metadata"].get(fixed) != current["metadata"].get(fixed):
                    raise _invalid(kind, name, [f"metadata.{fixed}: Invalid value: field is immutable"])
            if (
                resource == "secrets"
                and current.get("immutable")
                and (merged.get("data") != current.get("data") or merged.get("immutable") is not True)
            ):
                raise _invalid(kind, name, ["data: Forbidden: field is immutable when `immutable` is set"])
            if resource == "pods" and merged.get("spec") != current.get("spec"):
                raise _invalid(
                    kind,
                    name,
                    [
                        "spec: Forbidden: pod updates may not change fields other "
                        "than image, activeDeadlineSeconds and tolerations"
                    ],
                )
            extra = unknown_fields(merged, model)
            if extra:
                raise ApiError(
                    400,
                    "BadRequest",
                    "strict decoding error: " + ", ".join(f'unknown field "{p}"' for p in extra),
                )
            causes: list[str] = []
            _check_meta(merged["metadata"], causes)
            VALIDATORS[resource](merged, causes)
            if causes:
                raise _invalid(kind, name, causes)
            decode_model(json.dumps(merged), model)
            self._touch(merged)
            self.objects[resource][(namespace, name)] = merged
            return merged

    # -- the kubelet --------------------------------------------------------------------------------

    def _delete_pod(self, namespace: str, name: str, grace: int | None) -> dict[str, Any]:
        # No process runs here, so a graceful delete completes at once, like a kubelet-less pod.
        with self._lock:
            pod = self._remove("pods", namespace, name)
        if pod is None:
            raise ApiError(404, "NotFound", f'pods "{name}" not found', {"name": name, "kind": "pods"})
        return pod

    # -- request handling -----------------------------------------------------------------------------

    def handle(
        self, method: str, path: str, query: dict[str, str], headers: Any, raw: str
    ) -> tuple[int, Any, str]:
        """Returns (status, body, content type)."""
        if self.token and headers.get("Authorization") != f"Bearer {self.token}":
            raise ApiError(401, "Unauthorized", "Unauthorized")
        m = _PATH.match(path)
        if not m or m.group("res") not in RESOURCES or RESOURCES[m.group("res")][4] != m.group("prefix"):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        ns, resource, name, sub = m.group("ns"), m.group("res"), m.group("name") or "", m.group("sub") or ""
        if sub and (sub != "log" or resource != "pods" or method != "GET"):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        unknown = set(query) - _KNOWN_QUERY
        if unknown:
            raise ApiError(400, "BadRequest", f"unknown query parameter(s): {sorted(unknown)}")
        if query.get("watch") in ("true", "1"):
            raise ApiError(400, "BadRequest", "the fake does not serve watches")
        verb = {
            ("POST", False): "create",
            ("GET", False): "list",
            ("GET", True): "get",
            ("DELETE", True): "delete",
            ("PATCH", True): "patch",
        }.get((method, bool(name)))
        if sub == "log":
            verb = "log"
        if verb is None:
            raise ApiError(
                405,
                "MethodNotAllowed",
                f"the server does not allow this method on the requested resource ({method} {path})",
            )
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError as e:
                raise ApiError(
                    400, "BadRequest", f"the body of the request was in an unknown format: {e}"
                ) from None
        with self._lock:
            self.requests.append(
                Request(method, path, verb, resource, ns, name, query, json.loads(raw) if raw else None)
            )
        fault = self._take_fault(verb, resource)
        if fault is not None:
            raise self._fault_error(fault, verb, resource, ns, name)
        out = self._dispatch(verb, resource, ns, name, query, headers, raw, body)
        late = self._take_fault(verb, resource, after=True)
        if late is not None:
            raise self._fault_error(late, verb, resource, ns, name)
        return out

    def _fault_error(self, fault: _Fault, verb: str, resource: str, ns: str, name: str) -> ApiError:
        reasons = {
            403: "Forbidden",
            404: "NotFound",
            409: "AlreadyExists",
            429: "TooManyRequests",
            500: "InternalError",
            503: "ServiceUnavailable",
            504: "Timeout",
        }
        action = "get" if verb == "log" else verb
        msg = fault.message or (
            f'{resource}{"/log" if verb == "log" else ""} is forbidden: User "{self.user}" cannot {action} '
            f'resource "{resource}" in API group "{RESOURCES[resource][1].rpartition("/")[0]}" '
            f'in the namespace "{ns}"'
            if fault.status == 403
            else f'{resource} "{name}" already exists'
            if fault.status == 409
            else f"injected failure {fault.status}"
        )
        hdrs = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else None
        return ApiError(
            fault.status, reasons.get(fault.status, HTTPStatus(fault.status).phrase), msg, headers=hdrs
        )

    def _dispatch(
        self,
        verb: str,
        resource: str,
        ns: str,
        name: str,
        query: dict[str, str],
        headers: Any,
        raw: str,
        body: Any,
    ) -> tuple[int, Any, str]:
        kind, api_version, _, list_kind, _ = RESOURCES[resource]
        if verb == "create":
            # The API server reads a body without Content-Type as JSON (the client sends none).
            ctype = (headers.get("Content-Type") or "application/json").split(";")[0].strip()
            if ctype != "application/json":
                raise ApiError(415, "UnsupportedMediaType", f"unsupported media type {ctype!r}")
            return 201, self._create(resource, ns, raw, body), "application/json"
        if verb == "patch":
            ctype = (headers.get("Content-Type") or "").split(";")[0].strip()
            return 200, self._patch(resource, ns, name, ctype, raw), "application/json"
        if ns not in self.namespaces:
            raise ApiError(
                404, "NotFound", f'namespaces "{ns}" not found', {"name": ns, "kind": "namespaces"}
            )
        if verb == "list":
            reqs = parse_selector(query.get("labelSelector", ""))
            if query.get("fieldSelector"):
                raise ApiError(400, "BadRequest", "the fake does not implement fieldSelector")
            with self._lock:
                items = [
                    json.loads(json.dumps(o))
                    for (n_s, _), o in sorted(self.objects[resource].items())
                    if n_s == ns and all(r.matches(o["metadata"].get("labels") or {}) for r in reqs)
                ]
                rv = str(next(self._rv))
            limit = int(query.get("limit") or 0)
            meta: dict[str, Any] = {"resourceVersion": rv}
            if limit and len(items) > limit:
                items = items[:limit]
                meta["continue"] = "fake-continue-token"
            return (
                200,
                {"kind": list_kind, "apiVersion": api_version, "metadata": meta, "items": items},
                "application/json",
            )
        if verb == "get":
            obj = self.get(resource, name, ns)
            if obj is None:
                raise ApiError(
                    404, "NotFound", f'{resource} "{name}" not found', {"name": name, "kind": resource}
                )
            return 200, obj, "application/json"
        if verb == "delete":
            if body is not None:
                extra = unknown_fields(body, "V1DeleteOptions")
                if extra:
                    raise ApiError(400, "BadRequest", f"strict decoding error: unknown field(s) {extra}")
                decode_model(raw, "V1DeleteOptions")
            policy = query.get("propagationPolicy") or (body or {}).get("propagationPolicy")
            if policy not in (None, "Orphan", "Background", "Foreground"):
                raise ApiError(400, "BadRequest", f"propagationPolicy {policy!r} is not supported")
            grace_raw = query.get("gracePeriodSeconds", (body or {}).get("gracePeriodSeconds"))
            grace = int(grace_raw) if grace_raw is not None else None
            if resource == "pods":
                return 200, self._delete_pod(ns, name, grace), "application/json"
            obj = self._remove(resource, ns, name)
            if obj is None:
                raise ApiError(
                    404, "NotFound", f'{resource} "{name}" not found', {"name": name, "kind": resource}
                )
            return (
                200,
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Success",
                    "details": {"name": name, "kind": resource, "uid": obj["metadata"]["uid"]},
                },
                "application/json",
            )
        # log
        with self._lock:
            pod = self.objects["pods"].get((ns, name))
            if pod is None:
                raise ApiError(404, "NotFound", f'pods "{name}" not found', {"name": name, "kind": "pods"})
            cname = query.get("container") or self._container_name(pod)
            if cname not in [c["name"] for c in pod["spec"]["containers"]]:
                raise ApiError(400, "BadRequest", f"container {cname} is not valid for pod {name}")
            states = [c.get("state", {}) for c in pod["status"].get("containerStatuses") or []]
            lines = list(self.logs.get((ns, name), []))
            if not lines and (not states or "waiting" in states[0]):
                why = (
                    (states[0].get("waiting") or {}).get("reason", "ContainerCreating")
                    if states
                    else "ContainerCreating"
                )
                raise ApiError(
                    400, "BadRequest", f'container "{cname}" in pod "{name}" is waiting to start: {why}'
                )
        tail = query.get("tailLines")
        if tail is not None:
            n = int(tail)
            lines = lines[-n:] if n > 0 else []
        text = "".join(line + "\n" for line in lines)
        return 200, text, "text/plain"


def _qos(spec: dict[str, Any]) -> str:
    reqs, lims = [], []
    for c in spec["containers"]:
        r = c.get("resources") or {}
        reqs.append(r.get("requests") or {})
        lims.append(r.get("limits") or {})
    if not any(reqs) and not any(lims):
        return "BestEffort"
    if all(
        lim.get("cpu") and lim.get("memory") and (req or lim) == lim
        for req, lim in zip(reqs, lims, strict=True)
    ):
        return "Guaranteed"
    return "Burstable"


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    if not isinstance(target, dict):
        target = {}
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        else:
            target[k] = _merge_patch(target.get(k), v)
    return target


class _Handler(BaseHTTPRequestHandler):
    kube: FakeKube
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keep test output quiet
        pass

    def _serve(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length).decode("utf-8") if length else ""
        parsed = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(parsed.query, keep_blank_values=True).items()}
        extra_headers: dict[str, str] = {}
        try:
            status, body, ctype = self.kube.handle(method, parsed.path, query, self.headers, raw)
        except ApiError as e:
            status, body, ctype = e.code, e.body(), "application/json"
            extra_headers = e.headers
        except Exception as e:  # a bug in the fake: make it loud, as a 500 the test will see
            status, ctype = 500, "application/json"
            body = ApiError(500, "InternalError", f"fake server bug: {type(e).__name__}: {e}").body()
        with self.kube._lock:
            for r in reversed(self.kube.requests):
                if r.path == parsed.path and r.method == method and r.status == 0:
                    r.status = status
                    break
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in extra_headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._serve("DELETE")

    def do_PATCH(self) -> None:  # noqa: N802
        self._serve("PATCH")

    def do_PUT(self) -> None:  # noqa: N802
        self._serve("PUT")
