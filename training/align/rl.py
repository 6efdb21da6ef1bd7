"""Reward models and online RL for the alignment stage, on TRL's trainers.

- `align/reward`: TRL's `RewardTrainer` (Bradley-Terry on chosen/rejected) on a sequence-
  classification head over the SFT model; exported as an `AutoModelForSequenceClassification`
  directory with its tokenizer; held-out pairwise accuracy with a bootstrap interval.
- `align/rl`: TRL's `GRPOTrainer` (or `RLOOTrainer`) from the SFT or DPO model with the rewards
  of `align.rl.rewards`: the verifier (`lmforge.verify`, the check evaluation's exact match
  uses), the reward model, a user's `module:function`, summed with their weights.

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
from typing import Any

from lmforge.errors import ConfigError, DeterministicError
from lmforge.jsonl import read_jsonl
from lmforge.verify import is_correct, partial_credit

log = logging.getLogger("training.align")


class RewardHacking(DeterministicError):
    """The learned (or configured) reward rose while what it stands for got worse; not retried."""


# -- rewards ------------------------------------------------------------------------------------------


def _text(completion: Any) -> str:
    """A completion as TRL hands it to a reward function: a string, or a list with one assistant message."""
    if isinstance(completion, list):
        return "".join(m.get("content", "") for m in completion)
    return str(completion)


def verifier_reward(completions: list[Any], answer: list[str | None], **_: Any) -> list[float | None]:
    """1.0 when the completion is exactly the verified answer (lmforge.verify), else 0.0; None
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


def rl_trainer(
    spec: dict[str, Any], model: Any, tokenizer: Any, args_for: Any, callbacks: list[Any], peft: Any = None
) -> Any:
    """TRL's GRPOTrainer (or RLOOTrainer) for the spec; with `peft` (a LoRA config) it trains an adapter,
    and TRL takes the reference's log-probabilities with the adapter switched off."""
    from datasets import Dataset

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
    args = args_for(spec, RLConfig, **common)
    left_padding_positions(model)
    model.generation_config.max_length = None  # max_completion_length bounds generation (else a warning per batch)
    prompts = filter_prompts(spec, model, tokenizer, prompt_records(spec["train"], cfg["prompts"]))
    draws = cfg["max_steps"] * cfg["global_batch_size"] // cfg["num_generations"]
    data = Dataset.from_list(one_epoch(prompts, draws, cfg["seed"]))
    reward_tokenizers: Any = None
    if any(isinstance(f, str) for f in functions):
        from transformers import AutoTokenizer

        reward_tokenizers = [AutoTokenizer.from_pretrained(f) if isinstance(f, str) else None for f in functions]
        functions = [_load_reward_model(f) if isinstance(f, str) else f for f in functions]
    return RLTrainer(
        model=model,
        reward_funcs=functions,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        reward_processing_classes=reward_tokenizers,
        callbacks=callbacks,
        peft_config=peft,
    )


def _load_reward_model(path: str) -> Any:
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32).eval()
    model.config._name_or_path = "reward_model"  # TRL names its metrics after it: rewards/reward_model/mean
    return model


# -- the reward model ---------------------------------------------------------------------------------


def reward_trainer(spec: dict[str, Any], tokenizer: Any, args_for: Any, callbacks: list[Any], peft: Any) -> Any:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForSequenceClassification, set_seed
    from trl import RewardConfig, RewardTrainer

    cfg = spec["config"]
    # the score head is new, initialised at random: seeded here, as the Trainer seeds only after the
    # model exists (unseeded, held-out accuracy of the same step ranged 0.626-0.714 on tiny-cpu-rl,
    # and 0.5 on the tests' small model once)
    set_seed(cfg["seed"])
    model = AutoModelForSequenceClassification.from_pretrained(
        spec["base_dir"],
        num_labels=1,
        dtype=torch.bfloat16 if spec["precision"] == "bf16" else torch.float32,
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    extra = (
        {"center_rewards_coefficient": cfg["center_rewards_coefficient"]}
        if cfg.get("center_rewards_coefficient")
        else {}
    )
    args = args_for(spec, RewardConfig, disable_dropout=True, **extra)
    data = load_dataset("json", data_files=spec["train"], split="train").select_columns(
        ["prompt", "chosen", "rejected"]
    )
    if peft is not None:
        peft.task_type = "SEQ_CLS"
    return RewardTrainer(
        model=model, args=args, train_dataset=data, processing_class=tokenizer, peft_config=peft, callbacks=callbacks
    )


def score(model: Any, tokenizer: Any, conversations: list[list[dict[str, str]]], batch_size: int = 16) -> list[float]:
    """The reward model's scalar for each whole conversation (chat template applied, as TRL does)."""
    import torch

    device = next(model.parameters()).device
    out: list[float] = []
    tokenizer.padding_side = "right"
    for start in range(0, len(conversations), batch_size):
        texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in conversations[start : start + batch_size]]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            logits = model(**batch).logits
        out += [float(v) for v in logits[:, 0].float().cpu()]
    return out


def pairwise_accuracy(model: Any, tokenizer: Any, records: list[dict[str, Any]]) -> dict[str, Any]:
    """How often the reward model scores held-out chosen above rejected, with a 95% bootstrap interval."""
    from training.align.heldout import bootstrap_ci

    chosen = score(model, tokenizer, [r["prompt"] + r["chosen"] for r in records])
    rejected = score(model, tokenizer, [r["prompt"] + r["rejected"] for r in records])
    wins = [float(c > r) for c, r in zip(chosen, rejected)]
    accuracy, low, high = bootstrap_ci(wins)
    margins = [c - r for c, r in zip(chosen, rejected)]
    return {
        "pairwise_accuracy": accuracy,
        "pairwise_accuracy_ci": [low, high],
        "mean_margin": sum(margins) / len(margins) if margins else float("nan"),
        "items": len(wins),
    }


def finish_reward(spec: dict[str, Any], tokenizer: Any, hf: Path) -> dict[str, Any]:
    """Rank 0 after training: the exported classifier (LoRA merged) with its tokenizer, held-out accuracy."""
    import torch
    from transformers import AutoModelForSequenceClassification

    out_dir = Path(spec["out_dir"])
    if spec.get("lora") is not None:
        from peft import PeftModel

        base = AutoModelForSequenceClassification.from_pretrained(spec["base_dir"], num_labels=1, dtype=torch.float32)
        base.config.pad_token_id = tokenizer.pad_token_id
        merged = PeftModel.from_pretrained(base, str(out_dir / "adapter")).merge_and_unload()
        merged.save_pretrained(str(hf), safe_serialization=True)
    tokenizer.save_pretrained(str(hf))
    (hf / "training_args.bin").unlink(missing_ok=True)
    model = _load_reward_model(str(hf))
    return pairwise_accuracy(model, tokenizer, list(read_jsonl(Path(spec["heldout"]))))


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
        self.reward_model = _load_reward_model(spec["reward_model_dir"]) if spec.get("reward_model_dir") else None
        self.reward_tokenizer = None
        if self.reward_model is not None:
            from transformers import AutoTokenizer

            self.reward_tokenizer = AutoTokenizer.from_pretrained(spec["reward_model_dir"])
        self.reference: Any = None

    def _reference(self) -> Any:
        if self.reference is None:
            from training.align.entry import _load_model

            self.reference = _load_model(self.spec["base_dir"], "fp32").eval()
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
