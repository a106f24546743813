"""The sandbox block's and the ``resoluto`` pool's fields, built from the settings' one
declaration (settings/fields.py), and how their JSON schemas are shaped so Prefect's UIs render
plain inputs.

A setting reads the same wherever it is edited: its title and description are its
declaration's. Nothing here decides behaviour; ``config.py`` does.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Optional, TypeVar

from prefect_resoluto.settings import fields as settings
from prefect_resoluto.settings.fields import OWN, SETTINGS, Form, SandboxSettings, Surface


class SurfaceType(NamedTuple):
    """A field type a surface supplies for a setting whose :class:`~settings.Form` names it:
    a Prefect or pydantic type fields.py does not import."""

    annotation: Any
    factory: Callable[[], Any] | None = None
    schema: Callable[[dict[str, Any]], None] | None = None


def _form(name: str, surface: Surface) -> Form:
    s = SETTINGS[name]
    form = s.block if surface is Surface.BLOCK else s.pool
    assert isinstance(form, Form), f"{surface.value} does not expose {name}"
    return form


def _own_type(name: str) -> Any:
    # SandboxRuntime / Conduit appear only in the types of settings whose forms name their own.
    hints = typing.get_type_hints(SandboxSettings, localns={"SandboxRuntime": object, "Conduit": object})
    return hints[name]


def setting_fields(surface: Surface, types: Mapping[str, SurfaceType]) -> dict[str, tuple[Any, Any]]:
    """The pydantic fields (annotation, FieldInfo) of the settings ``surface`` shows, in
    declaration order, each with its one title and description."""
    from pydantic import Field

    out: dict[str, tuple[Any, Any]] = {}
    for name in settings.exposed(surface):
        s, form = SETTINGS[name], _form(name, surface)
        supplied = types[form.type] if isinstance(form.type, str) else None
        annotation = (
            supplied.annotation if supplied else form.type if form.type is not None else _own_type(name)
        )
        kw: dict[str, Any] = {
            "title": form.title or s.title,
            "description": form.description or s.description,
        }
        if form.examples is not None:
            kw["examples"] = form.examples
        if form.gt is not None:
            kw["gt"] = form.gt
        if form.ge is not None:
            kw["ge"] = form.ge
        factory = supplied.factory if supplied and supplied.factory else None
        default = form.default
        if default is OWN and factory is None:
            declared = {f.name: f for f in dataclasses.fields(SandboxSettings)}[name]
            if declared.default_factory is not dataclasses.MISSING:
                factory = declared.default_factory
            else:
                default = declared.default
        schema = supplied.schema if supplied else None
        if schema is None and factory is None and default is None:
            schema = plain_optional
        if schema is not None:
            kw["json_schema_extra"] = schema
        out[name] = (annotation, Field(default_factory=factory, **kw) if factory else Field(default, **kw))
    return out


_M = TypeVar("_M")


def model(
    name: str,
    base: type[_M],
    fields: Mapping[str, tuple[Any, Any]],
    validators: dict[str, Any],
    module: str,
) -> type[_M]:
    """A pydantic model ``name`` of ``module`` deriving from ``base`` with ``fields`` (in
    order) and ``validators``: what a surface inherits its setting fields from."""
    from pydantic import create_model

    made: type[_M] = create_model(  # type: ignore[call-overload]
        name, __base__=base, __module__=module, __validators__=validators, **fields
    )
    return made


def setting_validators(surface: Surface) -> dict[str, Any]:
    """The field validators a surface's declared forms ask for (``Form.check``, ``Form.normalize``)."""
    from pydantic import field_validator

    out: dict[str, Any] = {}
    for name in settings.exposed(surface):
        s, form = SETTINGS[name], _form(name, surface)
        if form.check and s.check is not None:
            out[f"_check_{name}"] = field_validator(name)(_checker(s.check))
        if form.normalize and s.normalize is not None:
            out[f"_normalize_{name}"] = field_validator(name, mode="before")(_normalizer(s.normalize))
    return out


def _checker(check: Callable[[Any], object]) -> Callable[[Any], Any]:
    def validate(v: Any) -> Any:
        if v is not None and v != "":
            check(v)
        return v or None  # an empty input is no value

    return validate


def _normalizer(normalize: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def validate(v: Any) -> Any:
        return normalize(v)

    return validate


def to_settings(surface: Surface, values: Mapping[str, Any]) -> dict[str, Any]:
    """A form's values as settings: an empty input of a ``blank_is_unset`` setting is None,
    containers are copies (the form keeps its own)."""
    out: dict[str, Any] = {}
    for name in settings.exposed(surface):
        v = values[name]
        if _form(name, surface).blank_is_unset and not v and v != 0:
            v = None
        elif isinstance(v, (list, dict)):
            v = type(v)(v)
        out[name] = v
    return out


def optional(annotation: Any) -> Any:
    """``annotation`` accepting None too (a job configuration's field: unset unless templated)."""
    return Optional[annotation]  # noqa: UP045 - pydantic annotation


def plain_optional(schema: dict[str, Any]) -> None:
    """Render ``X | None = None`` as a plain input for ``X`` rather than an ``X | null`` toggle.

    Pydantic writes ``anyOf: [X, {type: null}], default: null``; Prefect's forms show that
    as a two-way toggle. Written as ``X`` without a default, as Prefect's own workers'
    variables are, the field is simply optional: an empty input sends no value, and
    Prefect's schema validation (``preprocess_schema``) accepts null for a property that is
    neither required nor defaulted."""
    choices = schema.get("anyOf")
    if not isinstance(choices, list):
        return
    rest = [c for c in choices if c != {"type": "null"}]
    if len(rest) != 1 or len(rest) == len(choices) or "$ref" in rest[0]:
        return
    del schema["anyOf"]
    if schema.get("default", 0) is None:
        del schema["default"]
    for k, v in rest[0].items():
        schema.setdefault(k, v)


def title_choices(schema: dict[str, Any], titles: dict[str, str], none_title: str | None = None) -> None:
    """Human titles on the choices of a union of blocks or models (``anyOf`` of ``$ref``s),
    put on each choice rather than on the referenced definitions: Prefect's server keys
    nested *block* definitions by their title, so renaming those would break the form's
    references."""
    for choice in schema.get("anyOf", []):
        # While the schema is built, refs carry pydantic's provisional names
        # (``prefect_resoluto__blocks__LocalConduitBlock-Input__1``).
        ref = str(choice.get("$ref", "")).rsplit("/", 1)[-1]
        found = [
            t for name, t in titles.items() if ref == name or f"__{name}-" in ref or ref.endswith(f"__{name}")
        ]
        if found:
            choice["title"] = found[0]
        elif choice.get("type") == "null" and none_title:
            choice["title"] = none_title
