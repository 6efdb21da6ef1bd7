"""`w4a16`: 4-bit weights (symmetric) in groups of `group_size` input columns, activations in 16
bits. Calibrated: GPTQ rounds each column against the calibration activations' Hessian."""

from __future__ import annotations

from typing import Any

from serving.quantize.schemes import IGNORED, Scheme, cpu_avx512_only


def recipe(args: dict[str, Any], spec: dict[str, Any]) -> list[Any]:
    from llmcompressor.modifiers.gptq import GPTQModifier

    return [GPTQModifier(config_groups={"group_0": args}, ignore=list(IGNORED), dampening_frac=spec["dampening_frac"])]


SCHEME = Scheme(
    "w4a16",
    "W4A16",
    4,
    grouped=True,
    recipe=recipe,
    method="gptq",
    reads=("dampening_frac",),
    serving=cpu_avx512_only,
    order=20,
)
