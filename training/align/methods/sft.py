"""`align/sft`: supervised fine-tuning with TRL's `SFTTrainer` (full, LoRA or QLoRA, merged for
export), loss on the assistant turns only; measured by held-out assistant loss and exact match."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from lmforge.engine.stage import BASE_MODEL, Product
from training.align.methods import CHAT, PRETRAINED, AlignMethod, start_model
from training.align.sections import TrainConfig


class SftConfig(TrainConfig):
    inputs: list[str] = Field(
        default_factory=list, description="Chat JSONL (OpenAI `messages`, or `prompt`/`completion`); empty: built in."
    )
    packing: bool = Field(True, description="Pack short conversations into full sequences (TRL's best-fit packing).")
    assistant_only_loss: bool = Field(
        True, description="Loss on assistant tokens only (TRL, via {% generation %} markers)."
    )


class SFT(AlignMethod):
    name = "sft"
    tensor_parallel = True  # TRL's trainer on the policy the entry loads split (align.distributed.tensor_parallel)
    config = SftConfig
    description = "Supervised fine-tuning with TRL (full or LoRA, merged), assistant-only loss"
    data = CHAT
    curves = (
        ("loss", (("loss", "train"), ("eval_loss", "held-out"))),
        ("gradient norm", (("grad_norm", ""),)),
        ("held-out exact match", (("heldout_exact_match", ""),)),
        ("tokens/s", (("tokens_per_s", ""),)),
    )
    owns_data = True
    in_default_recipe = True  # align.sft.inputs: the chat data (SFT, RL prompts, the draft) when the user brings it
    starts: ClassVar[tuple[Product, ...]] = (BASE_MODEL, PRETRAINED)

    def runs(self, align: Any) -> bool:  # every recipe starts with it
        return True

    def start(self, config: Any) -> Product:
        return start_model(config)

    def lora(self, config: Any) -> bool:
        return config.align.method in ("lora", "qlora")

    def reads(self, config: Any) -> tuple[str, ...]:
        return (*super().reads(config), "align.method")

    def spec(self, ctx: Any, spec: dict[str, Any]) -> dict[str, Any]:
        return {**spec, "quantized_base": ctx.config.align.method == "qlora"}

    def trainer(self, spec: dict[str, Any], model: Any, tokenizer: Any, callbacks: list[Any]) -> Any:
        from trl import SFTConfig, SFTTrainer

        from training.align.kit import dataset, peft_config, training_args

        # a base's own chat template without {% generation %} markers cannot mask by itself: TRL swaps
        # in a marked copy of the templates it knows (Llama 3, Qwen 2.5/3, Gemma, Phi-3, ...); for
        # any other, the last assistant turn becomes the completion and the rest the prompt
        markers = trainable_template(tokenizer)
        only_assistant = spec["config"]["assistant_only_loss"]
        args = training_args(
            spec,
            SFTConfig,
            assistant_only_loss=only_assistant and markers,
            completion_only_loss=only_assistant and not markers,
            packing=spec["config"]["packing"],
        )
        train_data = dataset(spec["train"], ["messages"])
        if only_assistant and not markers:
            train_data = train_data.map(as_prompt_completion, remove_columns=["messages"])
        return SFTTrainer(
            model=model,
            args=args,
            train_dataset=train_data,
            processing_class=tokenizer,
            peft_config=peft_config(spec),
            callbacks=callbacks,
        )

    def measure(self, spec: dict[str, Any], tokenizer: Any, hf: Path) -> dict[str, Any]:
        from training.align.kit import before_and_after

        return before_and_after(spec, tokenizer, hf, assistant_loss_figures)


def assistant_loss_figures(model: Any, tokenizer: Any, heldout: list[dict[str, Any]], max_length: int) -> Any:
    """Held-out loss on the assistant turns, with its interval (no per-item pairing)."""
    from training.align.heldout import assistant_loss

    loss = assistant_loss(model, tokenizer, heldout, max_length)
    return {"heldout_loss": loss["loss"], "heldout_loss_ci": [loss["loss_ci_low"], loss["loss_ci_high"]]}, None


def trainable_template(tokenizer: Any) -> bool:
    """Whether assistant-only loss works through the chat template: it has `{% generation %}`
    markers, or TRL has a marked copy of it."""
    from trl.chat_template_utils import get_training_chat_template

    from lmforge.text.chat import has_generation_markers

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


SFT_MODEL = SFT.product  # hf-model:sft, what the methods after SFT start from
# a section's `init`: `sft`, the SFT model; `base`, the model SFT itself starts from
Init = Literal["sft", "base"]
FROM_SFT: Init = "sft"


class AfterSftOrItsStart(AlignMethod):
    """A method whose section's `init: Init` says where it starts: `sft`, the SFT model; `base`, the
    model SFT starts from (the base or the pretrained model)."""

    starts: ClassVar[tuple[Product, ...]] = (SFT_MODEL, BASE_MODEL, PRETRAINED)

    def start(self, config: Any) -> Product:
        return SFT_MODEL if self.section(config).init == FROM_SFT else start_model(config)
