"""Typed configuration of the pretraining stage (`pretrain:` in a preset).

What the model learns from (architecture, data order, optimizer, schedule, global batch,
steps, precision, guardrails) is cache identity. How the work is spread (ranks, ZeRO
stage, offload, micro-batch, activation checkpointing) is not: the same global batch gives
the same model up to floating-point reduction order, so those are runtime fields.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from lmforge.configbase import StrictModel, runtime_field
from training.parallel import ENGINE_NAMES

# the engines are the modules of training/parallel/engines (adding one adds a choice here)
EngineName = Literal[ENGINE_NAMES]  # type: ignore[valid-type]
Backend = Literal[("auto", *ENGINE_NAMES)]  # type: ignore[valid-type]


class ExpertsConfig(StrictModel):
    """Mixture of experts in every decoder layer (0 experts: a dense model). Exported as Mixtral
    (`MixtralForCausalLM`: lmforge's Llama attention, its SwiGLU MLP replaced by routed experts) or,
    with a shared expert, as Qwen2-MoE (`Qwen2MoeForCausalLM`, the only one of the two with a shared
    expert): architectures transformers, vLLM and llama.cpp all load."""

    num: int = Field(0, ge=0, description="Routed experts per layer; 0 = a dense model.")
    top_k: int = Field(2, ge=1, description="Experts each token is routed to.")
    intermediate_size: int | None = Field(
        None, ge=8, description="Each expert's SwiGLU width (default: the model's intermediate_size)."
    )
    shared_expert: bool = Field(
        False, description="Add an always-on expert beside the routed ones (exported as Qwen2-MoE)."
    )
    router_aux_loss_coef: float = Field(
        0.01, ge=0, description="Weight of the load-balancing loss (Switch Transformer's) added to the LM loss."
    )

    @property
    def enabled(self) -> bool:
        return self.num > 0


class ModelConfig(StrictModel):
    """A Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU), optionally with experts."""

    hidden_size: int = Field(256, ge=8)
    intermediate_size: int = Field(
        768,
        ge=8,
        description="SwiGLU width (about 8/3 of hidden_size, rounded up; vLLM's CPU 4-bit kernel needs a multiple of 32).",
    )
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1, description="Key/value heads for grouped-query attention.")
    rope_theta: float = Field(10_000.0, gt=0)
    tie_embeddings: bool = Field(True, description="Share input and output embeddings.")
    init_std: float = Field(0.02, gt=0)
    experts: ExpertsConfig = ExpertsConfig()

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.experts.enabled and self.experts.top_k > self.experts.num:
            raise ValueError(f"experts.top_k {self.experts.top_k} exceeds experts.num {self.experts.num}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        return self


class RopeScalingConfig(StrictModel):
    """How rotary positions stretch when continued pretraining runs at a longer `seq_len` than the
    model was trained at (context extension). The frequencies are transformers' own; see lmforge/rope.py."""

    type: Literal["auto", "none", "linear", "dynamic", "yarn", "llama3"] = Field(
        "auto",
        description="auto = yarn when seq_len exceeds the model's trained context, else nothing; none = train at "
        "the longer length with the positions unscaled (the baseline an extension is measured against).",
    )
    factor: float | None = Field(
        None, ge=1, description="Context multiple; default: seq_len / the trained context (recorded as original)."
    )
    beta_fast: float = Field(32.0, gt=0, description="YaRN: rotations above which a dimension is not interpolated.")
    beta_slow: float = Field(1.0, gt=0, description="YaRN: rotations below which a dimension is fully interpolated.")
    low_freq_factor: float = Field(1.0, gt=0, description="llama3: the low-frequency wavelength divisor.")
    high_freq_factor: float = Field(4.0, gt=0, description="llama3: the high-frequency wavelength divisor.")

    @model_validator(mode="after")
    def _bands(self) -> RopeScalingConfig:
        if self.beta_fast <= self.beta_slow:
            raise ValueError(f"beta_fast {self.beta_fast} must exceed beta_slow {self.beta_slow}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor {self.high_freq_factor} must exceed low_freq_factor {self.low_freq_factor}"
            )
        return self


class OptimConfig(StrictModel):
    """AdamW with linear warmup and cosine decay to `min_lr_ratio * lr`."""

    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0, description="Global gradient-norm clipping; 0 disables.")


class GuardrailConfig(StrictModel):
    """Loss-spike and NaN handling: roll back to the last good checkpoint and skip the batch."""

    enabled: bool = True
    spike_mode: Literal["ratio", "zscore"] = Field("zscore", description="How a spike is recognised.")
    spike_ratio: float = Field(2.0, gt=1, description="ratio mode: loss above this multiple of the window mean.")
    spike_zscore: float = Field(
        6.0, gt=0, description="zscore mode: loss this many standard deviations above the window mean."
    )
    window: int = Field(20, ge=2, description="Recent steps the spike statistics are taken over.")
    min_history: int = Field(10, ge=2, description="Steps of history needed before spikes are judged.")
    lr_scale_on_spike: float = Field(
        1.0, gt=0, le=1, description="Multiply the learning rate by this after each rollback."
    )
    max_consecutive_spikes: int = Field(
        3,
        ge=1,
        description="Stop (non-retryable) at this many anomalies in a row (each within `window` steps of the previous one).",
    )
    router_collapse_share: float = Field(
        0.01,
        ge=0,
        lt=1,
        description="Mixture of experts: an expert under this share of its layer's tokens for "
        "`router_collapse_steps` steps in a row is a finding (a collapsed router) in the anomaly report.",
    )
    router_collapse_steps: int = Field(20, ge=1, description="See `router_collapse_share`.")

    @model_validator(mode="after")
    def _history_fits_window(self) -> GuardrailConfig:
        if self.min_history > self.window:
            raise ValueError(
                f"min_history {self.min_history} exceeds window {self.window}: spikes would never be judged"
            )
        return self


class CheckpointConfig(StrictModel):
    every_steps: int = Field(50, ge=1, description="Checkpoint interval; also where spike rollbacks return to.")
    keep_last: int = runtime_field(3, description="Verified checkpoints kept; older ones are deleted.", ge=1)


class DistributedConfig(StrictModel):
    """How training is spread over processes; none of this changes the cache key."""

    launcher: Literal["auto", "deepspeed", "torchrun"] = runtime_field(
        "auto",
        description="Process launcher: auto = torchrun on one node (one light process that starts the ranks), "
        "DeepSpeed's runner with a hostfile or several nodes; deepspeed forces DeepSpeed's runner (and its "
        "launch.py) on one node too.",
    )
    num_ranks: Annotated[int, Field(ge=1)] | Literal["auto"] = runtime_field(
        "auto", description="Ranks per node; auto = all GPUs, or 2 on CPU."
    )
    hostfile: str | None = runtime_field(None, description="DeepSpeed hostfile for multi-node runs.")
    num_nodes: int = runtime_field(1, description="Nodes to use from the hostfile.", ge=1)
    node_launcher: Literal["pdsh", "slurm", "openmpi"] = runtime_field(
        "pdsh",
        description="How DeepSpeed starts the ranks of other nodes: pdsh (passwordless SSH), slurm (srun inside "
        "a SLURM job; `lmforge slurm` sets it) or openmpi.",
    )
    master_port: int | None = runtime_field(None, description="Rendezvous port; a free one is picked when unset.")
    backend: Backend = runtime_field(  # type: ignore[valid-type]
        "auto",
        description="Training engine (a module of training/parallel/engines): DeepSpeed ZeRO or PyTorch FSDP2; "
        "auto asks the planner.",
    )
    prefer_backend: Backend = runtime_field(  # type: ignore[valid-type]
        "auto",
        description="The planner's choice when two engines fit with the same traffic; auto = fsdp2 for a "
        "mixture of experts (measured faster: docs/benchmarks.md), deepspeed otherwise.",
    )
    pipeline_parallel: Annotated[int, Field(ge=1)] | Literal["auto"] = runtime_field(
        1,
        description="Pipeline stages (consecutive layers per rank group, micro-batches flowing through them; "
        "across nodes). auto = the planner's choice among degrees that divide the nodes (a stage is whole "
        "nodes; 1 on one node). With FSDP2 and untied embeddings; composes with tensor_parallel.",
    )
    pipeline_schedule: Literal["gpipe", "1f1b"] = runtime_field(
        "1f1b",
        description="Pipeline schedule: gpipe (every forward, then every backward) or 1f1b (one forward, one "
        "backward: at most `pipeline_parallel` micro-batches of activations held).",
    )
    tensor_parallel: Annotated[int, Field(ge=1)] | Literal["auto"] = runtime_field(
        1,
        description="Tensor + sequence parallel degree (ranks that split every layer's weights and the sequence "
        "between them; inside one node). auto = the planner's choice: 1 unless the model only fits split. "
        "With FSDP2; the ranks of a node must be a multiple of it.",
    )
    zero_stage: Literal["auto", 0, 1, 2, 3] = runtime_field(
        "auto", description="DeepSpeed ZeRO stage; auto asks the planner."
    )
    sharding: Literal["auto", "full", "grad_op", "hybrid"] = runtime_field(
        "auto",
        description="FSDP2 sharding: full (ZeRO-3-like), grad_op (weights kept gathered through backward), "
        "hybrid (sharded within a node, replicated across nodes); auto asks the planner.",
    )
    offload: Literal["auto", "none", "optimizer", "optimizer+params"] = runtime_field(
        "auto", description="CPU offload; auto asks the planner."
    )
    micro_batch_size: int = runtime_field(8, description="Sequences per rank per forward pass.", ge=1)
    activation_checkpointing: bool = runtime_field(
        False, description="Recompute activations in backward to save memory."
    )
    memory_headroom: float = runtime_field(
        0.2, description="Fraction of device memory the planner leaves free.", ge=0, lt=1
    )

    @model_validator(mode="after")
    def _multinode_needs_deepspeed(self) -> DistributedConfig:
        if self.launcher == "torchrun" and (self.hostfile or self.num_nodes > 1):
            raise ValueError(
                "multi-node runs (hostfile, num_nodes) need launcher: deepspeed; "
                "torchrun here starts the ranks of one node"
            )
        if self.num_nodes > 1 and not self.hostfile:
            raise ValueError("num_nodes > 1 needs a hostfile naming the nodes")
        from training.parallel import all_dimensions, all_engines, engine

        if self.backend != "auto":
            chosen = engine(self.backend)
            for other in all_engines():
                for name in other.own_fields:
                    if other is not chosen and getattr(self, name) != "auto":
                        raise ValueError(
                            f"{name} is {other.title}'s; with backend: {chosen.name} set "
                            f"{' or '.join(chosen.own_fields)} instead"
                        )
            for dim in all_dimensions():
                degree = getattr(self, dim.field)
                if not chosen.mesh_dimensions and degree != "auto" and degree > 1:
                    raise ValueError(
                        f"{dim.field} {degree} needs an engine that trains on a device mesh "
                        f"({', '.join(e.name for e in all_engines() if e.mesh_dimensions)}); {chosen.title} does not"
                    )
        for e in all_engines():
            problem = e.config_problem(self)
            if problem:
                raise ValueError(problem)
        return self


class FaultInjectionConfig(StrictModel):
    """Test hooks that make failures reproducible (`debug.pretrain:`; never in a normal run's key)."""

    nan_at_batches: list[int] = Field(
        default_factory=list, description="Global micro-batch indices whose loss is made NaN."
    )
    nan_grad_at_batches: list[int] = Field(
        default_factory=list,
        description="Global micro-batch indices whose gradients (not loss) are made NaN, as a broken "
        "attention kernel does.",
    )
    step_delay_s: float = Field(
        0.0, ge=0, description="Seconds each rank sleeps after every step: a tiny run as slow as a real one."
    )


class PretrainConfig(StrictModel):
    enabled: bool = runtime_field(True, description="Run this stage in `lmforge run`.")
    # not itself identity: it decides whether the base model is an input, and the base's content is
    init: Literal["auto", "scratch", "base"] = runtime_field(
        "auto",
        description="Where training starts: base = the weights of base_model (continued pretraining; "
        "`model` is then the base's architecture, not read), scratch = a new model from `model`; "
        "auto = base when base_model.path is set.",
    )
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    seq_len: int = Field(256, ge=8, description="Training sequence length in tokens.")
    rope_scaling: RopeScalingConfig = RopeScalingConfig()
    document_mask: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Attention within each packed document only: a window's position ids restart at every "
        "document start, which transformers turns into a block-diagonal causal mask (sdpa, eager, flex; "
        "flash-attention's varlen path), so no token attends to the document before it and each document sees "
        "the positions it would see alone. auto = on for a context extension (the long documents are learned "
        "as themselves), off otherwise; refused with pipeline or tensor parallelism. It changes the numerics, "
        "so it is in the cache key.",
    )
    global_batch_size: int = Field(
        16, ge=1, description="Sequences per optimizer step, over all ranks and accumulation."
    )
    max_steps: int = Field(300, ge=1)
    seed: int = 1234
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto = bf16 where the hardware has it (recent GPUs; CPUs with AVX512-BF16/AMX), else fp32."
    )
    float8: Literal["off", "auto", "on", "emulate"] = Field(
        "off",
        description="Float8 training of the decoder's attention and MLP projections (torchao; lm_head and embeddings "
        "stay in `precision`): on = required, refused where the GPU is not a CUDA GPU of compute capability 8.9+ "
        "(Ada, Hopper); auto = on where the GPU has it, off elsewhere; emulate = torchao's emulation on any "
        "device (slow; for checking the numerics on CPU). It changes the numerics, so it is in the cache key.",
    )
    checkpoint: CheckpointConfig = CheckpointConfig()
    guardrails: GuardrailConfig = GuardrailConfig()
    distributed: DistributedConfig = DistributedConfig()
    eval_every: int = runtime_field(50, description="Validation interval in steps.", ge=1)
    eval_batches: int = runtime_field(8, description="Validation micro-batches per evaluation.", ge=1)
    log_every: int = runtime_field(10, description="Progress-log interval in steps.", ge=1)
    resume: Literal["auto", "never"] = runtime_field(
        "auto", description="auto resumes from the latest verified checkpoint; never wipes the output and restarts."
    )
    compile: bool = runtime_field(
        False,
        description="torch.compile each decoder layer (inductor); the first step's compile time is reported apart.",
    )
    peak_tflops: float | None = runtime_field(
        None, description="Device peak for MFU; measured with a matmul when unset."
    )
    parity_tolerance: float = runtime_field(
        1e-3, description="Max |logit difference| allowed between engine and export.", gt=0
    )
    assumed_mfu: float = runtime_field(0.4, description="MFU the planner assumes for its time estimate.", gt=0, le=1)

    @field_validator("float8", "document_mask", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        """YAML 1.1 reads a bare `on` / `off` (a preset's `float8: on`, `--set pretrain.float8=off`) as a boolean."""
        return {True: "on", False: "off"}[value] if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _batch_splits_evenly(self) -> PretrainConfig:
        """Checked here when the rank count is fixed (the planner checks `auto` once it knows the devices)."""
        d = self.distributed
        from training.parallel import all_dimensions

        degrees = {dim.field: getattr(d, dim.field) for dim in all_dimensions()}
        if d.num_ranks != "auto" and "auto" not in degrees.values():
            split = {k: int(v) for k, v in degrees.items() if int(v) > 1}  # model-parallel ranks read one batch
            per_step = d.micro_batch_size * int(d.num_ranks) * d.num_nodes // math.prod(split.values())
            if self.global_batch_size % per_step:
                raise ValueError(
                    f"global_batch_size {self.global_batch_size} is not a multiple of micro_batch_size x "
                    f"ranks x nodes{''.join(f' / {k}' for k in split)} = {d.micro_batch_size} x "
                    f"{d.num_ranks} x {d.num_nodes}{''.join(f' / {v}' for v in split.values())}"
                )
        return self
