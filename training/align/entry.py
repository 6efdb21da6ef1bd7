"""Entry point of every alignment rank: SFT or DPO with TRL, started by accelerate, torchrun or deepspeed.

    accelerate launch --multi_gpu --num_processes N -m training.align.entry --spec <out>/run_spec.json

The spec (written by `training.align.steps`) says what to train (`kind`: sft or dpo), from
which model, on which data, and how. The rank trains with `trl.SFTTrainer` / `trl.DPOTrainer`,
checkpoints every `save_steps` (model, optimizer, scheduler, every rank's RNG, data position:
the HF Trainer's own checkpoints), and on a retry resumes from the newest *complete*
checkpoint -- never from step 0 into a directory holding progress. Rank 0 then writes `hf/`
(for LoRA: `adapter/` plus the merged model, checked against the PEFT model's logits), and
measures the held-out split (`training.align.heldout`) for the model it started from and the
one it made, so the step's summary can say what alignment changed. Outcomes are recorded by
`lmforge.entry.main` for the launching step's retry decision.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.entry import main
from training.device_setup import disable_shm_comm_op, safe_attention_kernels

if TYPE_CHECKING:
    from transformers import Trainer

log = logging.getLogger("training.align")
METRICS = "metrics.jsonl"


def newest_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint that verifies against the checksums `SealCheckpoints` wrote once every
    rank had finished writing it. One without them (a kill mid-save) or with a file that differs (a
    truncated rank file) is set aside under a unique name, never resumed from; the previous one is."""
    from training.checkpoint import set_aside, verify

    if not root.exists():
        return None
    found = sorted(
        (p for p in root.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
        key=lambda p: int(p.name.split("-")[-1]),
        reverse=True,
    )
    for candidate in found:
        problem = verify(candidate)
        if problem is None:
            return candidate
        set_aside(candidate, "incomplete: " + problem if problem.startswith("no ") else problem)
    return None


def resume_point(out_dir: Path) -> Path | None:
    from lmforge.errors import DeterministicError

    checkpoint = newest_checkpoint(out_dir / "checkpoints")
    metrics = out_dir / METRICS
    if checkpoint is None and metrics.exists() and metrics.stat().st_size:
        raise DeterministicError(
            f"{out_dir}: {METRICS} records training progress but no complete checkpoint is left; "
            "refusing to restart from step 0 over it (delete the output folder to start over)"
        )
    return checkpoint


def _callbacks(spec: dict[str, Any], trainer_holder: dict[str, Any]) -> list[Any]:
    from transformers import TrainerCallback

    out_dir = Path(spec["out_dir"])
    heldout = spec.get("heldout_generation") or []

    class JsonlMetrics(TrainerCallback):
        """Rank 0: one JSON line per logged step, with tokens/s from TRL's `num_tokens`."""

        def __init__(self) -> None:
            self.last: tuple[float, float] | None = None

        def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
            if not state.is_world_process_zero or not logs or "train_runtime" in logs:
                return
            row = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
            now, tokens = time.time(), float(logs.get("num_tokens", 0.0))
            if self.last is not None and tokens > self.last[1]:
                row["tokens_per_s"] = (tokens - self.last[1]) / max(now - self.last[0], 1e-9)
            self.last = (now, tokens)
            if "rewards/chosen" in row and spec["config"].get("beta"):
                row["kl_chosen"] = row["rewards/chosen"] / spec["config"]["beta"]  # log pi/pi_ref of chosen
            with open(out_dir / METRICS, "a") as handle:
                handle.write(json.dumps(row) + "\n")
            if state.global_step % spec["config"]["log_every"] == 0 and "loss" in row:
                extra = "".join(f" {k} {row[k]:.3f}" for k in ("rewards/accuracies", "rewards/margins") if k in row)
                log.info(
                    "%s step %d/%d loss %.4f%s%s",
                    spec["kind"],
                    state.global_step,
                    state.max_steps,
                    row["loss"],
                    extra,
                    f" {row['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in row else "",
                )

    class HeldoutGeneration(TrainerCallback):
        """Rank 0, every `eval_every` steps: exact match of greedy answers on held-out verifiable items."""

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            every = spec["eval_every"]
            if not heldout or state.global_step % every or not state.is_world_process_zero or _sharded(spec):
                return
            if spec["kind"] in ("reward", "rl"):  # a classifier does not generate; RL's watch measures this
                return
            from training.align.heldout import exact_match

            model = trainer_holder["trainer"].accelerator.unwrap_model(trainer_holder["trainer"].model)
            was_training = model.training
            score = exact_match(model, trainer_holder["tokenizer"], heldout)["exact_match"]
            model.train(was_training)
            with open(out_dir / METRICS, "a") as handle:
                handle.write(json.dumps({"step": state.global_step, "heldout_exact_match": score}) + "\n")
            log.info("step %d: held-out exact match %.3f", state.global_step, score)

    class SealCheckpoints(TrainerCallback):
        """After the Trainer saved `checkpoint-N` on every rank: wait for all of them (each writes its own
        RNG state, DeepSpeed its shards), then rank 0 writes the checksums that make it complete."""

        def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            from training.checkpoint import seal

            _barrier()
            if state.is_world_process_zero:
                seal(Path(args.output_dir) / f"checkpoint-{state.global_step}")
            _barrier()

    callbacks = [JsonlMetrics(), HeldoutGeneration(), SealCheckpoints()]
    if spec["kind"] == "rl":
        callbacks.append(hacking_watch(spec, trainer_holder))
    return callbacks


def hacking_watch(spec: dict[str, Any], holder: dict[str, Any]) -> Any:
    """Rank 0, at the start and every `eval_every` steps: the held-out probe of `training.align.rl`
    (verified accuracy, proxy reward, reward-model score, SFT loss, KL distribution) into
    metrics.jsonl, and the reward-hacking verdict against the start."""
    from transformers import TrainerCallback

    from training.align.rl import Probe, RewardHacking, hacking, summarize

    out_dir = Path(spec["out_dir"])
    start_file, warned_file = out_dir / "rl_start.json", out_dir / "hacking.json"

    class HackingWatch(TrainerCallback):
        def __init__(self) -> None:
            self.probe: Probe | None = None
            self.start: dict[str, Any] | None = None

        def _measure(self, step: int) -> dict[str, Any]:
            if self.probe is None:
                self.probe = Probe(spec, holder["tokenizer"])
            trainer = holder["trainer"]
            model = trainer.accelerator.unwrap_model(trainer.model)
            was_training = model.training
            figures = summarize(self.probe.measure(model))
            model.train(was_training)
            with open(out_dir / METRICS, "a") as handle:
                rows = {f"watch/{k}": v for k, v in figures.items() if k != "heldout_verified_items"}
                handle.write(json.dumps({"step": step, **rows}) + "\n")
            return figures

        def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if not state.is_world_process_zero or _sharded(spec):
                return
            if start_file.exists():  # a resumed run compares with the start of the first attempt
                self.start = json.loads(start_file.read_text())
                return
            self.start = self._measure(0)
            from lmforge.hashing import atomic_write_json

            atomic_write_json(start_file, self.start)

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step % spec["eval_every"] or not state.is_world_process_zero or self.start is None:
                return
            now = self._measure(state.global_step)
            verdict = hacking(spec, self.start, now)
            log.info(
                "rl step %d: held-out verified %.3f, reward %.3f%s, KL p50 %.4f p90 %.4f",
                state.global_step,
                now.get("heldout_verified", float("nan")),
                now.get("heldout_configured_reward", float("nan")),
                f", reward-model score {now['heldout_rm_score']:.3f}" if "heldout_rm_score" in now else "",
                now.get("kl_p50", float("nan")),
                now.get("kl_p90", float("nan")),
            )
            if verdict is None:
                return
            if not warned_file.exists():
                log.warning("%s", verdict)
                from lmforge.hashing import atomic_write_json

                atomic_write_json(warned_file, {"step": state.global_step, "message": verdict})
            if spec["stop_on_hacking"]:
                raise RewardHacking(f"align.rl.stop_on_hacking: step {state.global_step}: {verdict}")

    return HackingWatch()


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _sharded(spec: dict[str, Any]) -> bool:
    """Parameters sharded over ranks (ZeRO-3, FSDP2): no rank can generate alone."""
    return spec["zero_stage"] == 3 or spec.get("backend") == "fsdp2"


def _training_args(spec: dict[str, Any], cls: Any, **extra: Any) -> Any:
    import torch

    cfg, out_dir = spec["config"], Path(spec["out_dir"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_step = cfg["micro_batch_size"] * world
    ds: dict[str, Any] | None = None
    if spec["zero_stage"]:
        ds = {
            "zero_optimization": {"stage": spec["zero_stage"]},
            "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"},
            "fp16": {"enabled": False},
        }
        if spec["zero_stage"] == 3:
            ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    if spec.get("backend") == "fsdp2":
        # accelerate's FSDP plugin, version 2: fully_shard per decoder layer (the model's
        # _no_split_modules) and at the root; the saved model is gathered whole on rank 0
        extra.update(
            fsdp="full_shard auto_wrap",
            fsdp_config={"version": 2, "reshard_after_forward": True, "state_dict_type": "FULL_STATE_DICT"},
        )
    if spec.get("quantized_base"):  # QLoRA: checkpointed layers, as prepare_model_for_kbit_training set them
        extra.update(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        extra.setdefault("gradient_checkpointing", False)
    if "max_length" in {f.name for f in dataclasses.fields(cls)}:  # GRPO/RLOO bound completions instead
        extra["max_length"] = spec["max_length"]
    return cls(
        output_dir=str(out_dir / "checkpoints"),
        use_cpu=not torch.cuda.is_available(),
        bf16=spec["precision"] == "bf16",
        per_device_train_batch_size=cfg["micro_batch_size"],
        gradient_accumulation_steps=cfg["global_batch_size"] // per_step,
        learning_rate=cfg["lr"],
        lr_scheduler_type=cfg["lr_scheduler"],
        warmup_steps=int(cfg["warmup_ratio"] * cfg["max_steps"]),
        weight_decay=cfg["weight_decay"],
        max_steps=cfg["max_steps"],
        logging_steps=1,
        logging_first_step=True,
        report_to=["tensorboard"],
        save_strategy="steps",
        save_steps=cfg["save_steps"],
        save_total_limit=2,
        seed=cfg["seed"],
        data_seed=cfg["seed"],
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
        deepspeed=ds,
        save_only_model=False,
        **extra,
    )


def _load_model(path: str, precision: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)


def _peft_config(spec: dict[str, Any]) -> Any:
    from peft import LoraConfig

    lora = spec["lora"]
    return LoraConfig(
        r=lora["r"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        bias="none",
        task_type="CAUSAL_LM",
        target_modules="all-linear" if lora["target_modules"] == ["all-linear"] else lora["target_modules"],
    )


def _dataset(path: str, columns: list[str]) -> Any:
    from datasets import load_dataset

    data = load_dataset("json", data_files=path, split="train")
    return data.select_columns(columns)


def trainable_template(tokenizer: Any) -> bool:
    """Whether assistant-only loss works through the chat template: it has `{% generation %}`
    markers, or TRL has a marked copy of it."""
    from trl.chat_template_utils import get_training_chat_template

    from lmforge.chat import has_generation_markers

    if has_generation_markers(tokenizer.chat_template):
        return True
    try:
        get_training_chat_template(tokenizer)
    except ValueError:
        return False
    return True


def as_prompt_completion(record: dict[str, Any]) -> dict[str, Any]:
    """A chat as prompt (every turn before the last assistant turn) and completion (that turn)."""
    messages = record["messages"]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return {"prompt": messages[:last], "completion": [messages[last]]}


def train(spec: dict[str, Any], rank: int) -> None:
    out_dir = Path(spec["out_dir"])
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(out_dir / "tensorboard")  # transformers 5 has no logging_dir
    disable_shm_comm_op()
    safe_attention_kernels()
    if spec["zero_stage"]:
        import deepspeed
        import torch

        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")  # before ZeRO-3 loads
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["base_dir"])
    holder: dict[str, Any] = {"tokenizer": tokenizer}
    resume = resume_point(out_dir)
    if resume is not None:
        log.info("resuming from %s", resume.name)
    lora = spec.get("lora") is not None
    model: Any
    if spec["kind"] == "reward":
        from training.align.rl import reward_trainer

        model = None
    elif spec.get("quantized_base"):
        from training.align.qlora import four_bit_layers, load_4bit

        model = load_4bit(spec["base_dir"], spec["precision"])
        log.info("QLoRA: %d linear layers in 4-bit NF4 (double quantization)", four_bit_layers(model))
    else:
        model = _load_model(spec["base_dir"], spec["precision"])
    trainer: Trainer  # TRL's SFTTrainer, DPOTrainer, RewardTrainer, GRPOTrainer or RLOOTrainer
    if spec["kind"] == "reward":
        trainer = reward_trainer(
            spec, tokenizer, _training_args, _callbacks(spec, holder), _peft_config(spec) if lora else None
        )
    elif spec["kind"] == "rl":
        from training.align.rl import rl_trainer

        trainer = rl_trainer(
            spec, model, tokenizer, _training_args, _callbacks(spec, holder), _peft_config(spec) if lora else None
        )
    elif spec["kind"] == "draft":  # `model` is the teacher; the student is built from it
        from training.align.draft import draft_trainer

        train_data = _dataset(spec["train"], ["messages"])
        trainer = draft_trainer(spec, model, tokenizer, _training_args, _callbacks(spec, holder), train_data)
    elif spec["kind"] == "sft":
        from trl import SFTConfig, SFTTrainer

        # a base's own chat template without {% generation %} markers cannot mask by itself: TRL swaps
        # in a marked copy of the templates it knows (Llama 3, Qwen 2.5/3, Gemma, Phi-3, ...); for
        # any other, the last assistant turn becomes the completion and the rest the prompt
        markers = trainable_template(tokenizer)
        only_assistant = spec["config"]["assistant_only_loss"]
        args = _training_args(
            spec,
            SFTConfig,
            assistant_only_loss=only_assistant and markers,
            completion_only_loss=only_assistant and not markers,
            packing=spec["config"]["packing"],
        )
        train_data = _dataset(spec["train"], ["messages"])
        if only_assistant and not markers:
            train_data = train_data.map(as_prompt_completion, remove_columns=["messages"])
        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=train_data,
            processing_class=tokenizer,
            peft_config=_peft_config(spec) if lora else None,
            callbacks=_callbacks(spec, holder),
        )
    else:
        from trl import DPOConfig, DPOTrainer

        weight = spec["config"].get("sft_weight", 0.0)
        losses = (
            {"loss_type": [spec["config"]["loss_type"], "sft"], "loss_weights": [1.0, weight]}
            if weight
            else {"loss_type": [spec["config"]["loss_type"]]}
        )
        args = _training_args(spec, DPOConfig, beta=spec["config"]["beta"], **losses)
        # the reference is the SFT model, frozen, loaded from disk like the policy (with LoRA: adapter off)
        reference = None if lora else _load_model(spec["base_dir"], spec["precision"])
        trainer = DPOTrainer(
            model=model,
            ref_model=reference,
            args=args,
            train_dataset=_dataset(spec["train"], ["prompt", "chosen", "rejected"]),
            processing_class=tokenizer,
            peft_config=_peft_config(spec) if lora else None,
            callbacks=_callbacks(spec, holder),
        )
    holder["trainer"] = trainer
    if spec.get("quantized_base"):
        from training.align.qlora import adapters_in_fp32

        adapters_in_fp32(trainer.model)
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for noisy in (PrinterCallback, ProgressCallback):  # a dict or a progress bar per step; JsonlMetrics logs instead
        trainer.remove_callback(noisy)
    if rank == 0:
        log.info(
            "distributed: %s over %d rank(s)", trainer.accelerator.distributed_type, trainer.accelerator.num_processes
        )
    started = time.time()
    result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    seconds = time.time() - started
    target = out_dir / ("adapter" if lora else "hf")
    trainer.save_model(str(target))  # collective under ZeRO-3; written by rank 0
    if rank == 0:
        finish(spec, trainer, tokenizer, result, seconds)


def finish(spec: dict[str, Any], trainer: Any, tokenizer: Any, result: Any, seconds: float) -> None:
    """Rank 0: the exported `hf/` (merged for LoRA, parity-checked), held-out figures, summary.json."""
    out_dir = Path(spec["out_dir"])
    hf = out_dir / "hf"
    for export in (hf, out_dir / "adapter"):  # a pickle has no place next to the weights it describes
        (export / "training_args.bin").unlink(missing_ok=True)
    summary = {
        "final_step": trainer.state.global_step,
        "train_loss": result.training_loss,
        "train_seconds": round(seconds, 2),
    }
    if spec["kind"] == "reward":
        from training.align.rl import finish_reward

        summary.update(finish_reward(spec, tokenizer, hf))
        summary["heldout_items"] = summary["items"]
        summary["warnings"] = []
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return
    summary["merge_parity_max_abs_logit_diff"] = merge_lora(spec, out_dir / "adapter", hf) if spec.get("lora") else None
    finalize_export(spec, tokenizer, hf)
    if spec["kind"] == "draft":
        from training.align.draft import measure_draft

        summary.update(measure_draft(spec, tokenizer, hf))
        summary["warnings"] = []
    elif spec["kind"] == "rl":
        summary.update(measure_rl(spec, tokenizer, hf))
        hacked = out_dir / "hacking.json"
        summary["warnings"] = [json.loads(hacked.read_text())["message"]] if hacked.exists() else []
        learnt_prompts = generalisation(summary, summary) if "rl_prompts_exact_match_delta_ci" in summary else None
        summary["warnings"] += [learnt_prompts] if learnt_prompts else []
        summary["reward_hacking"] = hacked.exists()
        from training.align.rl import filter_summary

        summary["prompt_filter"] = filter_summary(out_dir)
    else:
        summary.update(measure(spec, tokenizer, hf))
        summary["warnings"] = overoptimisation(spec, summary)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def merge_lora(spec: dict[str, Any], adapter: Path, hf: Path) -> float:
    """Merge the adapter into the base model, save it, and check it against the PEFT model's logits."""
    import torch
    from peft import PeftModel

    from lmforge.errors import ParityError

    base = _load_model(spec["base_dir"], "fp32")
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    batch = parity_batch(spec)
    with torch.no_grad():
        reference = peft_model(input_ids=batch).logits.float()
    merged = peft_model.merge_and_unload()
    if spec.get("fault", {}).get("corrupt_merge"):  # test hook: a merge that went wrong
        with torch.no_grad():
            next(p for n, p in merged.named_parameters() if "down_proj" in n).mul_(1.5)
    merged.save_pretrained(str(hf), safe_serialization=True)
    reloaded = _load_model(str(hf), "fp32").eval()
    with torch.no_grad():
        gap = float((reloaded(input_ids=batch).logits.float() - reference).abs().max())
    tolerance = spec["lora"]["merge_parity_tolerance"]
    if gap > tolerance:
        raise ParityError(
            f"merged LoRA model's logits differ from the PEFT model's by {gap:.3g} (tolerance {tolerance})"
        )
    log.info("LoRA merge parity ok: max |logit diff| %.3g", gap)
    return gap


def parity_batch(spec: dict[str, Any]) -> Any:
    """A fixed batch from the held-out data, the same on every run."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["base_dir"])
    records = [json.loads(line) for line in Path(spec["heldout"]).read_text().splitlines()[:4]]
    texts = [
        tokenizer.apply_chat_template(r["messages"] if "messages" in r else r["prompt"] + r["chosen"], tokenize=False)
        for r in records
    ]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][:64] for t in texts]
    width = min(len(i) for i in ids)
    return torch.tensor([i[:width] for i in ids])


def finalize_export(spec: dict[str, Any], tokenizer: Any, hf: Path) -> None:
    """Tokenizer with the chat template and the model's context, and stop tokens that end a turn."""
    from training.export import copy_tokenizer, generation_config

    base = Path(spec["base_dir"])
    copy_tokenizer(base, hf, spec["max_length"])
    special = {"bos_id": tokenizer.bos_token_id, "eos_id": tokenizer.eos_token_id, "pad_id": tokenizer.pad_token_id}
    generation_config(base, special, spec["max_length"]).save_pretrained(str(hf))


def measure(spec: dict[str, Any], tokenizer: Any, hf: Path) -> dict[str, Any]:
    """Held-out figures for the model this step started from and the one it made."""
    from lmforge.jsonl import read_jsonl
    from training.align.heldout import assistant_loss, exact_match, paired_bootstrap, preference_accuracy

    heldout = list(read_jsonl(Path(spec["heldout"])))
    verifiable = spec.get("heldout_generation") or []
    out: dict[str, Any] = {}
    paired: dict[str, dict[str, list[float]]] = {}
    for name, path in (("before", spec["base_dir"]), ("after", str(hf))):
        model = _load_model(path, "fp32")
        if spec["kind"] == "sft":
            loss = assistant_loss(model, tokenizer, heldout, spec["max_length"])
            out.update(
                {
                    f"heldout_loss_{name}": loss["loss"],
                    f"heldout_loss_{name}_ci": [loss["loss_ci_low"], loss["loss_ci_high"]],
                }
            )
        else:
            pref = preference_accuracy(model, tokenizer, heldout, spec["max_length"])
            paired.setdefault("preference_accuracy", {})[name] = pref["wins"]
            out.update(
                {
                    f"preference_accuracy_{name}": pref["preference_accuracy"],
                    f"preference_accuracy_{name}_ci": [
                        pref["preference_accuracy_ci_low"],
                        pref["preference_accuracy_ci_high"],
                    ],
                    f"logprob_margin_{name}": pref["mean_logprob_margin"],
                }
            )
        em = exact_match(model, tokenizer, verifiable)
        paired.setdefault("exact_match", {})[name] = em["hits"]
        out.update(
            {
                f"exact_match_{name}": em["exact_match"],
                f"exact_match_{name}_ci": [em["exact_match_ci_low"], em["exact_match_ci_high"]],
                f"exact_match_{name}_by_task": em["by_task"],
                f"examples_{name}": em["examples"],
            }
        )
        out["heldout_items"] = len(heldout)
        out["heldout_generation_items"] = em["items"]
        del model
    for metric, runs in paired.items():  # the change on the same items, with a paired bootstrap interval
        delta, low, high = paired_bootstrap(runs["before"], runs["after"])
        out[f"{metric}_delta"], out[f"{metric}_delta_ci"] = delta, [low, high]
    return out


def measure_rl(spec: dict[str, Any], tokenizer: Any, hf: Path) -> dict[str, Any]:
    """Held-out figures of the policy RL started from and the one it made, on held-out prompts no RL
    step saw: exact match (the verifier) with a paired interval on the change, the configured and the
    reward model's reward, the SFT loss, and the KL distribution of the result to the start."""
    from training.align.heldout import exact_match, paired_bootstrap
    from training.align.rl import Probe, summarize

    probe = Probe({**spec, "heldout_generation": spec["heldout_all"]}, tokenizer)
    own = rl_prompts_sample(spec)
    out: dict[str, Any] = {}
    raw: dict[str, dict[str, Any]] = {}
    own_hits: dict[str, list[float]] = {}
    for name, path in (("before", spec["base_dir"]), ("after", str(hf))):
        model = _load_model(path, "fp32").eval()
        raw[name] = probe.measure(model, with_kl=name == "after")
        own_hits[name] = exact_match(model, tokenizer, own)["hits"] if own else []
        for key, value in summarize(raw[name]).items():
            if key == "heldout_verified_items":  # the watch's; the paired figures below use raw
                continue
            out[f"{key}_{name}" if not key.startswith("kl_") else key] = value
        out[f"examples_{name}"] = raw[name]["examples"]
        if name == "before":
            probe.reference = model  # the start is the KL reference: load it once
    out["exact_match_before"], out["exact_match_after"] = out["heldout_verified_before"], out["heldout_verified_after"]
    for metric, key in (("exact_match", "heldout_verified"), ("heldout_reward", "heldout_configured_reward")):
        delta, low, high = paired_bootstrap(raw["before"][key], raw["after"][key])
        out[f"{metric}_delta"], out[f"{metric}_delta_ci"] = delta, [low, high]
    by_task: dict[str, dict[str, list[float]]] = {}
    for name in ("before", "after"):
        for hit, record in zip(raw[name]["heldout_verified"], [r for r in spec["heldout_all"] if "answer" in r]):
            by_task.setdefault(name, {}).setdefault(record["task"], []).append(hit)
        out[f"exact_match_{name}_by_task"] = {t: round(sum(v) / len(v), 4) for t, v in sorted(by_task[name].items())}
    out["heldout_items"] = out["heldout_generation_items"] = len(spec["heldout_all"])
    if own:  # the same on RL's own prompts: whether RL taught the skill or its prompts
        delta, low, high = paired_bootstrap(own_hits["before"], own_hits["after"])
        out["rl_prompts_exact_match_before"] = sum(own_hits["before"]) / len(own)
        out["rl_prompts_exact_match_after"] = sum(own_hits["after"]) / len(own)
        out["rl_prompts_exact_match_delta"], out["rl_prompts_exact_match_delta_ci"] = delta, [low, high]
        out["rl_prompts_items"] = len(own)
    return out


def rl_prompts_sample(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """A fixed sample of RL's own training prompts with a verified answer (those the prompt filter
    kept, when it ran), as many as the held-out items: a gain there that does not reach held-out
    ones is memorisation (measured on tiny-cpu-rl, a 4M model)."""
    import random

    from lmforge.errors import ConfigError
    from training.align.rl import prompt_records

    filtered = Path(spec["out_dir"]) / "prompt_filter.jsonl"
    if filtered.exists():
        from lmforge.jsonl import read_jsonl

        verifiable = [r for r in read_jsonl(filtered) if r["kept"]]
    else:
        try:
            verifiable = [r for r in prompt_records(spec["train"], "verifiable") if r.get("answer") is not None]
        except ConfigError:  # RL on chats without a verified answer (align.rl.prompts: all): nothing to score
            return []
    return random.Random(0).sample(verifiable, min(len(verifiable), len(spec["heldout_all"])))


def generalisation(own: dict[str, Any], heldout: dict[str, Any]) -> str | None:
    """One line when RL's gain on its own prompts is real (interval above 0) and on held-out ones is not."""
    (low, high), (held_low, held_high) = own["rl_prompts_exact_match_delta_ci"], heldout["exact_match_delta_ci"]
    if low <= 0 or held_low > 0:
        return None
    return (
        f"RL raised exact match on its own prompts by {own['rl_prompts_exact_match_delta']:+.3f} [{low:+.3f}, "
        f"{high:+.3f}] but not on held-out ones ({heldout['exact_match_delta']:+.3f} [{held_low:+.3f}, "
        f"{held_high:+.3f}]): the policy learnt its prompts, not the skill; more varied prompts "
        "(align.builtin.per_skill) or a larger model"
    )


def overoptimisation(spec: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """DPO's reward accuracy saturating while held-out exact match falls: the over-optimisation the
    seeds warn about (the policy learns to separate pairs, not to answer)."""
    if spec["kind"] != "dpo":
        return []
    rows = [json.loads(line) for line in (Path(spec["out_dir"]) / METRICS).read_text().splitlines()]
    accuracies = [r["rewards/accuracies"] for r in rows if "rewards/accuracies" in r][-10:]
    before, after = summary.get("exact_match_before"), summary.get("exact_match_after")
    if not accuracies or before is None or after is None or math.isnan(before) or math.isnan(after):
        return []
    saturated = sum(accuracies) / len(accuracies) >= 0.95
    if saturated and after < before - 0.05:
        message = (
            f"DPO reward accuracy saturated ({sum(accuracies) / len(accuracies):.2f} over the last steps) while "
            f"held-out exact match fell {before:.3f} -> {after:.3f}: likely over-optimisation; lower "
            "align.dpo.lr or max_steps, or raise align.dpo.beta"
        )
        log.warning("%s", message)
        return [message]
    return []


if __name__ == "__main__":
    sys.exit(main(train))
