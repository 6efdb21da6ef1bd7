"""Consolidate the trained weights into a Hugging Face model directory and check parity.

The directory holds safetensors weights, config, generation config and the curation
tokenizer, so `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`
and vLLM load it directly. Parity: the exported model, reloaded from disk, must reproduce
the training engine's logits on a fixed validation batch within a tolerance.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from training.model import model_config

log = logging.getLogger(__name__)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",  # a base model's SentencePiece model, where it ships one
    "added_tokens.json",
)


def end_of_turn_ids(tokenizer_dir: Path, eos_id: int) -> list[int]:
    """Stop tokens: <|im_end|> (the end of a chat turn, where vLLM and `generate` must stop) and EOS."""
    from tokenizers import Tokenizer

    im_end = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).token_to_id("<|im_end|>")
    return [im_end, eos_id] if im_end is not None else [eos_id]


def generation_config(tokenizer_dir: Path, special: dict[str, int], context: int) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=special["bos_id"],
        eos_token_id=end_of_turn_ids(tokenizer_dir, special["eos_id"]),
        pad_token_id=special["pad_id"],
        max_length=context,
    )


def copy_tokenizer(tokenizer_dir: Path, out_dir: Path, context: int) -> None:
    """The tokenizer files, with `model_max_length` set to the model's context (TRL and lm-eval read it)."""
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, out_dir / name)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["model_max_length"] = context
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def save_hf(
    state: dict[str, Any],
    trainer_cfg: Any,
    vocab_size: int,
    special: dict[str, int],
    tokenizer_dir: Path,
    out_dir: Path,
    base_dir: Path | None = None,
    rope: dict[str, Any] | None = None,
) -> None:
    """Save the weights as a Hugging Face model: lmforge's Llama, or the base's own architecture,
    generation config (its stop tokens) and context when training continued a base model; with
    `rope`, the context extended to seq_len (lmforge/rope.py). config.json carries the rotary
    settings in both of transformers' shapes."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from lmforge.rope import with_both_shapes
    from training.model import base_config

    if base_dir is not None:
        config = base_config(base_dir, rope, trainer_cfg.seq_len)
        trained = json.loads((base_dir / "config.json").read_text()).get("max_position_embeddings")
        context = int(getattr(config, "max_position_embeddings", None) or trainer_cfg.seq_len)
        generation = GenerationConfig.from_pretrained(str(base_dir))
        if rope is not None and generation.max_length == trained:  # lmforge's own: generation up to the context
            generation.max_length = context
    else:
        config = model_config(trainer_cfg.model, vocab_size, trainer_cfg.seq_len, special)
        context = trainer_cfg.seq_len
        generation = generation_config(tokenizer_dir, special, trainer_cfg.seq_len)
    dtype = next(iter(state.values())).dtype
    config.dtype = str(dtype).removeprefix("torch.")
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k.endswith(("lm_head.weight", "embed_out.weight")))]
    if missing or unexpected:
        raise RuntimeError(f"export: state dict mismatch (missing {missing}, unexpected {unexpected})")
    model.generation_config = generation
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    config_path = out_dir / "config.json"
    config_path.write_text(json.dumps(with_both_shapes(json.loads(config_path.read_text())), indent=2) + "\n")
    copy_tokenizer(tokenizer_dir, out_dir, context)
    del model
    torch.set_grad_enabled(True)


def parity_gap(engine: Any, hf_dir: Path, batch: Any, forward: Any = None) -> float:
    """Max |logit difference| between the engine and the exported model on `batch` (rank 0 value).
    `forward(batch)`: the engine's logits where calling it is not enough (pipeline stages)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from training.float8 import high_precision

    engine.eval()
    # compiled layers run eagerly here: inductor's fused bf16 kernels round differently from the
    # eager kernels the exported model runs, and the check is about the weights, not the kernels;
    # for the same reason float8 layers (pretrain.float8) run as the plain nn.Linear they subclass
    with torch.no_grad(), torch.compiler.set_stance("force_eager"), high_precision(engine.module):
        logits = forward(batch) if forward is not None else engine(input_ids=batch).logits
        if hasattr(logits, "full_tensor"):  # split by vocabulary under tensor parallelism
            logits = logits.full_tensor()
        reference = logits.float().cpu()
    engine.train()
    if dist.get_rank() != 0:
        return 0.0
    # on the engine's device: the same kernels in the same dtype, so a bf16 GPU run is not
    # judged by the rounding differences between CUDA and CPU matmuls
    exported = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype="auto").to(batch.device)
    exported.eval()
    with torch.no_grad():
        logits = exported(input_ids=batch).logits.float().cpu()
    del exported
    return float((logits - reference).abs().max())
