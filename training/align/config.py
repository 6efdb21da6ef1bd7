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
    merge_parity_tolerance: float = runtime_field(
        1e-3, description="Max |logit difference| between the merged model and the PEFT model.", gt=0
    )


class TrainConfig(StrictModel):
    """The optimizer and schedule shared by SFT and DPO (each has its own copy)."""

    lr: float = Field(2e-4, gt=0)
    max_steps: int = Field(300, ge=1)
    global_batch_size: int = Field(16, ge=1, description="Sequences (or pairs) per optimizer step, over all ranks.")
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    max_seq_len: int | None = Field(
        None, ge=8, description="Truncate sequences to this many tokens (default: the model's context)."
    )
    seed: int = 1234
    save_steps: int = Field(50, ge=1, description="Checkpoint interval; a retry resumes from the latest one.")
    micro_batch_size: int = runtime_field(8, description="Sequences per rank per forward pass.", ge=1)
    eval_every: int = runtime_field(50, description="Held-out evaluation interval in steps.", ge=1)
    log_every: int = runtime_field(10, description="Progress-log interval in steps.", ge=1)


class SftConfig(TrainConfig):
    inputs: list[str] = Field(
        default_factory=list, description="Chat JSONL (OpenAI `messages`, or `prompt`/`completion`); empty: built in."
    )
    packing: bool = Field(True, description="Pack short conversations into full sequences (TRL's best-fit packing).")
    assistant_only_loss: bool = Field(
        True, description="Loss on assistant tokens only (TRL, via {% generation %} markers)."
    )


class DpoConfig(TrainConfig):
    enabled: bool = runtime_field(True, description="Run DPO after SFT in `lmforge run`.")
    inputs: list[str] = Field(
        default_factory=list, description="Preference JSONL (`prompt`, `chosen`, `rejected`); empty: built in."
    )
    beta: float = Field(0.1, gt=0, description="DPO's KL strength (0.1 in the seeds).")
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field("sigmoid", description="TRL's DPO loss.")
    sft_weight: float = Field(
        0.0,
        ge=0,
        description=(
            "Weight of an NLL term on the chosen answer added to the DPO loss (TRL loss_type [.., 'sft'], "
            "as in RPO/MPO); keeps the policy generating the chosen answers, not only ranking them. 0 = plain DPO."
        ),
    )
    lora: bool = Field(False, description="Train DPO as a LoRA adapter on the SFT model (reference = adapter off).")
    lr: float = Field(5e-7, gt=0, description="5e-7 for real models (the seeds); the tiny preset sets its own.")
    max_steps: int = Field(150, ge=1)


class RewardModelConfig(TrainConfig):
    """`align/reward`: a Bradley-Terry reward model (TRL's RewardTrainer) on the lineage's preference data."""

    init: Literal["sft", "base"] = Field(
        "sft", description="Start from the SFT model (the usual choice) or from the model SFT started from."
    )
    lora: bool = Field(False, description="Train a LoRA adapter (merged for export) instead of every weight.")
    center_rewards_coefficient: float | None = Field(
        None, ge=0, description="TRL's term that keeps rewards centred on 0 (0.01 in its docs); None: off."
    )
    lr: float = Field(1e-5, gt=0, description="1e-5 for real models; the tiny preset sets its own.")
    max_steps: int = Field(150, ge=1)


class DraftConfig(TrainConfig):
    """`align/draft`: a draft model for speculative decoding, distilled from the last model of the recipe
    (TRL's GKDTrainer on the SFT conversations; see training/align/methods/draft.py)."""

    enabled: bool = runtime_field(
        False, description="Distil a draft model (serve.speculative.draft_model: distilled serves with it)."
    )
    layers: int | None = Field(
        None,
        ge=1,
        description="Decoder layers of the student (copied, evenly spaced, from the teacher's); "
        "None: a quarter of the teacher's, at least 1.",
    )
    beta: float = Field(
        0.0, ge=0, le=1, description="GKD's generalized JSD: 0 = forward KL to the teacher, 1 = reverse."
    )
    temperature: float = Field(1.0, gt=0, description="Softmax temperature of both distributions in the loss.")
    heldout_chats: int = runtime_field(
        200, ge=1, description="Held-out conversations the summary's top-1 agreement is measured on."
    )
    lr: float = Field(1e-3, gt=0)
    max_steps: int = Field(200, ge=1)


class RewardFunction(StrictModel):
    """One term of RL's reward: the built-in verifier, the trained reward model, or a function of the user's."""

    kind: Literal["verifier", "partial_verifier", "reward_model", "function"] = Field(
        description="verifier: 1 when the completion is exactly the verified answer (lmforge.verify, the check "
        "evaluation's exact match uses), else 0; partial_verifier: 1 when exact, else a share below 0.5 of its "
        "character similarity to the answer; reward_model: the score of align/reward's model; function: "
        "`function` below."
    )
    weight: float = Field(1.0, description="Weight of this term in the sum (TRL's reward_weights).")
    function: str | None = Field(
        None,
        description="`module:function` taking (prompts, completions, **columns) and returning one float per "
        "completion, as TRL's reward functions do (only for kind: function).",
    )

    @model_validator(mode="after")
    def _function_named(self) -> RewardFunction:
        if (self.kind == "function") != (self.function is not None):
            raise ValueError("function: give module:function exactly when kind is function")
        if self.function is not None and ":" not in self.function:
            raise ValueError(f"function: {self.function!r} is not module:function")
        return self


class PromptFilterConfig(StrictModel):
    """Which training prompts RL keeps: those the starting model answers right sometimes, not never or always.

    A group of completions that all earn the same reward has no advantage and no gradient (GRPO and
    RLOO); DAPO's dynamic sampling drops such groups. Here every candidate prompt is sampled `samples`
    times once, before training, at the rollout temperature, and scored by the verifier."""

    samples: int = Field(
        0,
        ge=0,
        description="Completions per prompt the starting model samples to estimate its pass rate; 0 = keep all.",
    )
    min_pass_rate: float = Field(
        0.0, ge=0, lt=1, description="Keep prompts answered right in more than this share of the samples."
    )
    max_pass_rate: float = Field(
        1.0, gt=0, le=1, description="Keep prompts answered right in less than this share of the samples."
    )
    pool: int | None = Field(
        None, ge=1, description="Score a seeded sample of this many training prompts (None: all of them)."
    )

    @model_validator(mode="after")
    def _range(self) -> PromptFilterConfig:
        if self.min_pass_rate >= self.max_pass_rate:
            raise ValueError(f"min_pass_rate {self.min_pass_rate} is not below max_pass_rate {self.max_pass_rate}")
        return self


class HackingWatchConfig(StrictModel):
    """Reward hacking: the reward model's score rising while what it should stand for gets worse."""

    min_reward_gain: float = runtime_field(
        0.05,
        description="Rise of the held-out proxy reward (reward-model score, or the configured reward) over the "
        "start that counts as rising (smaller moves are noise).",
        ge=0,
    )
    max_accuracy_drop: float = runtime_field(
        0.02, description="Fall of held-out verified accuracy (absolute) beyond which the watch fires.", ge=0
    )
    max_loss_rise: float = runtime_field(
        0.05, description="Relative rise of the held-out SFT loss beyond which the watch fires.", ge=0
    )


class RlConfig(TrainConfig):
    """`align/rl`: online RL with TRL's GRPOTrainer (or RLOOTrainer) from the SFT or DPO model."""

    algorithm: Literal["grpo", "rloo"] = Field("grpo", description="TRL's GRPOTrainer or RLOOTrainer.")
    rewards: list[RewardFunction] = Field(
        default_factory=lambda: [RewardFunction(kind="verifier")],
        min_length=1,
        description="Reward terms, summed with their weights.",
    )
    prompts: Literal["verifiable", "all"] = Field(
        "verifiable",
        description="Training prompts: the SFT train split's items with a verified answer, or every SFT prompt "
        "(the turns before the last assistant turn).",
    )
    prompt_filter: PromptFilterConfig = PromptFilterConfig()
    beta: float = Field(0.04, ge=0, description="KL strength to the reference (the starting model); 0 = no KL term.")
    num_generations: int = Field(8, ge=2, description="Completions per prompt (the group).")
    max_completion_length: int = Field(32, ge=1, description="Tokens generated per completion.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollouts.")
    epsilon: float = Field(0.2, gt=0, description="PPO-style clipping of the probability ratio.")
    num_iterations: int = Field(1, ge=1, description="Optimisation passes per batch of rollouts (mu).")
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] = Field("dapo", description="TRL's GRPO loss normalisation.")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Divide advantages by the group's (or batch's) reward std; none as in Dr. GRPO."
    )
    lora: bool = Field(
        False,
        description=(
            "Train a LoRA adapter (align.lora's rank, alpha, targets) on the starting policy, merged for export "
            "with a parity check; the KL reference is the adapter switched off (no second model in memory)."
        ),
    )
    lr: float = Field(1e-6, gt=0, description="1e-6 for real models; the tiny preset sets its own.")
    max_steps: int = Field(200, ge=1)
    global_batch_size: int = Field(
        64, ge=1, description="Completions per optimizer step over all ranks (prompts x num_generations)."
    )
    use_vllm: bool = runtime_field(
        False,
        description="Generate with TRL's vLLM integration (colocate mode, GPUs only); on CPU the Trainer generates.",
    )
    hacking: HackingWatchConfig = HackingWatchConfig()
    stop_on_hacking: bool = runtime_field(
        False, description="Fail the step (not retried) when the reward-hacking watch fires, instead of warning."
    )
    heldout_prompts: int = runtime_field(
        64, description="Held-out prompts the watch scores at every eval_every (reward model, verifier, KL).", ge=1
    )

    @model_validator(mode="after")
    def _groups(self) -> RlConfig:
        if self.global_batch_size % self.num_generations:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is not a multiple of num_generations "
                f"{self.num_generations} (each prompt's group of completions)"
            )
        if self.prompt_filter.samples and self.prompts != "verifiable":
            raise ValueError("prompt_filter: pass rates need verified answers (prompts: verifiable)")
        return self


DEFAULT_RECIPE: list[str] = ["sft", "dpo"]


def recipe_order() -> list[str]:
    """The methods a recipe may name, in the order they run: the registry's (`training.align.methods`)."""
    from training.align.methods import methods

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
    backend: Literal["deepspeed", "fsdp2"] = runtime_field(
        "deepspeed",
        description="deepspeed: DDP or ZeRO (zero_stage) through accelerate; fsdp2: accelerate's FSDP plugin, "
        "version 2, full shard per decoder layer.",
    )
    zero_stage: Literal[0, 2, 3] = runtime_field(
        0, description="DeepSpeed ZeRO stage through accelerate (0: plain DDP)."
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


class AlignConfig(StrictModel):
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
        default_factory=lambda: list(DEFAULT_RECIPE),
        description="The alignment steps in order: [sft, dpo] (default), [sft, rl], [sft, dpo, rl], "
        "[sft, reward, rl], [sft, reward], ... The last model (dpo or rl) is what evaluation compares "
        "and quantization and serving take.",
    )
    sft: SftConfig = SftConfig()
    dpo: DpoConfig = DpoConfig()
    reward: RewardModelConfig = RewardModelConfig()
    rl: RlConfig = RlConfig()
    draft: DraftConfig = DraftConfig()
    distributed: AlignDistributedConfig = AlignDistributedConfig()
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto = bf16 where the hardware has it, else fp32."
    )
    eval_generations: int = runtime_field(
        120, description="Held-out verifiable items generated from during training to track exact match.", ge=0
    )

    @model_validator(mode="after")
    def _recipe_in_order(self) -> AlignConfig:
        r, order = self.recipe, recipe_order()
        unknown = [m for m in r if m not in order]
        if unknown:
            raise ValueError(f"recipe {r}: no alignment method {unknown[0]!r} (registered: {', '.join(order)})")
        if not r or r[0] != "sft" or len(set(r)) != len(r) or r != sorted(r, key=order.index):
            raise ValueError(
                f"recipe {r}: steps run in the order {', '.join(order)}; sft first, each at most once "
                "(e.g. [sft, dpo], [sft, rl], [sft, dpo, rl], [sft, reward, rl])"
            )
        if "rl" in r and any(f.kind == "reward_model" for f in self.rl.rewards) and "reward" not in r:
            raise ValueError("rl.rewards uses the reward model: add reward to align.recipe before rl")
        return self

    @model_validator(mode="after")
    def _multinode_needs_hostfile(self) -> AlignConfig:
        d = self.distributed
        if d.num_nodes > 1 and not d.hostfile:
            raise ValueError("align.distributed.num_nodes > 1 needs a hostfile naming the nodes")
        if self.method == "qlora" and (d.zero_stage == 3 or d.backend == "fsdp2"):
            raise ValueError("align.method: qlora keeps the 4-bit base whole on every rank; use zero_stage 0-2 (DDP)")
        if d.backend == "fsdp2" and d.zero_stage:
            raise ValueError("align.distributed.zero_stage is DeepSpeed's; with backend: fsdp2 leave it at 0")
        if (d.hostfile or d.num_nodes > 1) and d.launcher != "deepspeed":
            raise ValueError("multi-node alignment (hostfile, num_nodes) needs align.distributed.launcher: deepspeed")
        trained = ("sft", "dpo", *(k for k in ("reward", "rl") if k in self.recipe))
        for name in (*trained, *(("draft",) if self.draft.enabled else ())):
            cfg = getattr(self, name)
            if d.num_ranks != "auto" and cfg.global_batch_size % (
                cfg.micro_batch_size * int(d.num_ranks) * d.num_nodes
            ):
                raise ValueError(
                    f"{name}.global_batch_size {cfg.global_batch_size} is not a multiple of micro_batch_size "
                    f"x ranks x nodes = {cfg.micro_batch_size} x {d.num_ranks} x {d.num_nodes}"
                )
        return self
