"""The model pretraining trains: lmforge's Llama-style decoder from scratch (`transformers.LlamaConfig`),
or a base model's own weights and architecture (any `AutoModelForCausalLM`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmforge.moe import experts_of
from lmforge.rope import apply, rope_parameters_of
from training.config import ModelConfig


def llama_config(model: ModelConfig, vocab_size: int, max_positions: int, special: dict[str, int]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_kv_heads,
        max_position_embeddings=max_positions,
        # transformers 5 reads the 4.x keyword (into rope_parameters) but no longer declares it
        rope_theta=model.rope_theta,  # type: ignore[call-arg]
        tie_word_embeddings=model.tie_embeddings,
        initializer_range=model.init_std,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        attention_dropout=0.0,
        bos_token_id=special["bos_id"],
        eos_token_id=special["eos_id"],
        pad_token_id=special["pad_id"],
        use_cache=False,
    )


def moe_config(model: ModelConfig, vocab_size: int, max_positions: int, special: dict[str, int]) -> Any:
    """lmforge's Llama with every MLP replaced by `model.experts`: Mixtral's architecture, or Qwen2-MoE's
    when there is a shared expert (Mixtral has none). Qwen2-MoE's attention biases are off, so both
    keep lmforge's attention; top-k weights are renormalized in both (Mixtral always does)."""
    from transformers import MixtralConfig, Qwen2MoeConfig

    experts = model.experts
    width = experts.intermediate_size or model.intermediate_size
    dense = llama_config(model, vocab_size, max_positions, special).to_dict()
    common = {
        k: dense[k]
        for k in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings", "rope_parameters", "tie_word_embeddings", "initializer_range", "hidden_act",
            "rms_norm_eps", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache",
        )
    }  # fmt: skip
    common |= {"num_experts_per_tok": experts.top_k, "router_aux_loss_coef": experts.router_aux_loss_coef}
    if experts.shared_expert:
        return Qwen2MoeConfig(
            **common,
            num_experts=experts.num,
            moe_intermediate_size=width,
            shared_expert_intermediate_size=width,
            intermediate_size=model.intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            qkv_bias=False,
            use_sliding_window=False,
        )
    return MixtralConfig(**common, num_local_experts=experts.num, intermediate_size=width, sliding_window=None)


def model_config(model: ModelConfig, vocab_size: int, max_positions: int, special: dict[str, int]) -> Any:
    """The transformers config of lmforge's own model: Llama, or a mixture of experts (`moe_config`)."""
    if model.experts.enabled:
        return moe_config(model, vocab_size, max_positions, special)
    return llama_config(model, vocab_size, max_positions, special)


def build_model(model: ModelConfig, vocab_size: int, max_positions: int, special: dict[str, int], seed: int) -> Any:
    """A freshly initialised causal LM of `model_config`; the same seed gives the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(model_config(model, vocab_size, max_positions, special))


def base_config(base_dir: Path, rope: dict[str, Any] | None = None, context: int | None = None) -> Any:
    """A base model's transformers config; with `rope`, its rotary positions stretched to `context`
    tokens (context extension, lmforge/rope.py): what training loads and the export saves."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(base_dir))
    if rope is not None:
        apply(config, rope, int(context or config.max_position_embeddings))
    return config


def load_base(base_dir: Path, rope: dict[str, Any] | None = None, context: int | None = None) -> Any:
    """A base model's weights in fp32 (the engine casts for mixed precision), ready to train, with
    `base_config`'s settings."""
    import torch
    from transformers import AutoModelForCausalLM

    config = base_config(base_dir, rope, context)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), config=config, dtype=torch.float32)
    model.config.use_cache = False
    return model


def decoder_shape(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's shape read from a Hugging Face config.json (Llama, Qwen2, Mistral, GPT-NeoX,
    GPT-2 spellings), for the planner's memory model and the FLOP count."""
    hidden = config.get("hidden_size") or config.get("n_embd") or config["d_model"]
    heads = config.get("num_attention_heads") or config.get("n_head") or config["num_heads"]
    rope = rope_parameters_of(config)["rope_theta"]
    return {
        "hidden_size": hidden,
        "intermediate_size": config.get("intermediate_size") or config.get("n_inner") or 4 * hidden,
        "num_layers": config.get("num_hidden_layers") or config.get("n_layer") or config["num_layers"],
        "num_heads": heads,
        "num_kv_heads": config.get("num_key_value_heads") or heads,
        "tie_embeddings": bool(config.get("tie_word_embeddings", True)),
        "rope_theta": float(rope),
        "experts": experts_of(config),
    }


def model_config_of(config: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**decoder_shape(config))


def count_weights(directory: Path) -> int:
    """Parameters stored in a model directory's safetensors files (read from their headers only)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= d
                total += n
    return total
