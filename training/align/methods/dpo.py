"""`align/dpo`: direct preference optimisation with TRL's `DPOTrainer` against the frozen SFT model
(with LoRA: the adapter switched off), optionally with an SFT term on the chosen answers;
measured by held-out preference accuracy and exact match, with an over-optimisation warning."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from lmforge.configbase import runtime_field
from lmforge.engine.stage import Product
from training.align.methods import PreferenceMethod
from training.align.methods.sft import SFT_MODEL
from training.align.sections import TrainConfig

log = logging.getLogger("training.align")


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


class DPO(PreferenceMethod):
    name = "dpo"
    tensor_parallel = True  # TRL's trainer on the policy the entry loads split (align.distributed.tensor_parallel)
    config = DpoConfig
    description = "Direct preference optimisation with TRL against the frozen SFT model"
    starts: ClassVar[tuple[Product, ...]] = (SFT_MODEL,)
    curves = (
        ("loss", (("loss", "train"),)),
        ("rewards", (("rewards/chosen", "chosen"), ("rewards/rejected", "rejected"), ("rewards/margins", "margin"))),
        ("reward accuracy", (("rewards/accuracies", ""),)),
        ("held-out exact match", (("heldout_exact_match", ""),)),
    )
    owns_data = True
    in_default_recipe = True  # align.dpo.inputs: the preference pairs every preference method trains on

    def trainer(self, spec: dict[str, Any], model: Any, tokenizer: Any, callbacks: list[Any]) -> Any:
        from trl import DPOConfig, DPOTrainer

        from training.align.kit import dataset, load_model, peft_config, tensor_parallel, training_args

        weight = spec["config"].get("sft_weight", 0.0)
        losses = (
            {"loss_type": [spec["config"]["loss_type"], "sft"], "loss_weights": [1.0, weight]}
            if weight
            else {"loss_type": [spec["config"]["loss_type"]]}
        )
        args = training_args(spec, DPOConfig, beta=spec["config"]["beta"], **losses)
        # the reference is the SFT model, frozen, loaded from disk like the policy (with LoRA: adapter off)
        reference = None if spec.get("lora") else load_model(spec["base_dir"], spec["precision"], tensor_parallel(spec))
        return DPOTrainer(
            model=model,
            ref_model=reference,
            args=args,
            train_dataset=dataset(spec["train"], ["prompt", "chosen", "rejected"]),
            processing_class=tokenizer,
            peft_config=peft_config(spec),
            callbacks=callbacks,
        )

    def warnings(self, spec: dict[str, Any], summary: dict[str, Any]) -> list[str]:
        return overoptimisation(spec, summary)


def overoptimisation(spec: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """DPO's reward accuracy saturating while held-out exact match falls: the over-optimisation the
    seeds warn about (the policy learns to separate pairs, not to answer)."""
    from training.align.kit import METRICS

    rows = [json.loads(line) for line in (Path(spec["out_dir"]) / METRICS).read_text().splitlines()]
    accuracies = [r["rewards/accuracies"] for r in rows if "rewards/accuracies" in r][-10:]
    before, after = summary.get("exact_match_before"), summary.get("exact_match_after")
    if not accuracies or before is None or after is None or math.isnan(before) or math.isnan(after):
        return []
    saturated = sum(accuracies) / len(accuracies) >= 0.95
    if saturated and after < before - 0.05:
        message = (
            f"DPO reward accuracy saturated ({sum(accuracies) / len(accuracies):.2f} over the last steps) while "
            f"held-out exact match fell {before:.3f} -> {after:.3f}: likely over-optimisation; lower "
            "align.dpo.lr or max_steps, or raise align.dpo.beta"
        )
        log.warning("%s", message)
        return [message]
    return []
