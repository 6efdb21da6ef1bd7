"""Finding the registered stages and putting them in lifecycle order.

Stages register under the `lmforge.stages` entry-point group (see `lmforge.engine.stage`). They
are loaded on first use, not when this module is imported, so importing the core never
imports a domain package. The lifecycle order is a topological order of each stage's
`after` (ties keep the order of the names), so a stage added later slots in where it
belongs without any list being edited.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from lmforge.engine.stage import Role, Stage
from lmforge.errors import ConfigError

GROUP = "lmforge.stages"
COMMANDS_GROUP = "lmforge.commands"  # CLI plugins: callables taking `lmforge.cli.Commands` (the orchestrator's)


@functools.lru_cache(maxsize=1)
def stages() -> tuple[Stage, ...]:
    """Every registered stage, in lifecycle order."""
    found: dict[str, Stage] = {}
    for point in entry_points(group=GROUP):
        stage = point.load()
        if not isinstance(stage, Stage):
            raise TypeError(f"entry point {point.name} = {point.value} is not an lmforge.engine.stage.Stage")
        if stage.name != point.name:
            raise TypeError(f"entry point {point.name} registers a stage named {stage.name!r}")
        found[stage.name] = stage
    if not found:
        raise RuntimeError(
            f"no stages registered under the {GROUP!r} entry points; is lmforge installed (`pip install -e .`)?"
        )
    return tuple(lifecycle_order(found))


def lifecycle_order(found: dict[str, Stage]) -> list[Stage]:
    ordered: list[Stage] = []
    placed: set[str] = set()
    pending = dict(sorted(found.items()))
    while pending:
        ready = [s for s in pending.values() if all(a in placed or a not in found for a in s.after)]
        if not ready:
            raise RuntimeError(f"stages {sorted(pending)} wait on each other (check their `after`)")
        # among the ready ones, those that follow the most stages go last: a stable, readable order
        ready.sort(key=lambda s: (len(_ancestors(s, found)), s.name))
        stage = ready[0]
        ordered.append(stage)
        placed.add(stage.name)
        del pending[stage.name]
    return ordered


def _ancestors(stage: Stage, found: dict[str, Stage]) -> set[str]:
    seen: set[str] = set()
    todo = list(stage.after)
    while todo:
        name = todo.pop()
        if name in found and name not in seen:
            seen.add(name)
            todo.extend(found[name].after)
    return seen


def command_plugins() -> list[Callable[[Any], None]]:
    """The `lmforge.commands` entry points (e.g. `flows.cli:register`), loaded, in name order."""
    return [point.load() for point in sorted(entry_points(group=COMMANDS_GROUP), key=lambda p: p.name)]


def stage_names() -> list[str]:
    return [s.name for s in stages()]


def get_stage(name: str) -> Stage:
    for stage in stages():
        if stage.name == name:
            return stage
    raise ConfigError(f"no stage named {name!r} (stages: {', '.join(stage_names())})")


def domain_packages() -> tuple[str, ...]:
    """Logger names of lmforge's core and every registered stage's packages."""
    names = ["lmforge"]
    for stage in stages():
        names += [p for p in stage.packages if p not in names]
    return tuple(names)


@functools.lru_cache(maxsize=1)
def roles() -> tuple[Role, ...]:
    """The models a lineage can hold, in lifecycle order (each stage's `roles`, in stage order):
    base, pretrained, then one per alignment method that trains a policy."""
    found: list[Role] = []
    for stage in stages():
        for role in stage.roles() if callable(stage.roles) else stage.roles:
            if any(r.name == role.name for r in found):
                raise TypeError(f"stage {stage.name} registers the model role {role.name!r} a second time")
            found.append(role)
    return tuple(found)


def role_names() -> list[str]:
    return [r.name for r in roles()]


def check_roles(names: list[str]) -> list[str]:
    """`names` when each is a role of the lineage, else one ValueError naming the first that is not."""
    known = role_names()
    for name in names:
        if name not in known:
            raise ValueError(f"no model role {name!r} (the lineage has: {', '.join(known)})")
    return names
