"""Tensor parallelism with sequence parallelism (Megatron-style, on PyTorch's DTensor).

Within a tensor-parallel group every rank holds a slice of each projection: q/k/v and the MLP's
gate/up are split by output column (each rank computes its own attention heads and its part of
the MLP's width), o_proj and down_proj by input row (their partial outputs are summed). Between
those regions the residual stream is split along the sequence (sequence parallelism, Korthikanti
et al. 2022): the RMSNorms run on a rank's own positions and the sum of a row-parallel output
becomes a reduce-scatter, so activations outside attention and MLP are divided by the degree too.
The embedding is split by vocabulary row and the output head by vocabulary column, and the
logits stay split by vocabulary: the cross-entropy runs under `loss_parallel` (each rank's
log-sum-exp over its columns, combined), so no rank ever holds the whole sequence x vocabulary
logits (at 8k tokens and a 128k vocabulary that is 4 GiB per sequence in fp32).

The plans are data: for each model family (the `model_type` of its Hugging Face config) a
table from module-name patterns (`fnmatch`, relative to the causal LM) to a style name,
applied in table order. Llama, Qwen2 and Mistral share module names and shapes, so they share
one table; a family with other names is another table, not code.

Two choices differ from torchtitan's own Llama, because lmforge parallelizes Hugging Face's
modules, not its own: the embedding's output stays whole (Hugging Face's model derives position
ids and the causal mask from the embedding's sequence length, which a sequence-split output
would halve), and the first decoder layer takes its input split along the sequence instead.
A tied output head (`tie_word_embeddings`) is split like the embedding (both by vocabulary row)
and tied again after parallelizing, so it stays one parameter.

Why not transformers' own `tp_plan`: it is applied while loading weights (`from_pretrained`),
not to a model built in-process from scratch, and it has no sequence parallelism.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from training.parallel import Dimension

DECODER_PLAN: dict[str, str] = {
    "model.embed_tokens": "embedding",
    "model.layers.0": "enter_sequence",
    "model.layers.*.input_layernorm": "sequence",
    "model.layers.*.self_attn": "gather_hidden_states",
    "model.layers.*.self_attn.[qkv]_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise_to_sequence",
    "model.layers.*.post_attention_layernorm": "sequence",
    "model.layers.*.mlp": "gather_input",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise_to_sequence",
    "model.norm": "sequence_out",
    "lm_head": "head",
}
PLANS: dict[str, dict[str, str]] = {"llama": DECODER_PLAN, "qwen2": DECODER_PLAN, "mistral": DECODER_PLAN}


def style(name: str) -> Any:
    """The torch ParallelStyle a plan's style name stands for."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq, whole = Shard(1), Replicate()
    styles = {
        # vocabulary rows split; each rank looks up its rows and the partial embeddings are summed
        "embedding": lambda: RowwiseParallel(input_layouts=whole, output_layouts=whole),
        # the residual stream enters the layers split along the sequence (a local slice, no traffic)
        "enter_sequence": lambda: PrepareModuleInput(
            input_layouts=(whole,), desired_input_layouts=(seq,), use_local_output=True
        ),
        "sequence": lambda: SequenceParallel(use_local_output=True),
        # attention needs every position: all-gather the sequence (Hugging Face passes it by keyword)
        "gather_hidden_states": lambda: PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": seq},
            desired_input_kwarg_layouts={"hidden_states": whole},
            use_local_output=True,
        ),
        "gather_input": lambda: PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(whole,), use_local_output=True
        ),
        "colwise": ColwiseParallel,
        # partial sums reduce-scattered back onto the sequence split
        "rowwise_to_sequence": lambda: RowwiseParallel(output_layouts=seq),
        "sequence_out": SequenceParallel,  # the final norm hands the head a sequence-split DTensor
        # gathers the sequence, splits the vocabulary; the logits stay split for the loss
        "head": lambda: ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if name not in styles:
        raise KeyError(f"tensor-parallel plan names an unknown style {name!r}; known: {', '.join(styles)}")
    return styles[name]()


def plan_for(model_type: str) -> dict[str, str]:
    if model_type not in PLANS:
        raise ValueError(
            f"tensor parallelism has no plan for model type {model_type!r} (known: {', '.join(sorted(PLANS))}); "
            "add its table to training/parallel/dims/tensor.py, or set pretrain.distributed.tensor_parallel=1"
        )
    return PLANS[model_type]


def matches(plan: dict[str, str], names: list[str]) -> list[tuple[str, str]]:
    """(module name, style) in plan order, then module order; a pattern matching nothing is an error."""
    out: list[tuple[str, str]] = []
    for pattern, name in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(f"tensor-parallel plan pattern {pattern!r} matches no module of the model")
        out += [(n, name) for n in hits]
    return out


def apply(model: Any, tp_mesh: Any, run_plan: Any) -> Any:
    """Parallelize a Hugging Face causal LM in place over `tp_mesh` (the engine wraps it afterwards)."""
    from torch.distributed.tensor.parallel import parallelize_module

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    modules = dict(model.named_modules())
    for name, style_name in matches(plan_for(model.config.model_type), list(modules)):
        parallelize_module(modules[name], tp_mesh, style(style_name))
    if tied:  # both halves were split by vocabulary row: tie them again, one parameter
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def loss_parallel() -> Any:
    from torch.distributed.tensor.parallel import loss_parallel as context

    return context()


def shape_problem(shape: dict[str, Any], degree: int) -> str | None:
    """Every split dimension must divide evenly by the degree."""
    splits = {
        "num_heads": shape["num_heads"],
        "num_kv_heads": shape["num_kv_heads"],
        "intermediate_size": shape["intermediate_size"],
        "vocab_size": shape["vocab_size"],
        "seq_len (sequence parallel)": shape["seq_len"],
    }
    bad = [f"{k} {v}" for k, v in splits.items() if v % degree]
    if bad:
        return f"tensor_parallel {degree} does not divide {', '.join(bad)}"
    return None


DIMENSION = Dimension(
    name="tp",
    field="tensor_parallel",
    title="tensor + sequence parallel",
    apply=apply,
    shape_problem=shape_problem,
    divides=("weights", "gradients", "optimizer", "optimizer_step", "gathered", "activations", "logits", "buckets"),
    traffic_note=lambda degree: (
        f"2 all-gathers + 2 reduce-scatters of activations per layer per micro-batch over {degree} ranks"
    ),
    loss_context=loss_parallel,
)
