"""Float8 training of the decoder's linear layers (`pretrain.float8`), with torchao.

Why torchao: it is PyTorch's maintained float8 training library (torchtitan trains in float8
with it), and its `Float8Linear` is a subclass of `nn.Linear` holding the same `weight` and
`bias` parameters in the same dtype. Float8 exists only inside its matmuls, as dynamically
scaled casts (per tensor: e4m3 for inputs and weights, e5m2 for output gradients), so DeepSpeed,
FSDP2, torch.compile, the checkpoints and the Hugging Face export see the model they saw before:
the same state-dict keys, the same tensors. Transformer Engine would replace the model's modules
with its own, and calling `torch._scaled_mm` by hand would re-implement what torchao maintains.

What is converted: every `nn.Linear` except the output projection, with both dimensions a
multiple of 16 (the float8 GEMM's requirement on the GPU: a layer that is not stays in
`precision`, with a warning). In lmforge's Llama that is every attention and MLP projection.
What is skipped and why:

- the output projection (`lm_head`; `get_output_embeddings()` whatever its name): its logits
  feed a softmax over the whole vocabulary, where float8's 3-bit mantissa costs the most, and
  with tied embeddings it is the input embedding's matrix too; torchtitan leaves it out as well;
- the embeddings: a lookup (`nn.Embedding`), not a matmul, so there is nothing to convert.

`emulate` runs the same casts and scales with the matmul done in high precision (torchao's
emulation), on any device: slow, for checking the numerics on a CPU. Real float8 needs an NVIDIA
GPU of compute capability 8.9+ (the planner refuses `on` elsewhere) and is fast only under
`pretrain.compile` (torchao's casts are meant to be fused by inductor).

torchao is imported here only, and only when float8 is on.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)
MULTIPLE = 16  # the float8 GEMM (torch._scaled_mm) needs both dimensions divisible by 16
OUTPUT_NAMES = ("lm_head", "embed_out", "output")  # the output projection's usual names


def _torchao() -> tuple[Any, Any]:
    """torchao.float8 and its Float8Linear class."""
    from lmforge.errors import ConfigError

    # torchao's import warns about its optional C++ kernels (MX formats, CUTLASS) that float8
    # training does not use, and torch about how torchao registers its enums: not this run's concern
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
        from torchao.float8.float8_linear import Float8Linear  # not in torchao.float8's __all__
    except ImportError as exc:
        raise ConfigError(f"pretrain.float8 needs torchao (pip install torchao==0.18.0): {exc}") from exc
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return float8, Float8Linear


def eligible(model: Any) -> tuple[list[str], list[str]]:
    """(linear layers to convert, linear layers kept because a dimension is not a multiple of 16), by
    name; the output projection is in neither."""
    import torch

    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    chosen: list[str] = []
    uneven: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is output or name.rsplit(".", 1)[-1] in OUTPUT_NAMES:
            continue
        fits = module.in_features % MULTIPLE == 0 and module.out_features % MULTIPLE == 0
        (chosen if fits else uneven).append(name)
    return chosen, uneven


def convert(model: Any, mode: str) -> list[str]:
    """Swap the eligible `nn.Linear` layers of `model` for torchao's `Float8Linear`, in place
    (`mode`: on | emulate); return the swapped layers' names."""
    if mode not in ("on", "emulate"):
        raise ValueError(f"float8 mode {mode!r}: on or emulate")
    chosen, uneven = eligible(model)
    if uneven:
        log.warning(
            "float8: %d linear layer(s) with a dimension not divisible by %d stay in high precision: %s",
            len(uneven),
            MULTIPLE,
            ", ".join(uneven[:4]) + (" ..." if len(uneven) > 4 else ""),
        )
    float8, linear = _torchao()
    config = float8.Float8LinearConfig(emulate=mode == "emulate")
    wanted = set(chosen)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn in wanted)
    swapped = [name for name, module in model.named_modules() if isinstance(module, linear)]
    if swapped != chosen:
        raise RuntimeError(f"float8: torchao converted {swapped}, expected {chosen}")
    return swapped


@contextlib.contextmanager
def high_precision(model: Any) -> Iterator[None]:
    """Run every `Float8Linear` of `model` as the `nn.Linear` it subclasses (same weights, no
    float8 casts) while the block runs: the export parity check compares weights, not kernels."""
    if "torchao" not in sys.modules:  # nothing can have been converted
        yield
        return
    import torch
    from torchao.float8.float8_linear import Float8Linear

    swapped = [m for m in model.modules() if isinstance(m, Float8Linear)]
    for module in swapped:
        module.forward = torch.nn.Linear.forward.__get__(module)
    try:
        yield
    finally:
        for module in swapped:
            del module.forward
