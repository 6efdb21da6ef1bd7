"""The parallelism planner and compute budget.

Memory per rank is estimated the way DeepSpeed lays it out: 16-bit weights and gradients,
and with bf16/fp16 the fp32 master weights, the fp32 gradient buffer DeepSpeed keeps for the
optimizer step and Adam's two moments (2 + 2 + 4 + 4 + 8 = 20 bytes per parameter; fp32
training: 4 + 4 + 8 = 16), sharded by ZeRO stage (1: optimizer states and fp32 gradients;
2: also 16-bit gradients; 3: also weights), plus the communication buckets it allocates
(`reduce_bucket_size`, `allgather_bucket_size`, ZeRO-3's prefetch bucket) and activations at
the configured micro-batch and sequence length (after Korthikanti et al. 2022, without
sequence parallelism). Measured runs add what DeepSpeed's formulas leave out and the planner
counts too: ZeRO-0's flattened fp32 all-reduce buffer, the 4 B/parameter temporary of torch's
multi-tensor AdamW step, and on CPU the fp32 model the engine was built from. ZeRO-2's figure is
DeepSpeed's own `estimate_zero2_model_states_mem_needs` (2 + 18/N bytes per parameter);
`tests/test_training_units.py` checks the planner against it and against memory measured on a
real run.

The least-sharded strategy that fits is chosen: DDP (ZeRO-0) -> ZeRO-1 -> ZeRO-2 -> ZeRO-3
-> ZeRO-3 + optimizer offload -> + parameter offload. Sharding costs communication, so it is
used only when memory demands it.

The budget reports training FLOPs (6*N*D over the parameters that do matmuls -- an untied
input embedding is a lookup, not a matmul -- and with attention), the Chinchilla-optimal
token count (about 20 tokens per parameter) and the time at an assumed MFU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmforge.errors import ConfigError
from training.config import ModelConfig, PretrainConfig
from training.device import DeviceInfo, detect_device

GIB = 1024**3
STRATEGIES = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (3, "optimizer"), (3, "optimizer+params")]
# DeepSpeed's defaults, which ds_config.json sets explicitly (elements, in the 16-bit dtype)
REDUCE_BUCKET = 500_000_000
ALLGATHER_BUCKET = 500_000_000
PREFETCH_BUCKET = 50_000_000


def count_parameters(model: ModelConfig, vocab_size: int) -> int:
    h = model.hidden_size
    embeddings = vocab_size * h * (1 if model.tie_embeddings else 2)
    return embeddings + model.num_layers * layer_parameters(model) + h


def layer_parameters(model: ModelConfig) -> int:
    h, kv_dim = model.hidden_size, model.num_kv_heads * (model.hidden_size // model.num_heads)
    return 2 * h * h + 2 * h * kv_dim + 3 * h * model.intermediate_size + 2 * h


def matmul_parameters(params: int, model: ModelConfig, vocab_size: int) -> int:
    """Parameters that take part in matmuls: all but an untied input embedding (a table lookup)."""
    return params - (0 if model.tie_embeddings else vocab_size * model.hidden_size)


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


def memory_per_rank(
    params: int,
    cfg: PretrainConfig,
    precision: str,
    world: int,
    stage: int,
    offload: str,
    vocab_size: int,
    cpu: bool = False,
) -> tuple[dict[str, float], float]:
    """({component: GiB on each device}, GiB of host memory needed for offloaded states).

    `cpu`: the ranks run on the host, where the fp32 model the engine is built from (before
    DeepSpeed casts it) stays in the process: the allocator keeps the pages.
    """
    w_bytes = 4 if precision == "fp32" else 2
    mixed = precision != "fp32"
    weights: float = params * w_bytes
    grads: float = params * w_bytes
    # fp32 master weights + fp32 gradient buffer (mixed precision only) + Adam m and v
    optimizer: float = params * ((4 + 4 + 8) if mixed else 8)
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
    buckets = 0.0
    if stage == 0 and world > 1:  # gradients flattened for the all-reduce, and cast to fp32 for it
        buckets = params * (w_bytes + 4)
    elif stage in (1, 2):
        buckets = (min(REDUCE_BUCKET, params) + min(ALLGATHER_BUCKET, params)) * w_bytes
    elif stage == 3:  # the reduce bucket, the prefetch bucket, and the largest layer gathered whole
        buckets = (min(REDUCE_BUCKET, params) + min(PREFETCH_BUCKET, params) + layer_parameters(cfg.model)) * w_bytes
    m, s, mb = cfg.model, cfg.seq_len, cfg.distributed.micro_batch_size
    # 34*s*b*h bytes per layer in 16-bit; SDPA/flash attention never stores the s x s scores,
    # so the 5*a*s^2*b term of Korthikanti et al. does not apply.
    layer = 34 * s * mb * m.hidden_size * (w_bytes / 2)
    activations = (
        2 * s * mb * m.hidden_size * w_bytes * m.num_layers + layer
        if cfg.distributed.activation_checkpointing
        else layer * m.num_layers
    )
    logits = s * mb * vocab_size * 4 * 2  # fp32 logits and their gradient
    # torch's multi-tensor AdamW materialises sqrt(v) for the states it updates (4 B per parameter)
    workspace = 0.0 if offload != "none" else params * 4 / (world if stage >= 1 else 1)
    parts = {
        "weights": weights,
        "gradients": grads,
        "optimizer": optimizer,
        "optimizer_step": workspace,
        "buckets": buckets,
        "activations": activations + logits,
    }
    if cpu and mixed:
        parts["fp32_build_copy"] = params * 4
    return {k: v / GIB for k, v in parts.items()}, host / GIB


def compute_budget(
    params: int, cfg: PretrainConfig, peak_tflops: float | None, devices: int, vocab_size: int = 0
) -> dict[str, Any]:
    tokens = cfg.max_steps * cfg.global_batch_size * cfg.seq_len
    attention = 12 * cfg.model.num_layers * cfg.model.hidden_size * cfg.seq_len  # per token, fwd+bwd
    dense = matmul_parameters(params, cfg.model, vocab_size)
    budget: dict[str, Any] = {
        "params": params,
        "tokens": tokens,
        "flops_6nd": 6 * dense * tokens,
        "flops_with_attention": (6 * dense + attention) * tokens,
        "chinchilla_optimal_tokens": 20 * params,
        "tokens_per_param": round(tokens / params, 3),
    }
    if peak_tflops:
        seconds = budget["flops_with_attention"] / (peak_tflops * 1e12 * devices * cfg.assumed_mfu)
        budget.update(
            {
                "peak_tflops_per_device": round(peak_tflops, 2),
                "assumed_mfu": cfg.assumed_mfu,
                "estimated_hours": round(seconds / 3600, 4),
            }
        )
    return budget


def resolve_ranks(cfg: PretrainConfig, device: DeviceInfo) -> int:
    if cfg.distributed.num_ranks != "auto":
        return int(cfg.distributed.num_ranks)
    return device.count if device.kind == "cuda" else 2


def plan_parallelism(
    cfg: PretrainConfig, vocab_size: int = 8192, device: DeviceInfo | None = None, peak_tflops: float | None = None
) -> Plan:
    """Choose ZeRO stage / offload (unless fixed in the config) and explain the choice."""
    device = device or detect_device()
    ranks = resolve_ranks(cfg, device)
    world = ranks * cfg.distributed.num_nodes
    per_step = cfg.distributed.micro_batch_size * world
    if cfg.global_batch_size % per_step:
        raise ConfigError(
            f"pretrain.global_batch_size {cfg.global_batch_size} is not a multiple of "
            f"micro_batch_size x world size = {cfg.distributed.micro_batch_size} x {world}"
        )
    precision = resolve_precision(cfg.precision, device)
    params = count_parameters(cfg.model, vocab_size)
    ranks_sharing = ranks if device.kind == "cpu" else 1  # CPU ranks share the host's memory
    capacity = device.memory_bytes / GIB / ranks_sharing * (1 - cfg.distributed.memory_headroom)
    # offloaded states live in the node's RAM, shared by its ranks (unknown for a machine described by hand)
    host_capacity = (
        device.host_memory_bytes / GIB * (1 - cfg.distributed.memory_headroom)
        if device.host_memory_bytes
        else float("inf")
    )
    reasons = [
        f"{params / 1e6:.2f}M parameters, {precision}, {world} rank(s) ({ranks}/node x {cfg.distributed.num_nodes}), "
        f"{capacity:.1f} GiB usable per rank on {device.kind} ({device.name})"
    ]
    wanted_stage, wanted_offload = cfg.distributed.zero_stage, cfg.distributed.offload
    candidates = [
        (st, off)
        for st, off in STRATEGIES
        if (wanted_stage == "auto" or st == wanted_stage) and (wanted_offload == "auto" or off == wanted_offload)
    ]
    if not candidates:  # an explicit combination outside the ladder, e.g. ZeRO-2 + offload
        candidates = [
            (0 if wanted_stage == "auto" else int(wanted_stage), "none" if wanted_offload == "auto" else wanted_offload)
        ]
    chosen = None
    for stage, offload in candidates:
        parts, host = memory_per_rank(
            params, cfg, precision, world, stage, offload, vocab_size, cpu=device.kind == "cpu"
        )
        total = sum(parts.values())
        if device.kind == "cpu":  # "offloaded" states stay in the same memory on a CPU-only machine
            total += host
        host_fits = device.kind == "cpu" or host * ranks <= host_capacity
        fits = total <= capacity and host_fits
        offloaded = f", {host:.3f} GiB/rank offloaded to host" if host else ""
        verdict = (
            "fits"
            if fits
            else "too big"
            if total > capacity
            else f"host RAM too small ({host_capacity:.1f} GiB usable)"
        )
        reasons.append(
            f"ZeRO-{stage} offload={offload}: {total:.3f} GiB/rank "
            f"({', '.join(f'{k} {v:.3f}' for k, v in parts.items())}{offloaded}) -> {verdict}"
        )
        if fits:
            chosen = (stage, offload, parts, host)
            break
    if chosen is None:
        raise ConfigError(
            f"pretrain.distributed: no strategy fits in {capacity:.1f} GiB per rank; the most sharded, "
            f"{reasons[-1]}; lower micro_batch_size, enable activation_checkpointing, or add ranks"
        )
    stage, offload, parts, host = chosen
    reasons.append(f"chosen: ZeRO-{stage}, offload {offload} (least sharding that fits)")
    plan = Plan(
        stage,
        offload,
        ranks,
        cfg.distributed.num_nodes,
        world,
        cfg.global_batch_size // per_step,
        precision,
        params,
        parts,
        host,
        capacity,
        reasons,
    )
    plan.budget = compute_budget(params, cfg, peak_tflops or cfg.peak_tflops, devices_used(world, device), vocab_size)
    return plan


def format_plan(plan: Plan) -> str:
    lines = ["parallelism plan:"] + [f"  {r}" for r in plan.reasoning]
    lines.append(f"  gradient accumulation: {plan.grad_accum} micro-batches per step")
    lines.append("compute budget:")
    lines += [f"  {k}: {v:,}" if isinstance(v, int) else f"  {k}: {v}" for k, v in plan.budget.items()]
    return "\n".join(lines)
