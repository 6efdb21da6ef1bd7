"""Several fine-tunes on one base: the lineage's LoRA adapters, served by one vLLM server.

When alignment trains LoRA adapters, each aligned model is its base plus a low-rank update. The
updates *chain*: SFT's adapter is trained on the pretrained (or user's base) model, DPO's on the
merged SFT model, RL's on the merged model before it. vLLM applies one adapter to one base, so a
role whose adapter sits on another adapter is served as their **stack**: adapters that add their
updates, `W + s1 B1 A1 + s2 B2 A2`, are one LoRA of rank r1 + r2 with

    A = [A1; A2]            (rows)
    B = [s1 B1, s2 B2] / s  (columns; s = alpha / r of the stack, 1 here)

exact up to float rounding (merging is linear), so SFT, DPO and RL all become adapters on the same
root, served under one name each. Each stack is checked against the role's merged model (the one
evaluation judged) before it is served: the logits of root + stack through peft must match.

Why by hand: peft's `add_weighted_adapter(combination_type="cat")` builds the same concatenation,
but on a model with every adapter loaded at once (each trained on a different base, so loading them
together is itself the question) and it weights A and B both; this is 30 lines of tensor algebra on
the saved files, checked against peft's merged model below.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.errors import ConfigError

# the files that make the served base behave as the aligned models do (chat template, stop tokens)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
VLLM_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices (besides 1)


@dataclass(frozen=True)
class Adapter:
    """One aligned role as an adapter: its chain of trained adapters, root first."""

    role: str
    model_dir: Path  # the role's merged model (`<step>/hf`)
    chain: tuple[Path, ...]  # adapter directories, from the one trained on the root to the role's own
    root: Path  # the model the first adapter was trained on


def _config(adapter: Path) -> dict[str, Any]:
    path = adapter / "adapter_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable peft adapter config ({exc})") from None
    # target_parameters: LoRA of a mixture of experts' fused expert weights (align.lora.target_parameters)
    for field, plain in (("use_dora", False), ("modules_to_save", None), ("bias", "none"), ("target_parameters", None)):
        value = config.get(field, plain)
        if value != plain and value != []:
            raise ConfigError(
                f"{path}: {field}={value!r} is not a plain LoRA update vLLM can apply; serve this model merged "
                "(serve.adapters.enabled: false)"
            )
    return config


def chain_of(role: str, model_dir: Path) -> Adapter | None:
    """The role's adapter chain (its step's `adapter/`, then its base's, ...), or None when the role
    was fully fine-tuned. The chain ends at the first base that is not itself an adapter's merge."""
    chain: list[Path] = []
    current = model_dir
    while (current.parent / "adapter" / "adapter_config.json").exists():
        adapter = current.parent / "adapter"
        chain.insert(0, adapter)
        current = Path(_config(adapter)["base_model_name_or_path"])
    if not chain:
        return None
    return Adapter(role, model_dir, tuple(chain), current)


def _scale(config: dict[str, Any]) -> float:
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / (r**0.5) if config.get("use_rslora") else alpha / r


def stack(chain: tuple[Path, ...], out: Path) -> int:
    """Write the chain's adapters as one peft LoRA adapter in `out`; returns its rank."""
    import torch
    from safetensors.torch import load_file, save_file

    if len(chain) == 1:
        _copy_adapter(chain[0], out)
        return int(_config(chain[0])["r"])
    parts = []
    for adapter in chain:
        config = _config(adapter)
        weights = load_file(str(adapter / "adapter_model.safetensors"))
        parts.append((int(config["r"]), _scale(config), weights, config))
    rank = sum(r for r, *_ in parts)
    modules = sorted({k.rsplit(".lora_", 1)[0] for _, _, w, _ in parts for k in w if ".lora_A." in k})
    stacked: dict[str, torch.Tensor] = {}
    for module in modules:
        a_rows, b_cols = [], []
        like = next(w for _, _, w, _ in parts if f"{module}.lora_A.weight" in w)
        in_features = like[f"{module}.lora_A.weight"].shape[1]
        out_features = like[f"{module}.lora_B.weight"].shape[0]
        for r, scale, weights, _ in parts:
            a = weights.get(f"{module}.lora_A.weight")
            b = weights.get(f"{module}.lora_B.weight")
            if a is None or b is None:  # this adapter leaves the module alone: a zero block
                a, b = torch.zeros(r, in_features), torch.zeros(out_features, r)
            a_rows.append(a.float())
            b_cols.append(b.float() * scale)  # the stack's own scale is alpha / r = 1
        stacked[f"{module}.lora_A.weight"] = torch.cat(a_rows, 0).contiguous()
        stacked[f"{module}.lora_B.weight"] = torch.cat(b_cols, 1).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(stacked, str(out / "adapter_model.safetensors"))
    config = dict(parts[-1][3])
    targets = sorted({m.removeprefix("base_model.model.") for m in modules})
    config.update(
        r=rank,
        lora_alpha=rank,
        use_rslora=False,
        target_modules=targets,
        rank_pattern={},
        alpha_pattern={},
        base_model_name_or_path=str(Path(_config(chain[0])["base_model_name_or_path"])),
    )
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return rank


def _copy_adapter(adapter: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy2(adapter / name, out / name)


def served_base(root: Path, aligned: Path, out: Path) -> Path:
    """The base as the adapters are served: the root's weights (linked, not copied) with the aligned
    models' tokenizer, chat template and generation config (their stop tokens)."""
    out.mkdir(parents=True, exist_ok=True)
    for item in root.iterdir():
        if item.name not in TOKENIZER_FILES and not (out / item.name).exists():
            os.symlink(item.resolve(), out / item.name)
    for name in TOKENIZER_FILES:
        source = aligned / name if (aligned / name).exists() else root / name
        if source.exists():
            shutil.copy2(source, out / name)
    return out


def parity(base: Path, adapter: Path, merged: Path) -> float:
    """Max |logit difference| between `base` + `adapter` (peft) and the role's merged model, on a
    fixed token sequence: the stack is the model evaluation judged, or it is not served."""
    import torch
    from peft import PeftModel

    from lmforge.inference.hf_load import load_causal_lm, loading

    with torch.no_grad():
        reference_model = load_causal_lm(merged, dtype=torch.float32).eval()
        ids = torch.arange(3, 35).remainder(reference_model.config.vocab_size).unsqueeze(0)
        reference = reference_model(ids).logits
        model = load_causal_lm(base, dtype=torch.float32)
        with loading():
            peft_model = PeftModel.from_pretrained(model, str(adapter)).eval()
        return float((peft_model(ids).logits - reference).abs().max())


def parities(chains: list[Adapter], stacked: Path, out_dir: Path) -> dict[str, float]:
    """`parity` of each role's stack (`stacked/<role>`) in a fresh process (`serving.parity_entry`): the
    answer depends on the files alone, not on what the calling process loaded before (issue 57).
    A non-finite difference comes back as NaN, which no tolerance accepts."""
    import logging

    from lmforge.processes.launch import SINGLE, run_entry

    result = out_dir / "logs" / "parity.json"
    spec = {
        "adapters": [
            {"role": a.role, "root": str(a.root), "adapter": str(stacked / a.role), "merged": str(a.model_dir)}
            for a in chains
        ],
        "result": str(result),
    }
    run_entry(
        "serving.parity_entry",
        spec,
        out_dir,
        policy=SINGLE,
        spec_name="logs/parity_spec.json",
        logger=logging.getLogger("serving.adapters"),
        what="the adapters' parity check",
    )
    return {role: float(gap) for role, gap in json.loads(result.read_text()).items()}


def vllm_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds `rank`."""
    for choice in VLLM_RANKS:
        if rank <= choice:
            return choice
    raise ConfigError(f"serve.adapters: a stacked adapter of rank {rank} is above vLLM's largest ({VLLM_RANKS[-1]})")
