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

FSDP2 layouts are estimated beside them (`memory_fsdp2`): fp32 sharded parameters, gradients
and Adam states over the shard group, plus the gathered layers in the compute dtype.

Both families are laid out on one ladder each: DDP (ZeRO-0) -> ZeRO-1 -> ZeRO-2 -> ZeRO-3 ->
ZeRO-3 + optimizer offload -> + parameter offload, and FSDP2 grad_op -> full shard -> hybrid
(several nodes) -> full/hybrid + offload. Of the strategies that fit, the one chosen moves the
least: no offload before offload, then the least traffic across nodes, then the least traffic
in all (`communication`), then `pretrain.distributed.prefer_backend` on a tie between the
families, then the least sharding. `lmforge plan` prints every candidate with its memory,
traffic and verdict.

The budget reports training FLOPs (6*N*D over the parameters that do matmuls -- an untied
input embedding is a lookup, not a matmul -- and with attention), the Chinchilla-optimal
token count (about 20 tokens per parameter) and the time at an assumed MFU.

Float8 (`pretrain.float8`, `resolve_float8`) is resolved here too: float8 matmuls need an NVIDIA
GPU of compute capability 8.9 or newer (Ada, Hopper), so `auto` turns it on only there, `on` is
refused elsewhere, and `emulate` runs torchao's emulation anywhere. The memory figures do not
count it (its casts are transient; weights, gradients and optimizer states keep their dtypes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lmforge.errors import ConfigError
from training.config import ModelConfig, PretrainConfig
from training.device import DeviceInfo, detect_device
from training.parallel import ENGINE_NAMES, Strategy, all_dimensions, all_engines, engine

GIB = 1024**3
# DeepSpeed's defaults, which ds_config.json sets explicitly (elements, in the 16-bit dtype)
REDUCE_BUCKET = 500_000_000
ALLGATHER_BUCKET = 500_000_000
PREFETCH_BUCKET = 50_000_000


def count_parameters(model: ModelConfig, vocab_size: int) -> int:
    h = model.hidden_size
    embeddings = vocab_size * h * (1 if model.tie_embeddings else 2)
    return embeddings + model.num_layers * layer_parameters(model) + h


def layer_parameters(model: ModelConfig) -> int:
    """One decoder layer's parameters (a mixture of experts: every expert, the router and a shared one)."""
    h, kv_dim = model.hidden_size, model.num_kv_heads * (model.hidden_size // model.num_heads)
    attention = 2 * h * h + 2 * h * kv_dim + 2 * h
    experts = model.experts
    if not experts.enabled:
        return attention + 3 * h * model.intermediate_size
    expert = 3 * h * (experts.intermediate_size or model.intermediate_size)
    shared = expert + h if experts.shared_expert else 0  # its SwiGLU and its sigmoid gate
    return attention + experts.num * expert + h * experts.num + shared


def inactive_parameters(model: ModelConfig) -> int:
    """Parameters a token does not use: the experts it is not routed to (0 for a dense model)."""
    experts = model.experts
    if not experts.enabled:
        return 0
    expert = 3 * model.hidden_size * (experts.intermediate_size or model.intermediate_size)
    return model.num_layers * (experts.num - experts.top_k) * expert


def matmul_parameters(params: int, model: ModelConfig, vocab_size: int) -> int:
    """Parameters that take part in a token's matmuls: all but an untied input embedding (a table
    lookup) and, in a mixture of experts, the experts it is not routed to (FLOPs and MFU count these
    active parameters; memory counts all)."""
    return params - (0 if model.tie_embeddings else vocab_size * model.hidden_size) - inactive_parameters(model)


@dataclass
class Plan:
    zero_stage: int  # DeepSpeed's ZeRO stage; for FSDP2 the stage with the same memory layout
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
    backend: str = ENGINE_NAMES[0]  # a training.parallel engine
    sharding: str = ""  # FSDP2: full | grad_op | hybrid
    compile: bool = False
    float8: str = "off"  # resolved pretrain.float8: off | on | emulate
    degrees: dict[str, int] = field(default_factory=dict)  # model-parallel mesh dimensions above 1: {"tp": 2}

    @property
    def label(self) -> str:
        return engine(self.backend).label(self.zero_stage, self.sharding, self.offload)

    @property
    def model_parallel(self) -> int:
        return math.prod(self.degrees.values())

    @property
    def data_parallel(self) -> int:
        """Ranks that read different batches (the world divided by the model-parallel degrees)."""
        return self.world_size // self.model_parallel


OFFLOAD_ORDER = {"none": 0, "optimizer": 1, "optimizer+params": 2}


def communication(strategy: Strategy, grad_accum: int, ranks: int, nodes: int) -> tuple[float, float]:
    """(volume crossing nodes, total volume) per rank per optimizer step, in units of the model's size.

    Each engine counts its own total (`Engine.traffic`). Hybrid sharding shards within a
    node: its cross-node traffic is the all-reduce of each rank's shard between replicas
    (2 GA / ranks per node); everything else stays inside the node.
    """
    ga = grad_accum
    total = engine(strategy.backend).traffic(strategy, ga)
    if nodes == 1:
        return 0.0, total
    if strategy.sharding == "hybrid":
        return 2.0 * ga / ranks, total
    return total, total


def candidate_strategies(cfg: PretrainConfig, model_parallel: bool = False) -> list[Strategy]:
    """Every engine's ladder (or the one the config names), narrowed by what the configuration
    fixes; with model-parallel dimensions, only engines that compose with a device mesh."""
    d = cfg.distributed
    out: list[Strategy] = []
    for e in all_engines():
        if d.backend in ("auto", e.name) and (e.mesh_dimensions or not model_parallel):
            out += e.strategies(d)
    return out


def memory_fsdp2(
    params: int,
    cfg: PretrainConfig,
    precision: str,
    ranks: int,
    nodes: int,
    sharding: str,
    offload: str,
    vocab_size: int,
    cpu: bool = False,
) -> tuple[dict[str, float], float]:
    """({component: GiB per device}, GiB of host memory per rank) for an FSDP2 layout.

    Sharded over every rank (full, grad_op) or over the ranks of one node (hybrid): the fp32
    parameters (the master copy), their fp32 gradients, Adam's m and v and AdamW's step
    workspace. Gathered: in the compute dtype, two decoder layers at a time (the current one
    and the prefetched next) plus the root's own parameters (embeddings, final norm, head),
    with one layer's unsharded gradient in fp32 for the reduce-scatter; grad_op keeps every
    gathered weight through backward and accumulates unsharded gradients between reductions.
    """
    group = ranks if sharding == "hybrid" else ranks * nodes
    compute = 4 if precision == "fp32" else 2
    layer = layer_parameters(cfg.model)
    root = params - cfg.model.num_layers * layer
    sharded = {
        "weights": params * 4 / group,
        "gradients": params * 4 / group,
        "optimizer": params * 8 / group,
        "optimizer_step": params * 4 / group,
    }
    host = 0.0
    if offload != "none":
        host = sum(sharded.values())
        sharded = dict.fromkeys(sharded, 0.0)
    if sharding == "grad_op":
        gathered = params * compute + params * 4  # all weights kept from forward to backward; local gradients
    else:
        gathered = (root + 2 * layer) * compute + layer * 4
    dense, _ = memory_per_rank(params, cfg, precision, ranks * nodes, 0, "none", vocab_size)
    parts = {
        **sharded,
        "gathered": gathered,
        "activations": dense["activations"] * GIB,
        "logits": dense["logits"] * GIB,
    }
    if cpu:
        parts["fp32_build_copy"] = params * 4  # the model is built whole in fp32 before it is sharded
    return {k: v / GIB for k, v in parts.items()}, host / GIB


def resolve_precision(precision: str, device: DeviceInfo) -> str:
    if precision != "auto":
        return precision
    return "bf16" if device.bf16 else "fp32"  # CUDA bf16, or CPU AVX512-BF16/AMX


FLOAT8_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0) and newer


def float8_supported(device: DeviceInfo) -> bool:
    return device.kind == "cuda" and device.capability is not None and tuple(device.capability) >= FLOAT8_CAPABILITY


def describe_capability(device: DeviceInfo) -> str:
    """What this device offers float8, in words (for the plan and the refusal)."""
    if device.kind != "cuda":
        return f"this machine has no CUDA GPU ({device.kind}: {device.name})"
    if device.capability is None:
        return f"the compute capability of {device.name} is unknown (not an NVIDIA GPU, or not a known model)"
    return f"{device.name} has compute capability {device.capability[0]}.{device.capability[1]}"


def resolve_float8(float8: str, device: DeviceInfo) -> str:
    """`pretrain.float8` on this device: off | on | emulate. `on` where the GPU lacks float8 is refused."""
    if float8 == "auto":
        return "on" if float8_supported(device) else "off"
    if float8 == "on" and not float8_supported(device):
        raise ConfigError(
            f"pretrain.float8: on needs a CUDA GPU of compute capability 8.9+ (Ada, Hopper or newer), but "
            f"{describe_capability(device)}; set pretrain.float8=emulate to check its numerics on CPU, "
            "or auto to use it only where the hardware has it"
        )
    return float8


def float8_reason(setting: str, resolved: str, device: DeviceInfo) -> str:
    """The plan's line on float8: what was chosen and why."""
    what = {
        "on": "float8 matmuls (torchao) in the attention and MLP projections",
        "emulate": "float8 emulated by torchao (slow: numerics checks)",
        "off": "off",
    }[resolved]
    if setting != "auto":
        return f"float8: {what}"
    if resolved == "on":
        return f"float8: {what} (auto: {describe_capability(device)} >= 8.9)"
    return f"float8: off (auto: needs a CUDA GPU of compute capability 8.9+; {describe_capability(device)})"


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
        "activations": activations,
        # whole on every rank, also under tensor parallelism (the head's logits are gathered for the loss)
        "logits": logits,
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
        "active_params": params - inactive_parameters(cfg.model),
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


def mesh_label(degrees: dict[str, int]) -> str:
    return " x ".join(f"{name} {size}" for name, size in degrees.items()) or "data parallel only"


def dimension_by_mesh_name(name: str) -> Any:
    return next(d for d in all_dimensions() if d.name == name)


def mesh_candidates(cfg: PretrainConfig, ranks: int, vocab_size: int) -> list[dict[str, int]]:
    """The model-parallel degrees to consider: the configured ones, or for `auto` every degree
    that divides the ranks of a node (inner groups stay inside a node) and the model. An outer
    dimension (pipeline stages) is planned across nodes: every degree that divides the node count
    (a stage is whole nodes)."""
    shape = {**cfg.model.model_dump(), "vocab_size": vocab_size, "seq_len": cfg.seq_len}
    options: list[list[tuple[str, int]]] = [[]]
    for dim in all_dimensions():
        setting = getattr(cfg.distributed, dim.field)
        span = ranks * cfg.distributed.num_nodes if dim.outer else ranks
        if setting == "auto" and dim.outer:
            nodes = cfg.distributed.num_nodes
            sizes = [n for n in (1, 2, 4, 8, 16) if n <= nodes and nodes % n == 0 and not dim.shape_problem(shape, n)]
        elif setting == "auto":
            sizes = [n for n in (1, 2, 4, 8, 16) if n <= ranks and ranks % n == 0 and not dim.shape_problem(shape, n)]
        else:
            degree = int(setting)
            if degree > 1 and span % degree:
                where = f"the {span} rank(s) in all" if dim.outer else f"the {ranks} rank(s) of a node"
                inside = "" if dim.outer else f" ({dim.title} groups stay inside one node)"
                raise ConfigError(f"pretrain.distributed.{dim.field} {degree} does not divide {where}{inside}")
            problem = dim.shape_problem(shape, degree) if degree > 1 else None
            if problem:
                raise ConfigError(f"pretrain.distributed.{dim.field}: {problem}")
            sizes = [degree]
        options = [prev + [(dim.name, n)] for prev in options for n in sizes]
    out = [{name: n for name, n in combo if n > 1} for combo in options]
    return [d for d in out if (ranks * cfg.distributed.num_nodes) % max(1, math.prod(d.values())) == 0]


def resolve_ranks(cfg: PretrainConfig, device: DeviceInfo) -> int:
    if cfg.distributed.num_ranks != "auto":
        return int(cfg.distributed.num_ranks)
    return device.count if device.kind == "cuda" else 2


def preferred_backend(cfg: PretrainConfig) -> str:
    """The engine that wins a tie (pretrain.distributed.prefer_backend): auto = for a mixture of experts
    the engine that says it `prefers_experts` (FSDP2 trained one at 0.96x a plain transformers loop's
    tokens/s where DeepSpeed ZeRO-0 gave 0.82x: `benchmarks/pretrain.py`, docs/benchmarks.md), else
    the first engine."""
    if cfg.distributed.prefer_backend != "auto":
        return cfg.distributed.prefer_backend
    experts = [e.name for e in all_engines() if e.prefers_experts]
    return experts[0] if cfg.model.experts.enabled and experts else ENGINE_NAMES[0]


def plan_parallelism(
    cfg: PretrainConfig,
    vocab_size: int = 8192,
    device: DeviceInfo | None = None,
    peak_tflops: float | None = None,
    params: int | None = None,
) -> Plan:
    """Choose ZeRO stage / offload (unless fixed in the config) and explain the choice.

    `params`: the real parameter count where it is known (a base model's weights); otherwise it
    is computed from `cfg.model` (lmforge's own architecture)."""
    device = device or detect_device()
    ranks = resolve_ranks(cfg, device)
    world = ranks * cfg.distributed.num_nodes
    precision = resolve_precision(cfg.precision, device)
    float8 = resolve_float8(cfg.float8, device)
    params = params or count_parameters(cfg.model, vocab_size)
    ranks_sharing = ranks if device.kind == "cpu" else 1  # CPU ranks share the host's memory
    capacity = device.memory_bytes / GIB / ranks_sharing * (1 - cfg.distributed.memory_headroom)
    # offloaded states live in the node's RAM, shared by its ranks (unknown for a machine described by hand)
    host_capacity = (
        device.host_memory_bytes / GIB * (1 - cfg.distributed.memory_headroom)
        if device.host_memory_bytes
        else float("inf")
    )
    compute = precision + {"on": " + float8", "emulate": " + float8 (emulated)"}.get(float8, "")
    reasons = [
        f"{params / 1e6:.2f}M parameters, {compute}, {world} rank(s) ({ranks}/node x {cfg.distributed.num_nodes}), "
        f"{capacity:.1f} GiB usable per rank on {device.kind} ({device.name})"
    ]
    if cfg.float8 != "off":
        reasons.append(float8_reason(cfg.float8, float8, device))
    cpu = device.kind == "cpu"
    prefer = preferred_backend(cfg)
    fitting: list[tuple[tuple[Any, ...], Strategy, dict[str, float], float, dict[str, int]]] = []
    layouts = mesh_candidates(cfg, ranks, vocab_size)
    if float8 != "off" and any(layouts):
        if len(layouts) == 1:
            raise ConfigError(
                f"pretrain.float8 with {mesh_label(layouts[0])} is not supported yet (torchao's float8 needs its "
                "own tensor-parallel styles); set pretrain.float8=off, or the model-parallel degrees to 1"
            )
        layouts = [d for d in layouts if not d]
    for degrees in layouts:
        model_parallel = math.prod(degrees.values())
        data = world // model_parallel
        per_step = cfg.distributed.micro_batch_size * data
        if cfg.global_batch_size % per_step:
            if len(layouts) == 1:
                raise ConfigError(
                    f"pretrain.global_batch_size {cfg.global_batch_size} is not a multiple of micro_batch_size x "
                    f"data-parallel ranks = {cfg.distributed.micro_batch_size} x {data}"
                    + (f" (world {world} / model-parallel {model_parallel})" if model_parallel > 1 else "")
                )
            reasons.append(f"{mesh_label(degrees)}: global batch does not split over {data} data-parallel ranks")
            continue
        grad_accum = cfg.global_batch_size // per_step
        step_problems = [
            problem
            for name, degree in degrees.items()
            if (check := dimension_by_mesh_name(name).step_problem) and (problem := check(degree, grad_accum, cfg))
        ]
        if step_problems:
            if len(layouts) == 1:
                raise ConfigError(f"pretrain.distributed.{step_problems[0]}")
            reasons.append(f"{mesh_label(degrees)}: {step_problems[0]}")
            continue
        for index, strategy in enumerate(candidate_strategies(cfg, bool(degrees))):
            e = engine(strategy.backend)
            nodes = cfg.distributed.num_nodes
            parts, host = e.memory(params, cfg, precision, max(1, data // nodes), nodes, strategy, vocab_size, cpu)
            for name, degree in degrees.items():
                dim = dimension_by_mesh_name(name)
                factors = dim.memory_factors(degree, grad_accum, cfg) if dim.memory_factors else {}
                parts = {
                    k: v * factors[k] if k in factors else v / degree if k in dim.divides else v
                    for k, v in parts.items()
                }
                host /= degree
            total = sum(parts.values())
            if cpu:  # "offloaded" states stay in the same memory on a CPU-only machine
                total += host
            host_fits = cpu or host * ranks <= host_capacity
            fits = total <= capacity and host_fits
            across, volume = communication(strategy, grad_accum, max(1, data // nodes), nodes)
            if data == 1:  # one data-parallel rank: the engine has nobody to gather from or reduce with
                across, volume = 0.0, 0.0
            traffic = f"traffic {volume:g}x model/step" + (
                f" ({across:g}x across nodes)" if cfg.distributed.num_nodes > 1 else ""
            )
            traffic += "".join(
                f" + {dimension_by_mesh_name(name).traffic_note(degree)}" for name, degree in degrees.items()
            )
            offloaded = f", {host:.3f} GiB/rank offloaded to host" if host else ""
            verdict = (
                "fits"
                if fits
                else "too big"
                if total > capacity
                else f"host RAM too small ({host_capacity:.1f} GiB usable)"
            )
            where = f"{mesh_label(degrees)} + " if degrees else ""
            reasons.append(
                f"{where}{strategy.label}: {total:.3f} GiB/rank "
                f"({', '.join(f'{k} {v:.3f}' for k, v in parts.items())}{offloaded}), {traffic} -> {verdict}"
            )
            if fits:
                preferred = strategy.backend == prefer
                # no offload first, then the least model parallelism (its collectives run every layer),
                # then the least traffic across nodes and in all, then the preferred engine
                rank_key = (OFFLOAD_ORDER[strategy.offload], model_parallel, across, volume, not preferred, index)
                fitting.append((rank_key, strategy, parts, host, degrees))
    if not fitting:
        raise ConfigError(
            f"pretrain.distributed: no strategy fits in {capacity:.1f} GiB per rank; the most sharded, "
            f"{reasons[-1]}; lower micro_batch_size, enable activation_checkpointing, or add ranks"
        )
    fitting.sort(key=lambda item: item[0])
    best_key, best, parts, host, degrees = fitting[0]
    ties = [s.label for k, s, *_ in fitting[1:] if k[:4] == best_key[:4] and s.backend != best.backend]
    why = "no offload, " if best.offload == "none" else "the least offload, "
    if len(layouts) > 1:
        why += "the least model parallelism, "
    why += "the least traffic that fits" + (" across nodes" if cfg.distributed.num_nodes > 1 else "")
    if ties:
        why += f"; tie with {ties[0]} broken by prefer_backend={prefer}"
    model_parallel = math.prod(degrees.values())
    grad_accum = cfg.global_batch_size // (cfg.distributed.micro_batch_size * (world // model_parallel))
    plan = Plan(
        best.zero_stage,
        best.offload,
        ranks,
        cfg.distributed.num_nodes,
        world,
        grad_accum,
        precision,
        params,
        parts,
        host,
        capacity,
        reasons,
        backend=best.backend,
        sharding=best.sharding,
        compile=cfg.compile,
        float8=float8,
        degrees=degrees,
    )
    from training.parallel import mesh

    reasons.append(f"chosen: {best.label} ({why}); device mesh: {mesh.describe(plan)}")
    plan.budget = compute_budget(params, cfg, peak_tflops or cfg.peak_tflops, devices_used(world, device), vocab_size)
    return plan


def format_plan(plan: Plan) -> str:
    lines = ["parallelism plan:"] + [f"  {r}" for r in plan.reasoning]
    lines.append(f"  gradient accumulation: {plan.grad_accum} micro-batches per step")
    lines.append("compute budget:")
    lines += [f"  {k}: {v:,}" if isinstance(v, int) else f"  {k}: {v}" for k, v in plan.budget.items()]
    return "\n".join(lines)


# -- fine-tuning memory -------------------------------------------------------------------------------

# bytes per parameter of the model being fine-tuned, by method, before the optimizer:
# 4-bit NF4 is half a byte, plus one fp32 absmax per 64 weights quantized again to 8 bits with
# one fp32 constant per 256 of those (double quantization): 0.5 + 1/64 * (1 + 4/256) ~ 0.516
NF4_BYTES = 0.5 + (1 + 4 / 256) / 64


@dataclass
class FinetunePlan:
    method: str
    params: int
    trainable: int
    per_rank_gib: float
    capacity_gib: float
    fits: bool
    breakdown: dict[str, float]


def lora_parameters(model: ModelConfig, r: int) -> int:
    """Adapter parameters of rank `r` on every linear layer of the decoder (`all-linear`)."""
    h, i = model.hidden_size, model.intermediate_size
    kv = model.num_kv_heads * (h // model.num_heads)
    # q, k, v, o, gate, up, down: r x (in + out) each
    return model.num_layers * r * (9 * h + 2 * kv + 3 * i)


def plan_finetune(
    method: str,
    model: ModelConfig,
    params: int,
    vocab_size: int,
    precision: str,
    ranks: int,
    zero_stage: int,
    capacity_gib: float,
    micro_batch: int,
    seq_len: int,
    lora_r: int = 16,
) -> FinetunePlan:
    """Memory per rank of SFT by full fine-tuning, LoRA or QLoRA (a 4-bit NF4 base): weights,
    gradients, AdamW states (fp32 moments, plus an fp32 master copy under bf16) sharded as ZeRO
    shards them, and the activations of one micro-batch (QLoRA and LoRA with checkpointed layers)."""
    w = 2 if precision in ("bf16", "fp16") else 4
    master = 4 if w == 2 else 0
    embeddings = vocab_size * model.hidden_size * (1 if model.tie_embeddings else 2)
    trainable = params if method == "full" else lora_parameters(model, lora_r)
    share = {0: (1, 1, 1), 1: (1, 1, ranks), 2: (1, ranks, ranks), 3: (ranks, ranks, ranks)}[zero_stage]
    if method == "qlora":
        weights = (params - embeddings) * NF4_BYTES + embeddings * w
    else:
        weights = params * w / share[0]
    parts = {
        "weights": weights,
        "gradients": trainable * (4 if method != "full" else w) / share[1],
        "optimizer": trainable * (8 + master) / share[2],
        "activations": micro_batch * seq_len * model.hidden_size * w * (model.num_layers + 16)
        + micro_batch * seq_len * vocab_size * 4,  # checkpointed layer inputs, one layer live, fp32 logits
    }
    gib = {k: round(v / GIB, 2) for k, v in parts.items()}
    total = round(sum(parts.values()) / GIB, 2)
    return FinetunePlan(method, params, trainable, total, round(capacity_gib, 2), total <= capacity_gib, gib)


def format_finetune(plan: FinetunePlan) -> str:
    parts = ", ".join(f"{k} {v:.2f}" for k, v in plan.breakdown.items())
    verdict = "fits" if plan.fits else "does NOT fit (use qlora, more ranks or ZeRO-3)"
    return (
        f"fine-tuning plan ({plan.method}): {plan.params / 1e9:.2f}B parameters, {plan.trainable / 1e6:.1f}M "
        f"trainable; {plan.per_rank_gib:.2f} GiB per rank ({parts}) of {plan.capacity_gib:.1f} usable: {verdict}"
    )
