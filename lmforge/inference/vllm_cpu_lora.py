"""vLLM's CPU LoRA ops, applying each adapter once per group of tokens instead of once per token.

A vLLM general plugin (`vllm.general_plugins` entry point `lmforge_cpu_lora`, loaded by every vLLM
process of this environment; it does nothing off the CPU platform or with
`LMFORGE_VLLM_LORA_OPS=upstream`). It replaces the three functions of vLLM's pure-PyTorch LoRA
fallback (`vllm/lora/ops/torch_ops/lora_ops.py`: `bgmv_shrink`, `bgmv_expand`,
`bgmv_expand_slice`, which its `sgmv_*` prefill ops call) that the CPU platform's punica wrapper
runs.

Written by hand because no maintained library does this on CPU, and vLLM's own version:

- gathers a copy of the adapter's matrices **for every token** (`lora_b_weights[indices]`, then a
  batched `einsum`): a prefill chunk of 2,048 tokens through a rank-32 adapter on a 256-wide model
  copies 2,048 x 256 x 32 floats per projection and layer, once for A and once for B. On 2 cores
  this made the demo preset's adapter server miss its TTFT target by 2x (issue 44; figures in
  docs/benchmarks.md). Here the tokens are grouped by adapter, and each group is one matrix
  product with the adapter's matrix as it is (one product when the whole batch uses one adapter,
  the usual case);
- applies the **last loaded adapter** to tokens marked -1 (no adapter: the base model), because
  `weights[-1]` is a valid index (vLLM pull request 48421, open when this was written). Here those
  tokens get no delta, as vLLM's GPU kernels do.

Same arguments, same outputs (up to float summation order) for every valid index; the tests compare
both on random weights and mixed batches.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

log = logging.getLogger(__name__)
NAMES = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def _grouped(inputs: Any, weights: Any, indices: Any, dtype: Any) -> Any:
    """Each row of `inputs` times its adapter's matrix (`weights[index]`, [out, in]), transposed; 0 for index -1."""
    import torch

    matrices = weights.squeeze(1) if weights.dim() == 4 else weights  # [adapters, out, in]
    x = inputs.to(dtype)
    rows = min(x.shape[0], indices.shape[0])
    out = x.new_zeros((x.shape[0], matrices.shape[1]))
    if rows == 0:
        return out
    indices = indices[:rows]
    first = int(indices[0])
    if bool((indices == first).all()):  # one adapter (or none) for the whole batch: one product
        if first >= 0:
            out[:rows] = x[:rows] @ matrices[first].to(dtype).t()
        return out
    for index in torch.unique(indices).tolist():
        if index < 0:
            continue  # the base model's tokens: no delta
        where = (indices == index).nonzero(as_tuple=True)[0]
        out[where] = x[where] @ matrices[index].to(dtype).t()
    return out


def bgmv_shrink(
    inputs: Any, lora_a_weights: Any, output_tensor: Any, lora_indices_tensor: Any, scaling: float = 1.0
) -> None:
    outputs = _grouped(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(
    inputs: Any, lora_b_weights: Any, output_tensor: Any, lora_indices_tensor: Any, add_inputs: bool = True
) -> None:
    outputs = _grouped(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common = min(outputs.shape[1], output_tensor.shape[1])  # the adapter and the model may pad differently
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(
    inputs: Any,
    lora_b_weights: Any,
    output_tensor: Any,
    lora_indices_tensor: Any,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    outputs = _grouped(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs[:]


def register() -> None:
    """The plugin's entry point: install the grouped ops where vLLM's CPU LoRA path looks them up."""
    if os.environ.get("LMFORGE_VLLM_LORA_OPS", "grouped") == "upstream":
        return
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        import vllm.lora.ops.torch_ops as package
        import vllm.lora.ops.torch_ops.lora_ops as ops
    except Exception as exc:  # noqa: BLE001 - another vLLM layout: keep vLLM's own ops, say so once
        log.warning("lmforge's grouped CPU LoRA ops not installed (%s); vLLM's own are used", exc)
        return
    mine = sys.modules[__name__]
    for name in NAMES:
        for module in (ops, package, sys.modules.get("vllm.lora.punica_wrapper.punica_cpu")):
            if module is not None and hasattr(module, name):
                setattr(module, name, getattr(mine, name))
