"""The alignment stage's steps: the data, then one step per registered method (`training.align.methods`).

    hf-model:pretrained ---------------------------\\
    align/data -> chat-data ------------------> align/sft -> hf-model:sft --\\
               -> preference-data ------------------------------------------> align/dpo -> hf-model:dpo
                               \\-> align/reward -> reward-model --> align/rl -> hf-model:rl
                                  (from hf-model:sft)                (from dpo or sft, prompts from chat-data)

Which methods run, and in what order, is `align.recipe` (checked against the registry).

Every method's step launches the one rank entry (`training.align.entry`) on N ranks
(accelerate, torchrun, or the deepspeed launcher for several nodes) through lmforge's one
launch helper (`lmforge.processes.launch.run_entry`); a killed rank is retried and resumes from the
newest complete Trainer checkpoint. Their output digests cover `hf/` only, so downstream stages
follow the weights, not the logs. Past the data step this module names no method: what one reads, starts from
and makes is its `AlignMethod`.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

from lmforge.configbase import ConfigView
from lmforge.engine.graph import Step, StepContext
from lmforge.engine.remote import local_workspace
from lmforge.engine.stage import left_out_for_base
from lmforge.errors import ConfigError
from training.align.methods import (
    CHAT,
    HELDOUT_PREFERENCES,
    HELDOUT_SFT,
    KIT,
    LIBS,
    PREFERENCE,
    AlignMethod,
    data_owners,
    first_present,
    method,
    methods,
    precision,
)

log = logging.getLogger(__name__)
DATA = "align/data"


# -- data ---------------------------------------------------------------------------------------------


def _input_files(paths: list[str], workspace: str | Path) -> dict[str, str]:
    from lmforge.hashing import fingerprints
    from lmforge.inputs import expand_inputs

    cache = fingerprints(workspace)
    return {p: cache.path_fingerprint(p) for p in expand_inputs(paths)}


# the data kinds' inputs are the sections of the methods that own them (SFT's chat, DPO's preferences)
DATA_READS = ("align.heldout_fraction", "align.builtin", *(f"align.{m.name}.inputs" for m in data_owners().values()))


def _input_fingerprints(config: ConfigView) -> dict[str, Any]:
    """The content of the user's files (paths alone would miss an edited file)."""
    found: dict[str, Any] = {}
    for m in data_owners().values():
        inputs = m.section(config).inputs
        found[f"{m.name}_inputs"] = _input_files(inputs, local_workspace(config)) if inputs else "builtin"
    return found


def _label(ctx: StepContext):  # type: ignore[no-untyped-def]
    def label(origin: str) -> str:
        path = Path(origin.rsplit(":", 1)[0])
        inside = path.resolve().is_relative_to(ctx.workspace)
        return str(path.resolve().relative_to(ctx.workspace)) + origin[len(str(path)) :] if inside else origin

    return label


def _data_finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
    from lmforge.jsonl import write_jsonl
    from training.align import data

    a = ctx.config.align
    counts: dict[str, Any] = {}
    quarantine: list[dict[str, Any]] = []
    examples = data.builtin_examples(a.builtin.per_skill, a.builtin.seed, list(a.builtin.skills))
    builtins = {
        CHAT: (
            data.validate_chat,
            lambda: (
                [data.chat_record(e) for e in examples]
                + data.dialogue_records(a.builtin.dialogue_conversations, a.builtin.seed)
            ),
        ),
        PREFERENCE: (data.validate_preference, lambda: [data.preference_record(e) for e in examples]),
    }
    for data_kind, owner in data_owners().items():
        kind = owner.name  # its folder, its counts and its quarantined records' `dataset`
        inputs = list(ctx.identity[f"{kind}_inputs"]) if owner.section(ctx.config).inputs else []
        validate, builtin = builtins[data_kind]
        if inputs:
            records, bad, total = data.read_user_records(inputs, validate, _label(ctx))
            for record in bad:
                record["dataset"] = kind
            quarantine += bad
            if bad:
                log.warning(
                    "align %s data: quarantined %d of %d records (%s)",
                    kind,
                    len(bad),
                    total,
                    dict(Counter(b["reason"].split(" ")[0] for b in bad)),
                )
        else:
            records, total = builtin(), None
        train, heldout = data.split(records, a.heldout_fraction, a.builtin.seed)
        if not train:
            raise ConfigError(f"align.{kind}.inputs: no usable records to train on ({len(quarantine)} quarantined)")
        write_jsonl(ctx.out_dir / kind / "train.jsonl", train)
        write_jsonl(ctx.out_dir / (HELDOUT_SFT if data_kind == CHAT else HELDOUT_PREFERENCES), heldout)
        read = total if total is not None else len(records)
        counts[kind] = {
            "input": read,
            "train": len(train),
            "heldout": len(heldout),
            "quarantined": sum(1 for q in quarantine if q["dataset"] == kind),
            "duplicates": len(records) - len(train) - len(heldout),
            "by_task": data.task_counts(train + heldout),
        }
        if (
            counts[kind]["input"]
            != counts[kind]["train"]
            + counts[kind]["heldout"]
            + counts[kind]["quarantined"]
            + counts[kind]["duplicates"]
        ):
            raise AssertionError(f"align {kind} data lost records: {counts[kind]}")
    if quarantine:
        write_jsonl(ctx.out_dir / "quarantine.jsonl", quarantine)
    return {"counts": counts}


# -- training: each method's step (training.align.methods), run through one launcher ---------------


def _training_fields(kind: str) -> list[str]:
    """The fields of `align.<kind>` that shape the model (`AlignMethod.training_fields`)."""
    return method(kind).training_fields()


def _ranks(config: ConfigView) -> int:
    from training.device import detect_device

    ranks = config.align.distributed.num_ranks
    if ranks != "auto":
        return int(ranks)
    device = detect_device()
    return device.count if device.kind == "cuda" else 2


def _context(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]


def rank_spec(ctx: StepContext, m: AlignMethod) -> dict[str, Any]:
    """What every rank of `m`'s step reads (`training.align.entry`): the common fields, then the method's own."""
    from lmforge.jsonl import read_jsonl
    from training.align.data import spread_over_tasks

    a = ctx.config.align
    cfg = m.section(ctx.config)
    from training.device import detect_device
    from training.parallel import engine

    problem = engine(a.distributed.backend).align_problem(detect_device().kind)
    if problem:
        raise ConfigError(problem)
    base = ctx.path(first_present(ctx, m.start_candidates()))  # the start the graph chose
    context = _context(base)
    chats = m.data == CHAT
    data_dir = ctx.path(m.data_product())
    heldout = data_dir.parent / (HELDOUT_SFT if chats else HELDOUT_PREFERENCES)
    verifiable = spread_over_tasks(
        [r for r in read_jsonl(data_dir.parent / HELDOUT_SFT) if "answer" in r], a.eval_generations
    )
    world, degree = _ranks(ctx.config) * a.distributed.num_nodes, a.distributed.tensor_parallel
    if degree > 1:
        from training.parallel.dims.tensor import align_model_problem, align_world_problem

        problem = align_world_problem(
            world, a.distributed.num_nodes, degree, engine(a.distributed.backend).mesh_dimensions
        ) or align_model_problem(json.loads((base / "config.json").read_text()), degree, str(base / "config.json"))
        if problem:
            raise ConfigError(problem)
    if cfg.global_batch_size % (cfg.micro_batch_size * (world // degree)):
        replicas = "world size / tensor_parallel" if degree > 1 else "world size"
        raise ConfigError(
            f"align.{m.name}.global_batch_size {cfg.global_batch_size} is not a multiple of "
            f"micro_batch_size x {replicas} = {cfg.micro_batch_size} x {world // degree}"
        )
    lora = m.lora(ctx.config)
    fields = [f.rsplit(".", 1)[1] for f in m.training_fields()]
    settings = {f: _plain(getattr(cfg, f)) for f in fields}
    spec = {
        "kind": m.name,
        "config": json.loads(json.dumps(settings)),
        "base_dir": str(base),
        "out_dir": str(ctx.out_dir),
        "train": str(data_dir / "train.jsonl"),
        "heldout": str(heldout),
        "heldout_generation": verifiable,
        "max_length": min(cfg.max_seq_len or context, context),
        "precision": precision(ctx.config),
        "zero_stage": a.distributed.zero_stage,
        "backend": a.distributed.backend,
        "tensor_parallel": degree,
        "lora": a.lora.model_dump(mode="json") if lora else None,
        "quantized_base": False,
        "fault": ctx.config.debug.align.model_dump(mode="json"),
        "eval_every": cfg.eval_every,
    }
    return m.spec(ctx, spec)


def _plain(value: Any) -> Any:
    """A config value as JSON data (sections and lists of them dumped)."""
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def progress(m: AlignMethod):  # type: ignore[no-untyped-def]
    def progress(ctx: StepContext) -> tuple[float, float]:
        from training.metrics import last_logged_step

        return last_logged_step(ctx.out_dir / "metrics.jsonl"), m.section(ctx.config).max_steps

    return progress


def train_finalize(m: AlignMethod):  # type: ignore[no-untyped-def]
    def finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
        from lmforge.processes.launch import RANKS, Launch, run_entry

        d = ctx.config.align.distributed
        launch = Launch(d.launcher, _ranks(ctx.config), d.num_nodes, d.hostfile, d.node_launcher, d.master_port)
        attempt = run_entry(
            "training.align.entry",
            rank_spec(ctx, m),
            ctx.out_dir,
            launch=launch,
            policy=RANKS,
            logger=logging.getLogger("training.launcher"),
        )
        spec = attempt.spec
        summary = json.loads((ctx.out_dir / "summary.json").read_text())
        rows = [json.loads(line) for line in (ctx.out_dir / "metrics.jsonl").read_text().splitlines()]
        speeds = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
        metrics = {k: v for k, v in summary.items() if not k.startswith("examples_") and k != "warnings"}
        metrics["tokens_per_s"] = sum(speeds) / len(speeds) if speeds else None
        last = {
            k: v
            for r in rows
            for k, v in r.items()
            if k.startswith(("rewards/", "kl", "loss", "reward", "entropy", "completions/mean_length", "clip_ratio/"))
        }
        metrics.update({f"final_{k}": v for k, v in last.items()})
        for warning in summary["warnings"]:
            log.warning("%s: %s", ctx.step, warning)
        return {
            "counts": {
                "steps": summary["final_step"],
                "attempts": attempt.number,
                "heldout_items": summary["heldout_items"],
            },
            "metrics": metrics,
            "extra": {
                "warnings": summary["warnings"],
                "hf_dir": str(ctx.out_dir / "hf"),
                "examples": summary.get("examples_after", []),
                "world_size": spec["world_size"],
                "tensor_parallel": spec.get("tensor_parallel", 1),
                "precision": spec["precision"],
                "lora": spec["lora"] is not None,
            },
        }

    return finalize


def method_step(m: AlignMethod) -> Step:
    """The step `align/<name>` of a registered method: TRL on N ranks through the one launcher, retried
    and resumed from the newest complete checkpoint; its output digest covers `hf/` only, so
    downstream stages follow the weights, not the logs."""
    return Step(
        m.step_name,
        m.version,
        m.description,
        reads=m.reads,
        derive=m.identity,
        upstream=m.upstream,
        finalize=train_finalize(m),
        when=lambda c: m.enabled(c) and not left_out_for_base(c, "align"),
        retries=3,
        bookkeeping=("checkpoints", "logs"),
        digest_paths=("hf/",),
        provides={m.product: "hf"},
        progress=progress(m),
        curves=m.curves,
        code=(*KIT, type(m).__module__, *m.code),
        libraries=LIBS,
    )


def _steps() -> list[Step]:
    return [
        # version 4: SFT and DPO records of one question are held out together
        Step(
            DATA,
            4,
            "Chat and preference data: the user's (quarantined where malformed) or built in; train/held-out split",
            reads=DATA_READS,
            derive=_input_fingerprints,
            finalize=_data_finalize,
            provides={m.data_product(): m.name for m in data_owners().values()},
            code=("training.align.data", "lmforge.inputs"),
            libraries=("wordfreq",),
        ),
        *(method_step(m) for m in methods().values()),
    ]


ALIGN_STEPS = _steps()
