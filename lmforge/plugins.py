"""What lmforge's plug-in registries share (alignment methods, serving backends, curation filters):
the built-ins named as "module:Class", then another package's entry points, one instance each by name.

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


def registered(builtin: tuple[str, ...], group: str, what: str, kind: type | None = None) -> dict[str, Any]:
    """{name: instance}: the built-ins in their order, then the entry points of `group` sorted by name.
    A name registered twice is an error naming both (an entry point never silently replaces a built-in)."""
    from importlib.metadata import entry_points

    found: dict[str, Any] = {}
    origins: dict[str, str] = {}
    external = sorted(entry_points(group=group), key=lambda e: e.name)
    for origin, plugin in [
        *((t, load(t, kind)) for t in builtin),
        *((f"{e.name} = {e.value}", load(e.load(), kind)) for e in external),
    ]:
        if plugin.name in found:
            raise ValueError(f"{what} {plugin.name!r} registered twice ({origins[plugin.name]}; {origin})")
        found[plugin.name], origins[plugin.name] = plugin, origin
    return found
