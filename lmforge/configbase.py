"""Base class and helpers for lmforge's typed configuration.

Every config model forbids unknown keys. Fields that do not change a stage's results
(worker counts, log intervals, paths of outputs) are declared with `runtime_field`; the
cache identity of a stage is the config with those fields removed (`identity_dict`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

RUNTIME_MARK = {"lmforge_runtime": True}


class StrictModel(BaseModel):
    """A config section: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


def runtime_field(default: Any = ..., *, description: str, **kwargs: Any) -> Any:
    """A field that changes how a stage runs but not what it produces (excluded from cache keys)."""
    if "default_factory" in kwargs:
        return Field(description=description, json_schema_extra=RUNTIME_MARK, **kwargs)
    return Field(default, description=description, json_schema_extra=RUNTIME_MARK, **kwargs)


def is_runtime_field(model: type[BaseModel], name: str) -> bool:
    extra = model.model_fields[name].json_schema_extra
    return isinstance(extra, dict) and extra.get("lmforge_runtime") is True


def identity_dict(model: BaseModel) -> dict[str, Any]:
    """The model as plain JSON data, without runtime fields, recursively."""
    out: dict[str, Any] = {}
    for name in type(model).model_fields:
        if is_runtime_field(type(model), name):
            continue
        out[name] = _identity_value(getattr(model, name))
    return out


def _identity_value(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return identity_dict(value)
    if isinstance(value, dict):
        return {str(k): _identity_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_identity_value(v) for v in value]
    if hasattr(value, "__fspath__"):
        return str(value)
    return value


def runtime_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted names of all runtime fields under a model class (for docs and tests)."""
    found: list[str] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        if is_runtime_field(model, name):
            found.append(path)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found.extend(runtime_paths(annotation, path + "."))
    return found


def pick(config: BaseModel, *paths: str) -> dict[str, Any]:
    """Identity of the named config sections/fields, nested under their dotted paths.

    `pick(cfg, "curate.near_dedup", "curate.docs_per_shard")` ->
    {"curate": {"near_dedup": {...}, "docs_per_shard": 1000}}; runtime fields are dropped.
    """
    out: dict[str, Any] = {}
    for path in paths:
        parts = path.split(".")
        parent: Any = config
        for part in parts[:-1]:
            parent = getattr(parent, part)
        if is_runtime_field(type(parent), parts[-1]):
            continue
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = _identity_value(getattr(parent, parts[-1]))
    return out
