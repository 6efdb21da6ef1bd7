"""Alignment methods as plug-ins: one module per method, one registry.

A method is an `AlignMethod` subclass: its name (the step `align/<name>`, its config section
`align.<name>`), the data it trains on, the model it starts from, the product it makes, how it
builds its TRL trainer on each rank, how its result is exported and measured. The alignment
step graph (`training.align.steps`) and the rank entry (`training.align.entry`) read only this
interface: neither names a method.

The built-in methods live beside this file (`sft`, `dpo`, `reward`, `rl`, `draft`). Another
package adds one without editing lmforge through the `lmforge.align_methods` entry-point group:

    [project.entry-points."lmforge.align_methods"]
    kto = "my_package.kto:KTO"

The registry is read when first asked (`methods()`), in the order: built-ins, then entry points
sorted by name. Names must be unique.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from lmforge.engine.stage import BASE_MODEL, Product, Role, fine_tunes_base, hf_model

if TYPE_CHECKING:
    from lmforge.config import PipelineBase
    from lmforge.configbase import ConfigView
    from lmforge.engine.graph import StepContext
    from training.align.sections import TrainConfig

GROUP = "lmforge.align_methods"
BUILTIN = (
    "training.align.methods.sft:SFT",
    "training.align.methods.dpo:DPO",
    "training.align.methods.reward:Reward",
    "training.align.methods.rl:RL",
    "training.align.methods.draft:Draft",
    "training.align.methods.kto:KTO",
    "training.align.methods.orpo:ORPO",
    "training.align.methods.simpo:SimPO",
)
CHAT, PREFERENCE = "chat", "preference"  # the data kinds: messages; prompt, chosen, rejected
CHAT_DATA, PREFERENCE_DATA = Product("chat-data"), Product("preference-data")
HELDOUT_SFT, HELDOUT_PREFERENCES = "heldout_sft.jsonl", "heldout_preferences.jsonl"
PRETRAINED = hf_model("pretrained")  # the pretrain stage's product (training.stage)
# modules every method's rank runs, beside its own (the entry loads the other methods' modules by
# name, but runs only its own): part of every method step's code identity. Not this package as a
# whole: naming a package counts every module in it (lmforge.engine.codeprint), so a new method would
# re-key every other method's step.
KIT = (
    "training.align.entry",
    "training.align.kit",
    "training.align.heldout",
    "lmforge.text.verify",
    "training.align.qlora",
    "training.device_setup",
    "training.export",
)
LIBS = ("trl", "transformers", "peft", "torch", "accelerate", "bitsandbytes")


def precision(config: ConfigView) -> str:
    """`align.precision` resolved: auto = bf16 on a GPU that has it, else fp32."""
    from training.device import detect_device

    if config.align.precision != "auto":
        return config.align.precision
    device = detect_device()
    # on CPU fp32: bf16 autocast is slower there with TRL and not bit-identical across a resume
    return "bf16" if device.kind == "cuda" and device.bf16 else "fp32"


def start_model(config: PipelineBase) -> Product:
    """What SFT starts from: the base model itself when one is set and this run does not pretrain
    (`stages` without `pretrain`), otherwise the pretrained model (from scratch or continued)."""
    return BASE_MODEL if fine_tunes_base(config) else PRETRAINED


class AlignMethod:
    """One alignment method. Subclasses set the class attributes and implement `trainer`; the rest
    has defaults that fit a method training a causal LM with TRL on chat or preference data."""

    name: ClassVar[str]
    description: ClassVar[str]
    config: ClassVar[type[TrainConfig]]  # its section `align.<name>` (defaults as the class gives them)
    version: ClassVar[int] = 1  # raise it when the method's outputs change for reasons its code does not show
    data: ClassVar[str] = PREFERENCE  # CHAT (messages) or PREFERENCE (prompt, chosen, rejected)
    product: ClassVar[Product]  # what it makes (default: the hf-model of role `name`)
    # the products it may start from, first present wins at run time (the graph chose one: `start`)
    starts: ClassVar[tuple[Product, ...]] = ()
    loads_policy: ClassVar[bool] = True  # the entry loads the start model (4-bit under QLoRA) as `model`
    generates: ClassVar[bool] = True  # held-out exact match of greedy answers every `eval_every` steps
    # trains under transformers' tensor-parallel plans (`align.distributed.tensor_parallel`): its trainer
    # is TRL's on the policy the entry loads, with no model of its own that is not a plain copy
    tensor_parallel: ClassVar[bool] = False
    code: ClassVar[tuple[str, ...]] = ()  # modules it runs beyond its own module and the KIT
    in_recipe: ClassVar[bool] = True  # named in `align.recipe` (the draft is switched by its own `enabled`)
    in_default_recipe: ClassVar[bool] = False  # in `align.recipe`'s default (SFT, DPO)
    # its section's `inputs` are the user's files of its data kind (one method per kind: SFT's chat
    # data, DPO's preferences); align/data writes that kind under `<name>/`
    owns_data: ClassVar[bool] = False
    # for a trainer that logs no `num_tokens`: the batch's attention masks whose non-padding tokens
    # the entry counts, so its tokens/s is logged like every other method's
    token_keys: ClassVar[tuple[str, ...]] = ()
    # its step's training curves (Step.curves): panels of (title, ((metric key, label), ...))
    curves: ClassVar[tuple[tuple[str, tuple[tuple[str, str], ...]], ...]] = ()
    # the data sources its model was trained on, its start's included (the contamination check's
    # `Role.saw`); default: the pretraining documents, the chat data, and its own data
    saw: ClassVar[tuple[str, ...] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "product" not in cls.__dict__ and "name" in cls.__dict__:
            cls.product = hf_model(cls.name)
        # what a method owns is its own to say: a subclass of DPO (another package's variant) neither
        # owns the preference data, joins the default recipe nor trains under tensor parallelism unless it says so
        for flag in ("owns_data", "in_default_recipe", "tensor_parallel"):
            if flag not in cls.__dict__:
                setattr(cls, flag, False)

    # -- the step graph (the process that resolves and runs the pipeline) --------------------------

    @property
    def step_name(self) -> str:
        return f"align/{self.name}"

    def role(self) -> Role | None:
        """The lineage role of what it makes, when that is a policy (`hf-model:<name>`): evaluated,
        quantized and served like every aligned model, servable as a LoRA adapter. None otherwise."""
        if self.product != hf_model(self.name):
            return None
        own = (CHAT,) if self.data == CHAT else (CHAT, PREFERENCE)
        return Role(self.name, saw=self.saw if self.saw is not None else ("documents", *own), aligned=True)

    def section(self, config: ConfigView | PipelineBase) -> Any:
        return getattr(config.align, self.name)

    def enabled(self, config: PipelineBase) -> bool:
        """Whether `lmforge run` runs it (`runs`, on the config's `align` section)."""
        return self.runs(config.align)

    def runs(self, align: Any) -> bool:
        """Whether it runs under this `align` section: named in its recipe (and its own section's
        `enabled`, if it has one)."""
        own = "enabled" in self.config.model_fields  # a view of the config raises on a field it lacks
        return self.name in align.recipe and (not own or bool(getattr(align, self.name).enabled))

    def check(self, align: Any) -> None:
        """Raise ValueError when `align` cannot run with this method as configured (beyond its own section)."""

    def start(self, config: ConfigView | PipelineBase) -> Product:
        """The model it starts from, chosen when the graph is resolved (its one start, by default)."""
        if len(self.starts) != 1:
            raise NotImplementedError(f"{type(self).__name__} has several starts: say which one `start` takes")
        return self.starts[0]

    def start_candidates(self) -> tuple[Product, ...]:
        """The products it may start from, first present wins at run time (`starts` by default)."""
        return self.starts

    def data_product(self) -> Product:
        return CHAT_DATA if self.data == CHAT else PREFERENCE_DATA

    def upstream(self, config: PipelineBase) -> tuple[Product, ...]:
        return (self.start(config), self.data_product())

    def lora(self, config: ConfigView | PipelineBase) -> bool:
        """Whether it trains a LoRA adapter (merged for export)."""
        return "lora" in self.config.model_fields and bool(self.section(config).lora)

    def training_fields(self) -> list[str]:
        """The fields of `align.<name>` that shape the model (its `inputs` reach it as data, through `align/data`)."""
        return [f"align.{self.name}.{f}" for f in self.config.model_fields if f not in ("inputs", "enabled")]

    def reads(self, config: PipelineBase) -> tuple[str, ...]:
        return (
            *self.training_fields(),
            *(("align.lora",) if self.lora(config) else ()),
            "align.precision",
        )

    def identity(self, config: ConfigView) -> dict[str, Any]:
        """What is computed into its key beyond the fields it reads (`Step.derive`)."""
        return {"precision": precision(config)}

    def spec(self, ctx: StepContext, spec: dict[str, Any]) -> dict[str, Any]:
        """The rank spec, given the common one (`training.align.steps.rank_spec`): add or change fields."""
        return spec

    # -- each rank (training.align.entry) ------------------------------------------------------------

    def trainer(self, spec: dict[str, Any], model: Any, tokenizer: Any, callbacks: list[Any]) -> Any:
        """TRL's trainer for the spec (`training.align.kit` has the model, arguments, LoRA and data helpers)."""
        raise NotImplementedError

    def callbacks(self, spec: dict[str, Any], holder: dict[str, Any]) -> list[Any]:
        """Trainer callbacks beyond the entry's (metrics, held-out generation, checkpoint seals)."""
        return []

    # -- rank 0 after training -----------------------------------------------------------------------

    def export(self, spec: dict[str, Any], tokenizer: Any, hf: Path) -> dict[str, Any]:
        """Write `hf/` (the trainer saved `hf/` or, for LoRA, `adapter/`); summary fields it reports."""
        from training.align.kit import export_causal_lm

        return {"merge_parity_max_abs_logit_diff": export_causal_lm(spec, tokenizer, hf)}

    def measure(self, spec: dict[str, Any], tokenizer: Any, hf: Path) -> dict[str, Any]:
        """Held-out figures of the start and the result (`heldout_items` at least)."""
        raise NotImplementedError

    def warnings(self, spec: dict[str, Any], summary: dict[str, Any]) -> list[str]:
        """One line per thing worth a warning about the result (logged by the step, shown on its record)."""
        return []


class PreferenceMethod(AlignMethod):
    """A method that trains a policy on the preference pairs, measured as DPO is: held-out preference
    accuracy (the policy's log-probability of the chosen answer above the rejected one) and exact
    match, before and after, each change with its paired interval."""

    data = "preference"

    def measure(self, spec: dict[str, Any], tokenizer: Any, hf: Path) -> dict[str, Any]:
        from training.align.kit import before_and_after, preference_figures

        return before_and_after(spec, tokenizer, hf, preference_figures, paired_metric="preference_accuracy")


@functools.cache
def methods() -> dict[str, AlignMethod]:
    """Every registered method by name: the built-ins, then the `lmforge.align_methods` entry points."""
    from lmforge.plugins import registered

    return registered(BUILTIN, GROUP, "alignment method", AlignMethod)


def data_owners() -> dict[str, AlignMethod]:
    """{data kind: the method whose section's `inputs` fill it}, chat first."""
    owners: dict[str, AlignMethod] = {}
    for m in methods().values():
        if m.owns_data:
            if m.data in owners:
                raise ValueError(f"align data {m.data!r} owned by both {owners[m.data].name} and {m.name}")
            owners[m.data] = m
    return dict(sorted(owners.items(), key=lambda kv: kv[0] != CHAT))


def method(name: str) -> AlignMethod:
    try:
        return methods()[name]
    except KeyError:
        from lmforge.errors import ConfigError

        raise ConfigError(f"no alignment method {name!r} (registered: {', '.join(methods())})") from None


def first_present(ctx: StepContext, candidates: tuple[Product, ...]) -> Product:
    """The first of `candidates` that is one of the step's inputs (what the graph chose)."""
    return next(p for p in candidates if ctx.has(p))


__all__ = [
    "AlignMethod",
    "CHAT_DATA",
    "PREFERENCE_DATA",
    "HELDOUT_SFT",
    "HELDOUT_PREFERENCES",
    "PRETRAINED",
    "PreferenceMethod",
    "start_model",
    "precision",
    "methods",
    "method",
    "first_present",
]
