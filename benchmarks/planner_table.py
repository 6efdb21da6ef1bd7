"""The planner's choice for Llama 3.1 8B, 70B and 405B on nodes of 8 x H100 80 GB, beside the
configurations torchtitan publishes for the same shapes (no GPU needed: it is the plan alone).

    .venv/bin/python benchmarks/planner_table.py [--nodes 1,2,8,16] [--markdown]

Each row plans `pretrain.distributed.backend: auto`, `tensor_parallel: auto` and
`pipeline_parallel: auto` at torchtitan's
sequence length (8192) and per-rank micro-batch for that model (its train config's
`local_batch_size`: 1, 8 and 2), bf16, full activation checkpointing, a global batch of
micro-batch x GPUs (so every mesh splits it), 2 TiB of host RAM per node. The torchtitan column
is its train config's parallelism (torchtitan/models/llama3/train_configs/, removed at
238fa99's child in favour of config_registry.py with the same values) and its published
H100 runs (benchmarks/llama3_h100_202412_torchtitan.md at b5bcd76): GPUs, FSDP x TP x PP, peak
memory per GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GIB = 1024**3

# Llama 3.1 shapes (config.json of meta-llama/Llama-3.1-{8B,70B,405B}); untied embeddings, vocab 128256
SHAPES = {
    "8B": {"hidden_size": 4096, "intermediate_size": 14336, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8},
    "70B": {"hidden_size": 8192, "intermediate_size": 28672, "num_layers": 80, "num_heads": 64, "num_kv_heads": 8},
    "405B": {
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_layers": 126,
        "num_heads": 128,
        "num_kv_heads": 8,
    },
}
VOCAB = 128256
MICRO = {"8B": 1, "70B": 8, "405B": 2}  # torchtitan's local_batch_size per model
TORCHTITAN = {
    "8B": "config: FSDP (dp_shard -1), TP 1, selective AC; published: 8 GPUs FSDP 8, 82.4 GiB (batch 2); "
    "128 GPUs FSDP 128, 67.0 GiB",
    "70B": "config: FSDP -1 x TP 8, full AC; published: 256 GPUs FSDP 32 x TP 8, 71.9 GiB (batch 16, float8)",
    "405B": "config: FSDP -1 x TP 8, full AC, float8, async TP; published: 512 GPUs FSDP 8 x TP 8 x PP 8, "
    "82.5 GiB (1F1B)",
}


def plan_row(model: str, nodes: int) -> tuple[str, str, float, str]:
    from lmforge.errors import ConfigError
    from training.config import PretrainConfig
    from training.device import DeviceInfo
    from training.parallel import mesh
    from training.planner import plan_parallelism

    gpus = 8 * nodes
    distributed = {
        "num_ranks": 8,
        "num_nodes": nodes,
        "micro_batch_size": MICRO[model],
        "activation_checkpointing": True,
        "tensor_parallel": "auto",
        "pipeline_parallel": "auto",
        **({"hostfile": "/etc/lmforge/hostfile", "launcher": "deepspeed"} if nodes > 1 else {}),
    }
    cfg = PretrainConfig.model_validate(
        {
            "model": {**SHAPES[model], "tie_embeddings": False},
            "seq_len": 8192,
            "precision": "bf16",
            "global_batch_size": MICRO[model] * gpus,
            "distributed": distributed,
        }
    )
    device = DeviceInfo("cuda", "H100", 8, 80 * GIB, True, 64, host_memory_bytes=2048 * GIB, capability=(9, 0))
    try:
        plan = plan_parallelism(cfg, VOCAB, device, peak_tflops=989.0)
    except ConfigError as error:
        return "does not fit", "-", float("nan"), str(error).split(";")[0]
    total = sum(plan.per_rank_gib.values())
    return plan.label, mesh.describe(plan), total, f"{plan.params / 1e9:.1f}B params"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="1,2,8,16")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    nodes = [int(n) for n in args.nodes.split(",")]
    rows = []
    for model in SHAPES:
        for n in nodes:
            strategy, layout, gib, note = plan_row(model, n)
            rows.append((model, n, strategy, layout, gib, note))
    if args.markdown:
        print(
            "| model | nodes (GPUs) | micro-batch | lmforge's choice | device mesh | predicted GiB/GPU | torchtitan |"
        )
        print("|---|---|---|---|---|---|---|")
        for model, n, strategy, layout, gib, note in rows:
            tt = TORCHTITAN[model] if n == nodes[0] else '"'
            shown = f"{gib:.1f}" if gib == gib else note
            print(f"| {model} | {n} ({8 * n}) | {MICRO[model]} | {strategy} | {layout} | {shown} | {tt} |")
        return
    for model, n, strategy, layout, gib, note in rows:
        print(f"{model:5} {n:3} nodes  {strategy:34} {layout:28} {gib:7.1f} GiB/GPU  {note}")
    for model, text in TORCHTITAN.items():
        print(f"torchtitan {model}: {text}")


if __name__ == "__main__":
    main()
