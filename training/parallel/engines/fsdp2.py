"""The FSDP2 training engine: `torch.distributed.fsdp.fully_shard` behind the engine interface the loop uses.

`training.loop.Trainer` drives an engine through a small surface: call it on a batch,
`backward`, `step` (an optimizer step at the accumulation boundary), `get_lr`,
`get_global_grad_norm`, `lr_scheduler`/`optimizer`/`module`, `train`/`eval`, and
`save_checkpoint`/`load_checkpoint`. DeepSpeed's engine has that surface; this class gives
it to a model sharded with FSDP2, so the loop's guardrails, rollbacks, metrics, checkpoints,
export and parity check are the same code for both backends.

Sharding: `fully_shard` per decoder layer and once at the root (embeddings, final norm and
head), over the data-parallel part of the device mesh (`training.parallel.mesh`): its shard
dimension (full shard), or (replicate x shard) for hybrid sharding: sharded within a node,
replicated across nodes (HSDP). Model-parallel dimensions (tensor + sequence parallel) are
applied to the model before it reaches the engine (`Trainer._build_engine`), as torchtitan
orders them: parallelize, then activation checkpointing, then compile, then `fully_shard`;
the parameters are then DTensors on the whole mesh. `grad_op` keeps the
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
from typing import TYPE_CHECKING, Any

from training.parallel import Engine, Strategy, mesh

if TYPE_CHECKING:  # the config validates against this registry while it is defined: no import cycle
    from training.config import DistributedConfig, PretrainConfig
    from training.planner import Plan

NAME = __name__.rsplit(".", 1)[-1]
SCHEDULER_FILE = "scheduler.json"
# FSDP2's ladder: gathered weights kept through backward (ZeRO-2-like traffic), full shard
# (ZeRO-3), hybrid shard across nodes (HSDP), then everything offloaded to host memory
# (CPUOffloadPolicy moves parameters, gradients and optimizer states together).
LADDER = [
    ("grad_op", 2, "none"),
    ("full", 3, "none"),
    ("hybrid", 3, "none"),
    ("full", 3, "optimizer+params"),
    ("hybrid", 3, "optimizer+params"),
]


def decoder_layers(model: Any) -> list[Any]:
    """The repeated blocks of a Hugging Face causal LM (Llama, Qwen2, Mistral: model.model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: no model.layers to shard per block")
    return list(layers.values()) if hasattr(layers, "values") else list(layers)  # a pipeline stage's ModuleDict


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
        whole = mesh.get(plan)
        data = mesh.data_mesh(whole, plan)
        self.stages = whole["pp"] if "pp" in plan.degrees else None  # the pipeline's sub-mesh
        reshard = plan.sharding != "grad_op"
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=data, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
        fully_shard(model, mesh=data, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
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
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if self.stages is not None:  # each pipeline stage holds some layers: the norm is over all stages
            import torch.distributed as dist

            norm = norm**2
            dist.all_reduce(norm, group=self.stages.get_group())
            norm = norm.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, clip if clip > 0 else float("inf"), norm, foreach=True)
        self.grad_norm = float(norm)
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

        if self.stages is None:
            state: dict[str, Any] = get_model_state_dict(
                self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        else:  # each stage gathers its slice (same names as the whole model's), rank 0 merges them
            gathered: dict[str, Any] = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
            own = {k: v.detach().cpu() for k, v in gathered.items()}
            state = {}
            # one copy per stage: the rank at 0 on every other dimension (a tensor-parallel slice is gathered whole)
            if all(v == 0 for k, v in mesh.coordinates(self.plan, dist.get_rank()).items() if k != "pp"):
                slices: list[Any] = [None] * self.stages.size()
                group = self.stages.get_group()
                dist.gather_object(own, slices if dist.get_rank() == 0 else None, dst=0, group=group)
                state = {k: v for part in slices if part for k, v in part.items()}
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


# -- the engine's registration -------------------------------------------------------------


def config_problem(d: DistributedConfig) -> str | None:
    if d.backend == NAME and d.offload == "optimizer":
        return "FSDP2 offloads parameters, gradients and optimizer states together: offload optimizer+params"
    if d.sharding == "hybrid" and d.num_nodes == 1:
        return "sharding: hybrid shards within a node and replicates across nodes: it needs num_nodes > 1"
    return None


def strategies(d: DistributedConfig) -> list[Strategy]:
    if d.backend != NAME and d.zero_stage != "auto":  # backend auto with a ZeRO stage fixed: DeepSpeed's
        return []
    return [
        Strategy(NAME, stage, sharding, offload)
        for sharding, stage, offload in LADDER
        if (d.sharding == "auto" or sharding == d.sharding)
        and (d.offload == "auto" or offload == d.offload)
        and (sharding != "hybrid" or d.num_nodes > 1 or d.sharding == "hybrid")
    ]


def traffic(strategy: Strategy, grad_accum: int) -> float:
    """grad_op gathers once per micro-batch and reduces once per step (GA + 1: unsharded gradients
    accumulate locally); full shard gathers twice and reduces every micro-batch (3 GA: accumulating
    unsharded gradients would cost what sharding saved)."""
    return grad_accum + 1.0 if strategy.sharding == "grad_op" else 3.0 * grad_accum


def memory(
    params: int, cfg: PretrainConfig, precision: str, ranks: int, nodes: int, strategy: Strategy, vocab: int, cpu: bool
) -> tuple[dict[str, float], float]:
    from training.planner import memory_fsdp2

    return memory_fsdp2(params, cfg, precision, ranks, nodes, strategy.sharding, strategy.offload, vocab, cpu=cpu)


def launcher(d: DistributedConfig) -> str:
    """Plain torch.distributed: torchrun on one node; across nodes DeepSpeed's runner (pdsh, SLURM's
    srun, OpenMPI) only starts the ranks."""
    return "torchrun" if d.num_nodes == 1 else "deepspeed"


def init_process_group() -> None:
    """RANK/WORLD_SIZE/MASTER_* come from torchrun or the node launcher."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def resume_problem(saved: dict[str, Any], plan: Plan, world: int) -> None:
    """DCP reshards on load: any world size and any mesh (tensor-parallel shards included)."""
    return None


def trl_arguments(spec: dict[str, Any]) -> dict[str, Any]:
    """accelerate's FSDP plugin, version 2: fully_shard per decoder layer (the model's
    _no_split_modules) and at the root; the saved model is gathered whole on rank 0."""
    return {
        "fsdp": "full_shard auto_wrap",
        "fsdp_config": {"version": 2, "reshard_after_forward": True, "state_dict_type": "FULL_STATE_DICT"},
    }


def align_problem(device_kind: str) -> str | None:
    if device_kind != "cuda":
        return (
            f"align.distributed.backend: {NAME} needs GPUs: accelerate's FSDP plugin does not shard CPU ranks "
            "(it trains them as plain DDP); use another engine on CPU"
        )
    return None


ENGINE = Engine(
    name=NAME,
    title="FSDP2",
    own_fields=("sharding",),
    config_problem=config_problem,
    strategies=strategies,
    label=lambda stage, sharding, offload: f"FSDP2 {sharding} offload={offload}",
    traffic=traffic,
    memory=memory,
    launcher=launcher,
    init_process_group=init_process_group,
    build=Fsdp2Engine,
    consolidated_state=lambda engine, plan: engine.full_state_dict(),
    resume_problem=resume_problem,
    write_run_files=lambda out_dir, cfg, plan: None,
    run_files=(),
    norm_unreported=lambda plan: False,
    libraries=("deepspeed",),  # its LR schedule is DeepSpeed's WarmupCosineLR
    mesh_dimensions=True,
    align_stage=lambda zero_stage: 3,  # parameters, gradients and optimizer states all sharded
    trl_arguments=trl_arguments,
    align_problem=align_problem,
    # the tiny MoE at 0.96x a plain transformers loop's tokens/s, DeepSpeed ZeRO-0 at 0.82x (docs/benchmarks.md)
    prefers_experts=True,
)
