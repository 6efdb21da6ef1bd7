"""`align/rl`: online RL with TRL's `GRPOTrainer` (or `RLOOTrainer`) from the SFT or DPO model with
the rewards of `align.rl.rewards`: the verifier (`lmforge.text.verify`, the check evaluation's exact
match uses), the reward model (`training.align.methods.reward`), a user's `module:function`,
summed with their weights.

What TRL does not do, and this module adds (each measured, each small):

- position ids from the attention mask: TRL scores left-padded prompt+completion batches
  without `position_ids`, so a model with rotary positions would be trained on positions
  shifted by the padding it never saw during generation (`left_padding_positions`);
- the reward-hacking watch (`HackingWatch`): at every `eval_every` it scores held-out prompts
  (never trained on) greedily with the proxy reward (the reward model, or the configured reward
  when there is none), the verifier and the held-out SFT loss, and the per-prompt KL to the
  reference (its distribution, not only TRL's mean); when the proxy rises while verified
  accuracy or SFT loss gets worse beyond the configured margins it warns once, and with
  `stop_on_hacking` fails the step as not retryable.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from lmforge.configbase import StrictModel, runtime_field
from lmforge.engine.stage import Product
from lmforge.errors import ConfigError, DeterministicError
from lmforge.jsonl import read_jsonl
from lmforge.text.verify import is_correct, partial_credit
from training.align.methods import CHAT, PREFERENCE, AlignMethod
from training.align.methods.dpo import DPO
from training.align.methods.reward import Reward, load_reward_model, score
from training.align.methods.sft import SFT_MODEL
from training.align.sections import TrainConfig

log = logging.getLogger("training.align")
DPO_MODEL, REWARD_MODEL = DPO.product, Reward.product


class RewardFunction(StrictModel):
    """One term of RL's reward: the built-in verifier, the trained reward model, or a function of the user's."""

    kind: Literal["verifier", "partial_verifier", "reward_model", "function"] = Field(
        description="verifier: 1 when the completion is exactly the verified answer (lmforge.text.verify, the check "
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


class RewardHacking(DeterministicError):
    """The learned (or configured) reward rose while what it stands for got worse; not retried."""


# -- rewards ------------------------------------------------------------------------------------------


def _text(completion: Any) -> str:
    """A completion as TRL hands it to a reward function: a string, or a list with one assistant message."""
    if isinstance(completion, list):
        return "".join(m.get("content", "") for m in completion)
    return str(completion)


def verifier_reward(completions: list[Any], answer: list[str | None], **_: Any) -> list[float | None]:
    """1.0 when the completion is exactly the verified answer (lmforge.text.verify), else 0.0; None
    (no opinion, TRL skips it in the sum) for a prompt without a verified answer."""
    return [None if a is None else float(is_correct(_text(c), a)) for c, a in zip(completions, answer)]


def partial_verifier_reward(completions: list[Any], answer: list[str | None], **_: Any) -> list[float | None]:
    """1.0 when exact, else a share below 0.5 of the answer's character similarity."""
    return [None if a is None else partial_credit(_text(c), a) for c, a in zip(completions, answer)]


def import_function(path: str) -> Any:
    """`module:function`, imported; one line naming the field when it cannot be."""
    module, _, name = path.partition(":")
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"align.rl.rewards: cannot import {path} ({type(exc).__name__}: {exc})") from exc
    if not callable(function):
        raise ConfigError(f"align.rl.rewards: {path} is not callable")
    return function


def reward_functions(rewards: list[dict[str, Any]], reward_model_dir: str | None) -> tuple[list[Any], list[float]]:
    """TRL reward functions and weights for `align.rl.rewards` (the reward model as its directory)."""
    functions: list[Any] = []
    for term in rewards:
        if term["kind"] == "verifier":
            functions.append(verifier_reward)
        elif term["kind"] == "partial_verifier":
            functions.append(partial_verifier_reward)
        elif term["kind"] == "reward_model":
            if reward_model_dir is None:
                raise ConfigError("align.rl.rewards: reward_model needs align/reward in align.recipe")
            functions.append(reward_model_dir)
        else:
            function = import_function(term["function"])
            functions.append(function)
    return functions, [float(t["weight"]) for t in rewards]


# -- the model ----------------------------------------------------------------------------------------


def left_padding_positions(model: Any) -> None:
    """Give every forward with a left-padded attention mask and no `position_ids` the positions the
    tokens had during generation (`generate` computes them so; TRL's scoring passes none)."""

    def hook(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        mask = kwargs.get("attention_mask")
        if mask is None or kwargs.get("position_ids") is not None or mask.dim() != 2 or bool(mask[:, 0].all()):
            return None
        kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)


def prompt_records(path: str, which: str) -> list[dict[str, Any]]:
    """RL prompts from the SFT train split: verifiable items (with their answer), or every chat."""
    from training.align.heldout import prompt_messages

    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if which == "verifiable":
        rows = [r for r in rows if "answer" in r]
    out = [
        {"prompt": prompt_messages(r), "answer": r.get("answer"), "task": r.get("task", "chat")}
        for r in rows
        if any(m["role"] == "assistant" for m in r["messages"])
    ]
    if not out:
        raise ConfigError(f"align.rl.prompts: {which}: the SFT train split has no such prompts")
    return out


def filter_prompts(
    spec: dict[str, Any], model: Any, tokenizer: Any, records: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The prompts RL trains on under `align.rl.prompt_filter` (all of them when it is off).

    DAPO's dynamic sampling, done once before training: a prompt the starting model answers right
    in all or none of its samples gives a group with one reward and so no advantage, only cost.
    TRL's trainers have no such option. Each rank samples its share of the prompts (accelerate's
    `split_between_processes`), the pass counts are gathered, and `prompt_filter.jsonl` in the step
    directory keeps every scored prompt with its count: a retried or resumed attempt reads it back
    instead of sampling again, so it trains on the same prompts."""
    import random

    cfg = spec["config"]["prompt_filter"]
    if not cfg["samples"]:
        return records
    path = Path(spec["out_dir"]) / "prompt_filter.jsonl"
    scored_before = path.exists()
    if not scored_before:
        _score_pass_rates(spec, model, tokenizer, records, path)
    rows = list(read_jsonl(path))
    kept = [{k: r[k] for k in ("prompt", "answer", "task")} for r in rows if r["kept"]]
    if scored_before:
        log.info("prompt filter: %d of %d prompts kept by an earlier attempt (%s)", len(kept), len(rows), path.name)
    if not kept:
        raise ConfigError(
            f"align.rl.prompt_filter: none of {len(rows)} prompts has a pass rate in "
            f"({cfg['min_pass_rate']}, {cfg['max_pass_rate']}) over {cfg['samples']} samples ({path})"
        )
    random.Random(spec["config"]["seed"]).shuffle(kept)
    return kept


def _score_pass_rates(
    spec: dict[str, Any], model: Any, tokenizer: Any, records: list[dict[str, Any]], path: Path
) -> None:
    import random
    import time

    import torch
    from accelerate import PartialState
    from accelerate.utils import gather_object

    from lmforge.jsonl import write_jsonl
    from training.align.heldout import sample_answers

    rl = spec["config"]
    cfg = rl["prompt_filter"]
    if cfg["pool"] and len(records) > cfg["pool"]:
        records = random.Random(rl["seed"]).sample(records, cfg["pool"])
    state = PartialState()
    started = time.time()
    torch.manual_seed(rl["seed"] + state.process_index)
    model.generation_config.max_length = None
    model.to(state.device)  # where the Trainer puts it next: sample on the rank's GPU, not the CPU it loaded on
    with state.split_between_processes(list(range(len(records)))) as mine:
        groups = sample_answers(
            model,
            tokenizer,
            [records[i] for i in mine],
            rl["max_completion_length"],
            batch_size=16,
            samples=cfg["samples"],
            temperature=rl["temperature"],
        )
        local = [(i, sum(is_correct(a, records[i]["answer"]) for a in g)) for i, g in zip(mine, groups)]
    passes = dict(gather_object(local))
    low, high, n = cfg["min_pass_rate"], cfg["max_pass_rate"], cfg["samples"]
    rows = [{**r, "passes": passes[i], "samples": n, "kept": low < passes[i] / n < high} for i, r in enumerate(records)]
    if state.is_main_process:
        write_jsonl(path, rows)
        never, always = sum(r["passes"] == 0 for r in rows), sum(r["passes"] == n for r in rows)
        log.info(
            "prompt filter: kept %d of %d prompts (%d never answered right, %d always, in %d samples each) in %.0fs",
            sum(r["kept"] for r in rows),
            len(rows),
            never,
            always,
            n,
            time.time() - started,
        )
    state.wait_for_everyone()


def one_epoch(records: list[dict[str, Any]], draws: int, seed: int) -> list[dict[str, Any]]:
    """The prompts, repeated in seeded shuffles until they cover every prompt the run draws.

    TRL's `RepeatSampler` takes each epoch's order from one generator that a resumed run starts
    afresh (it has no `set_epoch`), so a run over several epochs of its prompts resumed onto
    another order (measured: held-out reward-model score 0.4201 against 0.4194 uninterrupted,
    with 6 filtered prompts). In one epoch the Trainer's resume skips exactly the batches done."""
    import random

    if len(records) >= draws:
        return records
    rng, out = random.Random(seed), list[dict[str, Any]]()
    while len(out) < draws:
        shuffled = list(records)
        rng.shuffle(shuffled)
        out.extend(shuffled)
    return out


def filter_summary(out_dir: Path) -> dict[str, Any] | None:
    """What the prompt filter kept, for the step's summary (None when it was off)."""
    path = out_dir / "prompt_filter.jsonl"
    if not path.exists():
        return None
    rows = list(read_jsonl(path))
    kept = [r for r in rows if r["kept"]]
    by_task: dict[str, list[int]] = {}
    for r in rows:
        by_task.setdefault(r["task"], [0, 0])[0] += 1
        by_task[r["task"]][1] += r["kept"]
    return {
        "scored": len(rows),
        "kept": len(kept),
        "never_right": sum(r["passes"] == 0 for r in rows),
        "always_right": sum(r["passes"] == r["samples"] for r in rows),
        "mean_pass_rate_kept": round(sum(r["passes"] / r["samples"] for r in kept) / max(len(kept), 1), 4),
        "kept_by_task": {t: f"{k}/{n}" for t, (n, k) in sorted(by_task.items())},
    }


def rl_trainer(spec: dict[str, Any], model: Any, tokenizer: Any, callbacks: list[Any]) -> Any:
    """TRL's GRPOTrainer (or RLOOTrainer) for the spec; with `peft` (a LoRA config) it trains an adapter,
    and TRL takes the reference's log-probabilities with the adapter switched off."""
    from datasets import Dataset

    from training.align.kit import peft_config, training_args

    cfg = spec["config"]
    functions, weights = reward_functions(cfg["rewards"], spec.get("reward_model_dir"))
    common = dict(
        num_generations=cfg["num_generations"],
        max_completion_length=cfg["max_completion_length"],
        temperature=cfg["temperature"],
        beta=cfg["beta"],
        epsilon=cfg["epsilon"],
        num_iterations=cfg["num_iterations"],
        reward_weights=weights,
        use_vllm=spec.get("use_vllm", False),
        vllm_mode="colocate",
        log_completions=False,
        disable_dropout=True,
    )
    if cfg["algorithm"] == "grpo":
        from trl import GRPOConfig as RLConfig
        from trl import GRPOTrainer as RLTrainer

        common.update(loss_type=cfg["loss_type"], scale_rewards=cfg["scale_rewards"])
    else:
        from trl import RLOOConfig as RLConfig  # type: ignore[assignment]
        from trl import RLOOTrainer as RLTrainer  # type: ignore[assignment]
    args = training_args(spec, RLConfig, **common)
    left_padding_positions(model)
    model.generation_config.max_length = None  # max_completion_length bounds generation (else a warning per batch)
    prompts = filter_prompts(spec, model, tokenizer, prompt_records(spec["train"], cfg["prompts"]))
    draws = cfg["max_steps"] * cfg["global_batch_size"] // cfg["num_generations"]
    data = Dataset.from_list(one_epoch(prompts, draws, cfg["seed"]))
    reward_tokenizers: Any = None
    if any(isinstance(f, str) for f in functions):
        from transformers import AutoTokenizer

        reward_tokenizers = [AutoTokenizer.from_pretrained(f) if isinstance(f, str) else None for f in functions]
        functions = [load_reward_model(f) if isinstance(f, str) else f for f in functions]
    return RLTrainer(
        model=model,
        reward_funcs=functions,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        reward_processing_classes=reward_tokenizers,
        callbacks=callbacks,
        peft_config=peft_config(spec),
    )


# -- held-out figures of a policy ---------------------------------------------------------------------


class Probe:
    """The held-out scoring the watch and the summary share: greedy answers to held-out prompts,
    scored by the verifier, the proxy reward and the reward model; the held-out SFT loss; the KL
    of the policy's next-token distribution to the reference's along its own answers."""

    def __init__(self, spec: dict[str, Any], tokenizer: Any) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.items = spec.get("heldout_generation") or []
        self.chats = spec.get("heldout_chats") or []
        cfg = spec["config"]
        self.functions, self.weights = reward_functions(
            [t for t in cfg["rewards"] if t["kind"] != "reward_model"], None
        )
        self.reward_model = load_reward_model(spec["reward_model_dir"]) if spec.get("reward_model_dir") else None
        self.reward_tokenizer = None
        if self.reward_model is not None:
            from transformers import AutoTokenizer

            self.reward_tokenizer = AutoTokenizer.from_pretrained(spec["reward_model_dir"])
        self.reference: Any = None

    def _reference(self) -> Any:
        if self.reference is None:
            from training.align.kit import load_model

            self.reference = load_model(self.spec["base_dir"], "fp32").eval()
        return self.reference

    def measure(self, model: Any, with_kl: bool = True) -> dict[str, Any]:
        from training.align.heldout import assistant_loss, generate_answers

        cfg = self.spec["config"]
        model.generation_config.max_length = None  # max_new_tokens bounds it
        answers = generate_answers(model, self.tokenizer, self.items, max_new_tokens=cfg["max_completion_length"])
        completions = [[{"role": "assistant", "content": a}] for a in answers]
        prompts = [_prompt(r) for r in self.items]
        columns = {"answer": [r.get("answer") for r in self.items], "task": [r.get("task") for r in self.items]}
        verified = [
            float(is_correct(a, r["answer"])) if "answer" in r else math.nan for a, r in zip(answers, self.items)
        ]
        configured = [0.0] * len(answers)
        for function, weight in zip(self.functions, self.weights):
            values = function(prompts=prompts, completions=completions, completion_ids=None, **columns)
            configured = [c + weight * (0.0 if v is None else float(v)) for c, v in zip(configured, values)]
        out: dict[str, Any] = {
            "heldout_verified": [v for v in verified if not math.isnan(v)],
            "heldout_configured_reward": configured,
            "heldout_length": [len(self.tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers],
            "examples": [
                {"prompt": p[-1]["content"], "answer": r.get("answer"), "model": a}
                for p, r, a in list(zip(prompts, self.items, answers))[:5]
            ],
        }
        if self.reward_model is not None:
            out["heldout_rm_score"] = score(
                self.reward_model, self.reward_tokenizer, [p + c for p, c in zip(prompts, completions)]
            )
        if self.chats:
            out["heldout_sft_loss"] = assistant_loss(model, self.tokenizer, self.chats, self.spec["max_length"])["loss"]
        if with_kl:
            out["kl"] = self.kl(model, prompts, answers)
        return out

    def kl(self, model: Any, prompts: list[list[dict[str, str]]], answers: list[str]) -> list[float]:
        """Per prompt: the mean over its answer's tokens of KL(policy || reference) of the next-token
        distributions (exact over the vocabulary, not a sampled estimate)."""
        import torch

        reference = self._reference()
        device = next(model.parameters()).device
        out: list[float] = []
        for prompt, answer in zip(prompts, answers):
            head = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            start = len(self.tokenizer(head, add_special_tokens=False)["input_ids"])
            ids = self.tokenizer(head + answer, add_special_tokens=False, return_tensors="pt")["input_ids"]
            if ids.shape[1] <= start:
                out.append(0.0)
                continue
            with torch.no_grad():
                p = torch.log_softmax(model(input_ids=ids.to(device)).logits.float()[0, start - 1 : -1], -1).cpu()
                q = torch.log_softmax(reference(input_ids=ids).logits.float()[0, start - 1 : -1], -1)
            out.append(float((p.exp() * (p - q)).sum(-1).mean()))
        return out


def _prompt(record: dict[str, Any]) -> list[dict[str, str]]:
    from training.align.heldout import prompt_messages

    return prompt_messages(record)


def summarize(figures: dict[str, Any]) -> dict[str, Any]:
    """Means with 95% bootstrap intervals, and the KL's distribution."""
    import numpy as np

    from training.align.heldout import bootstrap_ci

    out: dict[str, Any] = {}
    for name in ("heldout_verified", "heldout_configured_reward", "heldout_rm_score", "heldout_length"):
        if figures.get(name):
            mean, low, high = bootstrap_ci(figures[name])
            out[name], out[f"{name}_ci"] = mean, [low, high]
    if "heldout_sft_loss" in figures:
        out["heldout_sft_loss"] = figures["heldout_sft_loss"]
    if figures.get("heldout_verified"):  # per item, for the watch's paired test (not a metric)
        out["heldout_verified_items"] = list(figures["heldout_verified"])
    if figures.get("kl"):
        kl = np.asarray(figures["kl"])
        out.update(
            kl_mean=float(kl.mean()),
            kl_p50=float(np.percentile(kl, 50)),
            kl_p90=float(np.percentile(kl, 90)),
            kl_max=float(kl.max()),
        )
    return out


def _significant_drop(start: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether verified accuracy fell on the watched prompts beyond their noise: the paired 95%
    interval of the change lies below 0. On 64 prompts one answer is 0.016: tiny-cpu-rl's watch
    fired on 0.219 -> 0.172 (3 answers) at step 100 of a run that raised held-out exact match on
    1,678 items by +0.023 [+0.008, +0.038]. Without per-item records (a start measured by an
    older version) the margin alone decides, as it did."""
    from training.align.heldout import paired_bootstrap

    before, after = start.get("heldout_verified_items"), now.get("heldout_verified_items")
    if not before or not after or len(before) != len(after):
        return True
    return paired_bootstrap(before, after)[2] < 0


def hacking(spec: dict[str, Any], start: dict[str, Any], now: dict[str, Any]) -> str | None:
    """The watch's verdict: one line when the proxy reward rose while what it stands for got worse."""
    watch = spec["config"]["hacking"]
    proxy = "heldout_rm_score" if "heldout_rm_score" in now else "heldout_configured_reward"
    if proxy not in now or proxy not in start:
        return None
    gain = now[proxy] - start[proxy]
    if gain <= watch["min_reward_gain"]:
        return None
    worse = []
    if "heldout_verified" in now and "heldout_verified" in start:
        drop = start["heldout_verified"] - now["heldout_verified"]
        if drop > watch["max_accuracy_drop"] and _significant_drop(start, now):
            worse.append(f"verified accuracy {start['heldout_verified']:.3f} -> {now['heldout_verified']:.3f}")
    if "heldout_sft_loss" in now and "heldout_sft_loss" in start:
        rise = now["heldout_sft_loss"] / max(start["heldout_sft_loss"], 1e-9) - 1
        if rise > watch["max_loss_rise"]:
            worse.append(f"held-out SFT loss {start['heldout_sft_loss']:.3f} -> {now['heldout_sft_loss']:.3f}")
    if not worse:
        return None
    name = "reward-model score" if proxy == "heldout_rm_score" else "reward"
    return (
        f"reward hacking: held-out {name} rose {start[proxy]:.3f} -> {now[proxy]:.3f} while "
        + " and ".join(worse)
        + "; raise align.rl.beta, lower align.rl.lr, or fix the reward"
    )


# -- the method ---------------------------------------------------------------------------------------


class RL(AlignMethod):
    name = "rl"
    config = RlConfig
    description = (
        "Online RL with TRL's GRPOTrainer/RLOOTrainer: verifiable, learned or user rewards, KL to the start, "
        "reward-hacking watch"
    )
    data = "chat"  # prompts from the SFT conversations
    starts: ClassVar[tuple[Product, ...]] = (DPO_MODEL, SFT_MODEL)
    generates = False  # its watch measures the held-out answers (HackingWatch)
    # prompts from the chat data; through DPO or the reward model, the preference data
    saw = ("documents", CHAT, PREFERENCE)

    def check(self, align: Any) -> None:
        if (
            self.runs(align)
            and any(f.kind == "reward_model" for f in align.rl.rewards)
            and Reward.name not in align.recipe
        ):
            raise ValueError("rl.rewards uses the reward model: add reward to align.recipe before rl")

    def start(self, config: Any) -> Product:
        """The policy RL starts from: DPO's model when the recipe has DPO before RL, else SFT's."""
        dpo = DPO.name in config.align.recipe and DPO().section(config).enabled
        return DPO_MODEL if dpo else SFT_MODEL

    def upstream(self, config: Any) -> tuple[Product, ...]:
        # the reward model, when the recipe trains one: a reward term, or else the watch's proxy
        return (*super().upstream(config), *((REWARD_MODEL,) if Reward.name in config.align.recipe else ()))

    def identity(self, config: Any) -> dict[str, Any]:
        """Its precision, and the source of each user reward `module:function` (the function runs
        inside the step, so its code shapes the policy; the config only names it)."""
        functions = sorted({r.function for r in config.align.rl.rewards if r.kind == "function" and r.function})
        sources = {f: {"content": reward_source_digest(f)} for f in functions}
        return {**super().identity(config), **({"reward_functions": sources} if sources else {})}

    def spec(self, ctx: Any, spec: dict[str, Any]) -> dict[str, Any]:
        from lmforge.errors import ConfigError
        from training.align.data import spread_over_tasks
        from training.device import detect_device

        cfg = self.section(ctx.config)
        if cfg.use_vllm and detect_device().kind != "cuda":
            raise ConfigError(
                "align.rl.use_vllm: TRL's vLLM generation (colocate mode) needs GPUs; on CPU the Trainer generates"
            )
        all_heldout = list(read_jsonl(Path(spec["heldout"])))
        verifiable_all = [r for r in all_heldout if "answer" in r]
        return {
            **spec,
            "reward_model_dir": str(ctx.path(REWARD_MODEL)) if ctx.has(REWARD_MODEL) else None,
            "heldout_all": verifiable_all,  # the final before/after figures: every held-out verifiable item
            "heldout_chats": all_heldout[: cfg.heldout_prompts],  # the SFT loss the watch follows
            "stop_on_hacking": cfg.stop_on_hacking,
            "use_vllm": cfg.use_vllm,
            "heldout_generation": spread_over_tasks(verifiable_all, cfg.heldout_prompts),
        }

    def trainer(self, spec: dict[str, Any], model: Any, tokenizer: Any, callbacks: list[Any]) -> Any:
        return rl_trainer(spec, model, tokenizer, callbacks)

    def callbacks(self, spec: dict[str, Any], holder: dict[str, Any]) -> list[Any]:
        return [hacking_watch(spec, holder)]

    def measure(self, spec: dict[str, Any], tokenizer: Any, hf: Path) -> dict[str, Any]:
        out = measure_rl(spec, tokenizer, hf)
        out["reward_hacking"] = (Path(spec["out_dir"]) / "hacking.json").exists()
        out["prompt_filter"] = filter_summary(Path(spec["out_dir"]))
        return out

    def warnings(self, spec: dict[str, Any], summary: dict[str, Any]) -> list[str]:
        hacked = Path(spec["out_dir"]) / "hacking.json"
        found = [json.loads(hacked.read_text())["message"]] if hacked.exists() else []
        learnt_prompts = generalisation(summary, summary) if "rl_prompts_exact_match_delta_ci" in summary else None
        return found + ([learnt_prompts] if learnt_prompts else [])


def reward_source_digest(path: str) -> str:
    """SHA-256 of the source file of the module of a reward `module:function`, found without running it
    (`import_function` imports it when the step runs).

    Only that file counts: modules it imports in turn are the user's to version. Finding a dotted
    module imports its parent packages, as importing it will."""
    import importlib.util

    from lmforge.hashing import file_sha256

    module = path.partition(":")[0]
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:  # a parent package missing, or broken
        raise ConfigError(f"align.rl.rewards: cannot import {path} ({type(exc).__name__}: {exc})") from None
    if spec is None:
        raise ConfigError(f"align.rl.rewards: cannot import {path} (ModuleNotFoundError: no module named {module!r})")
    if not spec.origin or not Path(spec.origin).is_file():
        raise ConfigError(f"align.rl.rewards: {path}: its module has no source file to fingerprint ({spec.origin})")
    return file_sha256(spec.origin)


def hacking_watch(spec: dict[str, Any], holder: dict[str, Any]) -> Any:
    """Rank 0, at the start and every `eval_every` steps: the held-out probe (`Probe`)
    (verified accuracy, proxy reward, reward-model score, SFT loss, KL distribution) into
    metrics.jsonl, and the reward-hacking verdict against the start."""
    from transformers import TrainerCallback

    from training.align.kit import METRICS, sharded

    out_dir = Path(spec["out_dir"])
    start_file, warned_file = out_dir / "rl_start.json", out_dir / "hacking.json"

    class HackingWatch(TrainerCallback):
        def __init__(self) -> None:
            self.probe: Probe | None = None
            self.start: dict[str, Any] | None = None

        def _measure(self, step: int) -> dict[str, Any]:
            if self.probe is None:
                self.probe = Probe(spec, holder["tokenizer"])
            trainer = holder["trainer"]
            model = trainer.accelerator.unwrap_model(trainer.model)
            was_training = model.training
            figures = summarize(self.probe.measure(model))
            model.train(was_training)
            with open(out_dir / METRICS, "a") as handle:
                rows = {f"watch/{k}": v for k, v in figures.items() if k != "heldout_verified_items"}
                handle.write(json.dumps({"step": step, **rows}) + "\n")
            return figures

        def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if not state.is_world_process_zero or sharded(spec):
                return
            if start_file.exists():  # a resumed run compares with the start of the first attempt
                self.start = json.loads(start_file.read_text())
                return
            self.start = self._measure(0)
            from lmforge.hashing import atomic_write_json

            atomic_write_json(start_file, self.start)

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step % spec["eval_every"] or not state.is_world_process_zero or self.start is None:
                return
            now = self._measure(state.global_step)
            verdict = hacking(spec, self.start, now)
            log.info(
                "rl step %d: held-out verified %.3f, reward %.3f%s, KL p50 %.4f p90 %.4f",
                state.global_step,
                now.get("heldout_verified", float("nan")),
                now.get("heldout_configured_reward", float("nan")),
                f", reward-model score {now['heldout_rm_score']:.3f}" if "heldout_rm_score" in now else "",
                now.get("kl_p50", float("nan")),
                now.get("kl_p90", float("nan")),
            )
            if verdict is None:
                return
            if not warned_file.exists():
                log.warning("%s", verdict)
                from lmforge.hashing import atomic_write_json

                atomic_write_json(warned_file, {"step": state.global_step, "message": verdict})
            if spec["stop_on_hacking"]:
                raise RewardHacking(f"align.rl.stop_on_hacking: step {state.global_step}: {verdict}")

    return HackingWatch()


def measure_rl(spec: dict[str, Any], tokenizer: Any, hf: Path) -> dict[str, Any]:
    """Held-out figures of the policy RL started from and the one it made, on held-out prompts no RL
    step saw: exact match (the verifier) with a paired interval on the change, the configured and the
    reward model's reward, the SFT loss, and the KL distribution of the result to the start."""
    from training.align.heldout import exact_match, paired_bootstrap
    from training.align.kit import load_model

    probe = Probe({**spec, "heldout_generation": spec["heldout_all"]}, tokenizer)
    own = rl_prompts_sample(spec)
    out: dict[str, Any] = {}
    raw: dict[str, dict[str, Any]] = {}
    own_hits: dict[str, list[float]] = {}
    for name, path in (("before", spec["base_dir"]), ("after", str(hf))):
        model = load_model(path, "fp32").eval()
        raw[name] = probe.measure(model, with_kl=name == "after")
        own_hits[name] = exact_match(model, tokenizer, own)["hits"] if own else []
        for key, value in summarize(raw[name]).items():
            if key == "heldout_verified_items":  # the watch's; the paired figures below use raw
                continue
            out[f"{key}_{name}" if not key.startswith("kl_") else key] = value
        out[f"examples_{name}"] = raw[name]["examples"]
        if name == "before":
            probe.reference = model  # the start is the KL reference: load it once
    out["exact_match_before"], out["exact_match_after"] = out["heldout_verified_before"], out["heldout_verified_after"]
    for metric, key in (("exact_match", "heldout_verified"), ("heldout_reward", "heldout_configured_reward")):
        delta, low, high = paired_bootstrap(raw["before"][key], raw["after"][key])
        out[f"{metric}_delta"], out[f"{metric}_delta_ci"] = delta, [low, high]
    by_task: dict[str, dict[str, list[float]]] = {}
    for name in ("before", "after"):
        for hit, record in zip(raw[name]["heldout_verified"], [r for r in spec["heldout_all"] if "answer" in r]):
            by_task.setdefault(name, {}).setdefault(record["task"], []).append(hit)
        out[f"exact_match_{name}_by_task"] = {t: round(sum(v) / len(v), 4) for t, v in sorted(by_task[name].items())}
    out["heldout_items"] = out["heldout_generation_items"] = len(spec["heldout_all"])
    if own:  # the same on RL's own prompts: whether RL taught the skill or its prompts
        delta, low, high = paired_bootstrap(own_hits["before"], own_hits["after"])
        out["rl_prompts_exact_match_before"] = sum(own_hits["before"]) / len(own)
        out["rl_prompts_exact_match_after"] = sum(own_hits["after"]) / len(own)
        out["rl_prompts_exact_match_delta"], out["rl_prompts_exact_match_delta_ci"] = delta, [low, high]
        out["rl_prompts_items"] = len(own)
    return out


def rl_prompts_sample(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """A fixed sample of RL's own training prompts with a verified answer (those the prompt filter
    kept, when it ran), as many as the held-out items: a gain there that does not reach held-out
    ones is memorisation (measured on tiny-cpu-rl, a 4M model)."""
    import random

    from lmforge.errors import ConfigError

    filtered = Path(spec["out_dir"]) / "prompt_filter.jsonl"
    if filtered.exists():
        from lmforge.jsonl import read_jsonl

        verifiable = [r for r in read_jsonl(filtered) if r["kept"]]
    else:
        try:
            verifiable = [r for r in prompt_records(spec["train"], "verifiable") if r.get("answer") is not None]
        except ConfigError:  # RL on chats without a verified answer (align.rl.prompts: all): nothing to score
            return []
    return random.Random(0).sample(verifiable, min(len(verifiable), len(spec["heldout_all"])))


def generalisation(own: dict[str, Any], heldout: dict[str, Any]) -> str | None:
    """One line when RL's gain on its own prompts is real (interval above 0) and on held-out ones is not."""
    (low, high), (held_low, held_high) = own["rl_prompts_exact_match_delta_ci"], heldout["exact_match_delta_ci"]
    if low <= 0 or held_low > 0:
        return None
    return (
        f"RL raised exact match on its own prompts by {own['rl_prompts_exact_match_delta']:+.3f} [{low:+.3f}, "
        f"{high:+.3f}] but not on held-out ones ({heldout['exact_match_delta']:+.3f} [{held_low:+.3f}, "
        f"{held_high:+.3f}]): the policy learnt its prompts, not the skill; more varied prompts "
        "(align.builtin.per_skill) or a larger model"
    )
