"""How training is spread over processes: one module per parallelism, behind one interface.

Two kinds, each a folder of modules found by listing it (no list of names to keep in step):

- **Engines** (`engines/<name>.py`, each defining `ENGINE = Engine(...)`) own the data-parallel
  layout and the optimizer step: DeepSpeed ZeRO and PyTorch FSDP2. The module's name is the
  value of `pretrain.distributed.backend`. An engine tells the planner its strategies, their
  memory and traffic; the launcher which processes to start; the rank how to join the process
  group, wrap the model, write and check checkpoints and gather the full weights for export.
- **Mesh dimensions** (`dims/<name>.py`, each defining `DIMENSION = Dimension(...)`) split the
  model itself over ranks inside an engine's data-parallel layout: tensor + sequence parallel
  (`tensor_parallel`). Their degrees and the data-parallel degrees make the device mesh
  (`training.parallel.mesh`); an engine that composes with them says so (`mesh_dimensions`).

Adding a parallelism is one module in one of the two folders. The rest of lmforge names no
engine: it asks this registry (`engine(name)`, `ENGINE_NAMES`, `all_dimensions()`).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def _module_names(folder: str) -> tuple[str, ...]:
    return tuple(sorted(m.name for m in pkgutil.iter_modules([str(HERE / folder)]) if not m.name.startswith("_")))


# read from the file names, without importing anything: the config's choices are built from them
ENGINE_NAMES: tuple[str, ...] = _module_names("engines")
DIMENSION_NAMES: tuple[str, ...] = _module_names("dims")


@dataclass(frozen=True)
class Strategy:
    """One way to lay the training state out over the data-parallel ranks."""

    backend: str
    zero_stage: int  # DeepSpeed's stage, or the stage whose memory layout another engine's layout matches
    sharding: str
    offload: str

    @property
    def label(self) -> str:
        return engine(self.backend).label(self.zero_stage, self.sharding, self.offload)


@dataclass(frozen=True)
class Engine:
    """A data-parallel training engine. Every callable takes plain values, so the planner can ask
    about an engine without importing its library."""

    name: str
    title: str
    # pretrain.distributed fields only this engine reads (another engine refuses them when set)
    own_fields: tuple[str, ...]
    # (DistributedConfig) -> a one-line problem with the configuration for this engine, or None
    config_problem: Callable[[Any], str | None]
    # (DistributedConfig) -> the strategies it offers, narrowed by what the config fixes
    strategies: Callable[[Any], list[Strategy]]
    # (zero_stage, sharding, offload) -> "ZeRO-2 offload=none"
    label: Callable[[int, str, str], str]
    # (strategy, grad_accum) -> traffic per rank per optimizer step, in model sizes
    traffic: Callable[[Strategy, int], float]
    # (params, cfg, precision, ranks per node, nodes, strategy, vocab, cpu) -> ({part: GiB/rank}, host GiB/rank)
    memory: Callable[..., tuple[dict[str, float], float]]
    # (DistributedConfig) -> the launcher name `lmforge.processes.launch` starts the ranks with
    launcher: Callable[[Any], str]
    # () -> None: join the process group (in a rank, before anything collective)
    init_process_group: Callable[[], None]
    # (model, cfg, plan) -> the engine object the loop drives (DeepSpeed's engine surface)
    build: Callable[[Any, Any, Any], Any]
    # (engine, plan) -> the whole model on rank 0 (collective where sharded), None elsewhere
    consolidated_state: Callable[[Any, Any], dict[str, Any] | None]
    # (saved layout, plan, world) -> why a checkpoint of that layout cannot resume here, or None
    resume_problem: Callable[[dict[str, Any], Any, int], str | None]
    # (out_dir, cfg, plan) -> None: files the engine's ranks read (DeepSpeed's ds_config.json)
    write_run_files: Callable[[Path, Any, Any], None]
    # their names, removed when another engine runs in the same folder
    run_files: tuple[str, ...]
    # (plan) -> True where the engine clips without reporting the gradient norm (the loop measures it)
    norm_unreported: Callable[[Any], bool]
    # composes with mesh dimensions (tensor parallel): its ranks hold DTensors on a device mesh
    mesh_dimensions: bool
    # alignment (TRL through accelerate): (align zero_stage) -> the ZeRO stage whose layout it has
    align_stage: Callable[[int], int]
    # (rank spec) -> TRL/transformers TrainingArguments keywords that select this engine in accelerate
    trl_arguments: Callable[[dict[str, Any]], dict[str, Any]]
    # (device kind) -> why alignment cannot run on this engine there, or None
    align_problem: Callable[[str], str | None]
    # libraries whose versions are part of a run's identity
    libraries: tuple[str, ...] = ()
    # the planner's choice on a tie for a mixture of experts (prefer_backend auto): measured faster there
    prefers_experts: bool = False


@dataclass(frozen=True)
class Dimension:
    """A way to split the model over ranks inside the data-parallel layout (a device-mesh dimension)."""

    name: str  # the mesh dimension's name ("tp")
    field: str  # its degree: pretrain.distributed.<field>
    title: str
    # (model, sub-mesh, plan) -> the model this rank trains (parallelized in place, or this rank's part)
    apply: Callable[[Any, Any, Any], Any]
    # (model shape dict, degree) -> a one-line reason the model cannot be split that way, or None
    shape_problem: Callable[[dict[str, Any], int], str | None]
    # the memory parts (planner names) this dimension divides by its degree
    divides: tuple[str, ...]
    # (degree) -> the extra traffic per micro-batch, in activation sizes per layer (for the plan line)
    traffic_note: Callable[[int], str]
    # () -> a context the loss and its backward run in (the logits stay split: loss parallel), or None
    loss_context: Callable[[], Any] | None = None
    # placed before the data-parallel dimensions in the mesh (across nodes), not after (inside a node)
    outer: bool = False
    # (degree, micro-batches per step, the pretrain config) -> factors for memory parts this dimension
    # changes otherwise than dividing by its degree (pipeline stages hold several micro-batches' activations)
    memory_factors: Callable[[int, int, Any], dict[str, float]] | None = None
    # (degree, micro-batches per step, the pretrain config) -> why this layout cannot run, or None
    step_problem: Callable[[int, int, Any], str | None] | None = None


@cache
def engine(name: str) -> Engine:
    if name not in ENGINE_NAMES:
        raise KeyError(f"no training engine {name!r}; known: {', '.join(ENGINE_NAMES)}")
    found: Engine = importlib.import_module(f"training.parallel.engines.{name}").ENGINE
    return found


@cache
def dimension(name: str) -> Dimension:
    found: Dimension = importlib.import_module(f"training.parallel.dims.{name}").DIMENSION
    return found


def all_dimensions() -> list[Dimension]:
    return [dimension(n) for n in DIMENSION_NAMES]


def all_engines() -> list[Engine]:
    return [engine(n) for n in ENGINE_NAMES]


def libraries() -> tuple[str, ...]:
    """Every engine's libraries, once each, for a training step's identity."""
    return tuple(dict.fromkeys(lib for e in all_engines() for lib in e.libraries))


def modules() -> tuple[str, ...]:
    """Every parallelism module, for a training step's code identity."""
    return (
        "training.parallel",
        "training.parallel.mesh",
        *(f"training.parallel.engines.{n}" for n in ENGINE_NAMES),
        *(f"training.parallel.dims.{n}" for n in DIMENSION_NAMES),
    )


def moe_problem(field: str, degree: int) -> str:
    """Why `field` at `degree` cannot train a mixture of experts (one line)."""
    return (
        f"{field} {degree} is for dense models: a mixture of experts trains data-parallel (FSDP2 or ZeRO "
        "shard every expert; expert parallelism is not built), so set it to 1"
    )
