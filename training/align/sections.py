"""What every alignment method's config section has: the optimizer, schedule, batch and checkpoint
interval (`TrainConfig`). A method's own section (`align.<name>`) subclasses it in the method's
module (`training.align.methods`); `training.align.config` gathers them into `AlignConfig`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lmforge.configbase import StrictModel, runtime_field


class TrainConfig(StrictModel):
    """The optimizer and schedule every method has (each its own copy, in its section)."""

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
