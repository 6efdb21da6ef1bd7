"""`align/orpo`: odds-ratio preference optimisation with TRL's `ORPOTrainer` (Hong et al., 2024): an
SFT loss on the chosen answer plus a log-odds-ratio term that favours it over the rejected one,
with no reference model (one model in memory). It can start from the SFT model or, as ORPO was
meant to, straight from the model SFT would start from (`init: base`), fine-tuning and aligning
in one step. Measured like DPO: held-out preference accuracy and exact match before and after,
with paired intervals.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import Field

from lmforge.configbase import runtime_field
from training.align.methods import PreferenceMethod
from training.align.methods.sft import FROM_SFT, AfterSftOrItsStart, Init
from training.align.sections import TrainConfig


class OrpoConfig(TrainConfig):
    enabled: bool = runtime_field(True, description="Run ORPO when align.recipe names it.")
    init: Init = Field(
        FROM_SFT, description="Start from the SFT model, or from the model SFT starts from (ORPO needs no SFT step)."
    )
    beta: float = Field(0.1, gt=0, description="Weight of the odds-ratio term (lambda in the paper; TRL's beta).")
    lora: bool = Field(False, description="Train ORPO as a LoRA adapter (merged for export).")
    lr: float = Field(8e-6, gt=0, description="8e-6 in the paper for 7B models; tiny models need more.")
    max_steps: int = Field(150, ge=1)


class ORPO(PreferenceMethod, AfterSftOrItsStart):
    name = "orpo"
    config = OrpoConfig
    description = "Odds-ratio preference optimisation with TRL: SFT and preference in one loss, no reference model"

    # TRL's experimental trainer logs no num_tokens: the entry counts the pair's forward tokens
    token_keys = ("chosen_attention_mask", "rejected_attention_mask")

    def trainer(self, spec: dict[str, Any], model: Any, tokenizer: Any, callbacks: list[Any]) -> Any:
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        from training.align.kit import pair_dataset, pair_tokens, peft_config, training_args

        class Trainer(ORPOTrainer):
            def tokenize_row(self, feature: dict[str, Any], model: Any = None) -> dict[str, Any]:
                # pairs tokenized as SFT and the held-out measures see them (kit.pair_tokens says why)
                return pair_tokens(self.processing_class, feature, self.max_length)

            def concatenated_forward(self, model: Any, batch: dict[str, Any]) -> Any:
                # the paper's L_SFT: the NLL of the chosen answer given the prompt. TRL's scores the
                # prompt's tokens too, which on a model SFT trained on answers only (tiny-cpu: 8.1
                # nats a token at the first step, against 2.6 for the answer) turns ORPO's update
                # into language modelling of the prompts
                import torch.nn.functional as F

                out = super().concatenated_forward(model, batch)
                chosen = out[2]  # the chosen rows' logits, already shifted (the last position dropped)
                # the chosen labels, padded (-100) to the pair's common width as the logits are
                labels = batch["chosen_labels"].to(chosen.device)
                labels = F.pad(labels, (0, chosen.shape[1] + 1 - labels.shape[1]), value=-100)[:, 1:]
                nll = F.cross_entropy(chosen.flatten(0, 1), labels.flatten(), ignore_index=-100)
                return (*out[:4], nll, *out[5:])

        return Trainer(
            model=model,
            args=training_args(spec, ORPOConfig, beta=spec["config"]["beta"]),
            train_dataset=pair_dataset(spec["train"]),
            processing_class=tokenizer,
            peft_config=peft_config(spec),
            callbacks=callbacks,
        )
