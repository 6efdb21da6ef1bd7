"""Typed configuration of the alignment stage (`align:` in a preset).

What the aligned model learns from (data, method, LoRA shape, optimizer, schedule, steps,
DPO's beta) is cache identity; how the work is spread (launcher, ranks, ZeRO stage,
micro-batch) is not, as in pretraining.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from lmforge.configbase import StrictModel, runtime_field
from training.align.methods import methods
from training.config import EngineName
from training.parallel import ENGINE_NAMES, all_engines, engine

RENAMED_BUILTIN = {"tasks": "skills", "per_task": "per_skill"}  # old name -> new, accepted for one more release
Skill = Literal["add", "subtract", "copy", "reverse", "sort", "upper", "count", "capital"]
ALL_SKILLS: list[Skill] = ["add", "subtract", "copy", "reverse", "sort", "upper", "count", "capital"]


class BuiltinDataConfig(StrictModel):
    """The built-in instruction set, used when no inputs are given.

    Its generators are called skills (not "tasks", which are lm-eval's evaluation tasks here)."""

    skills: list[Skill] = Field(
        default_factory=lambda: list(ALL_SKILLS),
        description="Generated skills with one verifiable answer each.",
    )
    per_skill: int = Field(
        240, ge=1, description="Distinct examples generated per skill (fewer where a skill has fewer)."
    )
    dialogue_conversations: int = Field(150, ge=0, description="Multi-turn chatterbot conversations added to SFT data.")
    seed: int = 0

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not RENAMED_BUILTIN.keys() & data.keys():
            return data
        data = dict(data)
        for old, new in RENAMED_BUILTIN.items():
            if old in data:  # it wins over the new name (a preset's value, overridden with the old name)
                logging.getLogger("lmforge.config").warning(
                    "align.builtin.%s is now align.builtin.%s; the old name goes away in the next release", old, new
                )
                data[new] = data.pop(old)
        return data


class LoraConfig(StrictModel):
    """peft LoRA; the seeds' defaults for real models are r=16-64, alpha=2r, attention and MLP projections."""

    r: int = Field(16, ge=1, description="Rank of the low-rank update.")
    alpha: int = Field(32, ge=1, description="Scaling numerator (the update is scaled by alpha/r); 2r is usual.")
    dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: list[str] = Field(
        default_factory=lambda: ["all-linear"],
        description="Module names LoRA adapts; [all-linear]: every linear layer but the output head (the attention "
        "and MLP projections of any architecture: q_proj..down_proj in Llama/Qwen2, query_key_value..dense_4h_to_h "
        "in GPT-NeoX).",
    )
    target_parameters: list[str] = Field(
        default_factory=list,
        description="Parameters LoRA adapts beyond modules, through PEFT's target_parameters: a mixture of "
        "experts' fused expert weights, e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj] (Mixtral, "
        "Qwen2-MoE in transformers 5); [] = none. Merged into the exported model; not servable as an adapter.",
    )
    merge_parity_tolerance: float = runtime_field(
        1e-3, description="Max |logit difference| between the merged model and the PEFT model.", gt=0
    )

    @model_validator(mode="after")
    def _parameters_without_dropout(self) -> LoraConfig:
        if self.target_parameters and self.dropout:
            raise ValueError(
                f"target_parameters needs dropout: 0 (got {self.dropout}): PEFT adapts parameters without dropout"
            )
        return self


def recipe_order() -> list[str]:
    """The methods a recipe may name, in the order they run: the registry's (`training.align.methods`)."""
    return [m.name for m in methods().values() if m.in_recipe]


class AlignDistributedConfig(StrictModel):
    """How alignment training is spread; none of this changes the cache key."""

    launcher: Literal["accelerate", "torchrun", "deepspeed"] = runtime_field(
        "accelerate",
        description="Process launcher: accelerate or torchrun on one node, deepspeed with a hostfile for several.",
    )
    num_ranks: Annotated[int, Field(ge=1)] | Literal["auto"] = runtime_field(
        "auto", description="Ranks per node; auto = all GPUs, or 2 on CPU."
    )
    backend: EngineName = runtime_field(  # type: ignore[valid-type]
        ENGINE_NAMES[0],
        description="Training engine (a module of training/parallel/engines), through accelerate: deepspeed = DDP "
        "or ZeRO (zero_stage); fsdp2 = accelerate's FSDP plugin, version 2, full shard per decoder layer.",
    )
    zero_stage: Literal[0, 2, 3] = runtime_field(
        0, description="DeepSpeed ZeRO stage through accelerate (0: plain DDP)."
    )
    tensor_parallel: int = runtime_field(
        1,
        ge=1,
        description="Ranks each layer is split over with transformers' own tensor-parallel plan for the model "
        "(`base_model_tp_plan`: Llama, Qwen2, Mistral, ...); the ranks divided by it hold data-parallel "
        "replicas (sharded with fsdp2). Full fine-tuning by SFT and DPO; 1 = no tensor parallelism.",
    )
    hostfile: str | None = runtime_field(None, description="Hostfile for multi-node runs (same format as pretraining).")
    num_nodes: int = runtime_field(1, description="Nodes.", ge=1)
    node_launcher: Literal["pdsh", "slurm", "openmpi"] = runtime_field(
        "pdsh", description="How DeepSpeed starts the ranks of other nodes (as pretrain.distributed.node_launcher)."
    )
    master_port: int | None = runtime_field(None, description="Rendezvous port; a free one is picked when unset.")


class AlignFaultConfig(StrictModel):
    """Test hooks that make failures reproducible (`debug.align:`; never in a normal run's key)."""

    corrupt_merge: bool = Field(False, description="Damage the merged LoRA model before its parity check.")


class AlignConfigBase(StrictModel):
    """`align:` without the methods' sections (`AlignConfig` adds one per registered method)."""

    enabled: bool = runtime_field(True, description="Run this stage in `lmforge run`.")
    method: Literal["full", "lora", "qlora"] = Field(
        "full",
        description="SFT by full fine-tuning, a LoRA adapter, or QLoRA (LoRA on the model loaded in 4-bit NF4 "
        "with double quantization through bitsandbytes); adapters are merged into a 16-bit copy for export.",
    )
    heldout_fraction: float = Field(
        0.1, gt=0, lt=1, description="Share of records held out (by id hash) for evaluation."
    )
    builtin: BuiltinDataConfig = BuiltinDataConfig()
    lora: LoraConfig = LoraConfig()
    # which steps run (like `stages`); what a step starts from reaches its key through its upstream
    recipe: list[str] = runtime_field(
        default_factory=lambda: [m.name for m in methods().values() if m.in_default_recipe],
        description="The alignment steps in order: [sft, dpo] (default), [sft, rl], [sft, dpo, rl], "
        "[sft, reward, rl], [sft, reward], ... The last model (dpo or rl) is what evaluation compares "
        "and quantization and serving take.",
    )
    distributed: AlignDistributedConfig = AlignDistributedConfig()
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto = bf16 where the hardware has it, else fp32."
    )
    eval_generations: int = runtime_field(
        120, description="Held-out verifiable items generated from during training to track exact match.", ge=0
    )

    @model_validator(mode="after")
    def _recipe_in_order(self) -> AlignConfigBase:
        r, order = self.recipe, recipe_order()
        unknown = [m for m in r if m not in order]
        if unknown:
            raise ValueError(f"recipe {r}: no alignment method {unknown[0]!r} (registered: {', '.join(order)})")
        if not r or r[0] != order[0] or len(set(r)) != len(r) or r != sorted(r, key=order.index):
            raise ValueError(
                f"recipe {r}: steps run in the order {', '.join(order)}; {order[0]} first, each at most once "
                "(e.g. [sft, dpo], [sft, rl], [sft, dpo, rl], [sft, reward, rl])"
            )
        for m in methods().values():
            m.check(self)
        return self

    @model_validator(mode="after")
    def _multinode_needs_hostfile(self) -> AlignConfigBase:
        d = self.distributed
        if d.num_nodes > 1 and not d.hostfile:
            raise ValueError("align.distributed.num_nodes > 1 needs a hostfile naming the nodes")
        chosen = engine(d.backend)
        if d.zero_stage and "zero_stage" not in chosen.own_fields:
            raise ValueError(
                f"align.distributed.zero_stage is {next(e.title for e in all_engines() if 'zero_stage' in e.own_fields)}'s; "
                f"with backend: {d.backend} leave it at 0"
            )
        if self.method == "qlora" and chosen.align_stage(d.zero_stage) == 3:
            raise ValueError("align.method: qlora keeps the 4-bit base whole on every rank; use zero_stage 0-2 (DDP)")
        if (d.hostfile or d.num_nodes > 1) and d.launcher != "deepspeed":
            raise ValueError("multi-node alignment (hostfile, num_nodes) needs align.distributed.launcher: deepspeed")
        tp = d.tensor_parallel
        if tp > 1:
            from training.parallel.dims.tensor import align_problem

            problem = align_problem(self, [m for m in methods().values() if m.runs(self)])
            if problem:
                raise ValueError(problem)
        for name in (m.name for m in methods().values() if m.runs(self)):
            cfg = getattr(self, name)
            if d.num_ranks != "auto" and cfg.global_batch_size % (
                cfg.micro_batch_size * (int(d.num_ranks) // tp) * d.num_nodes
            ):
                replicas = "ranks / tensor_parallel" if tp > 1 else "ranks"
                raise ValueError(
                    f"{name}.global_batch_size {cfg.global_batch_size} is not a multiple of micro_batch_size "
                    f"x {replicas} x nodes = {cfg.micro_batch_size} x {int(d.num_ranks) // tp} x {d.num_nodes}"
                )
        return self


def _with_sections() -> type[AlignConfigBase]:
    """`align:` with one section per registered method (`align.<name>`, the method's `config` model)."""
    from pydantic import create_model

    sections: dict[str, Any] = {
        m.name: (m.config, Field(default_factory=m.config, description=f"`align/{m.name}`: {m.description}."))
        for m in methods().values()
    }
    return create_model("AlignConfig", __base__=AlignConfigBase, __module__=__name__, **sections)


AlignConfig = _with_sections()
