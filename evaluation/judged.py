"""The evaluation stage's judged steps: answers, the LLM judge, the safety suite.

    hf-model:<role> [+ chat-data] -> evaluate/answers-<role>     (the judge's prompts and the safety suite)
    evaluate/answers-* [+ hf-model:<judge role>] -> evaluate/judge   (pairwise, grades, agreement with the truth)
    evaluate/answers-* [+ the judge] -> evaluate/safety              (refusals per category; the release gate's data)

The answers are cached by content (`evaluation.answers`), the judge's calls one by one
(`evaluation.judge`): a rerun with a new model asks only what it has not asked before.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import TYPE_CHECKING, Any

from evaluation import answers as answer_sets
from evaluation import judge as judging
from evaluation import safety
from evaluation.asking import (
    CHAT_DATA,
    JUDGE_PROMPTS,
    SAFETY_SUITE,
    SERVER,
    answer_reads,
    answer_settings,
    classify,
    engine,
    file_digest,
    judge_derive,
    judge_prompts,
    judge_reads,
    judge_role,
    judged_roles,
    open_judge,
    safety_classifier,
    safety_prompts,
    safety_reads,
    safety_roles,
    suite_files,
    uses_judge_for_safety,
)
from lmforge.configbase import ConfigView
from lmforge.engine.graph import Step, StepContext
from lmforge.engine.registry import roles
from lmforge.engine.stage import Maybe, hf_model
from lmforge.hashing import atomic_write_json
from lmforge.jsonl import write_jsonl

if TYPE_CHECKING:
    from lmforge.config import PipelineBase

log = logging.getLogger(__name__)
JUDGE, SAFETY = "evaluate/judge", "evaluate/safety"


# -- evaluate/answers-<role> -----------------------------------------------------------------------


def _answers_sets(config: PipelineBase | ConfigView) -> list[str]:
    """The prompt sets a model answers: the judge's prompts and the safety suite, as they are enabled."""
    out = []
    if config.evaluate.judge.enabled:
        out.append(JUDGE_PROMPTS)
    if config.evaluate.safety.enabled:
        out.append(SAFETY_SUITE)
    return out


def _answers_derive(view: ConfigView) -> dict[str, Any]:
    ident: dict[str, Any] = {"sets": _answers_sets(view), **SERVER.identity()}
    if view.evaluate.judge.prompts != "builtin":
        ident["judge_prompts_file"] = file_digest(view.evaluate.judge.prompts)
    ident["suite_files"] = suite_files(view)
    return ident


def _answers_step(role: str) -> Step:
    model = hf_model(role)

    def finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
        from lmforge.engine.store import StageStore

        sets: dict[str, list[dict[str, Any]]] = {}
        names = _answers_sets(ctx.config)
        if JUDGE_PROMPTS in names:
            chat = ctx.path(CHAT_DATA).parent if ctx.has(CHAT_DATA) else None
            sets[JUDGE_PROMPTS] = judge_prompts(ctx.config, chat)
        if SAFETY_SUITE in names:
            sets[SAFETY_SUITE] = safety_prompts(ctx.config)
        got = answer_sets.answer_all(
            StageStore.for_config(ctx.config),
            ctx.path(model),
            ctx.manifest(model)["digest"],
            sets,
            answer_settings(ctx.config),
            engine(ctx.config),
            ctx.out_dir,
            role,
            ctx.config.evaluate.num_concurrent,
        )
        for name, rows in got.items():
            write_jsonl(ctx.out_dir / "answers" / f"{name}.jsonl", rows)
        return {
            "counts": {name: len(rows) for name, rows in got.items()},
            "extra": {"model": role, "model_dir": str(ctx.path(model)), "sets": sorted(got)},
        }

    return Step(
        f"evaluate/answers-{role}",
        1,
        f"The {role} model's answers to the judge's prompts and the safety suite (temporary vLLM server)",
        reads=lambda c: (
            *answer_reads(c),
            "evaluate.judge.prompts",
            "evaluate.judge.max_prompts",
            "evaluate.judge.seed",
            "evaluate.safety.suite",
        ),
        derive=_answers_derive,
        upstream=lambda c: (model, Maybe(CHAT_DATA)),
        finalize=finalize,
        when=lambda c: role in judged_roles(c) or role in safety_roles(c),
        retries=2,
        code=("evaluation.answers", "lmforge.inference.chat_client", "lmforge.inference.vllm_server"),
        files=("evaluation/suites/safety.jsonl",),
        libraries=(*SERVER.libraries, "openai", "transformers"),
    )


ANSWER_STEPS = {r.name: _answers_step(r.name) for r in roles()}


def _answers_of(ctx: StepContext, role: str, set_name: str) -> list[dict[str, Any]]:
    from lmforge.jsonl import read_jsonl

    return list(read_jsonl(ctx.upstream_dir(ANSWER_STEPS[role].name) / "answers" / f"{set_name}.jsonl"))


def _judge_upstream(config: PipelineBase) -> tuple[Any, ...]:
    role = judge_role(config)
    return (
        *(ANSWER_STEPS[r].name for r in judged_roles(config)),
        *((hf_model(role),) if role is not None else ()),
    )


def _judge_finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
    cfg = ctx.config.evaluate
    iters, seed = cfg.bootstrap_iters, cfg.seed
    judged = [ctx.upstream[n]["extra"]["model"] for n in ctx.upstream if n.startswith("evaluate/answers-")]
    answers = {role: _answers_of(ctx, role, JUDGE_PROMPTS) for role in judged}
    prompts = next(iter(answers.values()))
    text = {role: {a["id"]: a["answer_text"] for a in rows} for role, rows in answers.items()}
    result: dict[str, Any] = {"pairwise": [], "grades": {}}
    with open_judge(ctx) as judge:
        result["judge"] = {**judge.identity, "described": judging.describe(judge.identity)}
        truth = judging.agreement(judge, judging.verifiable_pairs(prompts, seed))
        result["agreement"] = judging.summarize_agreement(truth, iters, seed, cfg.judge.min_agreement)
        result["agreement_rows"] = truth
        for first, second in [(a, b) for a, b in _pairs_of(ctx) if a in text and b in text]:
            rows = judging.pairwise(judge, prompts, text[first], text[second])
            result["pairwise"].append(
                {"first": first, "second": second, **judging.summarize_pairwise(rows, iters, seed), "rows": rows}
            )
        for role in [r for r in _graded_of(ctx) if r in text]:
            rows = judging.grades(judge, prompts, text[role])
            result["grades"][role] = {**judging.summarize_grades(rows, iters, seed), "rows": rows}
        result["calls"], result["cached"] = judge.calls, judge.cached
        result["self_judged"] = self_judged(judge.identity, list(text))
    atomic_write_json(ctx.out_dir / "judge.json", result)
    agree = result["agreement"]
    if agree["below_minimum"]:
        log.warning(
            "judge %s agrees with the truth on %.2f of the verifiable pairs (minimum %.2f, chance 0.5): "
            "its verdicts are reported, not trusted",
            result["judge"]["described"],
            agree["estimate"],
            agree["min_agreement"],
        )
    metrics: dict[str, Any] = {"judge/agreement": agree["estimate"]}
    for p in result["pairwise"]:
        metrics[f"judge/win_rate/{p['second']}_vs_{p['first']}"] = p["estimate"]
        metrics[f"judge/swap_consistency/{p['second']}_vs_{p['first']}"] = p["swap_consistency"]
        metrics[f"judge/win_rate_order_averaged/{p['second']}_vs_{p['first']}"] = p["order_averaged"]["estimate"]
    for role, g in result["grades"].items():
        metrics[f"judge/grade/{role}"] = g["estimate"]
    log.info("judge: %d calls made, %d answered from the cache", result["calls"], result["cached"])
    return {
        "counts": {"judge_calls": result["calls"], "cached_calls": result["cached"], "prompts": len(prompts)},
        "metrics": {k: v for k, v in metrics.items() if v == v},  # NaN (nothing counted) is not a metric
        "extra": {
            "judge": result["judge"]["described"],
            "below_minimum": agree["below_minimum"],
            "lines": [
                f"judge: {result['judge']['described']}; agreement with the truth {_ci(agree)}"
                + (" (below the minimum: reported, not trusted)" if agree["below_minimum"] else ""),
                *_self_judged_lines(result["self_judged"], "judges its own answers"),
                *(
                    f"{p['second']} vs {p['first']}: win rate {_ci(p)}, swap consistency {p['swap_consistency']:.2f}, "
                    f"order-averaged {_ci(p['order_averaged'])}"
                    for p in result["pairwise"]
                ),
                *(f"{role}: mean grade {_ci(g)}" for role, g in result["grades"].items()),
                f"judge calls: {result['calls']} made, {result['cached']} from the cache",
            ],
        },
    }


def self_judged(identity: dict[str, Any], judged: list[str]) -> list[str]:
    """The judged roles that are the judge itself (a lineage judge, `model: last` in the demo)."""
    return [identity["role"]] if identity.get("kind") == "lineage" and identity.get("role") in judged else []


def _self_judged_text(roles_: list[str], what: str) -> list[str]:
    """The card's warning when a model judges itself: its verdicts on its own output are not independent
    evidence (self-preference is the best-documented bias of LLM judges)."""
    return [
        f"warning: the judge is the {role} model, which {what}: those verdicts are not independent; "
        "point evaluate.judge at another model"
        for role in roles_
    ]


def _self_judged_lines(roles_: list[str], what: str) -> list[str]:
    """The same, logged as the step ends (and listed by `lmforge explain`)."""
    lines = _self_judged_text(roles_, what)
    for line in lines:
        log.warning("%s", line)
    return lines


def _pairs_of(ctx: StepContext) -> list[tuple[str, str]]:
    cfg = ctx.config.evaluate.judge
    if cfg.pairwise is not None:
        return [(a, b) for a, b in cfg.pairwise]
    chat = [r.name for r in roles() if r.aligned]
    present = [r for r in chat if f"evaluate/answers-{r}" in ctx.upstream]
    return list(zip(present, present[1:], strict=False))


def _graded_of(ctx: StepContext) -> list[str]:
    cfg = ctx.config.evaluate.judge
    present = [n.removeprefix("evaluate/answers-") for n in ctx.upstream if n.startswith("evaluate/answers-")]
    return [r for r in (cfg.grade if cfg.grade is not None else present) if r in present]


def _safety_upstream(config: PipelineBase) -> tuple[Any, ...]:
    role = judge_role(config) if uses_judge_for_safety(config) else None
    return (
        *(ANSWER_STEPS[r].name for r in safety_roles(config)),
        *((hf_model(role),) if role is not None else ()),
    )


def _safety_finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
    cfg = ctx.config.evaluate
    roles_here = [ctx.upstream[n]["extra"]["model"] for n in ctx.upstream if n.startswith("evaluate/answers-")]
    result: dict[str, Any] = {"models": {}}
    with contextlib.ExitStack() as stack:
        judge, result["classifier"], result["judge_accuracy"], result["calls"] = safety_classifier(ctx, stack)
        for role in roles_here:
            rows = classify(judge, _answers_of(ctx, role, SAFETY_SUITE))
            result["models"][role] = {"rates": safety.rates(rows, cfg.bootstrap_iters, cfg.seed), "rows": rows}
        if judge is not None:
            result["calls"] = judge.calls
            result["self_judged"] = self_judged(judge.identity, roles_here)
    atomic_write_json(ctx.out_dir / "safety.json", result)
    metrics = {}
    for role, r in result["models"].items():
        overall = r["rates"]["all"]
        metrics[f"safety/unsafe_compliance/{role}"] = overall["unsafe_compliance"]["estimate"]
        metrics[f"safety/over_refusal/{role}"] = overall["over_refusal"]["estimate"]
    return {
        "counts": {"models": len(result["models"]), "judge_calls": result["calls"]},
        "metrics": {k: v for k, v in metrics.items() if v == v},
        "extra": {
            "classifier": result["classifier"],
            "lines": [
                f"refusals decided by: {result['classifier']}",
                *_self_judged_lines(result.get("self_judged", []), "classifies its own replies"),
                *(
                    f"{role}: unsafe compliance {_ci(r['rates']['all']['unsafe_compliance'])}, "
                    f"over-refusal {_ci(r['rates']['all']['over_refusal'])}"
                    for role, r in result["models"].items()
                ),
            ],
        },
    }


def _findings(manifest: dict[str, Any]) -> list[str]:
    """For `lmforge explain`: what the judge or the safety suite found."""
    return list(manifest.get("extra", {}).get("lines", []))


JUDGED_STEPS = [
    *ANSWER_STEPS.values(),
    Step(
        JUDGE,
        1,
        "The LLM judge: its agreement with the truth, pairwise win rates, grades (each call cached)",
        reads=judge_reads,
        derive=judge_derive,
        upstream=_judge_upstream,
        finalize=_judge_finalize,
        when=lambda c: bool(judged_roles(c)),
        retries=2,
        findings=_findings,
        code=("evaluation.judge", "lmforge.inference.chat_client", "lmforge.inference.vllm_server"),
        libraries=("openai", *SERVER.libraries),
    ),
    Step(
        SAFETY,
        1,
        "The safety suite: unsafe compliance and over-refusal per category, with intervals",
        reads=safety_reads,
        derive=lambda v: judge_derive(v) if uses_judge_for_safety(v) else {},
        upstream=_safety_upstream,
        finalize=_safety_finalize,
        when=lambda c: bool(safety_roles(c)),
        retries=2,
        findings=_findings,
        code=("evaluation.safety", "evaluation.judge", "lmforge.inference.chat_client"),
        files=("evaluation/suites/safety.jsonl",),
        libraries=("openai",),
    ),
]


def report_sections(ctx: StepContext) -> dict[str, Any]:
    """The judged results the report's card shows, when the steps ran."""
    out: dict[str, Any] = {}
    if JUDGE in ctx.upstream:
        out["judge"] = json.loads((ctx.upstream_dir(JUDGE) / "judge.json").read_text())
    if SAFETY in ctx.upstream:
        out["safety"] = json.loads((ctx.upstream_dir(SAFETY) / "safety.json").read_text())
    return out


def _ci(s: dict[str, Any], digits: int = 2) -> str:
    if s["n"] == 0 or s["estimate"] != s["estimate"]:
        return "n/a (nothing counted)"
    if s["low"] != s["low"]:
        return f"{s['estimate']:.{digits}f} (n={s['n']})"
    return f"{s['estimate']:.{digits}f} [{s['low']:.{digits}f}, {s['high']:.{digits}f}] (n={s['n']})"


def card_sections(sections: dict[str, Any]) -> str:
    """The judged results as markdown, for the evaluation card."""
    lines: list[str] = []
    judge = sections.get("judge")
    if judge:
        agree = judge["agreement"]
        lines += ["", "## Judged by an LLM", "", f"Judge: {judge['judge']['described']}.", ""]
        lines += [f"**{w}**" for w in _self_judged_text(judge.get("self_judged", []), "judges its own answers")]
        verdict = (
            f"**below the minimum {agree['min_agreement']:.2f}: the verdicts below are reported, not evidence**"
            if agree["below_minimum"]
            else f"at or above the minimum {agree['min_agreement']:.2f}"
        )
        lines.append(
            f"Agreement with the truth on {agree['n']} verifiable pairs (right vs wrong answer, both orders; "
            f"chance 0.5): {_ci(agree)}; both orders right: {agree['both_orders']:.2f}; {verdict}."
        )
        if judge["pairwise"]:
            lines += [
                "",
                "| comparison | win rate, both orders agree [95% CI] | wins / ties / losses | swap consistency "
                "| order-averaged win rate [95% CI] | no verdict |",
                "|---|---|---|---|---|---|",
            ]
            for p in judge["pairwise"]:
                lines.append(
                    f"| {p['second']} vs {p['first']} | {_ci(p)} | {p['wins']} / {p['ties']} / {p['losses']} "
                    f"| {p['swap_consistency']:.2f} | {_ci(p['order_averaged'])} "
                    f"| {p['unparsed']} of {p['prompts']} |"
                )
        if judge["grades"]:
            lines += ["", "| model | mean grade [95% CI] | no grade |", "|---|---|---|"]
            for role, g in judge["grades"].items():
                lines.append(f"| {role} | {_ci(g)} | {g['unparsed']} of {g['prompts']} |")
        lines += ["", f"Judge calls this run: {judge['calls']} made, {judge['cached']} from the cache."]
    safety_result = sections.get("safety")
    if safety_result:
        lines += ["", "## Safety suite", "", f"Refusals decided by: {safety_result['classifier']}.", ""]
        lines += [
            f"**{w}**" for w in _self_judged_text(safety_result.get("self_judged", []), "classifies its own replies")
        ]
        lines += ["| model | category | unsafe compliance [95% CI] | over-refusal [95% CI] |", "|---|---|---|---|"]
        for role, r in safety_result["models"].items():
            for category, rates in r["rates"].items():
                lines.append(
                    f"| {role} | {category} | {_ci(rates['unsafe_compliance'])} | {_ci(rates['over_refusal'])} |"
                )
    return "\n".join(lines) + ("\n" if lines else "")
