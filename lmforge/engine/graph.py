"""Steps, their cache keys and the pipeline graph.

A step is one cacheable unit of work with a name like `curate/minhash`; a stage
(`curate`, `pretrain`) is the steps sharing its first path component. A step's key is a
digest of these things, and nothing else:

- its name and hand-bumped `version` (for what no code shows: a changed data file, a fix
  in a library that must be taken),
- `identity(config)`: the config fields it declares it reads (`Step.reads`), the only ones it
  can read, plus values derived from them,
- its code: a digest per project module of its import closure, and per project file it
  declares it reads by path (`Step.files`: task YAML, scripts it copies) (`lmforge.engine.codeprint`),
- the output digests of its upstream steps (content, not keys, so an upstream rerun that
  produces identical bytes does not invalidate anything downstream).

A step names what it reads either as a step of its own stage (`"curate/select"`) or as a
typed `Product` of another stage (`TOKEN_SHARDS`, `hf_model("sft")`); the graph resolves a
product to the enabled step that `provides` it, so stages never refer to each other's steps.
The versions of the libraries that shape an output are recorded beside the key, not in it: an
upgrade is reported as drift (`lmforge explain`) and `runtime.on_code_drift` decides whether
the step reruns.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.configbase import ConfigView, deep_merge, pick
from lmforge.engine.stage import Maybe, Product
from lmforge.errors import ConfigError
from lmforge.hashing import canonical_json, digest

if TYPE_CHECKING:
    from lmforge.pipelinebase import PipelineBase

UnitResult = tuple[list[str], dict[str, Any]]


@dataclass(frozen=True)
class StepContext:
    """What a running step may look at. Picklable: it is sent to worker processes."""

    step: str
    key: str
    out_dir: Path
    config: ConfigView  # only what the step declared it reads (see `Step.reads`)
    upstream: dict[str, dict[str, Any]]
    workspace: Path
    identity: dict[str, Any] = field(default_factory=dict)  # the config part of the key, as recorded
    products: dict[str, tuple[str, str]] = field(default_factory=dict)  # str(product) -> (step, sub-path)

    def upstream_dir(self, name: str) -> Path:
        return Path(self.upstream[name]["dir"])

    def has(self, product: Product) -> bool:
        return str(product) in self.products

    def path(self, product: Product) -> Path:
        """Where an upstream product lives (a directory or file inside its step's output)."""
        step, sub = self.products[str(product)]
        return Path(self.upstream[step]["dir"]) / sub if sub else Path(self.upstream[step]["dir"])

    def manifest(self, product: Product) -> dict[str, Any]:
        """The manifest of the step that provided `product` (its counts, metrics, extra)."""
        return self.upstream[self.products[str(product)][0]]


Reads = tuple[str, ...] | Callable[["PipelineBase"], tuple[str, ...]]


def _always(config: PipelineBase) -> bool:
    return True


def _nothing(config: PipelineBase) -> tuple[Any, ...]:
    return ()


def _no_units(ctx: StepContext) -> list[str]:
    return []


@dataclass(frozen=True)
class Step:
    """One cacheable step.

    `units(ctx)` lists independent work units (shards); `run_unit(ctx, unit)` computes one
    and returns (files it wrote, relative to out_dir; a small JSON result). `finalize(ctx,
    results)` does the global part and returns {"counts":..., "metrics":..., "extra":...}.

    `reads` names the config fields the step reads, dotted (`"align.sft"`, `"serve.engine.dtype"`;
    a callable of the config when that depends on other settings). They are its cache key's config
    part, and inside the step `ctx.config` offers nothing else (runtime fields aside, which change
    how it runs, never what it makes): a field read but not hashed cannot happen. `derive` adds
    values computed from what it reads or from outside the config (a resolved precision, input
    files' fingerprints, library versions). A step runs when its stage's section is `enabled`
    and its own `when(config)` holds.
    """

    name: str
    version: int
    description: str
    finalize: Callable[[StepContext, dict[str, dict[str, Any]]], dict[str, Any]]
    reads: Reads = ()
    derive: Callable[[ConfigView], dict[str, Any]] | None = None
    # what it reads: steps of its own stage by name, other stages' results as typed products
    upstream: Callable[[PipelineBase], tuple[str | Product | Maybe, ...]] = _nothing
    provides: dict[Product, str] = field(default_factory=dict)  # product -> path inside the output ("" = all)
    units: Callable[[StepContext], list[str]] = _no_units
    run_unit: Callable[[StepContext, str], UnitResult] | None = None
    when: Callable[[PipelineBase], bool] = _always
    retries: int = 2
    # top-level folders kept out of the manifest's file list (self-verifying state; logs/ always is)
    bookkeeping: tuple[str, ...] = ()
    # output path prefixes that make up the digest downstream keys see (None: all outputs)
    digest_paths: tuple[str, ...] | None = None
    # modules no import reaches that shape the output (entry modules its launches run, packages loaded
    # by name): with the import closure of its functions they are its code identity, in its key
    # (lmforge.engine.codeprint); and the libraries (distribution names) whose versions shape it (recorded
    # beside the key: code drift)
    code: tuple[str, ...] = ()
    libraries: tuple[str, ...] = ()
    # project files it reads by path at run time, not by import (task YAML it renders, scripts it copies
    # for another program to run): repo-relative paths or globs, each counted by its bytes in its code
    # identity; a pattern matching no file fails here, when the step is created
    files: tuple[str, ...] = ()
    timeout_s: float | None = None  # default wall-clock limit (runtime.step_timeout_s overrides)
    # the training curves drawn from its metrics.jsonl (Prefect image artifacts, MLflow): panels of
    # (title, ((metric key, label), ...)); lmforge.curves draws them
    curves: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    # (done, total) of a running computation, read off its output folder (training steps, tasks
    # evaluated); shown as a progress artifact. Sharded steps report units without it.
    progress: Callable[[StepContext], tuple[float, float] | None] | None = None
    # what a completed output found, as lines `lmforge explain` prints under the step (from its manifest)
    findings: Callable[[dict[str, Any]], list[str]] | None = None

    def __post_init__(self) -> None:
        from lmforge.engine.codeprint import project_files

        project_files(self.files, self.name)

    def declared_reads(self, config: PipelineBase) -> tuple[str, ...]:
        return tuple(self.reads(config)) if callable(self.reads) else tuple(self.reads)

    def view(self, config: PipelineBase) -> ConfigView:
        """The configuration as this step may read it."""
        return ConfigView(config, self.declared_reads(config), self.name)

    def identity(self, config: PipelineBase) -> dict[str, Any]:
        """The config part of the key: every declared read, plus what `derive` adds."""
        ident = pick(config, *self.declared_reads(config))
        return deep_merge(ident, self.derive(self.view(config))) if self.derive is not None else ident

    def enabled(self, config: PipelineBase) -> bool:
        section = getattr(config, self.stage, None)
        return bool(getattr(section, "enabled", True)) and self.when(config)

    @property
    def stage(self) -> str:
        return self.name.split("/", 1)[0]


def config_identity(step: Step, config: PipelineBase) -> dict[str, Any]:
    """The step's identity fields as JSON sees them, so a record read back from a manifest
    compares equal to a fresh one (tuples become lists)."""
    return json.loads(canonical_json(step.identity(config)))


def debug_settings(step: Step, config: PipelineBase) -> dict[str, Any] | None:
    """The stage's `debug:` settings (fault injection) when any is set, else None."""
    section = getattr(getattr(config, "debug", None), step.stage, None)
    if section is None or section == type(section)():
        return None
    return json.loads(canonical_json(section.model_dump(mode="json")))


def key_components(
    step: Step, config: PipelineBase, upstream_names: tuple[str, ...], upstream: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Everything the key is made of, kept in the manifest so `explain` can diff it later.

    `debug:` settings are no part of a normal run's key; a step run with a fault injected is
    keyed apart, so what it makes is never reused by a run without the fault.
    """
    from lmforge.engine.codeprint import code_identity

    components = {
        "step": step.name,
        "version": step.version,
        "config": config_identity(step, config),
        "code": code_identity(step),
        "upstream": {name: upstream[name]["digest"] for name in upstream_names},
    }
    debug = debug_settings(step, config)
    if debug is not None:
        components["debug"] = debug
    return components


def step_key(components: dict[str, Any]) -> str:
    return digest(components)


class Graph:
    """All steps in lifecycle order, with lookups by step, stage and product."""

    def __init__(self, steps: list[Step]):
        self.steps = steps
        self._by_name = {s.name: s for s in steps}
        if len(self._by_name) != len(steps):
            raise ValueError("two steps share a name")

    def get(self, name: str) -> Step:
        return self._by_name[name]

    def stages(self) -> list[str]:
        return list(dict.fromkeys(s.stage for s in self.steps))

    def providers(self, product: Product, config: PipelineBase) -> list[Step]:
        """Enabled steps providing `product` (any role when `product.role` is empty)."""
        return [
            s
            for s in self.steps
            if any(p == product or (not product.role and p.kind == product.kind) for p in s.provides)
            and s.enabled(config)
        ]

    def provider(self, product: Product, config: PipelineBase, wanted_by: str = "") -> Step:
        found = self.providers(product, config)
        if not found:
            raise ConfigError(
                f"{wanted_by or 'a step'} needs {product}, which no enabled step provides "
                "(is the stage that makes it switched off?)"
            )
        return found[0]

    def _wants(self, step: Step, config: PipelineBase) -> list[str | Product]:
        """What `step` reads, optional products dropped where nothing enabled provides them."""
        return [
            w.product if isinstance(w, Maybe) else w
            for w in step.upstream(config)
            if not isinstance(w, Maybe) or self.providers(w.product, config)
        ]

    def upstream(self, step: Step, config: PipelineBase) -> tuple[str, ...]:
        """The step names `step` reads, products resolved to their providers."""
        names: list[str] = []
        for want in self._wants(step, config):
            name = self.provider(want, config, step.name).name if isinstance(want, Product) else want
            if name not in names:
                names.append(name)
        return tuple(names)

    def has(self, product: Product, config: PipelineBase) -> bool:
        return bool(self.providers(product, config))

    def products(self, step: Step, config: PipelineBase) -> dict[str, tuple[str, str]]:
        """str(product) -> (providing step, path inside its output), for the products `step` reads."""
        out: dict[str, tuple[str, str]] = {}
        for want in self._wants(step, config):
            if isinstance(want, Product):
                source = self.provider(want, config, step.name)
                sub = next(
                    path for p, path in source.provides.items() if p == want or (not want.role and p.kind == want.kind)
                )
                out[str(want)] = (source.name, sub)
        return out

    def active(self, config: PipelineBase, stages: list[str]) -> list[Step]:
        """Enabled steps of `stages` plus every enabled step they need upstream, in order."""
        wanted = {s.name for s in self.steps if s.stage in stages and s.enabled(config)}
        for step in reversed(self.steps):
            if step.name in wanted:
                wanted.update(self.upstream(step, config))
        return [s for s in self.steps if s.name in wanted]


def build_graph() -> Graph:
    """Every registered stage's steps, in lifecycle order."""
    from lmforge.engine.registry import stages

    return Graph([step for stage in stages() for step in stage.steps()])
