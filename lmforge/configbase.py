"""Base class and helpers for lmforge's typed configuration.

Every config model forbids unknown keys. Fields that do not change a stage's results
(worker counts, log intervals, paths of outputs) are declared with `runtime_field`; the
cache identity of a stage is the config with those fields removed (`identity_dict`).
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lmforge.errors import UndeclaredConfigRead

if TYPE_CHECKING:
    from pydantic.json_schema import JsonDict

RUNTIME_MARK: JsonDict = {"lmforge_runtime": True}


class StrictModel(BaseModel):
    """A config section: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bools_for_numbers(cls, data: Any) -> Any:
        """`max_steps: true` is a mistake, not 1: pydantic's lax mode would take a bool for an int or float."""
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if isinstance(value, bool) and field is not None and _numbers_only(field.annotation):
                    raise ValueError(f"{name}: expected a number, got {str(value).lower()}")
        return data


def _numbers_only(annotation: Any) -> bool:
    """True for int, float and their optionals/unions without bool or str."""
    import typing

    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    members = [a for a in args if a is not type(None)] if args else [annotation]
    return bool(members) and all(m in (int, float) for m in members)


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


def pick(config: BaseModel | ConfigView, *paths: str) -> dict[str, Any]:
    """Identity of the named config sections/fields, nested under their dotted paths.

    `pick(cfg, "curate.near_dedup", "curate.docs_per_shard")` ->
    {"curate": {"near_dedup": {...}, "docs_per_shard": 1000}}; runtime fields are dropped.
    """
    if isinstance(config, ConfigView):  # a step picking from its own view: only what it declared
        for path in paths:
            config.require(path)
        config = config._model
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


def has_section(config: BaseModel | ConfigView, name: str) -> bool:
    """Whether the pipeline has a top-level section `name` (a stage that may not be installed)."""
    model = config._model if isinstance(config, ConfigView) else config
    return name in type(model).model_fields


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` merged into a copy of `base`, nested dicts merged key by key (top wins)."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _covered(path: str, reads: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + ".") for r in reads)


class ConfigView:
    """The configuration as one step sees it: only the fields it declared in `reads` (which are
    exactly the fields in its cache key) and runtime fields (never in a key).

    Reading anything else raises `UndeclaredConfigRead`, so a field that changes a step's result
    without changing its key cannot happen: the step either declares it or cannot read it. Values
    under a declared path come back as they are (typed models, lists); sections on the way to a
    on the way to (or beside) a declared path come back as views, checked field by field.
    """

    __slots__ = ("_model", "_prefix", "_reads", "_step")

    def __init__(self, model: BaseModel, reads: tuple[str, ...], step: str, prefix: str = "") -> None:
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_reads", tuple(reads))
        object.__setattr__(self, "_step", step)
        object.__setattr__(self, "_prefix", prefix)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        model, prefix, reads = self._model, self._prefix, self._reads
        path = f"{prefix}{name}"
        if name not in type(model).model_fields:
            return self._derived(name, path)
        value = getattr(model, name)
        if is_runtime_field(type(model), name) or _covered(path, reads):
            return value
        if isinstance(value, BaseModel):  # a section: its fields are checked as they are read
            return ConfigView(value, reads, self._step, path + ".")
        raise UndeclaredConfigRead(
            f"step {self._step} reads {path} but does not declare it in its `reads` "
            "(every field a step reads is part of its cache key)"
        )

    def _derived(self, name: str, path: str) -> Any:
        """A property or method a config model defines (`num_perm` from bands x rows): run against
        this view, so the fields it reads are checked too. pydantic's own (model_dump) are refused."""
        for cls in type(self._model).__mro__:
            if cls is BaseModel or cls is StrictModel:
                break
            member = cls.__dict__.get(name)
            if isinstance(member, property) and member.fget is not None:
                return member.fget(self)
            if isinstance(member, types.FunctionType):
                return types.MethodType(member, self)
        raise UndeclaredConfigRead(
            f"step {self._step}: {path} is not a config field (a view of the "
            "configuration offers its declared fields only)"
        )

    def require(self, path: str) -> None:
        """Raise unless the full dotted `path` is declared (or a runtime field)."""
        full = f"{self._prefix}{path}"
        if not _covered(full, self._reads):
            node: Any = self
            for part in path.split("."):
                node = getattr(node, part)  # raises on the first undeclared, non-runtime part

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"step {self._step}: the configuration is read-only inside a step")

    def __getstate__(self) -> tuple[Any, ...]:
        return self._model, self._reads, self._step, self._prefix

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for name, value in zip(("_model", "_reads", "_step", "_prefix"), state):
            object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return f"ConfigView({self._step}: {', '.join(self._reads) or 'nothing'})"
