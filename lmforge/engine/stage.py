"""What a stage is: one folder plus one registration.

A stage (`curate`, `pretrain`, `align`, ...) registers a `Stage` under the `lmforge.stages`
entry-point group in `pyproject.toml`:

    [project.entry-points."lmforge.stages"]
    curate = "data_prep.stage:STAGE"

The core finds stages through that group (`lmforge.engine.registry`) and never imports a stage by
name, so adding `evaluation/` or `serving/` touches no core file. A stage hands its results
to later stages as typed `Product`s (the tokenizer, the token shards, a Hugging Face model
directory, an evaluation verdict), which the graph resolves to whichever enabled step
provides them: no stage looks for another by a step-name string.

Nothing here imports Prefect or any domain package: a `Stage` is plain data whose
callables load the stage's modules when they are first needed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from lmforge.pipelinebase import PipelineBase


@dataclass(frozen=True)
class Product:
    """A typed thing one step hands to another: `kind` says what it is, `role` which one.

    The kinds are a small shared vocabulary (see `KINDS`); the role tells apart several
    products of one kind, e.g. the `hf-model` of the `pretrained`, `sft` and `dpo` steps.
    """

    kind: str
    role: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown product kind {self.kind!r} (known: {', '.join(sorted(KINDS))})")

    def __str__(self) -> str:
        return f"{self.kind}:{self.role}" if self.role else self.kind


KINDS = {
    "documents": "curated documents: Parquet shards under kept/ (id, text, domain, ...)",
    "tokenizer": "a Hugging Face tokenizer directory with the ChatML chat template",
    "token-shards": "packed token shards (tokens/*.bin) with index.json",
    "hf-model": "a Hugging Face model directory (safetensors, config, tokenizer, generation config)",
    "reward-model": "a Hugging Face sequence-classification directory (one score per conversation) with its tokenizer",
    "draft-model": "a small Hugging Face causal LM with the served model's tokenizer, for speculative decoding",
    "chat-data": "chat records (JSONL with messages), train and held-out splits",
    "preference-data": "preference records (JSONL with prompt, chosen, rejected), train and held-out splits",
    "ngram-index": "a hashed n-gram index of a training source, for contamination checks",
    "eval-tasks": "lm-eval task YAMLs and their data, built for this lineage (an include_path)",
    "eval-results": "lm-eval results of one model on a task group, with per-sample logs",
    "eval-verdict": "the evaluation stage's verdict: metrics, contamination and gates per model",
    "quantized-model": "a quantized Hugging Face model directory in compressed-tensors format",
    "gguf-model": "GGUF files for llama.cpp (bf16 and quantized), their gate's verdict and an Ollama Modelfile",
    "quant-verdict": "the quantization gate's verdict: which checkpoint may ship",
    "endpoint": "a served model: URL, served name and the lineage behind it",
}

# shorthands for the products every lifecycle has
DOCUMENTS = Product("documents")
TOKENIZER = Product("tokenizer")
TOKEN_SHARDS = Product("token-shards")


def hf_model(role: str) -> Product:
    return Product("hf-model", role)


# the model a user brings (`base_model:`): the first model of its lineage when set
BASE_MODEL = hf_model("base")


def has_base(config: PipelineBase | Any) -> bool:
    """Whether the lineage starts from a base model the user brings (`base_model.path` set)."""
    section = getattr(config, "base_model", None)
    return bool(getattr(section, "path", ""))


def left_out_for_base(config: PipelineBase, stage: str) -> bool:
    """With a base model, a training stage (pretrain, align) is part of the lineage only when this run
    lists it in `stages`: without `pretrain`, alignment starts from the base itself; without either,
    evaluation, quantization and serving take the base as it is. (Without a base, a stage a listed
    stage needs comes along, as the lineage cannot exist without it.)"""
    return has_base(config) and stage not in config.stages


def fine_tunes_base(config: PipelineBase) -> bool:
    """A base model is set and this run does not pretrain: alignment starts from the base itself."""
    return left_out_for_base(config, "pretrain")


@dataclass(frozen=True)
class Role:
    """A model of the lineage: the role of an `hf-model` product a stage makes (`base`, `pretrained`,
    one per alignment method that trains a policy). Evaluation, quantization and serving take the
    roles from the registry (`lmforge.engine.registry.roles`), in lifecycle order, never from a list of
    their own.

    `saw`: the data sources it was trained on, as far as lmforge knows (its own and those of the
    models it starts from): `documents` (curated pretraining text), `sft` (the chat data), `dpo`
    (the preference data); the contamination check counts benchmark items found in them.
    `aligned`: a chat model alignment made (servable as a LoRA adapter, calibrated on chats)."""

    name: str
    saw: tuple[str, ...] = ()
    aligned: bool = False

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"role name {self.name!r}: letters, digits, - and _ only")


@dataclass(frozen=True)
class Maybe:
    """A product a step reads when the lineage has it, e.g. alignment data for evaluation
    (absent when the align stage is switched off); otherwise the step goes without."""

    product: Product


@dataclass(frozen=True)
class Resources:
    """Where a stage's work belongs: `cpu` work pools, or `gpu` ones when it trains or serves models."""

    pool: Literal["cpu", "gpu"] = "cpu"
    gpus: int = 0  # GPUs one run of the stage holds (0: none; -1: every GPU of the node)


@dataclass(frozen=True)
class ArtifactSpec:
    """A Prefect artifact described as plain data; `tasks.artifacts` publishes it.

    kind: "table" (data: list of row dicts), "markdown" (data: str), "link" (data: URL),
    "image" (data: path of a PNG; published as markdown with the image inlined).
    """

    key: str
    kind: Literal["table", "markdown", "link", "image"]
    data: Any
    description: str = ""


# stage artifacts: (manifests of this run's steps, their cache status, the failure if any) -> specs
ArtifactBuilder = Callable[[dict[str, dict[str, Any]], dict[str, str], BaseException | None], list[ArtifactSpec]]


@dataclass(frozen=True)
class Stage:
    """One stage of the lifecycle.

    `config_model` is the stage's typed config section (`<name>:` in a preset). `steps()`
    returns its `Step`s in order; `artifacts` builds the Prefect artifacts of one run of the
    stage (also when it failed: a divergence report matters most then). `after` names the
    stages it follows in the lifecycle; `packages` are the domain packages whose loggers
    should reach the run log.
    """

    name: str
    description: str
    config_model: type
    steps: Callable[[], list[Any]]
    after: tuple[str, ...] = ()
    artifacts: ArtifactBuilder | None = None
    resources: Resources = field(default_factory=Resources)
    packages: tuple[str, ...] = ()
    summary: Callable[[dict[str, dict[str, Any]]], list[str]] | None = None  # lines for the CLI's run summary
    # (config, its source) -> raise ConfigError for missing paths
    check: Callable[[PipelineBase, str], None] | None = None
    cli: Callable[[Any], None] | None = None  # (argparse subparsers) -> add the stage's own commands
    # (config, manifests) after the stage's steps ran, cached or not: bring live state (a running
    # server) in line with the cached outputs; returns what it did, for the log
    reconcile: Callable[[PipelineBase, dict[str, dict[str, Any]]], list[str]] | None = None
    # fault injection for tests and drills, as `debug.<stage>:` (a step run with one set is keyed apart)
    debug_model: type | None = None
    # the models of the lineage it makes (`hf-model:<role>` products), in the order they are made
    roles: Callable[[], tuple[Role, ...]] | tuple[Role, ...] = ()
