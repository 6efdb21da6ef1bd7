"""The Llama-style decoder, built from `transformers.LlamaConfig` and initialised from scratch."""

from __future__ import annotations

from typing import Any

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


def build_model(model: ModelConfig, vocab_size: int, max_positions: int, special: dict[str, int], seed: int) -> Any:
    """A freshly initialised LlamaForCausalLM; the same seed gives the same weights."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = llama_config(model, vocab_size, max_positions, special)
    return LlamaForCausalLM(config)
