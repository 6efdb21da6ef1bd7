"""Every field of the pipeline configuration, as documentation sees it: its dotted path, type,
default, allowed values, description and whether (and by which steps) it is part of a cache key.

One source for `lmforge config describe FIELD` and the generated configuration reference
(`lmforge.reference`), read from the typed config models the stages register.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from lmforge.configbase import is_runtime_field


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    path: str  # dotted; `[]` marks a list's item, `{}` a mapping's value
    type: str
    default: str
    allowed: str
    description: str
    keyed: bool  # part of a cache key: not a runtime field (nor under one)
    readers: tuple[str, ...]  # steps whose key it is part of (tiny-cpu, every stage)


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, str]:
    """(the config model an annotation holds, the path suffix: '' itself, '[]' a list's item, '{}' a map's value)."""
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _model_of(args[0])
    if origin in (list, tuple) and len(args) == 1:
        inner, _ = _model_of(args[0])
        return inner, "[]" if inner else ""
    if origin is dict and len(args) == 2:
        inner, _ = _model_of(args[1])
        return inner, "{}" if inner else ""
    return None, ""


def type_name(annotation: Any) -> str:
    text = repr(annotation) if not isinstance(annotation, type) else annotation.__name__
    text = re.sub(r"typing\.|pathlib\.|collections\.abc\.", "", text)
    text = re.sub(r"<class '([\w.]+)'>", lambda m: m.group(1).rsplit(".", 1)[-1], text)
    text = re.sub(r"\b[a-z_]+(?:\.[a-z_]+)+\.([A-Z]\w*)", r"\1", text)  # module.path.Class -> Class
    return text.replace("NoneType", "None").replace("Optional[", "optional[")


def _allowed(annotation: Any, info: FieldInfo) -> str:
    values: list[str] = []

    def literals(a: Any) -> None:
        if typing.get_origin(a) is typing.Literal:
            values.extend(repr(v) if not isinstance(v, str) else v for v in typing.get_args(a))
        elif isinstance(a, type) and issubclass(a, enum.Enum):
            values.extend(str(m.value) for m in a)
        for inner in typing.get_args(a):
            literals(inner)

    literals(annotation)
    bounds = []
    for meta in info.metadata:
        for name, sign in (
            ("gt", ">"),
            ("ge", ">="),
            ("lt", "<"),
            ("le", "<="),
            ("min_length", "len >="),
            ("max_length", "len <="),
        ):
            value = getattr(meta, name, None)
            if value is not None:
                bounds.append(f"{sign} {value}")
    return ", ".join(dict.fromkeys(values)) + ("; " if values and bounds else "") + ", ".join(bounds)


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        try:
            value = info.default_factory()  # type: ignore[call-arg]
        except Exception:  # noqa: BLE001 - a factory that needs context: say so
            return "(computed)"
    elif info.default is PydanticUndefined:
        return "(required)"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, Path):
        value = str(value)
    text = repr(value) if not isinstance(value, str) else (value if value else '""')
    return text if len(text) <= 80 else text[:77] + "..."


def walk_fields(
    model: type[BaseModel], prefix: str = "", runtime: bool = False
) -> Iterator[tuple[str, Any, FieldInfo, bool]]:
    """(dotted path, annotation, field info, runtime) of every leaf field below `model`."""
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        is_runtime = runtime or is_runtime_field(model, name)
        inner, suffix = _model_of(info.annotation)
        if inner is not None:
            yield from walk_fields(inner, f"{path}{suffix}.", is_runtime)
        else:
            yield path, info.annotation, info, is_runtime


def _step_reads() -> dict[str, tuple[str, ...]]:
    """{step: the dotted config paths in its key} for the default preset with every stage."""
    from lmforge.config import load_config
    from lmforge.engine.executor import graph

    config = load_config("tiny-cpu", check_paths=False)
    reads: dict[str, tuple[str, ...]] = {}
    for step in graph().steps:
        try:
            reads[step.name] = step.declared_reads(config)
        except Exception:  # noqa: BLE001 - a step whose reads need another setting: not listed
            continue
    return reads


def _readers(path: str, reads: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    plain = path.replace("[]", "").replace("{}", "")
    return tuple(
        step
        for step, paths in reads.items()
        if any(plain == p or plain.startswith(p + ".") or p.startswith(plain + ".") for p in paths)
    )


def config_fields() -> list[FieldDoc]:
    from lmforge.config import pipeline_model

    reads = _step_reads()
    out = []
    for path, annotation, info, runtime in walk_fields(pipeline_model()):
        readers = () if runtime else _readers(path, reads)
        out.append(
            FieldDoc(
                path=path,
                type=type_name(annotation),
                default=_default(info),
                allowed=_allowed(annotation, info),
                description=" ".join((info.description or "").split()),
                keyed=not runtime and bool(readers),
                readers=readers,
            )
        )
    return out


def describe(field: str) -> str:
    """One field's entry; a section lists its fields; an unknown name gets the closest ones."""
    from lmforge.errors import ConfigError

    fields = config_fields()
    by_path = {f.path: f for f in fields}
    plain = {f.path.replace("[]", "").replace("{}", ""): f for f in fields}
    found = by_path.get(field) or plain.get(field)
    if found is not None:
        keyed = (
            "yes: " + ", ".join(found.readers) if found.keyed else "no (runtime: how a step runs, not what it makes)"
        )
        return "\n".join(
            [
                found.path,
                f"  type:        {found.type}",
                f"  default:     {found.default}",
                *([f"  allowed:     {found.allowed}"] if found.allowed else []),
                f"  cache key:   {keyed}",
                f"  description: {found.description or '-'}",
            ]
        )
    below = [f.path for f in fields if f.path.startswith(field + ".")]
    if below:
        return f"{field} is a section; its fields:\n" + "\n".join(f"  {p}" for p in below)
    last, section = field.rsplit(".", 1)[-1], field.split(".", 1)[0]
    # the same name deeper in the same section first (pretrain.lr -> pretrain.optim.lr), then look-alikes
    close = sorted((p for p in by_path if p.endswith("." + last)), key=lambda p: not p.startswith(section + "."))[:3]
    close = close or difflib.get_close_matches(field, list(by_path), n=3, cutoff=0.75)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    raise ConfigError(f"no configuration field {field!r}{hint}")
