"""The device mesh: data-parallel degrees (`dp_replicate` x `dp_shard`) and the model-parallel
dimensions (`training.parallel.dims`), whose product is the world size.

Ranks are laid out with the last dimension innermost (torchtitan's order): tensor-parallel
groups are consecutive ranks, so on GPUs they sit inside one node, on NVLink, where their
per-layer collectives belong; data-parallel groups stride across them and across nodes.
"""

from __future__ import annotations

from typing import Any

DP_REPLICATE, DP_SHARD = "dp_replicate", "dp_shard"


def shape(plan: Any) -> dict[str, int]:
    """{dimension: degree}, outermost first: outer model-parallel dimensions (pipeline stages, across
    nodes), then data parallel, then the inner ones (tensor parallel, inside a node)."""
    from training.parallel import all_dimensions

    model_parallel = plan.model_parallel
    replicate = plan.num_nodes if plan.sharding == "hybrid" else 1
    outer = {d.name for d in all_dimensions() if d.outer}
    return {
        **{k: v for k, v in plan.degrees.items() if k in outer},
        DP_REPLICATE: replicate,
        DP_SHARD: plan.world_size // (replicate * model_parallel),
        **{k: v for k, v in plan.degrees.items() if k not in outer},
    }


def coordinates(plan: Any, rank: int) -> dict[str, int]:
    """This rank's index along every dimension."""
    out: dict[str, int] = {}
    for name, size in reversed(list(shape(plan).items())):
        rank, out[name] = divmod(rank, size)
    return dict(reversed(list(out.items())))


def data_rank(plan: Any, rank: int) -> int:
    """This rank's index among the data-parallel ranks (the ones that read different batches)."""
    c = coordinates(plan, rank)
    return c[DP_REPLICATE] * shape(plan)[DP_SHARD] + c[DP_SHARD]


def describe(plan: Any) -> str:
    return " x ".join(f"{name} {size}" for name, size in shape(plan).items() if size > 1) or "1 rank"


def build(plan: Any) -> Any:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    dims = shape(plan)
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(kind, tuple(dims.values()), mesh_dim_names=tuple(dims))


def data_mesh(mesh: Any, plan: Any) -> Any:
    """The sub-mesh FSDP shards over: (replicate, shard) for hybrid sharding, else shard alone."""
    return mesh[(DP_REPLICATE, DP_SHARD)] if plan.sharding == "hybrid" else mesh[DP_SHARD]


_MESHES: dict[tuple[tuple[str, int], ...], Any] = {}


def get(plan: Any) -> Any:
    """The mesh of this plan, built once per process (a rollback rebuilds the engine, not the groups)."""
    key = tuple(shape(plan).items())
    if key not in _MESHES:
        _MESHES[key] = build(plan)
    return _MESHES[key]
