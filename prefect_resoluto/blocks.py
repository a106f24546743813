"""Prefect blocks: sandbox and conduit settings editable in the UI / Prefect Cloud.

Register with ``prefect block register -m prefect_resoluto`` (a local server also picks
them up through the ``prefect.collections`` entry point). A saved sandbox block is what a
scheduled deployment uses: ``ResolutoTaskRunner(sandbox="my-sandbox")``.

The sandbox block's ``conduit`` is a nested *model*, not a nested block: Prefect's UIs do
not round-trip nested blocks (the V1 UI drops an inline one on Save, the V2 UI turns a
referenced one inline and writes its masked secret back as the literal ``********``), and
both round-trip a nested model, its masked secrets restored by the server. A conduit block
passed to the sandbox block is taken in as such a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional, Union

from prefect.blocks.core import Block
from prefect.types import SecretDict
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from guest_runner.conduit import Conduit, LocalConduit
from prefect_resoluto.settings.config import SandboxConfig
from prefect_resoluto.settings.fields import Surface, exposed
from prefect_resoluto.settings.forms import (
    SurfaceType,
    model,
    plain_optional,
    setting_fields,
    setting_validators,
    title_choices,
    to_settings,
)

# The conduit settings, once for the blocks and the sandbox block's nested models.
_Path = Annotated[str, Field(title="Path", description="Absolute path of the conduit directory on the host.")]
_Bucket = Annotated[str, Field(title="Bucket", description="Bucket name.")]
_BasePrefix = Annotated[
    str, Field(title="Key prefix", description="Key prefix under which every run is stored.")
]
_Endpoint = Annotated[
    Optional[str],  # noqa: UP045 - pydantic field
    Field(
        title="Endpoint URL",
        description="For S3-compatible stores, e.g. http://minio:9000.",
        json_schema_extra=plain_optional,
    ),
]
_Region = Annotated[
    Optional[str],  # noqa: UP045 - pydantic field
    Field(
        title="Region",
        description="Region (default: the environment's, else us-east-1).",
        json_schema_extra=plain_optional,
    ),
]
_AccessKey = Annotated[
    Optional[str],  # noqa: UP045 - pydantic field
    Field(
        title="Access key ID",
        description="Leave empty to use ambient AWS credentials.",
        json_schema_extra=plain_optional,
    ),
]
_SecretKey = Annotated[
    Optional[SecretStr],  # noqa: UP045 - pydantic field
    Field(
        title="Secret access key",
        description="Secret key for the access key ID.",
        json_schema_extra=plain_optional,
    ),
]
_SessionToken = Annotated[
    Optional[SecretStr],  # noqa: UP045 - pydantic field
    Field(title="Session token", description="Optional session token.", json_schema_extra=plain_optional),
]


def _check_absolute(v: str) -> str:
    if not v.startswith("/"):
        raise ValueError("the conduit path must be absolute")
    return v


def _s3(
    bucket: str,
    base_prefix: str,
    endpoint_url: str | None,
    region: str | None,
    access_key_id: str | None,
    secret_access_key: SecretStr | None,
    session_token: SecretStr | None,
) -> Conduit:
    from guest_runner.conduit.s3 import S3Conduit

    return S3Conduit(
        bucket,
        base_prefix=base_prefix,
        endpoint_url=endpoint_url,
        region=region,
        access_key_id=access_key_id,
        secret_access_key=secret_access_key.get_secret_value() if secret_access_key else None,
        session_token=session_token.get_secret_value() if session_token else None,
    )


class LocalConduitBlock(Block):
    """A directory both the host and its local sandboxes can see."""

    _block_type_name = "Resoluto Local Conduit"
    _block_type_slug = "resoluto-local-conduit"
    _description = "A local directory through which host and sandboxes exchange work (prefect-resoluto)."
    _code_example = """
```python
from prefect_resoluto import ResolutoTaskRunner
from prefect_resoluto.blocks import LocalConduitBlock

runner = ResolutoTaskRunner(conduit=LocalConduitBlock.load("BLOCK_NAME"))
```
"""

    path: _Path

    _absolute = field_validator("path")(_check_absolute)

    def to_conduit(self) -> Conduit:
        return LocalConduit(self.path)


class S3ConduitBlock(Block):
    """An S3 (or S3-compatible: MinIO, GCS interoperability) bucket as the conduit."""

    _block_type_name = "Resoluto S3 Conduit"
    _block_type_slug = "resoluto-s3-conduit"
    _description = (
        "An S3-compatible bucket through which host and sandboxes exchange work (prefect-resoluto)."
    )
    _code_example = """
```python
from prefect_resoluto import ResolutoTaskRunner
from prefect_resoluto.blocks import S3ConduitBlock

runner = ResolutoTaskRunner(conduit=S3ConduitBlock.load("BLOCK_NAME"))
```
"""

    bucket: _Bucket
    base_prefix: _BasePrefix = ""
    endpoint_url: _Endpoint = None
    region: _Region = None
    access_key_id: _AccessKey = None
    secret_access_key: _SecretKey = None
    session_token: _SessionToken = None

    def to_conduit(self) -> Conduit:
        return _s3(
            self.bucket,
            self.base_prefix,
            self.endpoint_url,
            self.region,
            self.access_key_id,
            self.secret_access_key,
            self.session_token,
        )


class LocalDirectoryConduit(BaseModel):
    """A directory both the host and its local sandboxes can see."""

    model_config = ConfigDict(title="Local directory")

    path: _Path

    _absolute = field_validator("path")(_check_absolute)

    def to_conduit(self) -> Conduit:
        return LocalConduit(self.path)


class S3BucketConduit(BaseModel):
    """An S3-compatible bucket (S3, MinIO, GCS interoperability)."""

    model_config = ConfigDict(title="S3 bucket")

    bucket: _Bucket
    base_prefix: _BasePrefix = ""
    endpoint_url: _Endpoint = None
    region: _Region = None
    access_key_id: _AccessKey = None
    secret_access_key: _SecretKey = None
    session_token: _SessionToken = None

    def to_conduit(self) -> Conduit:
        return _s3(
            self.bucket,
            self.base_prefix,
            self.endpoint_url,
            self.region,
            self.access_key_id,
            self.secret_access_key,
            self.session_token,
        )


#: What a conduit choice shows, per class: the block union of the pool's form and the model
#: union of the sandbox block's form.
CONDUIT_CHOICES = {
    "LocalConduitBlock": "Local directory",
    "S3ConduitBlock": "S3 bucket",
    "LocalDirectoryConduit": "Local directory",
    "S3BucketConduit": "S3 bucket",
}
CONDUIT_DEFAULT_TITLE = "Default (a local directory under the user's cache)"
#: Each conduit block and the settings model the sandbox block keeps it as (same fields).
_CONDUIT_SETTINGS: tuple[tuple[type[Block], type[BaseModel]], ...] = (
    (LocalConduitBlock, LocalDirectoryConduit),
    (S3ConduitBlock, S3BucketConduit),
)


def _conduit_choices(schema: dict[str, Any]) -> None:
    title_choices(schema, CONDUIT_CHOICES, CONDUIT_DEFAULT_TITLE)


def _k8s(title: str, description: str) -> Any:
    return Field(
        None, title=f"Kubernetes: {title}", description=description, json_schema_extra=plain_optional
    )


def _solari(title: str, description: str) -> Any:
    return Field(None, title=f"Solari: {title}", description=description, json_schema_extra=plain_optional)


# Every setting the block shows, built from its one declaration (settings/fields.py): a plain model
# the block inherits its fields from, in declaration order, before the runtimes' own below.
if TYPE_CHECKING:
    _BlockSettings = BaseModel
else:
    _BlockSettings = model(
        "_BlockSettings",
        BaseModel,
        setting_fields(
            Surface.BLOCK,
            {
                "conduit": SurfaceType(
                    Union[LocalDirectoryConduit, S3BucketConduit, None],  # noqa: UP007 - pydantic union
                    schema=_conduit_choices,
                ),
                "secret_dict": SurfaceType(SecretDict, lambda: SecretDict({})),
            },
        ),
        setting_validators(Surface.BLOCK),
        __name__,
    )


class SandboxBlock(Block, _BlockSettings):
    """Everything ResolutoTaskRunner needs to place task runs in sandboxes."""

    if TYPE_CHECKING:  # the settings' fields are built from their declaration (settings/fields.py)

        def __getattr__(self, name: str) -> Any: ...

    _block_type_name = "Resoluto Sandbox"
    _block_type_slug = "resoluto-sandbox"
    _description = "Where and how prefect-resoluto runs each task run in an isolated sandbox."
    # The UI puts the document's name in place of BLOCK_NAME (its first occurrence).
    _code_example = """
```python
from prefect import flow
from prefect_resoluto import ResolutoTaskRunner

@flow(task_runner=ResolutoTaskRunner(sandbox="BLOCK_NAME"))
def my_flow(): ...
```
"""

    # Fields in the order the form shows them: every runtime's settings first (inherited,
    # above), then those of one runtime, each titled with its runtime ("Kubernetes: namespace").
    kube_namespace: str | None = _k8s("namespace", "Namespace of the sandbox pods. Empty: default.")
    kube_context: str | None = _k8s("kubeconfig context", "Required unless the flow runs in the cluster.")
    runtime_class: str | None = _k8s("RuntimeClass", "RuntimeClass of the pods. Empty: kata.")
    service_account: str | None = _k8s("service account", "Service account of the sandbox pods.")
    priority_class: str | None = _k8s("PriorityClass", "PriorityClass of the sandbox pods.")
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        title="Kubernetes: node selector",
        description="Node labels the sandbox pods must match {LABEL: value}.",
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list,
        title="Kubernetes: tolerations",
        description="Tolerations of the sandbox pods, as in a pod spec.",
    )
    store_egress_cidr: str | None = _k8s("store egress CIDR", "CIDR of the object store the pods may reach.")
    store_egress_port: int | None = _k8s("store egress port", "Port of the object store the pods may reach.")
    store_credentials_secret: str | None = _k8s(
        "store credentials Secret",
        "Kubernetes Secret holding AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for the pods.",
    )

    solari_base_url: str | None = _solari("gateway URL", "Solari gateway base URL. Empty: SOLARI_BASE_URL.")
    solari_api_key: SecretStr | None = _solari("API key", "Solari API key. Empty: SOLARI_API_KEY.")
    solari_template: str | None = _solari("template", "Solari template of the sandbox VMs.")
    solari_conduit_mode: Optional[Literal["relay", "direct"]] = _solari(  # noqa: UP045 - pydantic field
        "conduit mode",
        "relay (the VM needs no network) or direct (the VM reaches the S3 conduit). Empty: relay.",
    )
    solari_session_timeout_s: float | None = Field(
        None,
        title="Solari session timeout (s)",
        description="Gateway session timeout, extended while the node runs. Empty: 300.",
        json_schema_extra=plain_optional,
    )
    solari_metadata: dict[str, str] = Field(
        default_factory=dict, title="Solari: VM metadata", description="Extra metadata on every VM."
    )

    @field_validator("conduit", mode="before")
    @classmethod
    def _conduit_model(cls, v: Any) -> Any:
        # A conduit block (README: conduit=S3ConduitBlock(...)) is kept as its settings.
        for block, settings in _CONDUIT_SETTINGS:
            if isinstance(v, block):
                return settings(**{name: getattr(v, name) for name in settings.model_fields})
        return v

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
        values = to_settings(Surface.BLOCK, {name: getattr(self, name) for name in exposed(Surface.BLOCK)})
        conduit, secret_env = values["conduit"], values["secret_env"]
        values["conduit"] = conduit.to_conduit() if conduit is not None else None
        values["secret_env"] = {str(k): str(v) for k, v in secret_env.get_secret_value().items()}
        return SandboxConfig(runtime_options=runtime_options, **values)


def load_sandbox_block(ref: str | SandboxBlock) -> SandboxBlock:
    if isinstance(ref, SandboxBlock):
        return ref
    if isinstance(ref, str):
        name = ref.split("/", 1)[1] if ref.startswith("resoluto-sandbox/") else ref
        return SandboxBlock.load(name)  # type: ignore[return-value]
    raise TypeError(f"sandbox must be a SandboxBlock or the name of a saved one, got {type(ref).__name__}")
