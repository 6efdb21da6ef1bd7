"""`align/simpo`: SimPO (Meng et al., 2024) with TRL's `CPOTrainer` (`loss_type: simpo`): the
length-normalised log-probability of an answer is its implicit reward, and the chosen one must
beat the rejected by a target margin; no reference model. It can start from the SFT model or from
the model SFT starts from (`init: base`). Measured like DPO: held-out preference accuracy and exact
match before and after, with paired intervals.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import Field

from lmforge.configbase import runtime_field
from training.align.methods import PreferenceMethod
from training.align.methods.sft import FROM_SFT, AfterSftOrItsStart, Init
from training.align.sections import TrainConfig


class SimpoConfig(TrainConfig):
    enabled: bool = runtime_field(True, description="Run SimPO when align.recipe names it.")
    init: Init = Field(FROM_SFT, description="Start from the SFT model, or from the model SFT starts from.")
    beta: float = Field(2.0, gt=0, description="Scale of the length-normalised reward (2.0-2.5 in the paper).")
    gamma: float = Field(0.5, ge=0, description="Target reward margin, TRL's simpo_gamma.")
    sft_weight: float = Field(
        0.0,
        ge=0,
        description="NLL on the chosen answer beside the SimPO loss (TRL's cpo_alpha: CPO-SimPO); 0: pure SimPO.",
    )
    lora: bool = Field(False, description="Train SimPO as a LoRA adapter (merged for export).")
    lr: float = Field(5e-7, gt=0, description="3e-7 to 1e-6 in the paper for 7-8B models; tiny models need more.")
    max_steps: int = Field(150, ge=1)


class SimPO(PreferenceMethod, AfterSftOrItsStart):
    name = "simpo"
    config = SimpoConfig
    description = "SimPO with TRL's CPOTrainer: length-normalised reward with a target margin, no reference model"

    # TRL's experimental trainer logs no num_tokens: the entry counts the pair's forward tokens
    token_keys = ("chosen_attention_mask", "rejected_attention_mask")

    def trainer(self, spec: dict[str, Any], model: Any, tokenizer: Any, callbacks: list[Any]) -> Any:
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        from training.align.kit import pair_dataset, pair_tokens, peft_config, training_args

        class Trainer(CPOTrainer):
            def tokenize_row(self, feature: dict[str, Any], model: Any = None) -> dict[str, Any]:
                # pairs tokenized as SFT and the held-out measures see them (kit.pair_tokens says why)
                return pair_tokens(self.processing_class, feature, self.max_length)

        cfg = spec["config"]
        args = training_args(
            spec, CPOConfig, loss_type="simpo", beta=cfg["beta"], simpo_gamma=cfg["gamma"], cpo_alpha=cfg["sft_weight"]
        )
        return Trainer(
            model=model,
            args=args,
            train_dataset=pair_dataset(spec["train"]),
            processing_class=tokenizer,
            peft_config=peft_config(spec),
            callbacks=callbacks,
        )
