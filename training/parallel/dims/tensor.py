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

from training.parallel import Dimension, moe_problem

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


def matches(plan: dict[str, str], names: list[str], stage: bool = False) -> list[tuple[str, str]]:
    """(module name, style) in plan order, then module order; a pattern matching nothing is an error,
    except on a pipeline stage (`stage`), which holds only some of the model's modules."""
    out: list[tuple[str, str]] = []
    for pattern, name in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits and not stage:
            raise ValueError(f"tensor-parallel plan pattern {pattern!r} matches no module of the model")
        out += [(n, name) for n in hits]
    return out


def apply(model: Any, tp_mesh: Any, run_plan: Any) -> Any:
    """Parallelize a Hugging Face causal LM in place over `tp_mesh` (the engine wraps it afterwards)."""
    from torch.distributed.tensor.parallel import parallelize_module

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    modules = dict(model.named_modules())
    stage = hasattr(model, "sequence_split")  # a pipeline stage (training.parallel.dims.pipeline): some modules only
    for name, style_name in matches(plan_for(model.config.model_type), list(modules), stage):
        parallelize_module(modules[name], tp_mesh, style(style_name))
    if tied:  # both halves were split by vocabulary row: tie them again, one parameter
        model.lm_head.weight = model.model.embed_tokens.weight
    if stage:  # what a later stage receives is this rank's slice of the sequence
        model.sequence_split = tp_mesh.size()
    return model


def loss_parallel() -> Any:
    from torch.distributed.tensor.parallel import loss_parallel as context

    return context()


def shape_problem(shape: dict[str, Any], degree: int) -> str | None:
    """Every split dimension must divide evenly by the degree."""
    if degree > 1 and (shape.get("experts") or {}).get("num"):
        return moe_problem("tensor_parallel", degree)
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


# -- alignment: transformers' own plans ------------------------------------------------------------
# Alignment builds its models with `from_pretrained` inside TRL's trainers, which is where transformers'
# own tensor-parallel plans apply: `base_model_tp_plan` (q/k/v and gate/up by column, o/down by row, the
# head by column gathered) loaded already split with `DistributedConfig(tp_size=N)`, and the Trainer
# feeds every rank of a tensor-parallel group the same batch (accelerate's ParallelismConfig: the data
# is split over the replicas only). lmforge uses those rather than the tables above: the trainer, its
# checkpoints and its export (`save_model` gathers one whole safetensors model) stay TRL's and
# transformers'. They have no sequence parallelism.


def align_problem(align: Any, running: list[Any]) -> str | None:
    """Why `align.distributed.tensor_parallel` cannot run with these settings (one line), else None."""
    from training.parallel import all_engines

    d = align.distributed
    degree = d.tensor_parallel
    head = f"align.distributed.tensor_parallel {degree}"
    if align.method != "full":
        return (
            f"{head}: method {align.method} trains adapters on split layers, which is not supported; use method: full"
        )
    refused = [m.name for m in running if not m.tensor_parallel]
    if refused:
        able = ", ".join(m.name for m in running if m.tensor_parallel) or "SFT and DPO"
        return f"{head}: {', '.join(refused)} does not train under tensor parallelism ({able} do); leave it at 1"
    if d.num_ranks != "auto" and int(d.num_ranks) % degree:
        return f"{head} does not divide num_ranks {d.num_ranks}"
    if d.zero_stage:
        return (
            f"{head}: ZeRO stage {d.zero_stage} is not composed with transformers' tensor parallelism here; "
            f"use zero_stage 0, or backend: {next(e.name for e in all_engines() if e.mesh_dimensions)} for sharded replicas"
        )
    return None


def align_world_problem(world: int, nodes: int, degree: int, mesh_engine: bool) -> str | None:
    """The ranks the launch has against the degree: without an engine that shards the replicas (FSDP2
    on a mesh), accelerate has no data-parallel dimension to put beside tensor parallelism."""
    if world % degree:
        return f"align.distributed.tensor_parallel {degree} does not divide the {world} ranks"
    if degree > world // nodes:
        return f"align.distributed.tensor_parallel {degree} is more than the {world // nodes} ranks of a node"
    if world > degree and not mesh_engine:
        return (
            f"align.distributed.tensor_parallel {degree} on {world} ranks needs data-parallel replicas beside it, "
            "which accelerate builds with FSDP2 only: use backend: fsdp2, or tensor_parallel = the ranks"
        )
    return None


def align_model_problem(model_config: dict[str, Any], degree: int, source: str) -> str | None:
    """The start model must have a plan in the installed transformers, and the degree must divide
    what the plan splits."""
    from transformers import AutoConfig

    kind = model_config.get("model_type")
    try:
        plan = getattr(AutoConfig.for_model(**model_config), "base_model_tp_plan", None)
    except (ValueError, KeyError):
        plan = None
    if not plan:
        return (
            f"{source}: model_type {kind!r} has no tensor-parallel plan in the installed transformers "
            "(base_model_tp_plan); set align.distributed.tensor_parallel: 1"
        )
    splits = {
        "num_attention_heads": model_config.get("num_attention_heads"),
        "num_key_value_heads": model_config.get("num_key_value_heads", model_config.get("num_attention_heads")),
        "intermediate_size": model_config.get("intermediate_size"),
        "vocab_size": model_config.get("vocab_size"),
    }
    bad = [f"{k} {v}" for k, v in splits.items() if isinstance(v, int) and v % degree]
    if bad:
        return f"{source}: align.distributed.tensor_parallel {degree} does not divide {', '.join(bad)}"
    return None


def align_load_arguments(degree: int) -> dict[str, Any]:
    """`from_pretrained` arguments that load the model already split over the tensor-parallel ranks."""
    if degree <= 1:
        return {}
    from transformers.distributed.configuration_utils import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_size=degree)}


def align_trainer_arguments(degree: int, world: int, mesh_engine: bool) -> dict[str, Any]:
    """accelerate's ParallelismConfig for the Trainer: the replicas sharded by FSDP2 (a 2-D mesh) or,
    without them, tensor parallelism alone."""
    if degree <= 1:
        return {}
    from accelerate.parallelism_config import ParallelismConfig

    replicas = world // degree
    if mesh_engine and replicas > 1:
        return {"parallelism_config": ParallelismConfig(dp_shard_size=replicas, tp_size=degree)}
    return {"parallelism_config": ParallelismConfig(tp_size=degree)}


def allow_on_cpu() -> None:
    """accelerate 1.15's ParallelismConfig accepts only GPU (or DeepSpeed/FSDP) distributed types, and a
    CPU run is MULTI_CPU; its tensor-parallel path itself has nothing device-specific (DTensor's
    collectives run on gloo). This lets the check see a multi-device run, on CPU only, so 2 CPU ranks
    train exactly what 2 GPUs would (tests/test_parallelism.py checks them against one rank). Written
    here because accelerate has no setting for it; a no-op where accelerate changes that method."""
    from accelerate.parallelism_config import ParallelismConfig

    check = getattr(ParallelismConfig, "_validate_accelerator", None)
    if check is None or getattr(check, "lmforge_cpu", False):
        return

    class _MultiDevice:
        def __init__(self, accelerator: Any) -> None:
            self._accelerator = accelerator

        def __getattr__(self, name: str) -> Any:
            return True if name == "multi_device" else getattr(self._accelerator, name)

    def validate(self: Any, accelerator: Any) -> Any:
        return check(self, _MultiDevice(accelerator))

    validate.lmforge_cpu = True  # type: ignore[attr-defined]
    ParallelismConfig._validate_accelerator = validate  # type: ignore[method-assign]
