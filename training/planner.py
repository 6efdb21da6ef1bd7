"""The parallelism planner and compute budget.

Memory per rank is estimated for weights, gradients and Adam states under each strategy,
plus activations at the configured micro-batch and sequence length (after Korthikanti et al.
2022, without sequence parallelism), and the least-sharded strategy that fits is chosen:
DDP (ZeRO-0) -> ZeRO-2 -> ZeRO-3 -> ZeRO-3 + optimizer offload -> + parameter offload.
Sharding costs communication, so it is used only when memory demands it.

The budget reports training FLOPs (6*N*D, and with attention), the Chinchilla-optimal
token count (about 20 tokens per parameter) and the time at an assumed MFU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmforge.errors import ConfigError
from training.config import ModelConfig, PretrainConfig
from training.device import DeviceInfo, detect_device

GIB = 1024**3
STRATEGIES = [(0, "none"), (2, "none"), (3, "none"), (3, "optimizer"), (3, "optimizer+params")]


def count_parameters(model: ModelConfig, vocab_size: int) -> int:
    h, kv_dim = model.hidden_size, model.num_kv_heads * (model.hidden_size // model.num_heads)
    per_layer = 2 * h * h + 2 * h * kv_dim + 3 * h * model.intermediate_size + 2 * h
    embeddings = vocab_size * h * (1 if model.tie_embeddings else 2)
    return embeddings + model.num_layers * per_layer + h


@dataclass
class Plan:
    zero_stage: int
    offload: str
    num_ranks: int
    num_nodes: int
    world_size: int
    grad_accum: int
    precision: str
    params: int
    per_rank_gib: dict[str, float]
    host_gib: float
    capacity_gib: float
    reasoning: list[str] = field(default_factory=list)
    budget: dict[str, Any] = field(default_factory=dict)


def resolve_precision(precision: str, device: DeviceInfo) -> str:
    if precision != "auto":
        return precision
    return "bf16" if device.bf16 else "fp32"  # CUDA bf16, or CPU AVX512-BF16/AMX


def devices_used(plan_world: int, device: DeviceInfo) -> int:
    """Accelerators the run occupies: its GPU ranks, or the one CPU host."""
    return plan_world if device.kind == "cuda" else 1


def memory_per_rank(params: int, cfg: PretrainConfig, precision: str, world: int, stage: int,
                    offload: str, vocab_size: int) -> tuple[dict[str, float], float]:
    """({component: GiB on each device}, GiB of host memory needed for offloaded states)."""
    w_bytes = 4 if precision == "fp32" else 2
    weights, grads = params * w_bytes, params * w_bytes
    optimizer = params * (8 if precision == "fp32" else 12)  # Adam m, v (+ fp32 master copy)
    if stage >= 1:
        optimizer /= world
    if stage >= 2:
        grads /= world
    if stage >= 3:
        weights /= world
    host = 0.0
    if offload in ("optimizer", "optimizer+params"):
        host += optimizer
        optimizer = 0
    if offload == "optimizer+params":
        host += weights
        weights = 0
    m, s, mb = cfg.model, cfg.seq_len, cfg.distributed.micro_batch_size
    # 34*s*b*h bytes per layer in 16-bit; SDPA/flash attention never stores the s x s scores,
    # so the 5*a*s^2*b term of Korthikanti et al. does not apply.
    layer = 34 * s * mb * m.hidden_size * (w_bytes / 2)
    activations = (2 * s * mb * m.hidden_size * w_bytes * m.num_layers + layer
                   if cfg.distributed.activation_checkpointing else layer * m.num_layers)
    logits = s * mb * vocab_size * 4 * 2  # fp32 logits and their gradient
    parts = {"weights": weights, "gradients": grads, "optimizer": optimizer, "activations": activations + logits}
    return {k: v / GIB for k, v in parts.items()}, host / GIB


def compute_budget(params: int, cfg: PretrainConfig, peak_tflops: float | None, devices: int) -> dict[str, Any]:
    tokens = cfg.max_steps * cfg.global_batch_size * cfg.seq_len
    attention = 12 * cfg.model.num_layers * cfg.model.hidden_size * cfg.seq_len  # per token, fwd+bwd
    budget: dict[str, Any] = {
        "params": params, "tokens": tokens, "flops_6nd": 6 * params * tokens,
        "flops_with_attention": (6 * params + attention) * tokens,
        "chinchilla_optimal_tokens": 20 * params, "tokens_per_param": round(tokens / params, 3),
    }
    if peak_tflops:
        seconds = budget["flops_with_attention"] / (peak_tflops * 1e12 * devices * cfg.assumed_mfu)
        budget.update({"peak_tflops_per_device": round(peak_tflops, 2), "assumed_mfu": cfg.assumed_mfu,
                       "estimated_hours": round(seconds / 3600, 4)})
    return budget


def resolve_ranks(cfg: PretrainConfig, device: DeviceInfo) -> int:
    if cfg.distributed.num_ranks != "auto":
        return int(cfg.distributed.num_ranks)
    return device.count if device.kind == "cuda" else 2


def plan_parallelism(cfg: PretrainConfig, vocab_size: int = 8192, device: DeviceInfo | None = None,
                     peak_tflops: float | None = None) -> Plan:
    """Choose ZeRO stage / offload (unless fixed in the config) and explain the choice."""
    device = device or detect_device()
    ranks = resolve_ranks(cfg, device)
    world = ranks * cfg.distributed.num_nodes
    per_step = cfg.distributed.micro_batch_size * world
    if cfg.global_batch_size % per_step:
        raise ConfigError(f"pretrain.global_batch_size {cfg.global_batch_size} is not a multiple of "
                          f"micro_batch_size x world size = {cfg.distributed.micro_batch_size} x {world}")
    precision = resolve_precision(cfg.precision, device)
    params = count_parameters(cfg.model, vocab_size)
    ranks_sharing = ranks if device.kind == "cpu" else 1  # CPU ranks share the host's memory
    capacity = device.memory_bytes / GIB / ranks_sharing * (1 - cfg.distributed.memory_headroom)
    # offloaded states live in the node's RAM, shared by its ranks (unknown for a machine described by hand)
    host_capacity = (device.host_memory_bytes / GIB * (1 - cfg.distributed.memory_headroom)
                     if device.host_memory_bytes else float("inf"))
    reasons = [f"{params / 1e6:.2f}M parameters, {precision}, {world} rank(s) ({ranks}/node x {cfg.distributed.num_nodes}), "
               f"{capacity:.1f} GiB usable per rank on {device.kind} ({device.name})"]
    wanted_stage, wanted_offload = cfg.distributed.zero_stage, cfg.distributed.offload
    candidates = [(st, off) for st, off in STRATEGIES
                  if (wanted_stage == "auto" or st == wanted_stage) and (wanted_offload == "auto" or off == wanted_offload)]
    if not candidates:  # an explicit combination outside the ladder, e.g. ZeRO-1 or ZeRO-2 + offload
        candidates = [(0 if wanted_stage == "auto" else int(wanted_stage), "none" if wanted_offload == "auto" else wanted_offload)]
    chosen = None
    for stage, offload in candidates:
        parts, host = memory_per_rank(params, cfg, precision, world, stage, offload, vocab_size)
        total = sum(parts.values())
        if device.kind == "cpu":  # "offloaded" states stay in the same memory on a CPU-only machine
            total += host
        host_fits = device.kind == "cpu" or host * ranks <= host_capacity
        fits = total <= capacity and host_fits
        offloaded = f", {host:.3f} GiB/rank offloaded to host" if host else ""
        verdict = "fits" if fits else "too big" if total > capacity else f"host RAM too small ({host_capacity:.1f} GiB usable)"
        reasons.append(f"ZeRO-{stage} offload={offload}: {total:.3f} GiB/rank "
                       f"({', '.join(f'{k} {v:.3f}' for k, v in parts.items())}{offloaded}) -> {verdict}")
        if fits:
            chosen = (stage, offload, parts, host)
            break
    if chosen is None:
        raise ConfigError(f"pretrain.distributed: no strategy fits in {capacity:.1f} GiB per rank; the most sharded, "
                          f"{reasons[-1]}; lower micro_batch_size, enable activation_checkpointing, or add ranks")
    stage, offload, parts, host = chosen
    reasons.append(f"chosen: ZeRO-{stage}, offload {offload} (least sharding that fits)")
    plan = Plan(stage, offload, ranks, cfg.distributed.num_nodes, world, cfg.global_batch_size // per_step,
                precision, params, parts, host, capacity, reasons)
    plan.budget = compute_budget(params, cfg, peak_tflops or cfg.peak_tflops, devices_used(world, device))
    return plan


def format_plan(plan: Plan) -> str:
    lines = ["parallelism plan:"] + [f"  {r}" for r in plan.reasoning]
    lines.append(f"  gradient accumulation: {plan.grad_accum} micro-batches per step")
    lines.append("compute budget:")
    lines += [f"  {k}: {v:,}" if isinstance(v, int) else f"  {k}: {v}" for k, v in plan.budget.items()]
    return "\n".join(lines)
