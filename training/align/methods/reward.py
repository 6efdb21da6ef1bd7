"""`align/reward`: a reward model with TRL's `RewardTrainer` (Bradley-Terry on chosen/rejected) on a
sequence-classification head over the SFT (or the starting) model, full or LoRA; exported as an
`AutoModelForSequenceClassification` directory with its tokenizer; measured by held-out pairwise
accuracy with a bootstrap interval. RL (`training.align.methods.rl`) uses it as a reward term or
as the reward-hacking watch's proxy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from lmforge.engine.stage import Product
from lmforge.jsonl import read_jsonl
from training.align.methods.sft import FROM_SFT, AfterSftOrItsStart, Init
from training.align.sections import TrainConfig


class RewardModelConfig(TrainConfig):
    """`align/reward`: a Bradley-Terry reward model (TRL's RewardTrainer) on the lineage's preference data."""

    init: Init = Field(
        FROM_SFT, description="Start from the SFT model (the usual choice) or from the model SFT started from."
    )
    lora: bool = Field(False, description="Train a LoRA adapter (merged for export) instead of every weight.")
    center_rewards_coefficient: float | None = Field(
        None, ge=0, description="TRL's term that keeps rewards centred on 0 (0.01 in its docs); None: off."
    )
    lr: float = Field(1e-5, gt=0, description="1e-5 for real models; the tiny preset sets its own.")
    max_steps: int = Field(150, ge=1)


class Reward(AfterSftOrItsStart):
    name = "reward"
    config = RewardModelConfig
    description = "Reward model with TRL's RewardTrainer (Bradley-Terry on chosen/rejected), full or LoRA"
    data = "preference"
    product = Product("reward-model")
    loads_policy = False  # it builds a sequence classifier from the start model itself
    generates = False  # a classifier does not generate

    def trainer(self, spec: dict[str, Any], model: Any, tokenizer: Any, callbacks: list[Any]) -> Any:
        return reward_trainer(spec, tokenizer, callbacks)

    def export(self, spec: dict[str, Any], tokenizer: Any, hf: Path) -> dict[str, Any]:
        export_classifier(spec, tokenizer, hf)
        return {}

    def measure(self, spec: dict[str, Any], tokenizer: Any, hf: Path) -> dict[str, Any]:
        figures = pairwise_accuracy(load_reward_model(str(hf)), tokenizer, list(read_jsonl(Path(spec["heldout"]))))
        return {**figures, "heldout_items": figures["items"]}


def load_reward_model(path: str) -> Any:
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32).eval()
    model.config._name_or_path = "reward_model"  # TRL names its metrics after it: rewards/reward_model/mean
    return model


def reward_trainer(spec: dict[str, Any], tokenizer: Any, callbacks: list[Any]) -> Any:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForSequenceClassification, set_seed
    from trl import RewardConfig, RewardTrainer

    from training.align.kit import peft_config, training_args

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
    args = training_args(spec, RewardConfig, disable_dropout=True, **extra)
    peft = peft_config(spec)
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


def export_classifier(spec: dict[str, Any], tokenizer: Any, hf: Path) -> None:
    """Rank 0 after training: the exported classifier (LoRA merged) with its tokenizer."""
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
