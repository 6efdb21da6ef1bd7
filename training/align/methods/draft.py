"""`align/draft`: a small draft model for speculative decoding, distilled from the model that is served.

The student is the teacher's own architecture with fewer decoder layers (every `k`-th layer and
the last one copied from the teacher, the embeddings, final norm and output head too: the usual
"layer dropping" initialisation, as DistilBERT's), so it has the teacher's tokenizer by
construction, which a draft needs (vLLM checks the proposed token ids against the teacher's).
It is trained with TRL's `GKDTrainer` on the lineage's SFT conversations with `lmbda=0` (the
dataset's sequences, no student sampling): the loss is the generalized Jensen-Shannon divergence
between the teacher's and the student's token distributions (`beta=0`: forward KL to the teacher).
Launch, checkpoints, resume and export are the alignment entry's, as for SFT (`Draft` below).

What a draft is worth is how often its next token is the teacher's: `measure_draft` reports the
top-1 agreement with the teacher on the held-out conversations (before and after distillation)
and the student's held-out loss beside the teacher's.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from pathlib import Path
from typing import Any

from pydantic import Field

from lmforge.configbase import runtime_field
from lmforge.engine.stage import Product, hf_model
from training.align.methods import AlignMethod
from training.align.sections import TrainConfig

log = logging.getLogger("training.align")
LAYER = re.compile(r"(\.(?:layers|h)\.)(\d+)\.")


def kept_layers(total: int, keep: int) -> list[int]:
    """`keep` of `total` layer indices, evenly spaced, first and last included."""
    keep = max(1, min(keep, total))
    if keep == 1:
        return [total - 1]
    return sorted({round(i * (total - 1) / (keep - 1)) for i in range(keep)})


def build_student(teacher: Any, layers: int | None) -> Any:
    """The teacher with `layers` decoder layers (default: a quarter, at least 1), weights copied."""
    from transformers import AutoModelForCausalLM

    total = teacher.config.num_hidden_layers
    keep = kept_layers(total, layers or max(1, total // 4))
    config = copy.deepcopy(teacher.config)
    config.num_hidden_layers = len(keep)
    if isinstance(getattr(config, "layer_types", None), list):  # Qwen2-style per-layer attention types
        config.layer_types = [config.layer_types[i] for i in keep]
    student = AutoModelForCausalLM.from_config(config, dtype=teacher.dtype)
    new_index = {old: new for new, old in enumerate(keep)}
    state = {}
    for name, tensor in teacher.state_dict().items():
        match = LAYER.search(name)
        if match is None:
            state[name] = tensor
        elif int(match.group(2)) in new_index:
            state[LAYER.sub(lambda m: f"{m.group(1)}{new_index[int(m.group(2))]}.", name, count=1)] = tensor
    student.load_state_dict(state, strict=True)
    return student


def draft_trainer(spec: dict[str, Any], teacher: Any, tokenizer: Any, callbacks: list[Any]) -> Any:
    """TRL's GKDTrainer distilling `teacher` (the model the entry loaded) into a layer-dropped copy."""
    import os

    from training.align.kit import dataset as load_dataset
    from training.align.kit import training_args

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    cfg = spec["config"]
    dataset = load_dataset(spec["train"], ["messages"])
    # GKD's collator splits each conversation into prompt and last answer and refuses one whose
    # answer alone fills max_length: those are left out (counted in the log), not truncated
    fits = dataset.filter(
        lambda r: (
            len(tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=False)) <= spec["max_length"]
        )
    )
    if len(fits) < len(dataset):
        log.info("draft: %d of %d conversations are longer than %d tokens; distilling on the rest",
                 len(dataset) - len(fits), len(dataset), spec["max_length"])  # fmt: skip
    if not len(fits):
        from lmforge.errors import ConfigError

        raise ConfigError(f"align.draft: no SFT conversation fits in {spec['max_length']} tokens")
    student = build_student(teacher, cfg["layers"])
    args = training_args(spec, GKDConfig, lmbda=0.0, beta=cfg["beta"], temperature=cfg["temperature"], seq_kd=False)
    teacher.eval()
    return GKDTrainer(
        model=student,
        teacher_model=teacher,
        args=args,
        train_dataset=fits,
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def _params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def agreement(student: Any, teacher: Any, tokenizer: Any, chats: list[list[dict[str, str]]]) -> dict[str, float]:
    """Top-1 agreement (argmax equal) on the positions that predict each chat's last answer (and over
    every position), and both models' loss per token over every position."""
    import torch
    import torch.nn.functional as F

    same = total = same_answer = answer = 0
    losses = {"student": 0.0, "teacher": 0.0}
    with torch.no_grad():
        for messages in chats:
            ids = torch.tensor([list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))])
            prompt = len(tokenizer.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True,
                                                       return_dict=False))  # fmt: skip
            if ids.shape[1] < 2:
                continue
            logits = {"student": student(input_ids=ids).logits[0, :-1].float(),
                      "teacher": teacher(input_ids=ids).logits[0, :-1].float()}  # fmt: skip
            target = ids[0, 1:]
            agree = logits["student"].argmax(-1) == logits["teacher"].argmax(-1)
            same, total = same + int(agree.sum()), total + target.numel()
            # the positions that predict the last answer's tokens: what a draft proposes when serving
            same_answer, answer = same_answer + int(agree[prompt - 1 :].sum()), answer + max(len(agree) - prompt + 1, 0)
            for name, value in logits.items():
                losses[name] += float(F.cross_entropy(value, target, reduction="sum"))
    return {
        "top1_agreement": same_answer / max(answer, 1),
        "top1_agreement_all_tokens": same / max(total, 1),
        "heldout_loss": losses["student"] / max(total, 1),
        "teacher_heldout_loss": losses["teacher"] / max(total, 1),
        "positions": total,
    }


def measure_draft(spec: dict[str, Any], tokenizer: Any, hf: Path) -> dict[str, Any]:
    """The summary's figures: agreement and loss of the initial (layer-dropped) and the distilled student."""
    import torch
    from transformers import AutoModelForCausalLM

    chats = [json.loads(line)["messages"] for line in Path(spec["heldout"]).read_text().splitlines()]
    chats = chats[: spec["config"]["heldout_chats"]]
    teacher = AutoModelForCausalLM.from_pretrained(spec["base_dir"], dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    before = agreement(build_student(teacher, spec["config"]["layers"]).eval(), teacher, tokenizer, chats)
    after = agreement(student, teacher, tokenizer, chats)
    return {
        "heldout_items": len(chats),
        "top1_agreement_before": before["top1_agreement"],
        "top1_agreement": after["top1_agreement"],
        "top1_agreement_all_tokens_before": before["top1_agreement_all_tokens"],
        "top1_agreement_all_tokens": after["top1_agreement_all_tokens"],
        "heldout_loss_before": before["heldout_loss"],
        "heldout_loss": after["heldout_loss"],
        "teacher_heldout_loss": after["teacher_heldout_loss"],
        "student_layers": student.config.num_hidden_layers,
        "teacher_layers": teacher.config.num_hidden_layers,
        "student_params": _params(student),
        "teacher_params": _params(teacher),
        "params_ratio": _params(student) / _params(teacher),
    }


class DraftConfig(TrainConfig):
    """`align/draft`: a draft model for speculative decoding, distilled from the last model of the recipe
    (TRL's GKDTrainer on the SFT conversations; see training/align/methods/draft.py)."""

    enabled: bool = runtime_field(
        False, description="Distil a draft model (serve.speculative.draft_model: distilled serves with it)."
    )
    layers: int | None = Field(
        None,
        ge=1,
        description="Decoder layers of the student (copied, evenly spaced, from the teacher's); "
        "None: a quarter of the teacher's, at least 1.",
    )
    beta: float = Field(
        0.0, ge=0, le=1, description="GKD's generalized JSD: 0 = forward KL to the teacher, 1 = reverse."
    )
    temperature: float = Field(1.0, gt=0, description="Softmax temperature of both distributions in the loss.")
    heldout_chats: int = runtime_field(
        200, ge=1, description="Held-out conversations the summary's top-1 agreement is measured on."
    )
    lr: float = Field(1e-3, gt=0)
    max_steps: int = Field(200, ge=1)


class Draft(AlignMethod):
    name = "draft"
    config = DraftConfig
    description = "Draft model for speculative decoding: fewer of the teacher's layers, distilled with TRL's GKDTrainer"
    data = "chat"
    in_recipe = False
    product = Product("draft-model")  # not an hf-model role: nothing evaluates, quantizes or serves it alone

    def start_candidates(self) -> tuple[Product, ...]:
        """The teacher: the recipe's last policy, whichever method made it (the registry's order)."""
        return tuple(hf_model(name) for name in reversed(policies()))

    def runs(self, align: Any) -> bool:
        return bool(align.draft.enabled)

    def start(self, config: Any) -> Product:
        return teacher(config)

    def lora(self, config: Any) -> bool:
        return False  # a new, smaller model: every weight trains

    def spec(self, ctx: Any, spec: dict[str, Any]) -> dict[str, Any]:
        return {**spec, "heldout_generation": []}  # judged by agreement with its teacher, not by answers

    def trainer(self, spec: dict[str, Any], model: Any, tokenizer: Any, callbacks: list[Any]) -> Any:
        return draft_trainer(spec, model, tokenizer, callbacks)

    def measure(self, spec: dict[str, Any], tokenizer: Any, hf: Path) -> dict[str, Any]:
        return measure_draft(spec, tokenizer, hf)


def policies() -> dict[str, AlignMethod]:
    """The registered methods that train a policy (an hf-model role), in the order recipes run them."""
    from training.align.methods import methods

    return {name: m for name, m in methods().items() if m.role() is not None}


def teacher(config: Any) -> Product:
    """What the draft is distilled from: the recipe's last policy (the model serving takes when unquantized)."""
    return hf_model([name for name, m in policies().items() if m.runs(config.align)][-1])
