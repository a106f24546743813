"""The block and pool forms as Prefect's UIs use them, through the session's real Prefect API:
what a form reads, what it sends back on Save, what the pool's template holds.

The requests are the ones Prefect 3.9.1's UIs send (recorded from headless Chromium): the
edit page reads ``GET /api/block_documents/{id}`` and its Save sends ``PATCH`` with the
form's ``data`` and ``merge_existing_data: false``. For a property whose schema is a nested
*block*, the form only holds a ``{"$ref": {"block_document_id": ...}}`` value: the V1 UI
(vue) drops any other value of it from ``data``, the V2 UI (react) sends it back as read (a
referenced block's data inline, its secrets as the masked ``********``). Every other value
goes back as read, masked secrets included (the server puts the stored secret back).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import pytest
from pydantic import SecretStr
from support.prefect_cli import api_http, api_url, prefect_cli

from prefect_resoluto.blocks import LocalConduitBlock, S3ConduitBlock, SandboxBlock

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect")]


def _api(method: str, path: str, **kw: Any) -> Any:
    with api_http() as http:
        r = http.request(method, api_url().rstrip("/") + path, **kw)
    r.raise_for_status()
    return r.json() if r.content else None


def _is_block_property(prop: dict[str, Any], definitions: dict[str, Any]) -> bool:
    refs = [c.get("$ref", "") for c in prop.get("anyOf", [prop])]
    return any("block_type_slug" in definitions.get(r.rsplit("/", 1)[-1], {}) for r in refs if r)


def ui_save(block_document_id: str, ui: str) -> None:
    """Press Save in the block's edit form without changing anything, as UI ``ui`` does."""
    doc = _api("GET", f"/block_documents/{block_document_id}")
    schema = doc["block_schema"]["fields"]
    data: dict[str, Any] = {}
    for name, value in doc["data"].items():
        prop = schema["properties"].get(name, {})
        if _is_block_property(prop, schema.get("definitions", {})):
            ref = doc["block_document_references"].get(name)
            if ref is not None and ui == "v1":
                data[name] = {"$ref": {"block_document_id": ref["block_document"]["id"]}}
            elif ui == "v2":
                data[name] = value  # as read: inline, masked secrets and all
            continue  # v1: a nested block without a reference is not a value the form keeps
        data[name] = value
    _api("PATCH", f"/block_documents/{block_document_id}", json={"data": data, "merge_existing_data": False})


@pytest.mark.sandbox
@pytest.mark.parametrize("ui", ["v1", "v2"])
def test_a_sandbox_block_with_a_nested_conduit_survives_the_edit_forms_save(ui):
    name = f"form-{ui}-{uuid.uuid4().hex[:6]}"
    block_id = SandboxBlock(
        runtime="gvisor",
        memory="2Gi",
        secret_env={"API_TOKEN": "blk-secret-4411"},
        conduit=S3ConduitBlock(
            bucket="flows", base_prefix="resoluto", secret_access_key=SecretStr("s3-key-7789")
        ),
    ).save(name)
    shown = _api("GET", f"/block_documents/{block_id}")["data"]
    assert shown["conduit"]["bucket"] == "flows" and shown["conduit"]["secret_access_key"] == "********"
    assert "s3-key-7789" not in str(shown) and "blk-secret-4411" not in str(shown)

    for _ in range(2):  # twice: a second Save reads what the first one wrote
        ui_save(str(block_id), ui)
    back = SandboxBlock.load(name)
    assert back.conduit is not None, "the conduit was dropped by the form's Save"
    assert (back.conduit.bucket, back.conduit.base_prefix) == ("flows", "resoluto")  # type: ignore[union-attr]
    assert back.conduit.secret_access_key.get_secret_value() == "s3-key-7789"  # type: ignore[union-attr]
    assert back.secret_env.get_secret_value() == {"API_TOKEN": "blk-secret-4411"}
    assert (back.runtime, back.memory) == ("gvisor", "2Gi")
    assert back.to_config().build_conduit().url.startswith("s3://flows")


def test_a_saved_conduit_block_passed_to_the_sandbox_block_is_kept_as_its_settings(tmp_path):
    conduit = LocalConduitBlock(path=str(tmp_path / "c"))
    conduit.save(f"c-{uuid.uuid4().hex[:6]}")
    name = f"form-ref-{uuid.uuid4().hex[:6]}"
    SandboxBlock(conduit=conduit).save(name)
    ui_save(str(SandboxBlock.load(name)._block_document_id), "v2")
    assert SandboxBlock.load(name).to_config().build_conduit().url == (tmp_path / "c").as_uri()


def test_block_forms_have_titles_plain_inputs_and_the_block_name_in_the_snippet():
    SandboxBlock.register_type_and_schema()
    with_slug = _api("GET", "/block_types/slug/resoluto-sandbox")
    assert 'sandbox="BLOCK_NAME"' in with_slug["code_example"]  # the UI puts the document's name there
    schema = SandboxBlock.model_json_schema()
    props = schema["properties"]
    titles = {k: p["title"] for k, p in props.items()}
    assert titles["cpus"] == "CPUs" and titles["pids"] == "Process limit"
    assert titles["store_egress_cidr"] == "Kubernetes: store egress CIDR"
    assert titles["solari_session_timeout_s"] == "Solari session timeout (s)"
    # Grouped: every runtime's settings, then Kubernetes', then Solari's.
    order = list(props)
    kube = [i for i, k in enumerate(order) if titles[k].startswith("Kubernetes:")]
    solari = [i for i, k in enumerate(order) if titles[k].startswith("Solari")]
    assert kube == list(range(kube[0], kube[-1] + 1)) and solari == list(range(solari[0], len(order)))
    toggles = [k for k, p in props.items() if {"type": "null"} in p.get("anyOf", []) and k != "conduit"]
    assert toggles == [], f"X | null toggles in the form: {toggles}"
    assert props["solari_api_key"]["format"] == "password"
    assert {c.get("title") for c in props["conduit"]["anyOf"]} >= {"Local directory", "S3 bucket"}


# --------------------------------------------------------------------------- the pool's form

SECRETISH = re.compile(r"secret|token|password|api_key|private_key")


def _secret_leaks(schema: dict[str, Any], where: str = "variables") -> list[str]:
    """Properties that look like they carry a secret and are not masked: not a password
    field, not a reference to a Secret block, not under the block's own secret_fields."""
    definitions = schema.get("definitions", {})
    leaks: list[str] = []

    def masked(name: str, prop: dict[str, Any], secret_fields: list[str]) -> bool:
        if prop.get("format") == "password" or name in secret_fields or f"{name}.*" in secret_fields:
            return True
        for choice in prop.get("anyOf", []):
            target = definitions.get(str(choice.get("$ref", "")).rsplit("/", 1)[-1], {})
            if target.get("block_type_slug") == "secret" or any(
                c.get("format") == "password" for c in [choice] if "$ref" not in c
            ):
                return True
        return False

    def walk(obj: dict[str, Any], path: str) -> None:
        secret_fields = obj.get("secret_fields", [])
        for name, prop in obj.get("properties", {}).items():
            # a Kubernetes Secret's *name* is not a secret; a key's id is not either
            if SECRETISH.search(name) and not name.endswith("_id") and name != "store_credentials_secret":
                if not masked(name, prop, secret_fields):
                    leaks.append(f"{path}.{name}")
            extra = prop.get("additionalProperties")
            if isinstance(extra, dict) and SECRETISH.search(name) and extra.get("format") == "password":
                leaks.append(f"{path}.{name} (an object of password fields is edited as clear JSON)")

    walk(schema, where)
    for def_name, definition in definitions.items():
        walk(definition, f"definitions.{def_name}")
    return leaks


def test_the_pools_template_has_no_secret_outside_a_password_field_or_a_secret_block():
    from prefect.client.orchestration import get_client

    name = f"forms-{uuid.uuid4().hex[:8]}"
    proc = prefect_cli("work-pool", "create", name, "--type", "resoluto")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with get_client(sync_client=True) as c:
        template = c.read_work_pool(name).base_job_template
    variables = template["variables"]
    assert _secret_leaks(variables) == []
    assert "secret_env" not in variables["properties"], "a pool default would be stored and shown in clear"
    secret = variables["properties"]["secret_env_block"]
    assert [
        variables["definitions"][c["$ref"].rsplit("/", 1)[-1]]["block_type_slug"]
        for c in secret["anyOf"]
        if "$ref" in c
    ] == ["secret"]
    assert "secret_env" not in template["job_configuration"]


def test_the_pool_form_has_real_defaults_choices_and_the_blocks_descriptions():
    from prefect_resoluto.worker.worker import ResolutoWorker

    variables = ResolutoWorker.get_default_base_job_template()["variables"]
    props = variables["properties"]
    assert {k: props[k].get("default") for k in ("min_isolation", "memory", "cpus", "silence_window")} == {
        "min_isolation": "user-kernel",
        "memory": "4Gi",
        "cpus": "2",
        "silence_window": 600.0,
    }
    block = SandboxBlock.model_json_schema()["properties"]
    for shared in ("min_isolation", "memory", "cpus", "image", "silence_window"):
        assert props[shared]["description"] == block[shared]["description"], shared
        assert props[shared]["title"] == block[shared]["title"], shared
    assert props["runtime"]["enum"] == ["gvisor", "container", "kubernetes", "bubblewrap", "process"]
    assert "Solari is not offered here" in props["runtime"]["description"]
    assert {c.get("title") for c in props["conduit"]["anyOf"]} >= {"Local directory", "S3 bucket"}
    described = [variables.get("description", "")] + [p.get("description", "") for p in props.values()]
    assert not [d for d in described if "``" in d], "RST backticks in the form"


def test_a_sandbox_blocks_values_win_over_the_pools_defaults_not_over_what_the_pool_sets():
    from prefect_resoluto.worker.worker import ResolutoJobConfiguration

    block = SandboxBlock(memory="1Gi", cpus="4", silence_window=120, min_isolation="namespace")
    at_defaults = ResolutoJobConfiguration(
        sandbox=block, memory="4Gi", cpus="2", silence_window=600, min_isolation="user-kernel"
    ).sandbox_config()
    assert (at_defaults.memory, at_defaults.cpus, at_defaults.silence_window) == ("1Gi", "4", 120)
    assert at_defaults.min_isolation.label == "namespace"
    set_here = ResolutoJobConfiguration(sandbox=block, memory="8Gi", min_isolation="vm").sandbox_config()
    assert (set_here.memory, set_here.min_isolation.label) == ("8Gi", "vm")
    alone = ResolutoJobConfiguration(memory="4Gi", cpus="2").sandbox_config()
    assert (alone.memory, alone.cpus) == ("4Gi", "2")


def test_a_secret_env_job_variable_is_refused_with_where_secrets_go():
    from prefect.client.schemas.objects import FlowRun

    from prefect_resoluto.worker.worker import ResolutoJobConfiguration

    run = FlowRun(flow_id=uuid.uuid4(), job_variables={"secret_env": {"TOKEN": "x"}})
    with pytest.raises(ValueError, match="secret_env_block"):
        ResolutoJobConfiguration().prepare_for_flow_run(run)


def test_a_sandbox_block_saved_with_a_referenced_conduit_block_still_loads():
    """Documents from before the conduit became a nested model hold a reference to a saved
    conduit block; they load as its settings."""
    conduit_id = S3ConduitBlock(bucket="legacy", secret_access_key=SecretStr("legacy-key-3310")).save(
        f"legacy-{uuid.uuid4().hex[:6]}"
    )
    SandboxBlock.register_type_and_schema()
    block_type = _api("GET", "/block_types/slug/resoluto-sandbox")
    (schema, *_) = _api(
        "POST",
        "/block_schemas/filter",
        json={"block_schemas": {"block_type_id": {"any_": [block_type["id"]]}}},
    )
    name = f"legacy-ref-{uuid.uuid4().hex[:6]}"
    _api(
        "POST",
        "/block_documents/",
        json={
            "name": name,
            "block_type_id": block_type["id"],
            "block_schema_id": schema["id"],
            "data": {"runtime": "gvisor", "conduit": {"$ref": {"block_document_id": str(conduit_id)}}},
        },
    )
    back = SandboxBlock.load(name)
    assert back.conduit is not None and back.conduit.bucket == "legacy"  # type: ignore[union-attr]
    assert back.conduit.secret_access_key.get_secret_value() == "legacy-key-3310"  # type: ignore[union-attr]
