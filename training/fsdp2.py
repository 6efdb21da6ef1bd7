"""The FSDP2 training engine: `torch.distributed.fsdp.fully_shard` behind the engine interface the loop uses.

`training.loop.Trainer` drives an engine through a small surface: call it on a batch,
`backward`, `step` (an optimizer step at the accumulation boundary), `get_lr`,
`get_global_grad_norm`, `lr_scheduler`/`optimizer`/`module`, `train`/`eval`, and
`save_checkpoint`/`load_checkpoint`. DeepSpeed's engine has that surface; this class gives
it to a model sharded with FSDP2, so the loop's guardrails, rollbacks, metrics, checkpoints,
export and parity check are the same code for both backends.

Sharding: `fully_shard` per decoder layer and once at the root (embeddings, final norm and
head), on a 1-D mesh over every rank (full shard), or a 2-D (replicate x shard) mesh for
hybrid sharding: sharded within a node, replicated across nodes (HSDP). `grad_op` keeps the
gathered parameters from forward to backward (`reshard_after_forward=False`: one all-gather
per micro-batch instead of two, ZeRO-2's memory). Mixed precision: fp32 sharded parameters
(the master copy) with bf16 compute and fp32 gradient reduction where the hardware has bf16.
Gradients are reduced once per optimizer step: micro-batches before the last accumulate
locally (`set_requires_gradient_sync(False)`).

Checkpoints: `torch.distributed.checkpoint` (DCP) writes each rank's shards of the model and
AdamW state plus a metadata file; the scheduler state and the micro-step position go beside
them as JSON. `training.checkpoint` wraps this in the same atomic, checksummed step folders
as DeepSpeed's. DCP reshards on load, so a checkpoint also resumes on another world size.

The LR schedule object is DeepSpeed's `WarmupCosineLR` (a plain scheduler over any torch
optimizer): both backends then follow the same learning rate to the step, which is what
makes their loss trajectories comparable, and the loop's LR-scale rule applies unchanged.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from training.config import PretrainConfig
from training.planner import Plan

SCHEDULER_FILE = "scheduler.json"


def decoder_layers(model: Any) -> list[Any]:
    """The repeated blocks of a Hugging Face causal LM (Llama, Qwen2, Mistral: model.model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: no model.layers to shard per block")
    return list(layers)


def build_mesh(plan: Plan) -> Any:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    kind = "cuda" if torch.cuda.is_available() else "cpu"
    if plan.sharding == "hybrid":
        return init_device_mesh(kind, (plan.num_nodes, plan.num_ranks), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(kind, (plan.world_size,), mesh_dim_names=("shard",))


class Fsdp2Engine:
    """A model sharded with FSDP2, its AdamW and LR schedule, with DeepSpeed's engine surface."""

    def __init__(self, model: Any, cfg: PretrainConfig, plan: Plan):
        import torch
        from deepspeed.runtime.lr_schedules import WarmupCosineLR
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        self.cfg, self.plan = cfg, plan
        mixed = plan.precision in ("bf16", "fp16")
        low = torch.bfloat16 if plan.precision == "bf16" else torch.float16
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if plan.offload != "none" else OffloadPolicy()
        if torch.cuda.is_available() and plan.offload == "none":
            model = model.to(torch.device("cuda", torch.cuda.current_device()))
        mesh = build_mesh(plan)
        reshard = plan.sharding != "grad_op"
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
        self.module = model
        opt = cfg.optim
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=opt.lr,
            betas=(opt.beta1, opt.beta2),
            eps=opt.eps,
            foreach=True,
        )
        self.lr_scheduler = WarmupCosineLR(
            self.optimizer,
            total_num_steps=cfg.max_steps,
            warmup_min_ratio=0.0,
            warmup_num_steps=opt.warmup_steps,
            warmup_type="linear",
            cos_min_ratio=opt.min_lr_ratio,
        )
        self.micro = 0  # micro-batches since the last optimizer step
        self.grad_norm = float("nan")
        self.skipped_steps = 0  # optimizer steps not taken: non-finite gradients (DeepSpeed's name)

    # -- the engine surface ----------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    def backward(self, loss: Any) -> None:
        """Accumulate this micro-batch's gradient; reduce over ranks only on the last one."""
        last = self.micro == self.plan.grad_accum - 1
        self.module.set_requires_gradient_sync(last)
        (loss / self.plan.grad_accum).backward()
        self.micro += 1

    def step(self) -> None:
        """At the accumulation boundary: clip, AdamW step, schedule step (as DeepSpeed does)."""
        import torch

        if self.micro < self.plan.grad_accum:
            return
        clip = self.cfg.optim.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), clip if clip > 0 else float("inf"))
        self.grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not math.isfinite(self.grad_norm):  # as DeepSpeed does: never apply it (the Trainer reports it)
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            self.micro = 0
            return
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        self.micro = 0

    def get_lr(self) -> list[float]:
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float:
        return self.grad_norm

    # -- state -----------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, Any] | None:
        """The whole model on rank 0 (collective), in the compute dtype as DeepSpeed exports it."""
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state: dict[str, Any] = get_model_state_dict(
            self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if dist.get_rank() != 0:
            return None
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.plan.precision)
        return {k: (v.to(dtype) if dtype and v.is_floating_point() else v) for k, v in state.items()}

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict[str, Any], save_latest: bool) -> None:
        """Collective: this rank's shards of model and optimizer through DCP, the schedule on rank 0."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        target = Path(save_dir) / tag
        model_state, optim_state = get_state_dict(self.module, self.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(target))
        if dist.get_rank() == 0:
            scheduler = dict(self.lr_scheduler.state_dict())
            (target / SCHEDULER_FILE).write_text(
                json.dumps({"scheduler": scheduler, "client_state": client_state}, indent=2)
            )

    def load_checkpoint(
        self, load_dir: str, tag: str, load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True
    ) -> tuple[str, dict[str, Any]]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        source = Path(load_dir) / tag
        model_state, optim_state = get_state_dict(self.module, self.optimizer)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(source))
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"] if load_optimizer_states else {},
        )
        saved = json.loads((source / SCHEDULER_FILE).read_text())
        if load_lr_scheduler_states:
            self.lr_scheduler.load_state_dict(saved["scheduler"])
        self.micro = 0
        return str(source), saved["client_state"]
