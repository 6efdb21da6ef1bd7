"""How the lineage's models are asked and judged: which chat models, the prompt sets, the settings
an answer set's address and a judge's identity are made of, the judge behind its cache, and the
safety suite's classifier.

Public to later stages (the release's safety gate measures a candidate exactly as `evaluate/safety`
does, and finds its cached answers); the steps themselves are in `evaluation.judged`.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evaluation import answers as answer_sets
from evaluation import backends, safety
from evaluation import judge as judging
from lmforge.configbase import ConfigView, has_section
from lmforge.engine.graph import StepContext
from lmforge.engine.registry import roles
from lmforge.engine.stage import Product, hf_model
from lmforge.errors import ConfigError
from lmforge.hashing import digest, folder_digest

if TYPE_CHECKING:
    from lmforge.config import PipelineBase

log = logging.getLogger(__name__)
JUDGE_PROMPTS, SAFETY_SUITE = "judge-prompts", "safety-suite"
CHAT_DATA = Product("chat-data")
# models answer, and a judge lmforge serves judges, on the evaluation's served backend: the model as it will be served
SERVER = backends.BACKENDS[backends.SERVED]


def _graph() -> Any:
    from lmforge.engine.executor import graph

    return graph()


def _exists(role: str, config: PipelineBase) -> bool:
    return _graph().has(hf_model(role), config)


def chat_roles(config: PipelineBase) -> list[str]:
    """The chat models of `evaluate.models` this lineage has, in lifecycle order."""
    return [r.name for r in roles() if r.aligned and r.name in config.evaluate.models and _exists(r.name, config)]


LAST = "last"  # evaluate.judge.model: the lineage's last chat model


def judge_role(config: PipelineBase | ConfigView) -> str | None:
    """The judge's role when it is a model of the lineage (else a folder, an endpoint or nothing);
    `last` resolves to the last chat model of evaluate.models the lineage has (a full config only)."""
    model = config.evaluate.judge.model
    if model == LAST:
        chat = chat_roles(config)  # type: ignore[arg-type]
        if not chat:
            raise ConfigError("evaluate.judge.model=last: this lineage has no chat model to judge with")
        return chat[-1]
    return model if model in {r.name for r in roles()} else None


def _role_in(ctx: StepContext) -> str | None:
    """The judge's role inside a step: the one model of the lineage among its inputs (`last` resolved)."""
    model = ctx.config.evaluate.judge.model
    if model != LAST:
        return model if model in {r.name for r in roles()} else None
    return next(r.name for r in reversed(roles()) if ctx.has(hf_model(r.name)))


def pairs(config: PipelineBase) -> list[tuple[str, str]]:
    cfg = config.evaluate.judge
    if cfg.pairwise is not None:
        return [(a, b) for a, b in cfg.pairwise if _exists(a, config) and _exists(b, config)]
    chat = chat_roles(config)
    return list(zip(chat, chat[1:], strict=False))


def graded(config: PipelineBase) -> list[str]:
    cfg = config.evaluate.judge
    return [r for r in cfg.grade if _exists(r, config)] if cfg.grade is not None else chat_roles(config)


def judged_roles(config: PipelineBase) -> list[str]:
    if not config.evaluate.judge.enabled:
        return []
    wanted = {r for pair in pairs(config) for r in pair} | set(graded(config))
    return [r.name for r in roles() if r.name in wanted]


def safety_roles(config: PipelineBase) -> list[str]:
    cfg = config.evaluate.safety
    if not cfg.enabled:
        return []
    if cfg.models is None:
        return chat_roles(config)
    return [r for r in cfg.models if _exists(r, config)]


def uses_judge_for_safety(config: PipelineBase | ConfigView) -> bool:
    c = config.evaluate
    return c.safety.classifier == "judge" or (c.safety.classifier == "auto" and c.judge.enabled)


# -- what an answer set's address and a judge's identity are made of ------------------------------


def engine(config: PipelineBase | ConfigView) -> Any:
    from lmforge.inference.vllm_server import EngineConfig

    return config.serve.engine if has_section(config, "serve") else EngineConfig()


def answer_reads(config: PipelineBase | ConfigView) -> tuple[str, ...]:
    return ("evaluate.answers", *(("serve.engine",) if has_section(config, "serve") else ()))


def answer_settings(config: PipelineBase | ConfigView) -> dict[str, Any]:
    """What an answer set's address holds besides the model and the prompts (the release gate computes
    the same, so it finds the answers the evaluation made)."""
    return {
        **config.evaluate.answers.model_dump(mode="json"),
        "engine": engine(config).model_dump(mode="json"),
        **SERVER.identity(),  # the server's library versions
    }


def file_digest(path: str) -> str | None:
    """A file's content digest (None when it is missing: the stage's check and the step that reads it
    say so in one line; a key is still computed, for `explain` and planning)."""
    from lmforge.hashing import file_sha256

    return file_sha256(path) if Path(path).is_file() else None


def suite_files(config: PipelineBase | ConfigView) -> dict[str, str | None]:
    """The user's suite files by content (the built-in one is a project file: in the code identity)."""
    return {s: file_digest(s) for s in config.evaluate.safety.suite if s != "builtin"}


def safety_prompts(config: PipelineBase | ConfigView) -> list[dict[str, Any]]:
    return safety.load_suite(config.evaluate.safety.suite)


def judge_prompts(config: ConfigView, chat_dir: Path | None) -> list[dict[str, Any]]:
    cfg = config.evaluate.judge
    if cfg.prompts == "builtin":
        if chat_dir is None or not (chat_dir / "heldout_sft.jsonl").exists():
            raise ConfigError(
                "evaluate.judge.prompts=builtin takes the prompts held out from SFT, and this lineage has no "
                "alignment data: give a prompt file"
            )
        return answer_sets.heldout_prompts(chat_dir / "heldout_sft.jsonl", cfg.max_prompts, cfg.seed)
    return answer_sets.read_prompt_file(cfg.prompts)[: cfg.max_prompts]


# -- the judge -------------------------------------------------------------------------------------


def judge_reads(config: PipelineBase | ConfigView) -> tuple[str, ...]:
    reads = ["evaluate.judge", "evaluate.bootstrap_iters", "evaluate.seed"]
    if config.evaluate.judge.model is not None and has_section(config, "serve"):
        reads.append("serve.engine")  # a judge lmforge serves: its context shapes the prompts
    return tuple(reads)


def judge_derive(view: ConfigView) -> dict[str, Any]:
    model = view.evaluate.judge.model
    if model is None or model == LAST or model in {r.name for r in roles()}:
        return {}  # an endpoint is its URL and model (read); a role is its digest (upstream)
    folder = Path(model)
    if not (folder / "config.json").is_file():
        return {"judge_folder": None}  # the stage's check (and open_judge) name it in one line
    from lmforge.engine.remote import local_workspace
    from lmforge.hashing import fingerprints

    cache = fingerprints(local_workspace(view))  # weights are hashed once, not at every plan of the run
    identity = {"judge_folder": folder_digest(folder.resolve(), cache.file)}
    cache.save()
    return identity


def open_judge(ctx: StepContext) -> judging.Judge:
    """The configured judge behind its per-call cache (a server is started only on a cache miss)."""
    from lmforge.engine.store import StageStore

    cfg = ctx.config.evaluate.judge
    store = StageStore.for_config(ctx.config)
    role = _role_in(ctx)
    if cfg.endpoint.url:
        identity: dict[str, Any] = {"kind": "endpoint", "url": cfg.endpoint.url, "model": cfg.endpoint.model}
        connect = judging.endpoint_connect(cfg)
        constrained = bool(cfg.constrained)
    else:
        if role is not None:
            product = hf_model(role)
            model_dir = ctx.path(product)
            identity = {"kind": "lineage", "role": role, "digest": ctx.manifest(product)["digest"]}
        else:
            model_dir = Path(cfg.model).resolve()
            if not (model_dir / "config.json").is_file():
                raise ConfigError(
                    f"evaluate.judge.model: {cfg.model!r} is neither a role of the lineage, `last`, nor a model folder"
                )
            folder = ctx.identity.get("judge_folder") or judge_derive(ctx.config)["judge_folder"]
            identity = {"kind": "local", "path": str(cfg.model), "digest": folder}
        identity["engine"] = digest(engine(ctx.config).model_dump(mode="json"))
        connect = judging.local_connect(model_dir, engine(ctx.config), ctx.out_dir, cfg)
        constrained = cfg.constrained is not False
    identity["constrained"] = constrained
    identity["template"] = cfg.template
    return judging.Judge(store, identity, cfg, connect)


# -- the safety suite ------------------------------------------------------------------------------


def safety_reads(config: PipelineBase | ConfigView) -> tuple[str, ...]:
    reads = ["evaluate.safety", "evaluate.bootstrap_iters", "evaluate.seed"]
    if uses_judge_for_safety(config):
        reads += [r for r in judge_reads(config) if r not in reads]
    return tuple(reads)


def classify(judge: judging.Judge | None, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    classes = safety.classify_judge(judge, rows) if judge is not None else safety.classify_rules(rows)
    return safety.outcomes(rows, classes)


def safety_classifier(
    ctx: StepContext, stack: contextlib.ExitStack
) -> tuple[judging.Judge | None, str, dict[str, Any] | None, int]:
    """(the judge or None for the rules, how the card names the classifier, the judge's accuracy on
    known replies, judge calls made). The judge decides only when it calls known refusals and known
    (placeholder) compliances right at least `evaluate.judge.min_agreement` of the time."""
    cfg = ctx.config.evaluate
    if not uses_judge_for_safety(ctx.config):
        return None, "rule-based refusal detector", None, 0
    judge = stack.enter_context(open_judge(ctx))
    accuracy = safety.classifier_accuracy(judge, safety_prompts(ctx.config), cfg.bootstrap_iters, cfg.seed)
    described = judging.describe(judge.identity)
    if accuracy["estimate"] >= cfg.judge.min_agreement:
        return (
            judge,
            f"the judge, {described} (right on {accuracy['estimate']:.2f} of {accuracy['n']} known replies)",
            accuracy,
            judge.calls,
        )
    log.warning(
        "safety: the judge classifies %.2f of %d known replies right (minimum %.2f): the rule-based detector decides",
        accuracy["estimate"],
        accuracy["n"],
        cfg.judge.min_agreement,
    )
    return (
        None,
        f"rule-based refusal detector (the judge, {described}, was right on only {accuracy['estimate']:.2f} of "
        f"{accuracy['n']} known refusals and compliances; minimum {cfg.judge.min_agreement:.2f})",
        accuracy,
        judge.calls,
    )
