"""A Hugging Face config.json's mixture of experts, read the same way by every stage (pretraining's
planner and router watch, quantization's refusal where vLLM cannot serve quantized experts)."""

from __future__ import annotations

from typing import Any


def experts_of(config: dict[str, Any]) -> dict[str, Any]:
    """A config.json's mixture of experts (Mixtral, Qwen2/3-MoE, OLMoE spellings) as `ExpertsConfig`
    fields; {"num": 0} for a dense model."""
    num = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    if not num:
        return {"num": 0}
    return {
        "num": num,
        "top_k": int(config.get("num_experts_per_tok") or 2),
        "intermediate_size": config.get("moe_intermediate_size") or config.get("intermediate_size"),
        "shared_expert": bool(config.get("shared_expert_intermediate_size")),
        "router_aux_loss_coef": float(config.get("router_aux_loss_coef") or 0.0),
    }
