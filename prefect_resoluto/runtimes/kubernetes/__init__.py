"""The Kubernetes runtime: one short-lived pod per node under a Kata (or gVisor) RuntimeClass.

One job per module:

* :mod:`.manifests` -- the node's NetworkPolicy, Secret and Pod as plain dicts (pure);
* :mod:`.status` -- what a pod's phase, container reasons and conditions mean for the node (pure);
* :mod:`.api` -- the pinned cluster connection, retries and error messages;
* :mod:`.store` -- the store's address for the NetworkPolicy, the guest bundle uploaded once per run;
* :mod:`.options` -- :class:`KubernetesOptions`, the runtime's settings as one frozen value;
* :mod:`.runtime` -- :class:`KubernetesRuntime` (launch/status/destroy/sweep/logs), composing them;
* :mod:`.render` -- the same objects as YAML for ``prefect-resoluto render`` (imports PyYAML).

The names below are the runtime's public surface, importable from here as before the split.
"""

from prefect_resoluto.runtimes.kubernetes.api import KubernetesApiError, KubernetesConfigError
from prefect_resoluto.runtimes.kubernetes.manifests import (
    CONTAINER_NAME,
    DEFAULT_RUN_AS_USER,
    LABELS_ANNOTATION,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    METADATA_V4,
    METADATA_V6,
    NODE_LABEL,
    NON_PUBLIC_V4,
    RUN_LABEL,
    SANDBOX_ID_ANNOTATION,
    SANDBOX_LABEL,
    TOKEN_ANNOTATION,
    Manifests,
    dns_name,
    label_key,
    label_value,
    parse_egress_entry,
    pod_name,
    sanitise_labels,
)
from prefect_resoluto.runtimes.kubernetes.options import (
    DEFAULT_NAMESPACE,
    KubernetesOptions,
    isolation_of_runtime_class,
)
from prefect_resoluto.runtimes.kubernetes.runtime import KubernetesRuntime
from prefect_resoluto.runtimes.kubernetes.status import FATAL_WAITING_REASONS, INFRA_POD_REASONS

__all__ = [
    "CONTAINER_NAME",
    "DEFAULT_NAMESPACE",
    "DEFAULT_RUN_AS_USER",
    "FATAL_WAITING_REASONS",
    "INFRA_POD_REASONS",
    "LABELS_ANNOTATION",
    "MANAGED_BY",
    "MANAGED_BY_LABEL",
    "METADATA_V4",
    "METADATA_V6",
    "NODE_LABEL",
    "NON_PUBLIC_V4",
    "RUN_LABEL",
    "SANDBOX_ID_ANNOTATION",
    "SANDBOX_LABEL",
    "TOKEN_ANNOTATION",
    "KubernetesApiError",
    "KubernetesConfigError",
    "KubernetesOptions",
    "KubernetesRuntime",
    "Manifests",
    "dns_name",
    "isolation_of_runtime_class",
    "label_key",
    "label_value",
    "parse_egress_entry",
    "pod_name",
    "sanitise_labels",
]
