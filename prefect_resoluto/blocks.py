"""Prefect blocks: sandbox and conduit settings editable in the UI / Prefect Cloud.

Register with ``prefect block register -m prefect_resoluto.blocks`` (a local server also
picks them up through the ``prefect.collections`` entry point). A saved sandbox block
is what a scheduled deployment uses: ``ResolutoTaskRunner(sandbox="my-sandbox")``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from prefect.blocks.core import Block
from prefect.types import SecretDict
from pydantic import Field, SecretStr, field_validator

from guest_runner.conduit import Conduit, LocalConduit
from prefect_resoluto.config import SandboxConfig
from prefect_resoluto.runtimes.base import IsolationLevel


class LocalConduitBlock(Block):
    """A directory both the host and its local sandboxes can see."""

    _block_type_name = "Resoluto Local Conduit"
    _block_type_slug = "resoluto-local-conduit"
    _description = "A local directory through which host and sandboxes exchange work (prefect-resoluto)."

    path: str = Field(..., description="Absolute path of the conduit directory on the host.")

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("the conduit path must be absolute")
        return v

    def to_conduit(self) -> Conduit:
        return LocalConduit(self.path)


class S3ConduitBlock(Block):
    """An S3 (or S3-compatible: MinIO, GCS interoperability) bucket as the conduit."""

    _block_type_name = "Resoluto S3 Conduit"
    _block_type_slug = "resoluto-s3-conduit"
    _description = "An S3-compatible bucket through which host and sandboxes exchange work (prefect-resoluto)."

    bucket: str = Field(..., description="Bucket name.")
    base_prefix: str = Field("", description="Key prefix under which every run is stored.")
    endpoint_url: str | None = Field(None, description="For S3-compatible stores, e.g. http://minio:9000.")
    region: str | None = Field(None, description="Region (default: the environment's, else us-east-1).")
    access_key_id: str | None = Field(None, description="Leave empty to use ambient AWS credentials.")
    secret_access_key: SecretStr | None = Field(None, description="Secret key for access_key_id.")
    session_token: SecretStr | None = Field(None, description="Optional session token.")

    def to_conduit(self) -> Conduit:
        from guest_runner.s3conduit import S3Conduit

        return S3Conduit(
            self.bucket,
            base_prefix=self.base_prefix,
            endpoint_url=self.endpoint_url,
            region=self.region,
            access_key_id=self.access_key_id,
            secret_access_key=self.secret_access_key.get_secret_value() if self.secret_access_key else None,
            session_token=self.session_token.get_secret_value() if self.session_token else None,
        )


class SandboxBlock(Block):
    """Everything ResolutoTaskRunner needs to place task runs in sandboxes."""

    _block_type_name = "Resoluto Sandbox"
    _block_type_slug = "resoluto-sandbox"
    _description = "Where and how prefect-resoluto runs each task run in an isolated sandbox."
    _code_example = """
```python
from prefect import flow
from prefect_resoluto import ResolutoTaskRunner

@flow(task_runner=ResolutoTaskRunner(sandbox="my-sandbox"))
def my_flow(): ...
```
"""

    runtime: str | None = Field(
        None, description="gvisor, container, kubernetes, bubblewrap or process; empty: the strongest "
                          "runtime available on the host that runs the flow.")
    image: str | None = Field(None, description="Image for container/kubernetes runtimes.")
    memory: str | None = Field(None, description="Memory limit per sandbox, e.g. 512Mi or 2Gi.")
    cpus: str | None = Field(None, description="CPU limit per sandbox, e.g. 1, 0.5 or 500m.")
    min_isolation: str = Field(
        IsolationLevel.USER_KERNEL.label,
        description="Refuse runtimes weaker than this: vm, user-kernel, namespace or none.")
    silence_window: float = Field(600.0, description="Seconds without any event before a sandbox is presumed dead.")
    infrastructure_retries: int = Field(1, ge=0, description="Re-launches after an infrastructure failure.")
    warm_pool: int | None = Field(
        None, ge=0, description="Warm sandboxes kept ready per kind of node (0 disables; empty: the task "
        "runner's concurrency, at most 4, on local runtimes).")
    output_paths: list[str] = Field(default_factory=list, description="Paths/globs returned from every node.")
    env: dict[str, str] = Field(default_factory=dict, description="Environment for every sandbox.")
    secret_env: SecretDict = Field(
        default_factory=lambda: SecretDict({}),
        description="Secret environment: masked here, redacted from every log line.")
    egress: list[str] = Field(default_factory=list, description=(
        "Egress allowlist: names (api.example.com, *.example.com, host:8443) on local runtimes, CIDRs on "
        "Kubernetes. Empty: no network at all."))
    egress_resolve: dict[str, str] = Field(
        default_factory=dict, description="Pin allowlisted names to addresses (HOST -> IP), like curl --resolve.")
    setup_egress: Optional[list[str]] = Field(  # noqa: UP045 - pydantic field
        None, description="The setup command's own allowlist (e.g. a package index); the workload's is egress.")
    setup_argv: Optional[list[str]] = Field(  # noqa: UP045 - pydantic field
        None, description="A command run in the sandbox before each task (e.g. pip install ...).")
    conduit: Union[LocalConduitBlock, S3ConduitBlock, None] = Field(  # noqa: UP007 - pydantic union
        None, description="Conduit; empty: a local directory under the user's cache.")
    # Kubernetes runtime settings
    kube_namespace: str | None = Field(None, description="Kubernetes namespace for sandbox pods.")
    kube_context: str | None = Field(None, description="kubeconfig context to use (required unless in-cluster).")
    runtime_class: str | None = Field(None, description="RuntimeClass for pods (default kata).")
    service_account: str | None = Field(None, description="Service account for sandbox pods.")
    priority_class: str | None = Field(None, description="PriorityClass for sandbox pods.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node selector for sandbox pods.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Tolerations for sandbox pods.")
    store_egress_cidr: str | None = Field(None, description="CIDR of the object store pods may reach.")
    store_egress_port: int | None = Field(None, description="Port of the object store pods may reach.")
    store_credentials_secret: str | None = Field(
        None, description="Kubernetes Secret holding AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for pods.")

    @field_validator("min_isolation")
    @classmethod
    def _level(cls, v: str) -> str:
        return IsolationLevel.parse(v).label

    def to_config(self) -> SandboxConfig:
        kube = {
            "namespace": self.kube_namespace, "context": self.kube_context, "runtime_class": self.runtime_class,
            "service_account": self.service_account, "priority_class": self.priority_class,
            "node_selector": self.node_selector or None, "tolerations": self.tolerations or None,
            "store_egress_cidr": self.store_egress_cidr, "store_egress_port": self.store_egress_port,
            "store_credentials_secret": self.store_credentials_secret, "image": self.image,
        }
        runtime_options = {k: v for k, v in kube.items() if v is not None} if self.runtime == "kubernetes" else {}
        if self.runtime == "container" and self.image:
            runtime_options["image"] = self.image
        return SandboxConfig(
            runtime=self.runtime or None,
            runtime_options=runtime_options,
            conduit=self.conduit.to_conduit() if self.conduit is not None else None,
            output_paths=list(self.output_paths),
            env=dict(self.env),
            secret_env={str(k): str(v) for k, v in self.secret_env.get_secret_value().items()},
            memory=self.memory,
            cpus=self.cpus,
            image=self.image,
            egress=list(self.egress),
            egress_resolve=dict(self.egress_resolve),
            setup_egress=list(self.setup_egress) if self.setup_egress is not None else None,
            setup_argv=list(self.setup_argv) if self.setup_argv else None,
            min_isolation=self.min_isolation,
            silence_window=self.silence_window,
            infrastructure_retries=self.infrastructure_retries,
            warm_pool=self.warm_pool,
        )


def load_sandbox_block(ref: str | SandboxBlock) -> SandboxBlock:
    if isinstance(ref, SandboxBlock):
        return ref
    if isinstance(ref, str):
        name = ref.split("/", 1)[1] if ref.startswith("resoluto-sandbox/") else ref
        return SandboxBlock.load(name)  # type: ignore[return-value]
    raise TypeError(f"sandbox must be a SandboxBlock or the name of a saved one, got {type(ref).__name__}")
