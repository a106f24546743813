"""Render the Kubernetes objects of one node as YAML, without contacting a cluster.

Backs ``prefect-resoluto render --runtime kubernetes``: an operator reviews exactly what
the runtime would create -- NetworkPolicy, Secret (secret values replaced by
placeholders), Pod, in creation order -- and can ``kubectl apply -f`` it by hand. The
objects themselves come from :mod:`.manifests`; this only fills in placeholders and prints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from prefect_resoluto.runtimes.base import LaunchSpec
from prefect_resoluto.runtimes.guest_bundle import ENV_BUNDLE_KEY
from prefect_resoluto.runtimes.kubernetes.manifests import STORE_CREDENTIAL_VARS
from prefect_resoluto.runtimes.kubernetes.runtime import KubernetesRuntime

SECRET_PLACEHOLDER = "REPLACE-ME"


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render_documents(
    spec: LaunchSpec, runtime: KubernetesRuntime | None = None, *, name: str | None = None, **options: Any
) -> list[dict[str, Any]]:
    """NetworkPolicy, Secret (placeholders for values) and Pod for ``spec``, in creation order.

    ``options`` build a :class:`KubernetesRuntime` when ``runtime`` is not given. Nothing
    is uploaded and no cluster is contacted (the store's host name may be resolved for
    the NetworkPolicy, as at launch).
    """
    rt = runtime if runtime is not None else KubernetesRuntime(**options)
    placeholders = {k: f"{SECRET_PLACEHOLDER} ({k})" for k in spec.secret_env}
    if rt.options.store_role_arn:
        for var in STORE_CREDENTIAL_VARS:
            placeholders[var] = f"{SECRET_PLACEHOLDER} (short-lived credentials minted at launch)"
    m = rt.manifests(spec, name=name, secret_values=placeholders, upload_bundle=False)
    docs = m.documents()
    if m.secret is not None:
        secret = dict(m.secret)
        secret.pop("data", None)
        secret["stringData"] = {k: placeholders.get(k, SECRET_PLACEHOLDER) for k in sorted(m.secret["data"])}
        docs = [secret if d is m.secret else d for d in docs]
    return docs


def to_yaml(documents: Sequence[Mapping[str, Any]], header: str = "") -> str:
    body = yaml.dump_all(
        [dict(d) for d in documents],
        Dumper=_Dumper,
        sort_keys=False,
        default_flow_style=False,
        width=110,
        explicit_start=True,
    )
    return header + body


def render_yaml(
    spec: LaunchSpec, runtime: KubernetesRuntime | None = None, *, name: str | None = None, **options: Any
) -> str:
    """:func:`render_documents` as a multi-document YAML string with an explanatory header."""
    docs = render_documents(spec, runtime, name=name, **options)
    lines = [
        "# Rendered by prefect-resoluto: the objects the kubernetes runtime creates for one node,",
        "# in creation order. Secret values are placeholders; fill them in before applying.",
    ]
    pod_env = docs[-1]["spec"]["containers"][0].get("env") or []
    bundle = next((e.get("value") for e in pod_env if e.get("name") == ENV_BUNDLE_KEY), None)
    if bundle:
        lines += [
            "# The pod starts the guest runner from the conduit object",
            f"#   {bundle}",
            "# which a real run uploads first (prefect_resoluto.runtimes.guest_bundle.build_guest_bundle);",
            "# upload it yourself when applying by hand, or use an image with the runner",
            "# built in (images/Dockerfile) and guest_source='image'.",
        ]
    return to_yaml(docs, "\n".join(lines) + "\n")
