"""The pretraining stage as a step of the pipeline graph.

`pretrain/train` reads the packed token shards and the tokenizer of the curation stage,
plans the parallelism (DeepSpeed ZeRO or FSDP2), launches the ranks, and leaves a Hugging Face model in `hf/`.
Its output digest covers `hf/` only: the weights are what downstream stages consume,
while logs, metrics and timings differ on every run. Checkpoints verify themselves and
are kept out of the manifest's file list.

A retry of this step (after a killed rank) finds the verified checkpoints in the same
directory and resumes; it never starts over in a directory that has progress in it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.configbase import ConfigView
from lmforge.engine.graph import Step, StepContext
from lmforge.engine.stage import BASE_MODEL, TOKEN_SHARDS, TOKENIZER, fine_tunes_base, has_base, hf_model
from lmforge.errors import ConfigError, TrainingDiverged
from training.metrics import METRICS_FILE, last_logged_step
from training.parallel import libraries as parallel_libraries
from training.parallel import modules as parallel_modules
from training.parallel.mesh import shape as mesh_shape

if TYPE_CHECKING:
    from lmforge.processes.launch import Launcher
    from training.config import DistributedConfig, PretrainConfig
    from training.planner import Plan

log = logging.getLogger(__name__)
TRAIN = "pretrain/train"
PRETRAINED = hf_model("pretrained")


def _special_tokens(pack_dir: Path) -> tuple[int, dict[str, int]]:
    index = json.loads((pack_dir / "index.json").read_text())
    return index["vocab_size"], {"bos_id": index["eos_id"], "eos_id": index["eos_id"], "pad_id": index["pad_id"]}


def from_base(config: Any) -> bool:
    """Whether pretraining continues a base model's training (`pretrain.init`)."""
    return has_base(config) and config.pretrain.init != "scratch"  # (init: base without a base fails the config check)


def _reads(config: Any) -> tuple[str, ...]:
    """The whole section, but the architecture (`pretrain.model`) only when training from scratch."""
    from training.config import PretrainConfig

    skip = ("model", "init") if from_base(config) else ("init",)  # init: runtime (see PretrainConfig)
    return tuple(f"pretrain.{f}" for f in PretrainConfig.model_fields if f not in skip)


def _pretrain_config(view: Any) -> Any:
    """The section as a typed config from the step's view (the architecture, when not read, at its default)."""
    from lmforge.errors import UndeclaredConfigRead
    from training.config import PretrainConfig

    values = {}
    for name in PretrainConfig.model_fields:
        try:
            value = getattr(view, name)
        except UndeclaredConfigRead:
            continue
        if not isinstance(value, ConfigView):  # a view: a section the step did not declare (`model`)
            values[name] = value
    return PretrainConfig.model_validate(values)


def _base_shape(cfg: Any, base_dir: Path, pack_vocab: int) -> tuple[Any, int, dict[str, Any] | None]:
    """The config with the base's architecture in `model`, the base's embedding rows, and the rotary
    settings that extend its context to `seq_len` (None: the base keeps its own; lmforge/rope.py)."""
    from lmforge.rope import extension
    from training.model import model_config_of

    hf_config = json.loads((base_dir / "config.json").read_text())
    rows = int(hf_config["vocab_size"])
    if pack_vocab > rows:
        raise ConfigError(
            f"base_model: the tokenizer has {pack_vocab} tokens but {base_dir}/config.json has {rows} embedding rows"
        )
    rope = extension(cfg.rope_scaling, hf_config, cfg.seq_len)
    return cfg.model_copy(update={"model": model_config_of(hf_config)}), rows, rope


_STARTED_OVER: set[Path] = set()


def _check_resumable(out_dir: Path, resume: str) -> None:
    """Refuse to silently restart from step 0 where earlier progress exists but cannot be verified.

    `resume: never` wipes earlier progress once per process: a Prefect retry of the same
    run (after a killed rank) still resumes from what this run itself has written. The
    checksums themselves are verified once, by rank 0, before it loads anything.
    """
    if resume == "never" and out_dir not in _STARTED_OVER:
        _STARTED_OVER.add(out_dir)
        for name in ("checkpoints", "tensorboard", "metrics.jsonl", "hf"):
            target = out_dir / name
            shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)


def launcher_for(d: DistributedConfig, backend: str) -> Launcher:
    """The launcher that starts the ranks: the engine's choice (`training.parallel`)."""
    from training.parallel import engine

    return engine(backend).launcher(d)  # type: ignore[return-value]


def _train_finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
    from lmforge.processes.launch import RANKS, Launch, run_entry
    from training.device import detect_device, peak_tflops
    from training.planner import devices_used, format_plan, plan_parallelism, resolve_precision

    cfg, out_dir = _pretrain_config(ctx.config.pretrain), ctx.out_dir
    pack_dir, tokenizer_dir = ctx.path(TOKEN_SHARDS), ctx.path(TOKENIZER)
    vocab_size, special = _special_tokens(pack_dir)
    base_dir = ctx.path(BASE_MODEL) if ctx.has(BASE_MODEL) else None
    params, rope = None, None
    if base_dir is not None:
        from lmforge.rope import describe
        from training.model import count_weights

        cfg, vocab_size, rope = _base_shape(cfg, base_dir, vocab_size)
        params = count_weights(base_dir)
        log.info("continued pretraining of %s (%.2fM parameters)", base_dir, params / 1e6)
        if rope is not None:
            log.info("context extended to %d tokens; rotary positions: %s", cfg.seq_len, describe(rope))
    device = detect_device()
    per_device = cfg.peak_tflops or peak_tflops(device, resolve_precision(cfg.precision, device))
    plan = plan_parallelism(
        cfg, vocab_size, device, peak_tflops=per_device, params=params
    )  # the budget's time estimate needs the peak
    log.info("%s", format_plan(plan))
    masked = document_mask(cfg, plan, extending=rope is not None)
    _check_resumable(out_dir, cfg.resume)
    d = cfg.distributed
    from training.parallel import all_engines, engine

    for other in all_engines():  # a previous attempt's engine files, where this run uses another engine
        for name in other.run_files if other.name != plan.backend else ():
            (out_dir / name).unlink(missing_ok=True)
    engine(plan.backend).write_run_files(out_dir, cfg, plan)
    launch = Launch(
        launcher_for(d, plan.backend), plan.num_ranks, d.num_nodes, d.hostfile, d.node_launcher, d.master_port
    )
    spec = {
        "config": cfg.model_dump(mode="json"),
        "plan": dataclasses.asdict(plan),
        "pack_dir": str(pack_dir),
        "tokenizer_dir": str(tokenizer_dir),
        "base_dir": str(base_dir) if base_dir is not None else None,
        "rope": rope,
        "document_mask": masked,
        "special": special,
        "debug": ctx.config.debug.pretrain.model_dump(mode="json"),
        "peak_tflops": per_device * devices_used(plan.world_size, device),
    }
    try:
        attempt = run_entry(
            "training.train_entry",
            spec,
            out_dir,
            launch=launch,
            policy=RANKS,
            logger=logging.getLogger("training.launcher"),
        )
    except TrainingDiverged as exc:
        exc.anomalies = anomaly_rows(_read_anomalies(out_dir))  # published by the flow even though the step failed
        raise
    from training.reader import TokenWindows

    summary = json.loads((out_dir / "summary.json").read_text())
    anomalies = _read_anomalies(out_dir)
    unigram = ctx.manifest(TOKEN_SHARDS)["metrics"].get("unigram_entropy_nats")
    return {
        "counts": {
            "steps": summary["final_step"],
            "tokens": summary["tokens"],
            "anomalies": len(anomalies),
            "attempts": attempt.number,
            "params": summary["params"],
            "float8_layers": len(summary.get("float8_layers", [])),
        },
        "metrics": {
            **{
                k: v
                for k, v in summary.items()
                if k not in ("final_step", "tokens", "params", "float8_layers", "expert_shares")
            },
            "unigram_entropy_nats": unigram,
            # the share of training tokens in documents at least seq_len long (context extension's mix)
            "long_document_fraction": round(TokenWindows(pack_dir, "train", cfg.seq_len).long_document_fraction(), 4),
        },
        "extra": {
            "anomalies": anomaly_rows(anomalies),
            "plan": {
                "strategy": plan.label,
                "backend": plan.backend,
                "sharding": plan.sharding,
                "compile": plan.compile,
                "zero_stage": plan.zero_stage,
                "offload": plan.offload,
                "world_size": plan.world_size,
                "degrees": plan.degrees,
                "mesh": mesh_shape(plan),
                "per_rank_gib": plan.per_rank_gib,
                "grad_accum": plan.grad_accum,
                "precision": plan.precision,
                "float8": plan.float8,
                "reasoning": plan.reasoning,
            },
            "float8_layers": summary.get("float8_layers", []),
            "rope": rope,  # None: the model's own rotary settings (no context extension)
            "document_mask": masked,  # attention within each packed document only
            "expert_shares": summary.get("expert_shares"),  # a mixture of experts: [layer][expert] token share
            "budget": plan.budget,
            "hf_dir": str(out_dir / "hf"),
        },
    }


def document_mask(cfg: PretrainConfig, plan: Plan, extending: bool) -> bool:
    """Whether attention stays within each packed document (pretrain.document_mask; auto: on for a
    context extension). Pipeline stages take input ids alone and the tensor-parallel plans are not checked
    with a block-diagonal mask, so a model-parallel run is refused (`on`) or keeps attending across (`auto`)."""
    from training.planner import mesh_label

    wanted = cfg.document_mask == "on" or (cfg.document_mask == "auto" and extending)
    if wanted and plan.degrees:  # the model-parallel dimensions above 1
        if cfg.document_mask == "on":
            raise ConfigError(
                f"pretrain.document_mask=on is not built for model parallelism ({mesh_label(plan.degrees)}): "
                "set it to off, or train data-parallel"
            )
        log.info("document mask off: %s splits the model (tokens attend across documents)", mesh_label(plan.degrees))
        return False
    if wanted:
        log.info("document mask on: tokens attend within their own packed document only")
    return wanted


def _read_anomalies(out_dir: Path) -> list[dict[str, Any]]:
    path = out_dir / "anomalies.json"
    return json.loads(path.read_text()) if path.exists() else []


def anomaly_rows(anomalies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per anomaly for the manifest and the `pretrain-anomalies` artifact."""
    rows = []
    for a in anomalies:
        samples = a.get("samples", [])
        doc_ids = [d for s in samples for d in s.get("doc_ids", [])]
        rows.append(
            {
                "step": a["step"],
                "kind": a["kind"],
                "loss": a["loss"],
                "loss_after": a.get("loss_after"),
                "window_mean": a.get("window_mean"),
                "grad_norm_before": a.get("grad_norm_before"),
                "micro_batches": a["micro_batches"],
                "shards": sorted({s["shard"] for s in samples}),
                "doc_ids": doc_ids[:20] + ([f"... {len(doc_ids) - 20} more"] if len(doc_ids) > 20 else []),
                "action": a["action"],
            }
        )
    return rows


def _resolved_for_device(config: ConfigView) -> dict[str, Any]:
    """`precision: auto` and `float8: auto` resolved on this machine: auto gives bf16 on hardware that
    has it and fp32 elsewhere, float8 on GPUs of compute capability 8.9+ and none elsewhere: different
    models, so different keys."""
    pretrain = config.pretrain
    if pretrain.precision != "auto" and pretrain.float8 != "auto":
        return {}
    from training.device import detect_device
    from training.planner import resolve_float8, resolve_precision

    device = detect_device()
    resolved = {}
    if pretrain.precision == "auto":
        resolved["precision"] = f"auto:{resolve_precision('auto', device)}"
    if pretrain.float8 == "auto":
        resolved["float8"] = f"auto:{resolve_float8('auto', device)}"
    return {"pretrain": resolved}


PRETRAIN_STEPS = [
    # version 2: windows span shard boundaries (no shard tail or short shard is skipped)
    Step(
        TRAIN,
        2,
        "Train the model (from scratch or the base's weights; DeepSpeed or FSDP2, as planned), export to HF format",
        reads=_reads,
        derive=_resolved_for_device,
        upstream=lambda c: (TOKEN_SHARDS, TOKENIZER, BASE_MODEL) if from_base(c) else (TOKEN_SHARDS, TOKENIZER),
        finalize=_train_finalize,
        retries=3,
        bookkeeping=("checkpoints", "logs"),
        digest_paths=("hf/",),
        provides={PRETRAINED: "hf"},
        when=lambda c: not fine_tunes_base(c),  # fine-tuning a base directly: no pretrained model
        progress=lambda ctx: (last_logged_step(ctx.out_dir / METRICS_FILE), ctx.config.pretrain.max_steps),
        curves=(
            ("loss", (("loss", "train"), ("val_loss", "validation"))),
            ("gradient norm", (("grad_norm", ""),)),
            ("MFU", (("mfu", ""),)),
            ("tokens/s", (("tokens_per_s", ""),)),
        ),
        code=(
            "training.loop",
            "training.model",
            "training.checkpoint",
            "training.export",
            "training.train_entry",
            "training.guardrails",
            *parallel_modules(),
            "training.planner",
            "training.device_setup",
            "training.reader",
            "training.float8",
        ),
        libraries=("torch", "transformers", *parallel_libraries(), "torchao"),
    ),
]
