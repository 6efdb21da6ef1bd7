"""The pretraining stage's registration: token shards in, a Hugging Face model out."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.engine.stage import ArtifactSpec, Resources, Role, Stage
from lmforge.errors import ConfigError, TrainingDiverged
from training.config import FaultInjectionConfig, PretrainConfig

if TYPE_CHECKING:
    from lmforge.config import PipelineBase


def _steps() -> list[Any]:
    from training.steps import PRETRAIN_STEPS

    return PRETRAIN_STEPS


def _artifacts(
    manifests: dict[str, dict[str, Any]], status: dict[str, str], error: BaseException | None
) -> list[ArtifactSpec]:
    if isinstance(error, TrainingDiverged):  # the report matters most when the run stopped
        return (
            [
                ArtifactSpec(
                    "pretrain-anomalies", "table", error.anomalies, "training stopped: too many anomalies in a row"
                )
            ]
            if error.anomalies
            else []
        )
    manifest = manifests.get("pretrain/train")
    if manifest is None:
        return []
    rows = [{"metric": k, "value": v} for k, v in manifest["metrics"].items() if isinstance(v, (int, float, str))]
    specs = [ArtifactSpec("pretrain-summary", "table", rows, "final training metrics")]
    if manifest["extra"].get("anomalies"):
        specs.append(
            ArtifactSpec(
                "pretrain-anomalies",
                "table",
                manifest["extra"]["anomalies"],
                "loss spikes / non-finite losses: rolled back and skipped",
            )
        )
    return specs


def _summary(manifests: dict[str, dict[str, Any]]) -> list[str]:
    if "pretrain/train" not in manifests:
        return []
    return [f"model:   {manifests['pretrain/train']['dir']}/hf  (transformers.AutoModelForCausalLM.from_pretrained)"]


def _check(config: PipelineBase, source: str) -> None:
    if config.pretrain.init == "base" and not config.base_model.path:
        raise ConfigError(f"{source}: pretrain.init: base needs base_model.path (the model to continue training)")
    scaling = config.pretrain.rope_scaling.type
    if scaling not in ("auto", "none") and (not config.base_model.path or config.pretrain.init == "scratch"):
        raise ConfigError(
            f"{source}: pretrain.rope_scaling.type={scaling} extends a model trained at a shorter context: it needs "
            "base_model.path (continued pretraining); a model from scratch is trained at seq_len unscaled"
        )
    hostfile = config.pretrain.distributed.hostfile
    if hostfile and not Path(hostfile).exists():
        raise ConfigError(f"{source}: pretrain.distributed.hostfile: file not found: {hostfile}")


def _cli(commands: Any) -> None:
    plan = commands.add_parser("plan", help="print the pretraining parallelism plan and compute budget")
    plan.add_argument("--gpus", type=int, help="plan for a node with this many GPUs instead of this machine")
    plan.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory per GPU for --gpus (default 80)")
    plan.add_argument(
        "--gpu-name", default="H100", help="GPU model for --gpus: its peak FLOP/s and float8 support (default H100)"
    )
    plan.set_defaults(handler=_cmd_plan, needs_config=True, check_paths=False)


def _cmd_plan(args: argparse.Namespace, config: PipelineBase) -> int:
    from training.device import KNOWN_GPU_PEAK_TFLOPS, DeviceInfo, detect_device, known_capability, peak_tflops
    from training.planner import format_plan, plan_parallelism, resolve_precision

    if args.gpus:
        memory = int(args.gpu_memory_gib * 1024**3)
        capability = known_capability(args.gpu_name)
        device = DeviceInfo("cuda", args.gpu_name, args.gpus, memory, True, 64, capability=capability)
        peak = KNOWN_GPU_PEAK_TFLOPS.get(args.gpu_name)
    else:  # this machine: the measured (cached) peak, so the budget includes a time estimate
        device = detect_device()
        peak = peak_tflops(device, resolve_precision(config.pretrain.precision, device))
    cfg, vocab, params = config.pretrain, config.curate.tokenizer.vocab_size, None
    if config.base_model.path:  # the base's own architecture and parameter count, from its config.json
        from training.model import model_config_of

        hf_config, params = _base_architecture(config)
        cfg, vocab = cfg.model_copy(update={"model": model_config_of(hf_config)}), int(hf_config["vocab_size"])
        print(f"base model: {config.base_model.path} ({(hf_config.get('architectures') or ['?'])[0]})")
    plan = plan_parallelism(cfg, vocab, device=device, peak_tflops=peak, params=params)
    print(format_plan(plan))
    if config.base_model.path:
        print(_finetune_line(config, cfg, vocab, plan))
    return 0


def _base_architecture(config: PipelineBase) -> tuple[dict[str, Any], int]:
    """The base's config.json and its parameter count (the model built on the meta device: no weights read)."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from training.base.prepare import resolve

    directory = resolve(config.base_model.path, config.base_model.revision)
    hf_config = json.loads((directory / "config.json").read_text())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(str(directory), trust_remote_code=config.base_model.trust_remote_code)
        )
    return hf_config, sum(p.numel() for p in model.parameters())


def _finetune_line(config: PipelineBase, cfg: Any, vocab: int, plan: Any) -> str:
    from training.planner import format_finetune, plan_finetune

    a = config.align
    from training.parallel import engine

    zero = engine(a.distributed.backend).align_stage(a.distributed.zero_stage)
    finetune = plan_finetune(
        a.method,
        cfg.model,
        plan.params,
        vocab,
        "bf16" if a.precision == "bf16" else plan.precision,
        plan.num_ranks,
        zero,
        plan.capacity_gib,
        a.sft.micro_batch_size,
        a.sft.max_seq_len or cfg.seq_len,
        a.lora.r,
    )
    return format_finetune(finetune)


STAGE = Stage(
    name="pretrain",
    description="Pretraining: a Llama trained from scratch with DeepSpeed, exported to Hugging Face format.",
    config_model=PretrainConfig,
    debug_model=FaultInjectionConfig,
    steps=_steps,
    after=("curate",),
    artifacts=_artifacts,
    resources=Resources(pool="gpu", gpus=-1),
    packages=("training",),
    summary=_summary,
    check=_check,
    cli=_cli,
    roles=(Role("pretrained", saw=("documents",)),),
)
