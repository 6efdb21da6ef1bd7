"""Resumable checkpoints for alignment under transformers' tensor parallelism.

transformers 5.19's Trainer does not checkpoint the optimizer of a model split at load time
(`DistributedConfig(tp_size=N)`): it refuses `save_only_model=False`, and with `save_only_model=True`
a retry would start Adam's moments and the LR schedule again from nothing, so the resumed run would
not be the uninterrupted one (lmforge's retries resume; they never restart). No maintained library
fills that gap for the Trainer, so lmforge does, with PyTorch's own distributed checkpoint (DCP):

- save: the Trainer writes the gathered model and `trainer_state.json` as usual, and in place of its
  optimizer save every rank writes its shards of the model and optimizer state as one DCP
  (`dcp/`, DTensor-aware through `torch.distributed.checkpoint.state_dict`), rank 0 the scheduler,
  each rank its RNG state (the Trainer's own file); lmforge's seal then covers them all;
- resume: the Trainer's model, optimizer and scheduler loaders are replaced by reads of the same.

Installed on the trainer instance after it is built (`install`): the Trainer's constructor is what
refuses, so it is built with `save_only_model=True` and the flag is cleared afterwards.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import MethodType
from typing import Any

DCP_DIR = "dcp"
SCHEDULER = "scheduler.pt"  # transformers.trainer.SCHEDULER_NAME


def install(trainer: Any) -> None:
    trainer.args.save_only_model = False
    trainer._save_optimizer_and_scheduler = MethodType(_save, trainer)
    trainer._load_from_checkpoint = MethodType(_load_model, trainer)
    trainer._load_optimizer_and_scheduler = MethodType(_load_optimizer, trainer)


def _optimizer(trainer: Any) -> Any:
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper holds torch's


def _save(self: Any, output_dir: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(self.model, _optimizer(self))
    dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=os.path.join(output_dir, DCP_DIR))
    if self.args.should_save:
        torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER))


def _load_model(self: Any, checkpoint: str, model: Any = None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(self.model)}
    dcp.load(state, checkpoint_id=os.path.join(checkpoint, DCP_DIR))
    set_model_state_dict(self.model, state["model"])


def _load_optimizer(self: Any, checkpoint: str | None) -> None:
    if checkpoint is None:
        return
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    optimizer = _optimizer(self)
    state = {"optim": get_optimizer_state_dict(self.model, optimizer)}  # initialized in the shards' layout
    dcp.load(state, checkpoint_id=os.path.join(checkpoint, DCP_DIR))
    set_optimizer_state_dict(self.model, optimizer, state["optim"])
    self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER), weights_only=True))


def tidy_export(hf: Path) -> None:
    """The gathered model of a tied-embedding model holds the output head as well (split apart, the two
    are no longer one tensor to `save_pretrained`); written again without it, as one rank saves it."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    weights = hf / "model.safetensors"
    config = json.loads((hf / "config.json").read_text())
    if not config.get("tie_word_embeddings") or not weights.exists():
        return
    with safe_open(str(weights), framework="pt") as handle:
        if "lm_head.weight" not in handle.keys():
            return
        metadata = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys() if name != "lm_head.weight"}
    save_file(tensors, str(weights), metadata=metadata)
