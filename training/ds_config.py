"""DeepSpeed configuration generated from the typed pretraining config and the plan."""

from __future__ import annotations

from typing import Any

from training.config import PretrainConfig
from training.planner import ALLGATHER_BUCKET, PREFETCH_BUCKET, REDUCE_BUCKET, Plan


def build_ds_config(cfg: PretrainConfig, plan: Plan) -> dict[str, Any]:
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
