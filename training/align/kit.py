"""What every alignment method's trainer is built from, on each rank: the model, TRL's arguments,
LoRA, the data, the checkpoint rules, the export of `hf/` and the held-out figures SFT-like
methods share. A method (`training.align.methods`) calls these; it never imports the entry.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("training.align")
METRICS = "metrics.jsonl"


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def sharded(spec: dict[str, Any]) -> bool:
    """Parameters sharded or split over ranks (ZeRO-3, FSDP2, tensor parallelism): no rank can generate alone."""
    from training.parallel import engine

    return engine(spec["backend"]).align_stage(spec["zero_stage"]) == 3 or tensor_parallel(spec) > 1


def tensor_parallel(spec: dict[str, Any]) -> int:
    return int(spec.get("tensor_parallel", 1))


def training_args(spec: dict[str, Any], cls: Any, **extra: Any) -> Any:
    """TRL's config class `cls` (SFTConfig, DPOConfig, ...) with the spec's schedule, batch, precision,
    checkpointing and distribution; `extra` are the method's own arguments."""
    import torch

    cfg, out_dir = spec["config"], Path(spec["out_dir"])
    world, degree = int(os.environ.get("WORLD_SIZE", "1")), tensor_parallel(spec)
    per_step = cfg["micro_batch_size"] * (world // degree)  # a tensor-parallel group reads one batch
    from training.parallel import engine
    from training.parallel.dims.tensor import align_trainer_arguments

    chosen = engine(spec["backend"])
    # the engine's arguments, except under tensor parallelism without replicas (nothing for FSDP to shard)
    sharding = chosen.trl_arguments(spec) if degree == 1 or world > degree else {}
    extra = {**sharding, **align_trainer_arguments(degree, world, chosen.mesh_dimensions), **extra}
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
        save_only_model=degree > 1,  # the Trainer's refusal; training.align.tp_checkpoint resumes it
        **extra,
    )


def load_model(path: str, precision: str, tensor_parallel: int = 1) -> Any:
    """The causal LM at `path`; with `tensor_parallel` > 1 loaded already split over the ranks by
    transformers' own plan for it (every rank calls this together)."""
    import torch
    from transformers import AutoModelForCausalLM

    from training.parallel.dims.tensor import align_load_arguments

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16 if precision == "bf16" else torch.float32, **align_load_arguments(tensor_parallel)
    )


def peft_config(spec: dict[str, Any]) -> Any:
    """The LoRA of `align.lora` when this method trains an adapter, else None."""
    from peft import LoraConfig

    lora = spec.get("lora")
    if lora is None:
        return None
    return LoraConfig(
        r=lora["r"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        bias="none",
        task_type="CAUSAL_LM",
        target_modules="all-linear" if lora["target_modules"] == ["all-linear"] else lora["target_modules"],
        target_parameters=lora.get("target_parameters") or None,  # a mixture of experts' fused expert weights
    )


def dataset(path: str, columns: list[str]) -> Any:
    from datasets import load_dataset

    data = load_dataset("json", data_files=path, split="train")
    return data.select_columns(columns)


PAIR_SIDES = ("prompt", "chosen", "rejected")


def pair_dataset(path: str) -> Any:
    """Preference pairs for TRL's experimental pair trainers (ORPO, CPO/SimPO), with each side's
    messages kept beside the strings those trainers template them into (`chat_<side>`), for
    `pair_tokens`."""
    data = dataset(path, list(PAIR_SIDES))
    return data.map(lambda row: {f"chat_{side}": row[side] for side in PAIR_SIDES})


def pair_tokens(tokenizer: Any, feature: dict[str, Any], max_length: int) -> dict[str, Any]:
    """One pair tokenized as SFT and the held-out measures see it: the chat template's tokens, with
    labels on the assistant turn its generation markers mark (without markers: every token after
    the prompt).

    Written here because TRL's experimental ORPO and CPO trainers (`tokenize_row`) tokenize the
    templated strings, then score every token after the prompt: the template's tail after the
    end-of-turn token, and an EOS appended after it that the template never writes. On a model SFT
    taught to stop at its end-of-turn, those two tokens carried most of ORPO's NLL term (on tiny-cpu
    7.8 and 13.2 nats against 2.6 for the answer's first token) and so most of its update, and ORPO
    lowered held-out preference accuracy at every learning rate tried. Their forward pass and loss
    are TRL's; only the rows change."""
    from training.align.heldout import _masked

    prompt = tokenizer.apply_chat_template(
        list(feature["chat_prompt"]), add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"][:max_length]
    row: dict[str, Any] = {"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
    for side in ("chosen", "rejected"):
        ids, marked = _masked(tokenizer, list(feature["chat_prompt"]) + list(feature[f"chat_{side}"]), max_length)
        if not any(marked):  # a template without generation markers: the completion is what follows the prompt
            marked = [int(i >= len(prompt)) for i in range(len(ids))]
        row[f"{side}_input_ids"] = ids
        row[f"{side}_attention_mask"] = [1] * len(ids)
        row[f"{side}_labels"] = [token if keep else -100 for token, keep in zip(ids, marked)]
    return row


# -- the export ---------------------------------------------------------------------------------------


def merge_lora(spec: dict[str, Any], adapter: Path, hf: Path) -> float:
    """Merge the adapter into the base model, save it, and check it against the PEFT model's logits."""
    import torch
    from peft import PeftModel

    from lmforge.errors import ParityError

    base = load_model(spec["base_dir"], "fp32")
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    batch = parity_batch(spec)
    with torch.no_grad():
        reference = peft_model(input_ids=batch).logits.float()
    merged = peft_model.merge_and_unload()
    if spec.get("fault", {}).get("corrupt_merge"):  # test hook: a merge that went wrong
        with torch.no_grad():
            next(p for n, p in merged.named_parameters() if "down_proj" in n).mul_(1.5)
    merged.save_pretrained(str(hf), safe_serialization=True)
    reloaded = load_model(str(hf), "fp32").eval()
    with torch.no_grad():
        gap = float((reloaded(input_ids=batch).logits.float() - reference).abs().max())
    tolerance = spec["lora"]["merge_parity_tolerance"]
    if not gap <= tolerance:  # NaN is no pass
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
    # TRL turns a mixture of experts' router logits on to train its load-balancing loss, and the config is
    # saved that way: off again, as the base had it (every batched forward would compute that loss, and
    # transformers' version of it breaks on a padded batch under a cache: lm-eval and generation crash)
    config_path = hf / "config.json"
    config = json.loads(config_path.read_text())
    if config.get("output_router_logits"):
        config["output_router_logits"] = False
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special = {"bos_id": tokenizer.bos_token_id, "eos_id": tokenizer.eos_token_id, "pad_id": tokenizer.pad_token_id}
    generation_config(base, special, spec["max_length"]).save_pretrained(str(hf))


def export_causal_lm(spec: dict[str, Any], tokenizer: Any, hf: Path) -> float | None:
    """`hf/` as a causal LM: the LoRA adapter merged (parity-checked; its gap returned) and the
    tokenizer and generation settings beside it."""
    gap = merge_lora(spec, Path(spec["out_dir"]) / "adapter", hf) if spec.get("lora") else None
    finalize_export(spec, tokenizer, hf)
    return gap


# -- held-out figures ---------------------------------------------------------------------------------


def before_and_after(
    spec: dict[str, Any], tokenizer: Any, hf: Path, measure: Any, paired_metric: str | None = None
) -> dict[str, Any]:
    """Held-out figures of the model the step started from and the one it made: `measure(model)`
    (the method's own, returning `(figures, per-item outcomes)`) on each, exact match of greedy
    answers to the held-out verifiable items, and the paired change of each with its interval."""
    from lmforge.jsonl import read_jsonl
    from training.align.heldout import exact_match, paired_bootstrap

    heldout = list(read_jsonl(Path(spec["heldout"])))
    verifiable = spec.get("heldout_generation") or []
    out: dict[str, Any] = {}
    paired: dict[str, dict[str, list[float]]] = {}
    for name, path in (("before", spec["base_dir"]), ("after", str(hf))):
        model = load_model(path, "fp32")
        figures, outcomes = measure(model, tokenizer, heldout, spec["max_length"])
        out.update({f"{k}_{name}" if not k.endswith("_ci") else f"{k[:-3]}_{name}_ci": v for k, v in figures.items()})
        if paired_metric is not None and outcomes is not None:
            paired.setdefault(paired_metric, {})[name] = outcomes
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


def preference_figures(model: Any, tokenizer: Any, heldout: list[dict[str, Any]], max_length: int) -> Any:
    """Held-out preference accuracy (chosen scored above rejected by the policy's log-probabilities)
    with its interval and the mean log-probability margin; per pair, whether it was won."""
    from training.align.heldout import preference_accuracy

    pref = preference_accuracy(model, tokenizer, heldout, max_length)
    figures = {
        "preference_accuracy": pref["preference_accuracy"],
        "preference_accuracy_ci": [pref["preference_accuracy_ci_low"], pref["preference_accuracy_ci_high"]],
        "logprob_margin": pref["mean_logprob_margin"],
    }
    return figures, pref["wins"]
