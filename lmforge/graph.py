"""Steps, their cache keys and the pipeline graph.

A step is one cacheable unit of work with a name like `curate/minhash`; a stage
(`curate`, `pretrain`) is the steps sharing its first path component. A step's key is a
digest of four things, and nothing else:

- its name and hand-bumped `version` (bump when the code's semantics change),
- `identity(config)`: the config fields that change its results,
- the output digests of its upstream steps (content, not keys, so an upstream rerun that
  produces identical bytes does not invalidate anything downstream).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lmforge.hashing import canonical_json, digest

UnitResult = tuple[list[str], dict[str, Any]]


@dataclass(frozen=True)
class StepContext:
    """What a running step may look at. Picklable: it is sent to worker processes."""

    step: str
    key: str
    out_dir: Path
    config: Any
    upstream: dict[str, dict[str, Any]]
    workspace: Path

    def upstream_dir(self, name: str) -> Path:
        return Path(self.upstream[name]["dir"])


@dataclass(frozen=True)
class Step:
    """One cacheable step.

    `units(ctx)` lists independent work units (shards); `run_unit(ctx, unit)` computes one
    and returns (files it wrote, relative to out_dir; a small JSON result). `finalize(ctx,
    results)` does the global part and returns {"counts":..., "metrics":..., "extra":...}.
    """

    name: str
    version: int
    description: str
    identity: Callable[[Any], dict[str, Any]]
    finalize: Callable[[StepContext, dict[str, dict[str, Any]]], dict[str, Any]]
    upstream: Callable[[Any], tuple[str, ...]] = lambda config: ()
    units: Callable[[StepContext], list[str]] = lambda ctx: []
    run_unit: Callable[[StepContext, str], UnitResult] | None = None
    enabled: Callable[[Any], bool] = lambda config: True
    retries: int = 2
    # top-level folders kept out of the manifest's file list (self-verifying state, logs)
    bookkeeping: tuple[str, ...] = ()
    # output path prefixes that make up the digest downstream keys see (None: all outputs)
    digest_paths: tuple[str, ...] | None = None

    @property
    def stage(self) -> str:
        return self.name.split("/", 1)[0]


def config_identity(step: Step, config: Any) -> dict[str, Any]:
    """The step's identity fields as JSON sees them, so a record read back from a manifest
    compares equal to a fresh one (tuples become lists)."""
    return json.loads(canonical_json(step.identity(config)))


def key_components(step: Step, config: Any, upstream: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Everything the key is made of, kept in the manifest so `explain` can diff it later."""
    return {
        "step": step.name,
        "version": step.version,
        "config": config_identity(step, config),
        "upstream": {name: upstream[name]["digest"] for name in step.upstream(config)},
    }


def step_key(components: dict[str, Any]) -> str:
    return digest(components)


class Graph:
    """All steps in pipeline order, with lookups by step and stage name."""

    def __init__(self, steps: list[Step]):
        self.steps = steps
        self._by_name = {s.name: s for s in steps}

    def get(self, name: str) -> Step:
        return self._by_name[name]

    def stages(self) -> list[str]:
        return list(dict.fromkeys(s.stage for s in self.steps))

    def active(self, config: Any, stages: list[str]) -> list[Step]:
        """Enabled steps of `stages` plus every enabled step they need upstream, in order."""
        wanted = {s.name for s in self.steps if s.stage in stages and s.enabled(config)}
        for step in reversed(self.steps):
            if step.name in wanted:
                wanted.update(step.upstream(config))
        return [s for s in self.steps if s.name in wanted]


def build_graph() -> Graph:
    from data_prep.steps import CURATE_STEPS
    from training.steps import PRETRAIN_STEPS

    return Graph([*CURATE_STEPS, *PRETRAIN_STEPS])
