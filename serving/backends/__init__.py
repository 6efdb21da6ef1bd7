"""Serving backends as plug-ins: one module per server, one registry.

A backend is a `serving.backends.base.ServingBackend` subclass: its name (`serve.backend`), its
settings section under `serve:`, which model file of the lineage it serves, its server's command
and environment, and which serving features it supports (LoRA adapters, speculative decoding).
The release (`serving.release`) and the step (`serving.steps`) read only that interface: neither
names a backend. Every backend's server sits behind the same guard (`lmforge.inference.vllm_guard`: the
key, bounded bodies, draining), smoke test and SLO benchmark, and is promoted the same way.

The built-ins live beside this file (`vllm`, `llamacpp`). Another package adds one without
editing lmforge through the `lmforge.serving_backends` entry-point group:

    [project.entry-points."lmforge.serving_backends"]
    tgi = "my_package.tgi:TGI"

This module imports only the standard library: `llamacpp_server` runs in the llama.cpp
environment, which imports this package on its way.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.backends.base import ServingBackend

GROUP = "lmforge.serving_backends"
BUILTIN = ("serving.backends.vllm:VLLM", "serving.backends.llamacpp:LlamaCpp")


@functools.cache
def backends() -> dict[str, ServingBackend]:
    """Every registered backend by name: the built-ins, then the `lmforge.serving_backends` entry points."""
    from lmforge.plugins import registered

    return registered(BUILTIN, GROUP, "serving backend")


def backend(name: str) -> ServingBackend:
    try:
        return backends()[name]
    except KeyError:
        from lmforge.errors import ConfigError

        raise ConfigError(f"serve.backend: no serving backend {name!r} (registered: {', '.join(backends())})") from None


def default() -> str:
    """The first built-in: `serve.backend`'s default."""
    return next(iter(backends()))
