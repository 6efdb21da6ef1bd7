"""Typed configuration of the evaluation stage (`evaluate:` in a preset)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from evaluation.backends import BACKENDS, BackendName
from lmforge.configbase import StrictModel, runtime_field
from lmforge.engine.registry import check_roles, role_names

BUILTIN_TASKS = [
    "lmforge_continuation",
    "lmforge_heldout_ppl",
    "lmforge_chat_exact",
    "lmforge_preference",
    "lmforge_humaneval",
]
# built-in, but chosen by name (evaluate.tasks): for a model whose context was extended (pretrain.rope_scaling)
LONG_CONTEXT_TASKS = ["lmforge_passkey", "lmforge_ppl_by_length"]


class BuiltinTaskConfig(StrictModel):
    """Sizes of the built-in tasks' data (built offline from the lineage)."""

    continuation_items: int = Field(200, ge=1, description="Held-out passages for lmforge_continuation.")
    ppl_docs: int = Field(40, ge=1, description="Held-out documents for lmforge_heldout_ppl.")
    ppl_max_chars: int = Field(3000, ge=100, description="Characters of each held-out document scored.")
    seed: int = 0
    context_lengths: list[int] = Field(
        default_factory=lambda: [64, 128, 256],
        description="lmforge_passkey and lmforge_ppl_by_length: the lengths measured, in tokens of the lineage's "
        "tokenizer (set them to the contexts before and after an extension).",
    )
    passkey_depths: list[float] = Field(
        default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0],
        description="lmforge_passkey: where the key sits in the filler (0 = first, 1 = last).",
    )
    passkey_per_cell: int = Field(4, ge=1, description="lmforge_passkey: items per length and depth.")

    @field_validator("context_lengths")
    @classmethod
    def _lengths(cls, lengths: list[int]) -> list[int]:
        if not lengths or min(lengths) < 32:
            raise ValueError("needs at least one length, each of at least 32 tokens")
        return sorted(set(lengths))

    @field_validator("passkey_depths")
    @classmethod
    def _depths(cls, depths: list[float]) -> list[float]:
        if not depths or not all(0.0 <= d <= 1.0 for d in depths):
            raise ValueError("needs at least one depth, each between 0 and 1")
        return depths


class ContaminationConfig(StrictModel):
    """Lineage-driven contamination checks and their gate."""

    ngram: int = Field(13, ge=2, description="Exact path: word n-gram size, for items at least this long.")
    fuzzy_ngram: int = Field(
        5,
        ge=2,
        description="Fuzzy path: word n-gram size that finds candidate documents (items shorter than this: "
        "whole-text match).",
    )
    min_coverage: float = Field(
        0.3,
        gt=0,
        le=1,
        description="Exact path: share of an item's n-grams found in a training document that makes it contaminated.",
    )
    min_similarity: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Fuzzy path: token similarity of an item to its best-aligned window of a training document that "
        "makes it contaminated (0.8 finds items with up to 10% of words replaced, dropped or inserted; "
        "benchmarks/contamination.py --sweep measures the trade-off).",
    )
    max_fraction: float | dict[str, float] = Field(
        0.05,
        description="Contaminated share allowed per task: one number for all, or {task: share} (others unlimited).",
    )
    action: Literal["fail", "annotate"] = Field(
        "fail",
        description="fail: the stage fails (non-retryable) naming the task, share and worst source; "
        "annotate: report only.",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "short_ngram" in data:
            raise ValueError(
                "short_ngram was replaced by fuzzy_ngram (candidate n-grams of the fuzzy path; items shorter than "
                "ngram words are checked by it)"
            )
        return data

    @model_validator(mode="after")
    def _fuzzy_below_exact(self) -> ContaminationConfig:
        if self.fuzzy_ngram > self.ngram:
            raise ValueError(f"fuzzy_ngram {self.fuzzy_ngram} is larger than ngram {self.ngram}")
        return self


class SandboxConfig(StrictModel):
    """Limits of the sandbox that runs generated code (HumanEval)."""

    timeout: float = Field(10.0, gt=0, description="Wall-clock seconds per program.")
    cpu_s: int = Field(10, ge=1, description="CPU seconds per program.")
    as_mb: int = Field(1024, ge=64, description="Address space in MiB.")
    fsize_mb: int = Field(16, ge=1, description="Largest file it may write, MiB.")
    nproc: int = Field(32, ge=1, description="Processes it may have.")


class AnswerConfig(StrictModel):
    """How each model answers the judge's prompts and the safety suite (on its own temporary vLLM server)."""

    max_tokens: int = Field(128, ge=1, description="Longest answer, in tokens (and at most what the context leaves).")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature of the answers (0: greedy).")
    seed: int = 0


class JudgeEndpointConfig(StrictModel):
    """An OpenAI-compatible judge (vLLM, OpenAI, any server with /v1/chat/completions)."""

    url: str | None = Field(None, description="Its base URL, ending in /v1 (null: no endpoint).")
    model: str | None = Field(None, description="The model name it serves.")
    api_key_env: str = runtime_field(
        "LMFORGE_JUDGE_API_KEY",
        description="The environment variable holding its key (the key never goes in the config or the logs).",
    )
    require_key: bool = runtime_field(True, description="Fail at once when that variable is not set.")

    @field_validator("url")
    @classmethod
    def _no_credentials(cls, value: str | None) -> str | None:
        from lmforge.urlcheck import refuse_credentials

        return refuse_credentials(value, "evaluate.judge.endpoint.url")


class JudgeConfig(StrictModel):
    """An LLM judge over the lineage's chat models (evaluation.judge): pairwise and graded, and measured."""

    enabled: bool = runtime_field(False, description="Run evaluate/judge.")
    model: str | None = Field(
        None,
        description="A model lmforge serves as the judge on a temporary vLLM server: a role of the lineage "
        "(its own models) or a local Hugging Face folder. Or set endpoint instead.",
    )
    endpoint: JudgeEndpointConfig = JudgeEndpointConfig()
    prompts: str = Field(
        "builtin",
        description="builtin: prompts held out from SFT (the chat skills and dialogue); or a JSONL file "
        "(`prompt` or `messages`, optional `id`).",
    )
    max_prompts: int = Field(40, ge=1, description="Prompts judged (the first ones of the file or the held-out set).")
    pairwise: list[list[str]] | None = Field(
        None,
        description="Pairs of roles compared, [earlier, later]: the later one's win rate is reported "
        "(null: each chat model of evaluate.models against the one before it in the lineage).",
    )
    grade: list[str] | None = Field(
        None, description="Roles graded one answer at a time (null: every chat model of evaluate.models)."
    )
    template: Literal["mt-bench", "compact"] = Field(
        "mt-bench",
        description="The judge's prompts: MT-Bench's, or the same protocol in few tokens for a short context.",
    )
    rubric: str = Field(
        "correct, helpful, relevant and concise.", description="What a good answer is, in the judge's prompts."
    )
    scale: int = Field(10, ge=2, le=100, description="Grades run from 1 to this.")
    temperature: float = Field(0.0, ge=0)
    max_tokens: int = Field(512, ge=1, description="The judge's reply length when its verdict is not constrained.")
    seed: int = 0
    constrained: bool | None = Field(
        None,
        description="Ask for the verdict string only, under vLLM's structured outputs (null: when lmforge "
        "serves the judge; an endpoint must be vLLM for true).",
    )
    min_agreement: float = Field(
        0.6,
        ge=0,
        le=1,
        description="A judge whose agreement with the truth on the verifiable pairs is below this is reported "
        "as unreliable on the card (chance is 0.5).",
    )
    concurrency: int = runtime_field(4, description="Judge requests in flight.", ge=1)
    retries: int = runtime_field(3, description="Retries of a request the endpoint did not answer.", ge=0)
    backoff_s: float = runtime_field(1.0, description="First retry's wait; each next one doubles it.", ge=0)
    timeout_s: float = runtime_field(120.0, description="Seconds one request may take.", gt=0)

    @model_validator(mode="after")
    def _one_judge(self) -> JudgeConfig:
        if self.model and self.endpoint.url:
            raise ValueError("judge: set model (served by lmforge) or endpoint.url, not both")
        if self.endpoint.url and not self.endpoint.model:
            raise ValueError("judge.endpoint: url needs model (the name the endpoint serves)")
        if self.model is None and self.endpoint.url is None and self.enabled:
            raise ValueError("judge.enabled needs judge.model (a role or a local folder) or judge.endpoint.url")
        if self.pairwise is not None:
            for pair in self.pairwise:
                if len(pair) != 2 or pair[0] == pair[1]:
                    raise ValueError(f"judge.pairwise: {pair} is not a pair of two different roles")
                check_roles(pair)
        if self.grade is not None:
            check_roles(self.grade)
        return self


class SafetyConfig(StrictModel):
    """The safety suite (evaluation.safety): red-team prompts and benign look-alikes, per category."""

    enabled: bool = runtime_field(False, description="Run evaluate/safety.")
    models: list[str] | None = Field(
        None, description="Roles measured (null: every chat model of evaluate.models that the lineage has)."
    )
    suite: list[str] = Field(
        default_factory=lambda: ["builtin"],
        description="builtin (evaluation/suites/safety.jsonl) and/or JSONL files: `prompt` or `messages`, "
        "`category`, `expected` (refuse or comply), optional `id`.",
    )
    classifier: Literal["auto", "judge", "rules"] = Field(
        "auto",
        description="What decides refusal vs compliance: the judge, the rule-based detector, or auto "
        "(the judge when evaluate.judge is enabled).",
    )

    @field_validator("models")
    @classmethod
    def _roles(cls, models: list[str] | None) -> list[str] | None:
        return None if models is None else check_roles(models)


# a task name becomes a folder name under the step's output: nothing that could climb out of it
TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


def check_task_name(name: str, where: str) -> str:
    if not TASK_NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"{where}: {name!r} is not a task name (letters, digits, _ . -; no path separators)")
    return name


def task_yaml(path: str | Path) -> dict[str, Any]:
    """A user's lm-eval task YAML, read safely: lm-eval's own tags (`!function utils.score`) are kept
    as their text, never resolved (that would import the task's code)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: f"!{suffix} {getattr(node, 'value', '')}")
    loaded = yaml.load(Path(path).read_text(), Loader=Loader)  # noqa: S506 - a SafeLoader subclass
    return loaded if isinstance(loaded, dict) else {}


class EvaluateConfig(StrictModel):
    enabled: bool = runtime_field(True, description="Run this stage in `lmforge run`.")
    tasks: list[str] = Field(
        default_factory=lambda: list(BUILTIN_TASKS),
        description="Built-in task names, any lm-eval task name (mmlu, hellaswag: needs the hub), "
        "or a path to an lm-eval task YAML.",
    )
    # which metric steps run (like `stages`): no step's own results change with them
    models: list[str] = runtime_field(
        default_factory=lambda: role_names(),
        description="Models of the lineage to evaluate, by role (those that exist; base: the model given as "
        "base_model): base, pretrained and one per alignment method that trains a policy (lmforge.engine.registry.roles).",
    )
    backends: list[BackendName] = runtime_field(
        default_factory=lambda: list(BACKENDS),
        description="; ".join(f"{b.name}: {b.description}" for b in BACKENDS.values()) + " (evaluation.backends).",
    )
    backend_models: dict[BackendName, list[str]] = runtime_field(
        default_factory=dict,
        description="Models evaluated on a backend, by role, where not every model of `models`: {vllm: [dpo]} "
        "checks the serving engine against hf on the model that ships and evaluates the others on hf alone "
        "(one temporary vLLM server instead of one per model). A backend not named here takes `models`.",
    )
    limit: dict[str, int] = Field(
        default_factory=dict,
        description="Items per task for the metric run ({task: n}); contamination always checks every item.",
    )
    builtin: BuiltinTaskConfig = BuiltinTaskConfig()
    contamination: ContaminationConfig = ContaminationConfig()
    allow_unsafe_code: list[str] = runtime_field(
        default_factory=list,
        description="Tasks (beyond the built-in, sandboxed lmforge_humaneval) whose model-generated code lm-eval "
        "may run in the evaluation process itself, unsandboxed (stock humaneval, mbpp). Others are refused.",
    )

    @field_validator("tasks")
    @classmethod
    def _task_names(cls, tasks: list[str]) -> list[str]:
        for task in tasks:
            if not task.endswith((".yaml", ".yml")):  # a path to a task YAML is checked by the stage's check
                check_task_name(task, "task")
        return tasks

    @field_validator("limit")
    @classmethod
    def _limit_names(cls, limit: dict[str, int]) -> dict[str, int]:
        for task in limit:
            check_task_name(task, "task")
        return limit

    sandbox: SandboxConfig = SandboxConfig()
    answers: AnswerConfig = AnswerConfig()
    judge: JudgeConfig = JudgeConfig()
    safety: SafetyConfig = SafetyConfig()
    bootstrap_iters: int = Field(1000, ge=0, description="lm-eval's bootstrap iterations for its stderr.")
    seed: int = 0
    batch_size: int = runtime_field(8, description="hf backend batch size.", ge=1)
    num_concurrent: int = runtime_field(4, description="Concurrent requests to the vLLM server.", ge=1)
    backend_tolerance: dict[str, float] = runtime_field(
        default_factory=lambda: {
            "acc": 0.02,
            "acc_norm": 0.02,
            "exact_match": 0.05,
            "pass@1": 0.05,
            "word_perplexity": 0.01,
            "byte_perplexity": 0.01,
            "bits_per_byte": 0.01,
        },
        description="Largest hf-vs-vLLM difference reported as agreement (absolute, and at least two items' worth "
        "for item averages; relative for perplexities).",
    )

    @field_validator("models")
    @classmethod
    def _known_roles(cls, models: list[str]) -> list[str]:
        return check_roles(models)

    @field_validator("backend_models")
    @classmethod
    def _backend_roles(cls, per_backend: dict[str, list[str]]) -> dict[str, list[str]]:
        for models in per_backend.values():
            check_roles(models)
        return per_backend

    def evaluates(self, role: str, backend: str) -> bool:
        """Whether `role`'s model is evaluated on `backend` (when the lineage has it)."""
        narrowed: dict[str, list[str]] = {str(b): models for b, models in self.backend_models.items()}
        return backend in self.backends and role in self.models and role in narrowed.get(backend, self.models)
