"""What lmforge's plug-in registries share (alignment methods, serving backends, curation filters):
the built-ins named as "module:Class", then another package's entry points, one instance each by name.

A plug-in's `code` (the modules its steps run: part of their code identity, `lmforge.engine.codeprint`)
always starts with the module that defines it and, when it differs, the module its registration
names: a plug-in need list only the modules it runs that no import of its own reaches (an entry
module a launch runs by name). Its module's imports are followed by the code identity as the
project's are, inside its own package, so editing any of it re-keys the steps that run it.

Standard library only: the serving backends' package is imported in the llama.cpp environment too.
"""

from __future__ import annotations

import importlib
from typing import Any


def load(target: Any, kind: type | None = None) -> Any:
    """An instance of `target` ("module:Class", a class or an instance), checked against `kind`."""
    if isinstance(target, str):
        module, _, attribute = target.partition(":")
        target = getattr(importlib.import_module(module), attribute)
    instance = target() if isinstance(target, type) else target
    if kind is not None and not isinstance(instance, kind):
        raise TypeError(f"{target!r} is not a {kind.__name__}")
    return instance


def keyed(plugin: Any, named: str | None = None) -> Any:
    """`plugin` with its own module (and `named`, the module its registration names) first in its
    `code`, then those it lists, each once: what defines a plug-in is always part of its identity."""
    own = (getattr(plugin, "__module__", None), named)
    plugin.code = tuple(dict.fromkeys([*(m for m in own if m), *getattr(plugin, "code", ())]))
    return plugin


def _module(value: str) -> str:
    """The module of a "module:attribute [extras]" reference."""
    return value.partition(":")[0].partition("[")[0].strip()


def registered(builtin: tuple[str, ...], group: str, what: str, kind: type | None = None) -> dict[str, Any]:
    """{name: instance}: the built-ins in their order, then the entry points of `group` sorted by name.
    A name registered twice is an error naming both (an entry point never silently replaces a built-in).
    Each instance's `code` starts with its own module (`keyed`)."""
    from importlib.metadata import entry_points

    found: dict[str, Any] = {}
    origins: dict[str, str] = {}
    external = sorted(entry_points(group=group), key=lambda e: e.name)
    for origin, plugin in [
        *((t, keyed(load(t, kind), _module(t))) for t in builtin),
        *((f"{e.name} = {e.value}", keyed(load(e.load(), kind), _module(e.value))) for e in external),
    ]:
        if plugin.name in found:
            raise ValueError(f"{what} {plugin.name!r} registered twice ({origins[plugin.name]}; {origin})")
        found[plugin.name], origins[plugin.name] = plugin, origin
    return found
