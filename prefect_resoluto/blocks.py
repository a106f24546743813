"""Prefect blocks: sandbox and conduit settings editable in the UI / Prefect Cloud.

Register with ``prefect block register -m prefect_resoluto.blocks`` (a local server also
picks them up through the ``prefect.collections`` entry point). A saved sandbox block
is what a scheduled deployment uses: ``ResolutoTaskRunner(sandbox="my-sandbox")``.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from prefect.blocks.core import Block
from prefect.types import SecretDict
from pydantic import Field, SecretStr, field_validator

from guest_runner.conduit import Conduit, LocalConduit
from prefect_resoluto.config import SandboxConfig
from prefect_resoluto.runtimes import RUNTIMES
from prefect_resoluto.runtimes.base import DEFAULT_CPUS, DEFAULT_MEMORY, DEFAULT_PIDS, IsolationLevel

# Choices, so the block form shows dropdowns: every registered runtime, every level.
RuntimeName = Literal[tuple(RUNTIMES)]  # type: ignore[valid-type]
IsolationName = Literal[tuple(level.label for level in sorted(IsolationLevel, reverse=True))]  # type: ignore[valid-type]


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
    _description = (
        "An S3-compatible bucket through which host and sandboxes exchange work (prefect-resoluto)."
    )

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


#: What the conduit choice in the sandbox block's form shows, per block class. Put on each
#: choice, not on the nested schemas: Prefect's server keys nested block definitions by
#: their title, so renaming those would break the form's references.
CONDUIT_CHOICES = {"LocalConduitBlock": "Local directory", "S3ConduitBlock": "S3 bucket"}


def _title_choices(schema: dict[str, Any], titles: dict[str, str]) -> None:
    for choice in schema.get("anyOf", []):
        # While the schema is built, refs carry pydantic's provisional names
        # (``prefect_resoluto__blocks__LocalConduitBlock-Input__1``).
        ref = str(choice.get("$ref", "")).rsplit("/", 1)[-1]
        found = [
            t for name, t in titles.items() if ref == name or f"__{name}-" in ref or ref.endswith(f"__{name}")
        ]
        if found:
            choice["title"] = found[0]
        elif choice.get("type") == "null":
            choice["title"] = "Default (a local directory under the user's cache)"


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

    runtime: RuntimeName | None = Field(  # type: ignore[valid-type]
        None,
        description="Where sandboxes run; empty: the strongest runtime available on the host "
        "that runs the flow.",
    )
    image: str | None = Field(None, description="Image for container/kubernetes runtimes.")
    memory: str | None = Field(
        None, description=f"Memory limit per sandbox, e.g. 512Mi or 8Gi; empty: {DEFAULT_MEMORY}."
    )
    cpus: str | None = Field(
        None, description=f"CPU limit per sandbox, e.g. 1, 0.5 or 500m; empty: {DEFAULT_CPUS:g}."
    )
    disk: str | None = Field(
        None,
        description="Size of /tmp and /workspace per sandbox where the runtime "
        "can size them (ephemeral storage on Kubernetes); empty: "
        "the memory limit. In-memory scratch counts against memory.",
    )
    output_limit: str | None = Field(
        None,
        description="Most bytes of output files the host takes from one sandbox, e.g. 10Gi; "
        "empty: what the sandbox could hold (disk, else the memory limit).",
    )
    pids: int = Field(DEFAULT_PIDS, gt=0, description="Most processes and threads per sandbox.")
    min_isolation: IsolationName = Field(  # type: ignore[valid-type]
        IsolationLevel.USER_KERNEL.label, description="Refuse runtimes weaker than this."
    )
    silence_window: float = Field(
        600.0, description="Seconds without any event before a sandbox is presumed dead."
    )
    infrastructure_retries: int = Field(1, ge=0, description="Re-launches after an infrastructure failure.")
    warm_pool: int | None = Field(
        None,
        ge=0,
        description="Warm sandboxes kept ready per kind of node (0 disables; empty: the task "
        "runner's concurrency, at most 4, on local runtimes).",
    )
    output_paths: list[str] = Field(default_factory=list, description="Paths/globs returned from every node.")
    env: dict[str, str] = Field(default_factory=dict, description="Environment for every sandbox.")
    secret_env: SecretDict = Field(
        default_factory=lambda: SecretDict({}),
        description="Secret environment: masked here, redacted from every log line.",
    )
    egress: list[str] = Field(
        default_factory=list,
        description=(
            "Egress allowlist: names (api.example.com, *.example.com, host:8443) on local runtimes, CIDRs on "
            "Kubernetes. Empty: no network at all."
        ),
    )
    egress_resolve: dict[str, str] = Field(
        default_factory=dict,
        description="Pin allowlisted names to addresses (HOST -> IP), like curl --resolve.",
    )
    setup_egress: Optional[list[str]] = Field(  # noqa: UP045 - pydantic field
        None,
        description="The setup command's own allowlist (e.g. a package index); the workload's is egress.",
    )
    setup_argv: Optional[list[str]] = Field(  # noqa: UP045 - pydantic field
        None, description="A command run in the sandbox before each task (e.g. pip install ...)."
    )
    conduit: Union[LocalConduitBlock, S3ConduitBlock, None] = Field(  # noqa: UP007 - pydantic union
        None,
        description="Conduit; empty: a local directory under the user's cache.",
        json_schema_extra=lambda schema: _title_choices(schema, CONDUIT_CHOICES),
    )
    # Kubernetes runtime settings
    kube_namespace: str | None = Field(None, description="Kubernetes namespace for sandbox pods.")
    kube_context: str | None = Field(
        None, description="kubeconfig context to use (required unless in-cluster)."
    )
    runtime_class: str | None = Field(None, description="RuntimeClass for pods (default kata).")
    service_account: str | None = Field(None, description="Service account for sandbox pods.")
    priority_class: str | None = Field(None, description="PriorityClass for sandbox pods.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node selector for sandbox pods.")
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list, description="Tolerations for sandbox pods."
    )
    store_egress_cidr: str | None = Field(None, description="CIDR of the object store pods may reach.")
    store_egress_port: int | None = Field(None, description="Port of the object store pods may reach.")
    store_credentials_secret: str | None = Field(
        None, description="Kubernetes Secret holding AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for pods."
    )

    # Solari runtime settings (runtime="solari")
    solari_base_url: str | None = Field(
        None, description="Solari gateway base URL (default: SOLARI_BASE_URL)."
    )
    solari_api_key: SecretStr | None = Field(None, description="Solari API key (default: SOLARI_API_KEY).")
    solari_template: str | None = Field(None, description="Solari template for the sandbox VMs.")
    solari_conduit_mode: Optional[Literal["relay", "direct"]] = Field(  # noqa: UP045 - pydantic field
        None,
        description="relay (default: the VM needs no network) or direct (the VM reaches the S3 conduit).",
    )
    solari_session_timeout_s: float | None = Field(
        None, description="Gateway session timeout, extended while the node runs (default 300)."
    )
    solari_metadata: dict[str, str] = Field(default_factory=dict, description="Extra metadata on every VM.")

    @field_validator("min_isolation", mode="before")
    @classmethod
    def _level(cls, v: str) -> str:
        return IsolationLevel.parse(v).label

    def to_config(self) -> SandboxConfig:
        kube = {
            "namespace": self.kube_namespace,
            "context": self.kube_context,
            "runtime_class": self.runtime_class,
            "service_account": self.service_account,
            "priority_class": self.priority_class,
            "node_selector": self.node_selector or None,
            "tolerations": self.tolerations or None,
            "store_egress_cidr": self.store_egress_cidr,
            "store_egress_port": self.store_egress_port,
            "store_credentials_secret": self.store_credentials_secret,
            "image": self.image,
        }
        runtime_options: dict[str, Any] = (
            {k: v for k, v in kube.items() if v is not None} if self.runtime == "kubernetes" else {}
        )
        if self.runtime == "solari":
            solari = {
                "base_url": self.solari_base_url,
                "api_key": self.solari_api_key,
                "template": self.solari_template,
                "conduit_mode": self.solari_conduit_mode,
                "session_timeout_s": self.solari_session_timeout_s,
                "metadata": self.solari_metadata or None,
            }
            runtime_options = {k: v for k, v in solari.items() if v is not None}
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
            disk=self.disk,
            output_limit=self.output_limit,
            pids=self.pids,
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
