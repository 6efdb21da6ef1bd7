"""The release's safety gate (`serve.gate.safety`): a candidate that complies with more red-team
prompts than the model being served does not ship.

Both models answer the safety suite (`evaluation.safety`) the way the evaluation stage has them
answer it, so the candidate's answers are usually already cached by `evaluate/safety`'s answers,
and the served model's from when it was the candidate. Both are classified by the same classifier
(the judge when it passed its check on known replies, else the rule-based detector), and compared
prompt by prompt with the paired bootstrap the quantization gate uses (`evaluation.stats.paired`),
overall and per category:

- `max_increase: not_significantly_worse` (default): a category fails when the 95% interval of
  the change in unsafe compliance lies wholly above zero; a number: when the change exceeds it;
- `max_unsafe_compliance`: a fixed bound on the candidate's overall rate, with or without a
  served model to compare with.

A refused release raises `GateFailed` naming every failing category with its figures.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.configbase import has_section
from lmforge.engine.graph import StepContext
from lmforge.errors import ConfigError, GateFailed

if TYPE_CHECKING:
    from lmforge.config import ConfigOrView

log = logging.getLogger(__name__)
NOT_SIGNIFICANTLY_WORSE = "not_significantly_worse"


def reads(config: ConfigOrView) -> tuple[str, ...]:
    """What the gate reads beyond `serve.gate`: how the evaluation answers and classifies the suite."""
    if not config.serve.gate.safety.enabled or not has_section(config, "evaluate"):
        return ()
    from evaluation.asking import answer_reads, safety_reads

    return tuple(dict.fromkeys((*answer_reads(config), *safety_reads(config))))


def judge_products(config: Any) -> tuple[Any, ...]:
    """The judge model the gate's classifier needs when it is a model of the lineage."""
    if not config.serve.gate.safety.enabled or not has_section(config, "evaluate"):
        return ()
    from evaluation.asking import judge_role, uses_judge_for_safety
    from lmforge.engine.stage import hf_model

    role = judge_role(config) if uses_judge_for_safety(config) else None
    return (hf_model(role),) if role is not None else ()


def measure(ctx: StepContext, classifier: Any, model_dir: Path, digest: str, name: str) -> list[dict[str, Any]]:
    """One model's safety outcomes per prompt (answers from the cache or a temporary vLLM server)."""
    from evaluation import asking
    from evaluation.answers import answer_all
    from lmforge.engine.store import StageStore

    if not Path(model_dir).is_dir():
        raise ConfigError(
            f"serve.gate.safety: {model_dir} is not a Hugging Face model folder (a GGUF file?): the safety suite runs "
            "on vLLM; measure its source model with evaluate.safety and switch the gate off for this backend"
        )
    answers = answer_all(
        StageStore.for_config(ctx.config),
        Path(model_dir),
        digest,
        {asking.SAFETY_SUITE: asking.safety_prompts(ctx.config)},
        asking.answer_settings(ctx.config),
        asking.engine(ctx.config),
        ctx.out_dir / "safety-gate" / name,
        name,
    )[asking.SAFETY_SUITE]
    return asking.classify(classifier, answers)


def check(ctx: StepContext, model_dir: Path, digest: str, role: str, served: dict[str, Any] | None) -> dict[str, Any]:
    """The gate's decision for the candidate `model_dir` against the `served` record (None: nothing served);
    raises GateFailed when the candidate may not ship. Returns what the release records."""
    from evaluation import asking, safety

    cfg = ctx.config.serve.gate.safety
    if not cfg.enabled:
        return {}
    if not has_section(ctx.config, "evaluate"):
        raise ConfigError("serve.gate.safety needs the evaluation stage (its safety suite and classifier)")
    iters, seed = ctx.config.evaluate.bootstrap_iters, ctx.config.evaluate.seed
    with contextlib.ExitStack() as stack:
        classifier, described, _, _ = asking.safety_classifier(ctx, stack)
        candidate = measure(ctx, classifier, model_dir, digest, role)
        record: dict[str, Any] = {"classifier": described, "candidate": safety.rates(candidate, iters, seed)["all"]}
        failures: list[str] = []
        overall = record["candidate"]["unsafe_compliance"]["estimate"]
        if cfg.max_unsafe_compliance is not None and overall > cfg.max_unsafe_compliance + 1e-9:
            failures.append(f"all: unsafe compliance {overall:.2f} is over the bound {cfg.max_unsafe_compliance:.2f}")
        served_model = (served or {}).get("lineage", {}).get("model", {})
        if cfg.compare_served and served and served.get("model_dir") and served_model.get("digest"):
            if served_model["digest"] == digest:
                record["served"] = "the candidate itself"
            else:
                base = measure(ctx, classifier, Path(served["model_dir"]), served_model["digest"], "served")
                comparison = safety.compare(candidate, base, iters, seed)
                record["served"] = served.get("served_name")
                record["comparison"] = comparison
                for category, c in comparison.items():
                    if not c["items"]:
                        continue
                    increase = c["delta"]
                    limit = cfg.max_increase
                    worse = c["worse"] if limit == NOT_SIGNIFICANTLY_WORSE else increase > float(limit) + 1e-9
                    if worse:
                        failures.append(
                            f"{category}: unsafe compliance {c['served']:.2f} -> {c['candidate']:.2f} "
                            f"({increase:+.2f}, 95% CI [{c['low']:+.2f}, {c['high']:+.2f}], {c['items']} prompts)"
                        )
        elif cfg.compare_served:
            record["served"] = "nothing served yet: no comparison"
    if failures:
        raise GateFailed(f"serve: the safety gate refused the {role} model ({described}): " + "; ".join(failures))
    log.info("serve: safety gate passed for the %s model (%s)", role, described)
    return record
