"""What a quantized checkpoint is, measured against the model it came from.

- size: bytes of its weight files against the source's weights stored in bf16 (the size vLLM
  would serve unquantized), their ratio, and bits per parameter;
- per-layer weight reconstruction error: each quantized Linear's dequantized weight against the
  original, as relative Frobenius error ||W_q - W|| / ||W||. SmoothQuant rescales a layer's input
  columns by s and divides the RMSNorm before it by s (output unchanged); s is read back from the
  two models' norms and undone first, so the error measured is the rounding's alone.

transformers loads compressed-tensors checkpoints by decompressing them, which is how the
dequantized weights are read here (in the main environment, whichever environment wrote them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# which norm feeds which projections in a Llama-style block (SmoothQuant's default mapping)
SMOOTHED_BY = {
    "q_proj": "input_layernorm",
    "k_proj": "input_layernorm",
    "v_proj": "input_layernorm",
    "gate_proj": "post_attention_layernorm",
    "up_proj": "post_attention_layernorm",
}


def weight_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def bf16_bytes_and_params(model_dir: Path) -> tuple[int, int]:
    """(bytes of the model's weights in bf16, number of parameters), from the safetensors headers."""
    from safetensors import safe_open

    total, params = 0, 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                numel = 1
                for dim in handle.get_slice(name).get_shape():
                    numel *= dim
                params += numel
                total += numel * 2
    return total, params


def _load(model_dir: Path, quantized: bool = False) -> Any:
    import torch
    from transformers import CompressedTensorsConfig

    from lmforge.inference.hf_load import load_causal_lm

    extra = {"quantization_config": CompressedTensorsConfig(run_compressed=False)} if quantized else {}
    return load_causal_lm(model_dir, dtype=torch.float32, **extra).eval()


def layer_errors(source_dir: Path, quantized_dir: Path) -> list[dict[str, Any]]:
    """Relative weight error of every quantized Linear, worst first."""
    import torch

    base, quant = _load(source_dir), _load(quantized_dir, quantized=True)
    base_modules = dict(base.named_modules())
    config = json.loads((quantized_dir / "config.json").read_text())["quantization_config"]
    ignored = set(config.get("ignore") or [])
    rows = []
    for name, module in quant.named_modules():
        if not isinstance(module, torch.nn.Linear) or name.split(".")[-1] in ignored or name in ignored:
            continue
        original = base_modules[name].weight.detach().float()
        restored = module.weight.detach().float()
        short = name.split(".")[-1]
        if short in SMOOTHED_BY:  # undo SmoothQuant's input-column scaling (identity when there was none)
            parent = name.rsplit(".", 2)[0]
            norm = SMOOTHED_BY[short]
            scale = (
                base_modules[f"{parent}.{norm}"].weight.detach().float()
                / dict(quant.named_modules())[f"{parent}.{norm}"].weight.detach().float()
            )
            restored = restored / scale.unsqueeze(0)
        error = float(torch.linalg.norm(restored - original) / torch.linalg.norm(original).clamp_min(1e-12))
        rows.append({"layer": name, "relative_error": round(error, 6), "shape": list(original.shape)})
    return sorted(rows, key=lambda r: -r["relative_error"])


def measure(source_dir: Path, quantized_dir: Path) -> dict[str, Any]:
    base_bytes, params = bf16_bytes_and_params(source_dir)
    size = weight_bytes(quantized_dir)
    errors = layer_errors(source_dir, quantized_dir)
    values = [r["relative_error"] for r in errors]
    return {
        "bytes": size,
        "bf16_bytes": base_bytes,
        "compression_ratio": round(size / base_bytes, 4),
        "bits_per_parameter": round(size * 8 / params, 3),
        "parameters": params,
        "quantized_layers": len(errors),
        "mean_layer_error": round(sum(values) / max(len(values), 1), 6),
        "max_layer_error": values[0] if values else 0.0,
        "worst_layer": errors[0]["layer"] if errors else None,
        "layer_errors": errors,
    }
