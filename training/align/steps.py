"""The alignment stage's steps: data, SFT, DPO.

    hf-model:pretrained ---------------------------\\
    align/data -> chat-data ------------------> align/sft -> hf-model:sft --\\
               -> preference-data ------------------------------------------> align/dpo -> hf-model:dpo
                               \\-> align/reward -> reward-model --> align/rl -> hf-model:rl
                                  (from hf-model:sft)                (from dpo or sft, prompts from chat-data)

Which of dpo, reward and rl run, and in what order, is `align.recipe`.

`align/sft` and `align/dpo` launch TRL on N ranks (accelerate, torchrun, or the deepspeed
launcher for several nodes) through lmforge's one launch helper (`lmforge.launch.run_entry`); a killed rank is retried and
resumes from the newest complete Trainer checkpoint. Their output digests cover `hf/` only,
so downstream stages follow the weights, not the logs.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.configbase import ConfigView
from lmforge.errors import ConfigError
from lmforge.graph import Step, StepContext
from lmforge.stage import BASE_MODEL, Product, fine_tunes_base, hf_model, left_out_for_base

if TYPE_CHECKING:
    from lmforge.config import PipelineBase

log = logging.getLogger(__name__)
DATA, SFT, DPO, REWARD, RL = "align/data", "align/sft", "align/dpo", "align/reward", "align/rl"
DRAFT = "align/draft"
CHAT_DATA, PREFERENCE_DATA = Product("chat-data"), Product("preference-data")
PRETRAINED, SFT_MODEL, DPO_MODEL = hf_model("pretrained"), hf_model("sft"), hf_model("dpo")
REWARD_MODEL, RL_MODEL = Product("reward-model"), hf_model("rl")
DRAFT_MODEL = Product("draft-model")  # not an hf-model role: nothing evaluates, quantizes or serves it alone
HELDOUT_SFT, HELDOUT_PREFERENCES = "heldout_sft.jsonl", "heldout_preferences.jsonl"


# -- data ---------------------------------------------------------------------------------------------


def _input_files(paths: list[str], workspace: str) -> dict[str, str]:
    from lmforge.hashing import fingerprints
    from lmforge.inputs import expand_inputs

    cache = fingerprints(workspace)
    return {p: cache.path_fingerprint(p) for p in expand_inputs(paths)}


DATA_READS = ("align.heldout_fraction", "align.builtin", "align.sft.inputs", "align.dpo.inputs")


def _input_fingerprints(config: ConfigView) -> dict[str, Any]:
    """The content of the user's files (paths alone would miss an edited file)."""
    a = config.align
    return {
        "sft_inputs": _input_files(a.sft.inputs, config.workspace) if a.sft.inputs else "builtin",
        "dpo_inputs": _input_files(a.dpo.inputs, config.workspace) if a.dpo.inputs else "builtin",
    }


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
    for kind, inputs, validate, builtin in (
        (
            "sft",
            list(ctx.identity["sft_inputs"]) if a.sft.inputs else [],
            data.validate_chat,
            lambda: (
                [data.chat_record(e) for e in examples]
                + data.dialogue_records(a.builtin.dialogue_conversations, a.builtin.seed)
            ),
        ),
        (
            "dpo",
            list(ctx.identity["dpo_inputs"]) if a.dpo.inputs else [],
            data.validate_preference,
            lambda: [data.preference_record(e) for e in examples],
        ),
    ):
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
        write_jsonl(ctx.out_dir / (HELDOUT_SFT if kind == "sft" else HELDOUT_PREFERENCES), heldout)
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


# -- training -----------------------------------------------------------------------------------------


def start_model(config: PipelineBase) -> Product:
    """What SFT starts from: the base model itself when one is set and this run does not pretrain
    (`stages` without `pretrain`), otherwise the pretrained model (from scratch or continued)."""
    return BASE_MODEL if fine_tunes_base(config) else PRETRAINED


def _precision(config: ConfigView) -> str:
    from training.device import detect_device

    if config.align.precision != "auto":
        return config.align.precision
    device = detect_device()
    # on CPU fp32: bf16 autocast is slower there with TRL and not bit-identical across a resume
    return "bf16" if device.kind == "cuda" and device.bf16 else "fp32"


def _training_fields(kind: str) -> list[str]:
    """The fields of `align.<kind>` that shape the model (its `inputs` reach it as data, through `align/data`)."""
    from training.align.config import DpoConfig, DraftConfig, RewardModelConfig, RlConfig, SftConfig, TrainConfig

    models: dict[str, type[TrainConfig]] = {
        "sft": SftConfig,
        "dpo": DpoConfig,
        "reward": RewardModelConfig,
        "rl": RlConfig,
        "draft": DraftConfig,
    }
    return [f"align.{kind}.{f}" for f in models[kind].model_fields if f not in ("inputs", "enabled")]


def _lora(config: ConfigView | PipelineBase, kind: str) -> bool:
    a = config.align
    if kind == "sft":
        return a.method in ("lora", "qlora")
    return kind != "draft" and getattr(a, kind).lora  # the draft is a new, smaller model: every weight trains


def draft_teacher(config: ConfigView | PipelineBase) -> Product:
    """What the draft is distilled from: the recipe's last policy (the model serving takes when unquantized)."""
    if "rl" in config.align.recipe:
        return RL_MODEL
    return DPO_MODEL if "dpo" in config.align.recipe and config.align.dpo.enabled else SFT_MODEL


def rl_start(config: ConfigView | PipelineBase) -> Product:
    """The policy RL starts from: DPO's model when the recipe has DPO before RL, else SFT's."""
    return DPO_MODEL if "dpo" in config.align.recipe and config.align.dpo.enabled else SFT_MODEL


def _train_reads(kind: str) -> Callable[[PipelineBase], tuple[str, ...]]:
    def reads(config: PipelineBase) -> tuple[str, ...]:
        lora = _lora(config, kind)
        return (
            *_training_fields(kind),
            *(("align.method",) if kind == "sft" else ()),
            *(("align.lora",) if lora else ()),
            "align.precision",
        )

    return reads


def _resolved_precision(config: ConfigView) -> dict[str, Any]:
    return {"precision": _precision(config)}


def _reward_source_digest(path: str) -> str:
    """SHA-256 of the source file of the module of a reward `module:function`, found without running it
    (`training.align.rl.import_function` imports it when the step runs).

    Only that file counts: modules it imports in turn are the user's to version. Finding a dotted
    module imports its parent packages, as importing it will."""
    import importlib.util

    from lmforge.hashing import file_sha256

    module = path.partition(":")[0]
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:  # a parent package missing, or broken
        raise ConfigError(f"align.rl.rewards: cannot import {path} ({type(exc).__name__}: {exc})") from None
    if spec is None:
        raise ConfigError(f"align.rl.rewards: cannot import {path} (ModuleNotFoundError: no module named {module!r})")
    if not spec.origin or not Path(spec.origin).is_file():
        raise ConfigError(f"align.rl.rewards: {path}: its module has no source file to fingerprint ({spec.origin})")
    return file_sha256(spec.origin)


def _rl_identity(config: ConfigView) -> dict[str, Any]:
    """RL's computed identity: its precision, and the source of each user reward `module:function`
    (the function runs inside the step, so its code shapes the policy; the config only names it)."""
    functions = sorted({r.function for r in config.align.rl.rewards if r.kind == "function" and r.function})
    sources = {f: {"content": _reward_source_digest(f)} for f in functions}
    return {**_resolved_precision(config), **({"reward_functions": sources} if sources else {})}


def _ranks(config: ConfigView) -> int:
    from training.device import detect_device

    ranks = config.align.distributed.num_ranks
    if ranks != "auto":
        return int(ranks)
    device = detect_device()
    return device.count if device.kind == "cuda" else 2


def _context(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]


def _spec(ctx: StepContext, kind: str) -> dict[str, Any]:
    from lmforge.jsonl import read_jsonl
    from training.align.data import spread_over_tasks

    a = ctx.config.align
    cfg = getattr(a, kind)
    if a.distributed.backend == "fsdp2":
        from training.device import detect_device

        if detect_device().kind != "cuda":
            raise ConfigError(
                "align.distributed.backend: fsdp2 needs GPUs: accelerate's FSDP plugin does not shard CPU ranks "
                "(it trains them as plain DDP); use deepspeed on CPU"
            )
    if kind == "dpo" or (kind == "reward" and a.reward.init == "sft"):
        start = SFT_MODEL
    elif kind == "rl":  # the model `rl_start` chose when the graph was resolved
        start = DPO_MODEL if ctx.has(DPO_MODEL) else SFT_MODEL
    elif kind == "draft":  # the teacher `draft_teacher` chose
        start = next(p for p in (RL_MODEL, DPO_MODEL, SFT_MODEL) if ctx.has(p))
    else:
        start = BASE_MODEL if ctx.has(BASE_MODEL) else PRETRAINED
    base = ctx.path(start)
    context = _context(base)
    chats = kind in ("sft", "rl", "draft")
    data_dir = ctx.path(CHAT_DATA if chats else PREFERENCE_DATA)
    heldout = data_dir.parent / (HELDOUT_SFT if chats else HELDOUT_PREFERENCES)
    verifiable = spread_over_tasks(
        [r for r in read_jsonl(data_dir.parent / HELDOUT_SFT) if "answer" in r], a.eval_generations
    )
    world = _ranks(ctx.config) * a.distributed.num_nodes
    if cfg.global_batch_size % (cfg.micro_batch_size * world):
        raise ConfigError(
            f"align.{kind}.global_batch_size {cfg.global_batch_size} is not a multiple of "
            f"micro_batch_size x world size = {cfg.micro_batch_size} x {world}"
        )
    lora = _lora(ctx.config, kind)
    fields = [f.rsplit(".", 1)[1] for f in _training_fields(kind)]
    settings = {f: _plain(getattr(cfg, f)) for f in fields}
    extra: dict[str, Any] = {}
    if kind == "rl":
        from training.device import detect_device

        if cfg.use_vllm and detect_device().kind != "cuda":
            raise ConfigError(
                "align.rl.use_vllm: TRL's vLLM generation (colocate mode) needs GPUs; on CPU the Trainer generates"
            )
        all_heldout = list(read_jsonl(heldout))
        verifiable_all = [r for r in all_heldout if "answer" in r]
        extra = {
            "reward_model_dir": str(ctx.path(REWARD_MODEL)) if ctx.has(REWARD_MODEL) else None,
            "heldout_all": verifiable_all,  # the final before/after figures: every held-out verifiable item
            "heldout_chats": all_heldout[: cfg.heldout_prompts],  # the SFT loss the watch follows
            "stop_on_hacking": cfg.stop_on_hacking,
            "use_vllm": cfg.use_vllm,
        }
        verifiable = spread_over_tasks(verifiable_all, cfg.heldout_prompts)
    if kind == "draft":  # judged by agreement with its teacher (draft.measure_draft), not by answers
        verifiable = []
    return {
        **extra,
        "kind": kind,
        "config": json.loads(json.dumps(settings)),
        "base_dir": str(base),
        "out_dir": str(ctx.out_dir),
        "train": str(data_dir / "train.jsonl"),
        "heldout": str(heldout),
        "heldout_generation": verifiable,
        "max_length": min(cfg.max_seq_len or context, context),
        "precision": _precision(ctx.config),
        "zero_stage": a.distributed.zero_stage,
        "backend": a.distributed.backend,
        "lora": a.lora.model_dump(mode="json") if lora else None,
        "quantized_base": kind == "sft" and a.method == "qlora",
        "fault": ctx.config.debug.align.model_dump(mode="json"),
        "eval_every": cfg.eval_every,
    }


def _plain(value: Any) -> Any:
    """A config value as JSON data (sections and lists of them dumped)."""
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _progress(kind: str):  # type: ignore[no-untyped-def]
    def progress(ctx: StepContext) -> tuple[float, float]:
        from training.metrics import last_logged_step

        return last_logged_step(ctx.out_dir / "metrics.jsonl"), getattr(ctx.config.align, kind).max_steps

    return progress


def _train_finalize(kind: str):  # type: ignore[no-untyped-def]
    def finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
        from lmforge.launch import RANKS, Launch, run_entry

        d = ctx.config.align.distributed
        launch = Launch(d.launcher, _ranks(ctx.config), d.num_nodes, d.hostfile, d.node_launcher, d.master_port)
        attempt = run_entry(
            "training.align.entry",
            _spec(ctx, kind),
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
                "precision": spec["precision"],
                "lora": spec["lora"] is not None,
            },
        }

    return finalize


CODE = (
    "training.align.entry",
    "training.align.heldout",
    "lmforge.verify",
    "training.align.qlora",
    "training.device_setup",
    "training.export",
)
LIBS = ("trl", "transformers", "peft", "torch", "accelerate", "bitsandbytes")

ALIGN_STEPS = [
    # version 4: SFT and DPO records of one question are held out together
    Step(
        DATA,
        4,
        "Chat and preference data: the user's (quarantined where malformed) or built in; train/held-out split",
        reads=DATA_READS,
        derive=_input_fingerprints,
        finalize=_data_finalize,
        provides={CHAT_DATA: "sft", PREFERENCE_DATA: "dpo"},
        code=("training.align.data", "lmforge.inputs"),
        libraries=("wordfreq",),
    ),
    Step(
        SFT,
        1,
        "Supervised fine-tuning with TRL (full or LoRA, merged), assistant-only loss",
        reads=_train_reads("sft"),
        derive=_resolved_precision,
        upstream=lambda c: (start_model(c), CHAT_DATA),
        finalize=_train_finalize("sft"),
        when=lambda c: not left_out_for_base(c, "align"),
        retries=3,
        bookkeeping=("checkpoints", "logs"),
        digest_paths=("hf/",),
        provides={SFT_MODEL: "hf"},
        progress=_progress("sft"),
        code=CODE,
        libraries=LIBS,
    ),
    Step(
        DPO,
        1,
        "Direct preference optimisation with TRL against the frozen SFT model",
        reads=_train_reads("dpo"),
        derive=_resolved_precision,
        upstream=lambda c: (SFT_MODEL, PREFERENCE_DATA),
        finalize=_train_finalize("dpo"),
        when=lambda c: "dpo" in c.align.recipe and c.align.dpo.enabled and not left_out_for_base(c, "align"),
        retries=3,
        bookkeeping=("checkpoints", "logs"),
        digest_paths=("hf/",),
        provides={DPO_MODEL: "hf"},
        progress=_progress("dpo"),
        code=CODE,
        libraries=LIBS,
    ),
    Step(
        REWARD,
        1,
        "Reward model with TRL's RewardTrainer (Bradley-Terry on chosen/rejected), full or LoRA",
        reads=_train_reads("reward"),
        derive=_resolved_precision,
        upstream=lambda c: (SFT_MODEL if c.align.reward.init == "sft" else start_model(c), PREFERENCE_DATA),
        finalize=_train_finalize("reward"),
        when=lambda c: "reward" in c.align.recipe and not left_out_for_base(c, "align"),
        retries=3,
        bookkeeping=("checkpoints", "logs"),
        digest_paths=("hf/",),
        provides={REWARD_MODEL: "hf"},
        progress=_progress("reward"),
        code=(*CODE, "training.align.rl"),
        libraries=LIBS,
    ),
    Step(
        RL,
        1,
        "Online RL with TRL's GRPOTrainer/RLOOTrainer: verifiable, learned or user rewards, KL to the start, "
        "reward-hacking watch",
        reads=_train_reads("rl"),
        derive=_rl_identity,
        upstream=lambda c: (
            rl_start(c),
            CHAT_DATA,
            # the reward model, when the recipe trains one: a reward term, or else the watch's proxy
            *((REWARD_MODEL,) if "reward" in c.align.recipe else ()),
        ),
        finalize=_train_finalize("rl"),
        when=lambda c: "rl" in c.align.recipe and not left_out_for_base(c, "align"),
        retries=3,
        bookkeeping=("checkpoints", "logs"),
        digest_paths=("hf/",),
        provides={RL_MODEL: "hf"},
        progress=_progress("rl"),
        code=(*CODE, "training.align.rl"),
        libraries=LIBS,
    ),
    Step(
        DRAFT,
        1,
        "Draft model for speculative decoding: fewer of the teacher's layers, distilled with TRL's GKDTrainer",
        reads=_train_reads("draft"),
        derive=_resolved_precision,
        upstream=lambda c: (draft_teacher(c), CHAT_DATA),
        finalize=_train_finalize("draft"),
        when=lambda c: c.align.draft.enabled and not left_out_for_base(c, "align"),
        retries=3,
        bookkeeping=("checkpoints", "logs"),
        digest_paths=("hf/",),
        provides={DRAFT_MODEL: "hf"},
        progress=_progress("draft"),
        code=(*CODE, "training.align.draft"),
        libraries=LIBS,
    ),
]
