"""The pipeline configuration: presets, `extends`, `--set` overrides and one-line errors.

A preset is a YAML file in `configs/` (or any path). `extends: NAME` deep-merges the named
preset underneath. `--set a.b.c=VALUE` overrides a field; VALUE is parsed as YAML, so
`--set pretrain.optim.lr=1e-3`, `--set curate.langid.keep=[en,fr]` and
`--set curate.minhash.enabled=false` all do what they say. Any problem becomes a
`ConfigError` whose message names the file (or the --set) and the field.
"""

from __future__ import annotations

import copy
import difflib
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from configs import PRESETS_DIR, preset_names
from data_prep.config import CurateConfig
from lmforge.configbase import StrictModel, runtime_field
from lmforge.errors import ConfigError
from training.config import PretrainConfig

STAGES = ("curate", "pretrain")


class RuntimeConfig(StrictModel):
    workers: int = runtime_field(2, description="Local worker processes for sharded steps.", ge=1)
    verify: Literal["checksum", "size"] = runtime_field(
        "checksum", description="How stage outputs are verified before reuse: full SHA-256, or sizes only (huge corpora)."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = runtime_field("INFO", description="Log level of lmforge's loggers.")


class PipelineConfig(StrictModel):
    """The whole pipeline; each stage section has its own typed model."""

    name: str = runtime_field("custom", description="Preset name, shown in the UI.")
    workspace: str = runtime_field("./workspace", description="Where stage outputs live (content-addressed).")
    stages: list[Literal["curate", "pretrain"]] = runtime_field(
        list(STAGES), description="Stages `lmforge run` runs, in pipeline order."
    )
    runtime: RuntimeConfig = RuntimeConfig()
    curate: CurateConfig = CurateConfig()
    pretrain: PretrainConfig = PretrainConfig()


def resolve_preset(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if not path.exists():
            raise ConfigError(f"{name_or_path}: config file not found")
        return path
    candidate = PRESETS_DIR / f"{name_or_path}.yaml"
    if not candidate.exists():
        raise ConfigError(f"{name_or_path}: no such preset (presets: {', '.join(preset_names())})")
    return candidate


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "?"
        raise ConfigError(f"{path}: {where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _load_layers(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    if path.resolve() in seen:
        raise ConfigError(f"{path}: extends itself (cycle through {', '.join(map(str, seen))})")
    data = _read_yaml(path)
    parent = data.pop("extends", None)
    if parent is None:
        return data
    return _deep_merge(_load_layers(resolve_preset(str(parent)), (*seen, path.resolve())), data)


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one `dotted.key=value` to nested dicts (value parsed as YAML)."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment}: expected KEY=VALUE, e.g. pretrain.optim.lr=1e-3")
    dotted, raw = assignment.split("=", 1)
    keys = dotted.strip().split(".")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {assignment}: {key} is not a section")
        node = child
    node[keys[-1]] = value


def _section(model: type[StrictModel], loc: tuple[Any, ...]) -> Any:
    """The model class at `loc` (None when the path leaves the typed sections)."""
    current: Any = model
    for part in loc:
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return None
        current = fields[part].annotation
    return current


def _field_names(model: type[StrictModel], loc: tuple[Any, ...]) -> list[str]:
    """Valid field names at the parent of `loc`, for 'did you mean' hints."""
    return list(getattr(_section(model, loc[:-1]), "model_fields", {}))


def _nested_matches(model: type[StrictModel], loc: tuple[Any, ...]) -> list[str]:
    """Dotted paths below the parent of `loc` that end in the unknown name: pretrain.lr -> pretrain.optim.lr."""
    found: list[str] = []

    def walk(section: Any, path: tuple[Any, ...]) -> None:
        for name, field in getattr(section, "model_fields", {}).items():
            if name == loc[-1] and path != loc[:-1]:
                found.append(".".join(map(str, (*path, name))))
            if hasattr(field.annotation, "model_fields"):
                walk(field.annotation, (*path, name))

    walk(_section(model, loc[:-1]), loc[:-1])
    return found


def _describe(error: dict[str, Any], source: str, overrides: list[str]) -> str:
    loc = tuple(p for p in error["loc"] if not str(p).startswith("function-after"))
    dotted = ".".join(str(p) for p in loc) or "(top level)"
    for assignment in overrides:
        key = assignment.split("=", 1)[0].strip()
        if dotted.startswith(key) or key.startswith(dotted + "."):
            source = f"--set {assignment}"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = "unknown field"
        close = difflib.get_close_matches(str(loc[-1]), _field_names(PipelineConfig, loc), n=1)
        deeper = _nested_matches(PipelineConfig, loc)
        if close:
            message += f" (did you mean '{close[0]}'?)"
        elif deeper:
            message += f" (did you mean {' or '.join(repr(d) for d in deeper)}?)"
    elif isinstance(error.get("input"), (str, int, float, bool)) or error.get("input") is None and "input" in error:
        message += f" (got {error['input']!r})"
    return f"{source}: {dotted}: {message}"


def load_config(
    preset: str = "tiny-cpu", overrides: list[str] | None = None, workspace: str | None = None,
    check_paths: bool = True,
) -> PipelineConfig:
    """Load a preset or YAML path, apply overrides, validate; raise ConfigError with one line."""
    overrides = list(overrides or [])
    path = resolve_preset(preset)
    data = _load_layers(path)
    for assignment in overrides:
        apply_override(data, assignment)
    if workspace:
        data["workspace"] = workspace
    try:
        config = PipelineConfig.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        line = _describe(errors[0], str(path), overrides)
        more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
        raise ConfigError(line + more) from None
    if check_paths:
        check_files(config, str(path))
    return config


def check_files(config: PipelineConfig, source: str) -> None:
    """Paths the config names must exist, so a typo fails now and not an hour into the run."""
    from data_prep.ingest import expand_inputs  # local: keeps config import light

    for index, pattern in enumerate(config.curate.inputs):
        try:
            matched = expand_inputs([pattern])
        except ConfigError as exc:
            raise ConfigError(f"{source}: curate.inputs[{index}]: {exc}") from None
        if not matched and not pattern.startswith("hf:"):
            raise ConfigError(f"{source}: curate.inputs[{index}]: no file matches {pattern!r}")
    for index, ref in enumerate(config.curate.quality_classifier.reference):
        if not Path(ref).is_file():
            raise ConfigError(f"{source}: curate.quality_classifier.reference[{index}]: not a file: {ref}")
    hostfile = config.pretrain.distributed.hostfile
    if hostfile and not Path(hostfile).exists():
        raise ConfigError(f"{source}: pretrain.distributed.hostfile: file not found: {hostfile}")
