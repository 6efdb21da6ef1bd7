"""DeepSpeed ZeRO as a training engine: stages 0-3 with optimizer and parameter offload.

The engine is DeepSpeed's own (`deepspeed.initialize`); this module gives the planner its ladder
(DDP = ZeRO-0 -> ZeRO-1 -> ZeRO-2 -> ZeRO-3 -> + optimizer offload -> + parameter offload), its
memory (`training.planner.memory_per_rank`, DeepSpeed's own layout) and traffic, and writes the
`ds_config.json` its ranks read. ZeRO shards optimizer state by rank: a checkpoint reloads only
into the same stage and, sharded, the same world size. DeepSpeed keeps weights as plain tensors,
so it does not compose with tensor parallelism (a DTensor mesh): that is FSDP2's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.parallel import Engine, Strategy

if TYPE_CHECKING:  # the config validates against this registry while it is defined: no import cycle
    from training.config import DistributedConfig, PretrainConfig
    from training.planner import Plan

NAME = __name__.rsplit(".", 1)[-1]
LADDER = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (3, "optimizer"), (3, "optimizer+params")]
CONFIG_FILE = "ds_config.json"


def build_ds_config(cfg: PretrainConfig, plan: Plan) -> dict[str, Any]:
    from training.planner import ALLGATHER_BUCKET, PREFETCH_BUCKET, REDUCE_BUCKET

    opt = cfg.optim
    zero: dict[str, Any] = {"stage": plan.zero_stage}
    if plan.zero_stage >= 1:  # DeepSpeed's defaults, stated so the planner's memory figures match them
        zero.update({"reduce_bucket_size": REDUCE_BUCKET, "allgather_bucket_size": ALLGATHER_BUCKET})
    if plan.zero_stage == 3:
        zero["stage3_prefetch_bucket_size"] = PREFETCH_BUCKET
    if plan.zero_stage >= 2:
        zero.update({"overlap_comm": False, "contiguous_gradients": True, "reduce_scatter": True})
    if plan.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if plan.offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if plan.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_batch_size": cfg.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.distributed.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": opt.grad_clip,
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            # torch's AdamW instead of the JIT-built fused CPU Adam: the fused op recomputes
            # its bias corrections differently after a checkpoint load, so a resumed run would
            # not reproduce an uninterrupted one bit for bit (and it costs a ~90 s build).
            "params": {
                "lr": opt.lr,
                "betas": [opt.beta1, opt.beta2],
                "eps": opt.eps,
                "weight_decay": opt.weight_decay,
                "torch_adam": plan.offload == "none",
            },
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": cfg.max_steps,
                "warmup_num_steps": opt.warmup_steps,
                "warmup_type": "linear",
                "warmup_min_ratio": 0.0,
                "cos_min_ratio": opt.min_lr_ratio,
            },
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if plan.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif plan.precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return config


def strategies(d: DistributedConfig) -> list[Strategy]:
    out = [
        Strategy(NAME, st, "", off)
        for st, off in LADDER
        if (d.zero_stage == "auto" or st == d.zero_stage) and (d.offload == "auto" or off == d.offload)
    ]
    if not out and d.backend == NAME:  # an explicit combination outside the ladder, e.g. ZeRO-2 + offload
        out.append(
            Strategy(
                NAME,
                0 if d.zero_stage == "auto" else int(d.zero_stage),
                "",
                "none" if d.offload == "auto" else d.offload,
            )
        )
    return out


def traffic(strategy: Strategy, grad_accum: int) -> float:
    """ZeRO-0 all-reduces once at the accumulation boundary (2); ZeRO-1 reduce-scatters there and
    all-gathers the updated weights (2); ZeRO-2 reduce-scatters every micro-batch (GA + 1); ZeRO-3
    also gathers the weights for forward and backward of every micro-batch (3 GA)."""
    return {0: 2.0, 1: 2.0, 2: grad_accum + 1.0, 3: 3.0 * grad_accum}[strategy.zero_stage]


def memory(
    params: int, cfg: PretrainConfig, precision: str, ranks: int, nodes: int, strategy: Strategy, vocab: int, cpu: bool
) -> tuple[dict[str, float], float]:
    from training.planner import memory_per_rank

    return memory_per_rank(params, cfg, precision, ranks * nodes, strategy.zero_stage, strategy.offload, vocab, cpu=cpu)


def launcher(d: DistributedConfig) -> str:
    """torchrun on one node when `launcher: auto` (DeepSpeed's runner and its launch.py each import
    deepspeed, 9 CPU-s a launch, only to start the ranks); DeepSpeed's runner with a hostfile or
    several nodes, or when asked for."""
    if d.launcher == "auto":
        return "torchrun" if d.num_nodes == 1 and not d.hostfile else "deepspeed"
    return d.launcher


def init_process_group() -> None:
    import deepspeed
    import torch

    from training.device_setup import disable_shm_comm_op

    disable_shm_comm_op()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def build(model: Any, cfg: PretrainConfig, plan: Plan) -> Any:
    import deepspeed

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=build_ds_config(cfg, plan))
    return engine


def consolidated_state(engine: Any, plan: Plan) -> dict[str, Any] | None:
    """Full state dict on rank 0 (collective under ZeRO-3), None elsewhere."""
    import torch.distributed as dist

    if plan.zero_stage == 3:
        state: dict[str, Any] | None = engine._zero3_consolidated_16bit_state_dict()
        return state
    return {k: v.detach().cpu() for k, v in engine.module.state_dict().items()} if dist.get_rank() == 0 else None


def resume_problem(saved: dict[str, Any], plan: Plan, world: int) -> str | None:
    stage, saved_world = saved.get("zero_stage", plan.zero_stage), saved.get("world_size", world)
    if stage != plan.zero_stage or (stage > 0 and saved_world != world):
        return (
            f"written with ZeRO-{stage} on {saved_world} rank(s); this run uses ZeRO-{plan.zero_stage} on {world}. "
            "Set pretrain.distributed.zero_stage and num_ranks back"
        )
    return None


def write_run_files(out_dir: Path, cfg: PretrainConfig, plan: Plan) -> None:
    from lmforge.hashing import atomic_write_json

    atomic_write_json(out_dir / CONFIG_FILE, build_ds_config(cfg, plan))


def trl_arguments(spec: dict[str, Any]) -> dict[str, Any]:
    """accelerate's DeepSpeed plugin for a ZeRO stage above 0 (its "auto" values follow TRL's
    arguments); ZeRO-0 is plain DDP, no plugin."""
    if not spec["zero_stage"]:
        return {}
    ds: dict[str, Any] = {
        "zero_optimization": {"stage": spec["zero_stage"]},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": False},
    }
    if spec["zero_stage"] == 3:
        ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    return {"deepspeed": ds}


ENGINE = Engine(
    name=NAME,
    title="DeepSpeed",
    own_fields=("zero_stage",),
    config_problem=lambda d: None,
    strategies=strategies,
    label=lambda stage, sharding, offload: f"ZeRO-{stage} offload={offload}",
    traffic=traffic,
    memory=memory,
    launcher=launcher,
    init_process_group=init_process_group,
    build=build,
    consolidated_state=consolidated_state,
    resume_problem=resume_problem,
    write_run_files=write_run_files,
    run_files=(CONFIG_FILE,),
    norm_unreported=lambda plan: plan.zero_stage == 0,
    libraries=("deepspeed",),
    mesh_dimensions=False,
    align_stage=lambda zero_stage: zero_stage,
    trl_arguments=trl_arguments,
    align_problem=lambda device_kind: None,
)
