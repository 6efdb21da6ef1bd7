"""What a quantized checkpoint is, measured against the model it came from.

- size: bytes of its weight files against the source's weights stored in bf16 (the size vLLM
  would serve unquantized), their ratio, and bits per parameter;
- per-layer weight reconstruction error: each quantized Linear's dequantized weight against the
  original, as relative Frobenius error ||W_q - W|| / ||W||. SmoothQuant and AWQ rescale a layer's
  input columns by s and divide the RMSNorm before it by s (output unchanged); s is read back from
  the two models' norms and undone first, so the error measured is the rounding's alone. AWQ also
  moves scales between projections (v_proj's output rows into o_proj's input columns, up_proj's
  into down_proj's): those are read back from the producing projection's rows (each row's
  least-squares factor against the original) and undone on both.

transformers loads compressed-tensors checkpoints by decompressing them, which is how the
dequantized weights are read here (in the main environment, whichever environment wrote them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# which norm feeds which projections in a Llama-style block (SmoothQuant's and AWQ's default mapping)
SMOOTHED_BY = {
    "q_proj": "input_layernorm",
    "k_proj": "input_layernorm",
    "v_proj": "input_layernorm",
    "gate_proj": "post_attention_layernorm",
    "up_proj": "post_attention_layernorm",
}
# AWQ's projection-to-projection mappings: the first's output rows scale the second's input columns
SMOOTHED_INTO = {"v_proj": "o_proj", "up_proj": "down_proj"}


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


def layer_errors(source_dir: Path, quantized_dir: Path, method: str = "") -> list[dict[str, Any]]:
    """Relative weight error of every quantized Linear, worst first (`method`: the quantizer's, e.g. awq)."""
    import torch

    base, quant = _load(source_dir), _load(quantized_dir, quantized=True)
    base_modules, quant_modules = dict(base.named_modules()), dict(quant.named_modules())
    config = json.loads((quantized_dir / "config.json").read_text())["quantization_config"]
    ignored = set(config.get("ignore") or [])
    restored: dict[str, Any] = {}
    for name, module in quant_modules.items():
        if not isinstance(module, torch.nn.Linear) or name.split(".")[-1] in ignored or name in ignored:
            continue
        weight = module.weight.detach().float()
        short = name.split(".")[-1]
        if short in SMOOTHED_BY:  # undo the input-column scaling moved into the norm (identity when there was none)
            parent, norm = name.rsplit(".", 2)[0], SMOOTHED_BY[short]
            scale = (
                base_modules[f"{parent}.{norm}"].weight.detach().float()
                / quant_modules[f"{parent}.{norm}"].weight.detach().float()
            )
            weight = weight / scale.unsqueeze(0)
        restored[name] = weight
    if method == "awq":  # undo the scales AWQ moved from one projection's rows into the next one's columns
        for name in list(restored):
            parent, short = name.rsplit(".", 1) if "." in name else ("", name)
            into = f"{parent}.{SMOOTHED_INTO[short]}" if short in SMOOTHED_INTO else None
            if into not in restored or restored[into].shape[1] != restored[name].shape[0]:
                continue  # no such pair here (grouped-query attention: AWQ skips v_proj -> o_proj)
            original = base_modules[name].weight.detach().float()
            factor = (restored[name] * original).sum(1) / (original * original).sum(1).clamp_min(1e-12)
            restored[name] = restored[name] / factor.unsqueeze(1)
            restored[into] = restored[into] * factor.unsqueeze(0)
    rows = []
    for name, weight in restored.items():
        original = base_modules[name].weight.detach().float()
        error = float(torch.linalg.norm(weight - original) / torch.linalg.norm(original).clamp_min(1e-12))
        rows.append({"layer": name, "relative_error": round(error, 6), "shape": list(original.shape)})
    return sorted(rows, key=lambda r: -r["relative_error"])


def measure(source_dir: Path, quantized_dir: Path, method: str = "") -> dict[str, Any]:
    base_bytes, params = bf16_bytes_and_params(source_dir)
    size = weight_bytes(quantized_dir)
    errors = layer_errors(source_dir, quantized_dir, method)
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
