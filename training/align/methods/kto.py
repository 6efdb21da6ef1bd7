"""`align/kto`: Kahneman-Tversky optimisation with TRL's `KTOTrainer` from the SFT model, against it
frozen (with LoRA: the adapter switched off). KTO learns from unpaired examples, each answer
labelled desirable or not; the lineage's preference pairs are split into two such rows (the
chosen answer desirable, the rejected one not), so the built-in data or a user's preference
file trains it as it trains DPO. Measured like DPO: held-out preference accuracy (the policy's
log-probability of the chosen answer above the rejected one) and exact match, each before and
after with a paired interval.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from lmforge.configbase import runtime_field
from lmforge.engine.stage import Product
from training.align.methods import PreferenceMethod
from training.align.methods.sft import SFT_MODEL
from training.align.sections import TrainConfig


class KtoConfig(TrainConfig):
    enabled: bool = runtime_field(True, description="Run KTO when align.recipe names it.")
    beta: float = Field(0.1, gt=0, description="KTO's KL strength (TRL's default).")
    desirable_weight: float = Field(
        1.0, gt=0, description="Weight of the desirable (chosen) rows' loss; raise it when they are rarer."
    )
    undesirable_weight: float = Field(1.0, gt=0, description="Weight of the undesirable (rejected) rows' loss.")
    lora: bool = Field(False, description="Train KTO as a LoRA adapter on the SFT model (reference = adapter off).")
    lr: float = Field(5e-7, gt=0, description="5e-7 to 5e-6 for real models (TRL's guidance); tiny models need more.")
    max_steps: int = Field(150, ge=1)


class KTO(PreferenceMethod):
    name = "kto"
    config = KtoConfig
    description = "Kahneman-Tversky optimisation with TRL on unpaired desirable/undesirable answers, from SFT"
    starts: ClassVar[tuple[Product, ...]] = (SFT_MODEL,)

    def trainer(self, spec: dict[str, Any], model: Any, tokenizer: Any, callbacks: list[Any]) -> Any:
        from trl import KTOConfig, KTOTrainer

        from training.align.kit import dataset, load_model, peft_config, training_args

        cfg = spec["config"]
        args = training_args(
            spec,
            KTOConfig,
            beta=cfg["beta"],
            desirable_weight=cfg["desirable_weight"],
            undesirable_weight=cfg["undesirable_weight"],
        )
        pairs = dataset(spec["train"], ["prompt", "chosen", "rejected"])
        rows = pairs.map(unpaired, batched=True, remove_columns=["prompt", "chosen", "rejected"])
        reference = None if spec.get("lora") else load_model(spec["base_dir"], spec["precision"])
        return KTOTrainer(
            model=model,
            ref_model=reference,
            args=args,
            train_dataset=rows,
            processing_class=tokenizer,
            peft_config=peft_config(spec),
            callbacks=callbacks,
        )


def unpaired(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Preference pairs as KTO's unpaired rows: each pair gives its chosen answer (label true) and its
    rejected one (label false), with the same prompt, interleaved so every batch holds both kinds."""
    out: dict[str, list[Any]] = {"prompt": [], "completion": [], "label": []}
    for prompt, chosen, rejected in zip(batch["prompt"], batch["chosen"], batch["rejected"]):
        for completion, label in ((chosen, True), (rejected, False)):
            out["prompt"].append(prompt)
            out["completion"].append(completion)
            out["label"].append(label)
    return out
