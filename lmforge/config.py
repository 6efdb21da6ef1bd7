"""The pipeline configuration: presets, `extends`, `--set` overrides and one-line errors.

A preset is a YAML file in `configs/` (or any path). `extends: NAME` deep-merges the named
preset underneath. `--set a.b.c=VALUE` overrides a field; VALUE is parsed as YAML, so
`--set pretrain.optim.lr=1e-3`, `--set curate.langid.keep=[en,fr]` and
`--set curate.minhash.enabled=false` all do what they say. Any problem becomes a
`ConfigError` whose message names the file (or the --set) and the field.

The model itself is assembled from the registered stages: the top level (`name`,
`workspace`, `stages`, `runtime`, `cluster`, `tracking`) is defined here, and each stage adds its own section
(`curate:`, `pretrain:`, ...) with the config model it registered. `PipelineConfig` is
built on first use, so importing this module imports no stage.
"""

from __future__ import annotations

import copy
import difflib
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import Field, ValidationError, create_model, field_validator

from configs import PRESETS_DIR, preset_names
from lmforge.configbase import RUNTIME_MARK, StrictModel
from lmforge.errors import ConfigError
from lmforge.pipelinebase import (  # noqa: F401 - re-exported: lmforge.config is where users look
    ClusterConfig,
    ConfigOrView,
    MlflowConfig,
    PipelineBase,
    RuntimeConfig,
    TrackingConfig,
)

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails


class WithStages(PipelineBase):
    """`PipelineBase` with the registered stages as `stages`' default and its check."""

    stages: list[str] = Field(
        default_factory=lambda: _stage_names(),
        json_schema_extra=RUNTIME_MARK,
        description="Stages `lmforge run` runs (the lifecycle order applies).",
    )

    @field_validator("stages")
    @classmethod
    def _known_stages(cls, value: list[str]) -> list[str]:
        unknown = [name for name in value if name not in _stage_names()]
        if unknown:
            raise ValueError(f"unknown stage {unknown[0]!r} (stages: {', '.join(_stage_names())})")
        return value


def _stage_names() -> list[str]:
    from lmforge.engine.registry import stage_names

    return stage_names()


@functools.lru_cache(maxsize=1)
def pipeline_model() -> type[PipelineBase]:
    """The whole pipeline's config model: the top level plus each registered stage's section."""
    from lmforge.engine.registry import stages

    sections: dict[str, Any] = {
        stage.name: (stage.config_model, Field(default_factory=stage.config_model, description=stage.description))
        for stage in stages()
    }
    debug = create_model(
        "DebugConfig",
        __base__=StrictModel,
        __module__=__name__,  # type: ignore[call-overload]
        __doc__="Fault injection for tests and drills, one section per stage.",
        **{
            stage.name: (stage.debug_model, Field(default_factory=stage.debug_model))
            for stage in stages()
            if stage.debug_model is not None
        },
    )
    sections["debug"] = (
        debug,
        Field(
            default_factory=debug,
            json_schema_extra=RUNTIME_MARK,
            description="Fault injection for tests and drills (debug.<stage>.*); no part of "
            "a normal run's cache key, and a step run with one set is keyed apart.",
        ),
    )
    return create_model(
        "PipelineConfig",
        __base__=WithStages,
        __module__=__name__,  # type: ignore[call-overload]
        __doc__="The whole pipeline; each stage section has its own typed model.",
        **sections,
    )


def __getattr__(name: str) -> Any:
    # `PipelineConfig` is built from the registry when first asked for (pickle asks for it too)
    if name == "PipelineConfig":
        return pipeline_model()
    if name == "DebugConfig":
        return pipeline_model().model_fields["debug"].annotation
    raise AttributeError(name)


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


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a mapping with the same key twice (PyYAML keeps the last one, silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (PyYAML would keep only the last)", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        if mark is None and isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not allow
            line = text.count("\n", 0, exc.position) + 1
            raise ConfigError(
                f"{path}: line {line}: invalid YAML (character {exc.character!r} is not allowed)"
            ) from None
        where = f"line {mark.line + 1}" if mark else "?"
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())  # one line, whatever PyYAML wrote
        raise ConfigError(f"{path}: {where}: invalid YAML ({problem})") from None
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


def _shown(assignment: str) -> str:
    """An assignment as an error line shows it: escaped when it holds line breaks or control characters."""
    return assignment if assignment.isprintable() else repr(assignment)


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one `dotted.key=value` to nested dicts (value parsed as YAML)."""
    if "=" not in assignment:
        raise ConfigError(f"--set {_shown(assignment)}: expected KEY=VALUE, e.g. pretrain.optim.lr=1e-3")
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
            raise ConfigError(f"--set {_shown(assignment)}: {key} is not a section")
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


def _describe(error: ErrorDetails, source: str, overrides: list[str]) -> str:
    from lmforge.urlcheck import REFUSED

    loc = tuple(p for p in error["loc"] if not str(p).startswith("function-after"))
    dotted = ".".join(str(p) for p in loc) or "(top level)"
    # a refused credential (lmforge.urlcheck, runtime.storage.options) is never repeated: not the
    # value given with --set, not the input
    secret = REFUSED in error["msg"]
    for assignment in overrides:
        key = assignment.split("=", 1)[0].strip()
        if dotted.startswith(key) or key.startswith(dotted + "."):
            source = f"--set {_shown(key)}=<not shown>" if secret else f"--set {_shown(assignment)}"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = "unknown field"
        close = difflib.get_close_matches(str(loc[-1]), _field_names(pipeline_model(), loc), n=1)
        deeper = _nested_matches(pipeline_model(), loc)
        if close:
            message += f" (did you mean '{close[0]}'?)"
        elif deeper:
            message += f" (did you mean {' or '.join(repr(d) for d in deeper)}?)"
    elif secret:
        pass
    elif isinstance(error.get("input"), (str, int, float, bool)) or error.get("input") is None and "input" in error:
        message += f" (got {error['input']!r})"
    return f"{source}: {dotted}: {message}"


def load_config(
    preset: str = "tiny-cpu",
    overrides: list[str] | None = None,
    workspace: str | None = None,
    check_paths: bool = True,
) -> PipelineBase:
    """Load a preset or YAML path, apply overrides, validate; raise ConfigError with one line."""
    try:
        return _load_config(preset, overrides, workspace, check_paths)
    except ConfigError as exc:
        message = str(exc)
        if message.isprintable():
            raise
        # a key, value or file name carried a line break or a control character: escaped, still one line
        raise ConfigError("".join(c if c.isprintable() else repr(c)[1:-1] for c in message)) from None


def _load_config(preset: str, overrides: list[str] | None, workspace: str | None, check_paths: bool) -> PipelineBase:
    overrides = list(overrides or [])
    path = resolve_preset(preset)
    data = _load_layers(path)
    for assignment in overrides:
        apply_override(data, assignment)
    if workspace:
        data["workspace"] = workspace
    try:
        config = pipeline_model().model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        line = _describe(errors[0], str(path), overrides)
        more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
        raise ConfigError(line + more) from None
    check_names(config, str(path))
    if check_paths:
        check_files(config, str(path))
    return config


def check_names(config: PipelineBase, source: str) -> None:
    """Names that must match something that exists: `runtime.step_timeout_s` keys are steps or stages."""
    from lmforge.engine.registry import stages

    known = {step.name for stage in stages() for step in stage.steps()} | set(_stage_names())
    for key in config.runtime.step_timeout_s:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else " (a step such as pretrain/train, or a stage)"
            raise ConfigError(f"{source}: runtime.step_timeout_s: no step or stage named {key!r}{hint}")


def check_files(config: PipelineBase, source: str) -> None:
    """Paths the config names must exist, so a typo fails now and not an hour into the run."""
    from lmforge.engine.registry import stages

    for stage in stages():
        if stage.check is not None:
            stage.check(config, source)
