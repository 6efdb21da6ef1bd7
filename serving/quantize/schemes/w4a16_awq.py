"""`w4a16-awq`: 4-bit weights (asymmetric, with zero points) in groups of `group_size`, activations
in 16 bits. Calibrated with AWQ (activation-aware weight quantization, llmcompressor's
`AWQModifier`): per input channel, it searches the scale that protects the channels the
calibration activations use most (moving it into the preceding norm or projection, so the
model's function is unchanged), then rounds the scaled weights per group. The checkpoint is the
same pack-quantized compressed-tensors format as GPTQ's, so vLLM serves it with the same 4-bit
kernels (on CPU: AVX-512 only)."""

from __future__ import annotations

from typing import Any

from serving.quantize.schemes import IGNORED, Scheme, cpu_avx512_only


def recipe(args: dict[str, Any], spec: dict[str, Any]) -> list[Any]:
    import torch
    from llmcompressor.modifiers.awq import AWQModifier

    if not torch.accelerator.is_available():
        # llmcompressor 0.14's AWQ pins its cached activations in page-locked memory for faster
        # host-to-device copies, which fails with no accelerator ("Cannot access accelerator device");
        # on a CPU-only machine there is no copy to speed up, so pinning is skipped (nothing else changes)
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
    return [AWQModifier(config_groups={"group_0": args}, ignore=list(IGNORED))]


SCHEME = Scheme(
    "w4a16-awq",
    "W4A16_ASYM",
    4,
    grouped=True,
    recipe=recipe,
    method="awq",
    serving=cpu_avx512_only,
    order=25,
)
