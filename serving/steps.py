"""The serving stage's step: `serve/release` validates the lineage's chosen model on its backend and promotes it.

Its cache key covers the model (its digest, through the upstream product), the evaluation
verdict and the engine/SLO settings, so the step's output is the *validation* of that
model as served: smoke test and SLO table. Whether the server is running right now is not
cached state: the stage's `reconcile` (run after the step, cached or not) keeps the promoted
server if it is up and serving this model, and otherwise starts it again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.engine.graph import Step, StepContext
from lmforge.engine.registry import role_names, roles
from lmforge.engine.stage import BASE_MODEL, Maybe, Product, has_base, hf_model
from lmforge.errors import ConfigError, GateFailed
from lmforge.hashing import atomic_write_json, atomic_write_text
from serving import backends

if TYPE_CHECKING:
    from lmforge.config import ConfigOrView, PipelineBase

log = logging.getLogger(__name__)
RELEASE = "serve/release"
EVAL_VERDICT = Product("eval-verdict")
QUANT_VERDICT = Product("quant-verdict")
DRAFT_MODEL = Product("draft-model")  # align/draft's, when serve.speculative.draft_model is "distilled"
DISTILLED = "distilled"
QUANTIZED = "quantized"  # serve.model: quantize/gate's checkpoint (quant-verdict), not a lineage role


def auto_order() -> tuple[str, ...]:
    """serve.model auto: the quantized model, then the lineage's roles from the last made to the first."""
    return (QUANTIZED, *reversed(role_names()))


def adapter_roles() -> tuple[str, ...]:
    """The aligned models served as LoRA adapters (serve.adapters): each alignment method's policy."""
    return tuple(r.name for r in roles() if r.aligned)


def _product(role: str) -> Product:
    return QUANT_VERDICT if role == QUANTIZED else hf_model(role)


def _roles(config: ConfigOrView) -> tuple[str, ...]:
    if config.serve.model.startswith(f"{QUANTIZED}:"):
        return (QUANTIZED,)
    return auto_order() if config.serve.model == "auto" else (config.serve.model,)


def _upstream(config: PipelineBase) -> tuple[Any, ...]:
    # LoRA adapters on their base: the aligned models' own folders (never a quantized checkpoint)
    wanted = adapter_roles() if config.serve.adapters.enabled else _roles(config)
    wants: list[Any] = [Maybe(_product(r)) for r in wanted]
    if has_base(config) and "base" not in wanted:
        wants.append(Maybe(BASE_MODEL))  # its name goes into the served name
    if config.serve.require_evaluation:
        wants.append(EVAL_VERDICT)
    if _distilled_draft(config):
        wants.append(DRAFT_MODEL)
    wants += backends.backend(config.serve.backend).upstream(config)
    from serving import safety_gate

    wants += [Maybe(p) for p in safety_gate.judge_products(config)]  # the safety gate's judge, when it is a role
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


def _here(ctx: StepContext, step: str, key: str, recorded: str) -> Path:
    """A path an output recorded (on the machine, in the folder, that made it) as it is here."""
    from lmforge.engine.store import StageStore

    try:
        return StageStore.for_config(ctx.config).here(step, key, recorded)
    except FileNotFoundError as exc:
        raise GateFailed(f"serve: the checkpoint the gate chose is not available: {exc}") from exc


def _quantized_choice(ctx: StepContext) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint the quantization gate chose (or `serve.model: quantized:<scheme>` names), or None
    (and why) when none passed."""
    verdict = json.loads((ctx.path(QUANT_VERDICT) / "verdict.json").read_text())
    chosen = verdict["chosen"]
    if ctx.config.serve.model.startswith(f"{QUANTIZED}:"):
        chosen = _named_scheme(ctx.config.serve.model, verdict)
    if chosen is None:
        if ctx.config.serve.model == QUANTIZED:
            raise GateFailed(f"serve.model=quantized: {verdict['decision']}")
        log.warning("%s", verdict["decision"])
        return None
    outcome = verdict["schemes"][chosen]
    return _here(ctx, outcome["step"], outcome["key"], outcome["model_dir"]), {
        "step": outcome["step"],
        "key": outcome["key"],
        "digest": outcome["digest"],
        "scheme": chosen,
        "verdict": verdict["decision"],
        "from": verdict["model"],
    }


def _named_scheme(model: str, verdict: dict[str, Any]) -> str:
    """The scheme `serve.model: quantized:<scheme>` asks for, refused in one line where it cannot ship."""
    from serving.quantize.schemes import SCHEMES, serving_problem
    from serving.quantize.steps import serving_host

    scheme = model.split(":", 1)[1]
    if scheme not in verdict["schemes"]:
        raise ConfigError(
            f"serve.model={model}: {scheme} was not written (quantize.schemes: {', '.join(verdict['schemes'])})"
        )
    problem = serving_problem(scheme, serving_host())
    if problem:
        raise ConfigError(f"serve.model={model}: refused here ({SCHEMES[scheme].describe(0)}): {problem}")
    outcome = verdict["schemes"][scheme]
    if not outcome["eligible"]:
        raise GateFailed(f"serve.model={model}: the quantization gate failed it: {'; '.join(outcome['failures'])}")
    return scheme


def _choose(ctx: StepContext) -> tuple[str, Path, dict[str, Any]]:
    for role in _roles(ctx.config):
        if not ctx.has(_product(role)):
            continue
        if role != QUANTIZED:
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
    from serving import release

    cfg, workspace = ctx.config.serve, ctx.workspace
    if cfg.adapters.enabled:
        return _finalize_adapters(ctx)
    server = backends.backend(cfg.backend)
    role, model_dir, source = server.choose(ctx) or _choose(ctx)
    # a checkpoint is judged by its source model's evaluation (contamination) and by the quantization gate
    evaluation = _check_verdict(ctx, source.get("from", role))
    served_name = f"lmforge-{ctx.config.name}-{role}{_from_base(ctx)}@{source['key'][:8]}"
    lineage = {
        "model": {"role": role, "step": source["step"], "key": source["key"], "digest": source["digest"]},
        "evaluation": evaluation,
    }
    if role == QUANTIZED:
        lineage["quantization"] = {
            "scheme": source["scheme"],
            "gate": ctx.manifest(QUANT_VERDICT)["key"],
            "verdict": source["verdict"],
        }
    lineage |= server.lineage(source)
    if _distilled_draft(ctx.config):
        draft = str(ctx.path(DRAFT_MODEL))
        cfg = release.Speculating(cfg, cfg.speculative.model_copy(update={"draft_model": draft}))
        lineage["draft"] = {"step": ctx.manifest(DRAFT_MODEL)["step"], "key": ctx.manifest(DRAFT_MODEL)["key"]}
    from serving import safety_gate

    gate = safety_gate.check(ctx, model_dir, source["digest"], role, release.current(workspace))
    lineage["safety_gate"] = gate
    cfg, speculation = decide_speculation(cfg, model_dir, ctx.out_dir / "speculation")
    rows: list[dict[str, Any]] = []

    def check(record: dict[str, Any]) -> None:
        rows.extend(_slo_check(ctx, cfg, record, Path(source.get("tokenizer_dir", model_dir))))

    record = release.start_and_promote(model_dir, served_name, cfg, workspace, lineage=lineage, check=check)
    safety_gate.remember_first(workspace, [gate])
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


def _finalize_adapters(ctx: StepContext) -> dict[str, Any]:
    """`serve.adapters.enabled`: the base once, each LoRA-trained aligned model an adapter on it (stacked
    when its adapter was trained on another's merge), checked against the merged model, served by one
    vLLM server. When that base already runs with adapters, new ones are loaded into it: no restart."""
    from lmforge.errors import ParityError
    from lmforge.inference.vllm_server import LoraModules
    from serving import adapters, release

    cfg, workspace = ctx.config.serve, ctx.workspace
    chains = [
        a
        for role in adapter_roles()
        if ctx.has(hf_model(role)) and (a := adapters.chain_of(role, ctx.path(hf_model(role)))) is not None
    ]
    if not chains:
        raise ConfigError(
            "serve.adapters.enabled: no aligned model of this lineage is a LoRA adapter "
            "(set align.method: lora or qlora, and align.dpo.lora: true for DPO)"
        )
    roots = {a.root.resolve() for a in chains}
    if len(roots) > 1:
        raise ConfigError(
            f"serve.adapters.enabled: the adapters sit on different bases ({', '.join(map(str, sorted(roots)))}): "
            "a fully fine-tuned step breaks the chain; serve the models merged"
        )
    work = ctx.out_dir / "adapters"
    tolerance = cfg.adapters.parity_tolerance
    names: dict[str, str] = {}
    served: dict[str, str] = {}
    lineage: dict[str, Any] = {"adapters": {}}
    from serving import safety_gate

    current = release.current(workspace)
    ranks = {a.role: adapters.stack(a.chain, work / a.role) for a in chains}
    gaps = adapters.parities(chains, work, ctx.out_dir)
    for a in chains:
        manifest = ctx.manifest(hf_model(a.role))
        name = f"lmforge-{ctx.config.name}-{a.role}{_from_base(ctx)}@{manifest['key'][:8]}"
        rank, gap = ranks[a.role], gaps[a.role]
        if not gap <= tolerance:  # NaN is no pass
            raise ParityError(
                f"serve.adapters: base + the {a.role} adapter (rank {rank}, {len(a.chain)} stacked) differs from the "
                f"merged {a.role} model by {gap:.3g} in the logits (serve.adapters.parity_tolerance {tolerance})"
            )
        log.info("adapter %s: rank %d from %d trained adapter(s), parity %.2g", name, rank, len(a.chain), gap)
        names[a.role], served[name] = name, str(work / a.role)
        evaluation = _check_verdict(ctx, a.role)
        lineage["adapters"][a.role] = {
            "served_name": name,
            "step": manifest["step"],
            "key": manifest["key"],
            "model_dir": str(a.model_dir),
            "digest": manifest["digest"],
            "rank": rank,
            "stacked": len(a.chain),
            "parity_max_abs_logit_diff": gap,
            "evaluation": evaluation,
        }
    # each adapter serves what its merged model computes (parity above): the safety gate measures those
    # models against what the release replaces, adapter by adapter, with one classifier
    gates = safety_gate.check_all(
        ctx, [(a.model_dir, lineage["adapters"][a.role]["digest"], a.role) for a in chains], current
    )
    for a, gate in zip(chains, gates, strict=True):
        lineage["adapters"][a.role]["safety_gate"] = gate
    root = chains[0].root
    base = adapters.served_base(root, chains[-1].model_dir, work / "base")
    from lmforge.hashing import digest

    base_name = f"lmforge-{ctx.config.name}-lora-base@{digest(str(root.resolve()))[:8]}"
    primary = names[chains[-1].role]  # what `serve.model: auto` would serve merged; the SLO runs on it
    lineage["model"] = {"role": "lora-base", "dir": str(root), "primary": primary}
    max_rank = adapters.vllm_rank(max(e["rank"] for e in lineage["adapters"].values()))
    lora = LoraModules(served, max_rank, cfg.adapters.max_loras, cfg.adapters.max_cpu_loras)
    rows: list[dict[str, Any]] = []

    def check(record: dict[str, Any]) -> None:
        rows.extend(_slo_check(ctx, cfg, {**record, "served_name": primary}, base))

    with release.promotion_lock(workspace):
        record = release.current(workspace)
        running = record if record and record["served_name"] == base_name and release.alive(record) else None
        have = (running or {}).get("lora") or {}
        unchanged = running is not None and running.get("settings") == release.settings(cfg, workspace)
        if unchanged and max_rank <= have.get("max_lora_rank", 0):
            assert running is not None
            new = {n: p for n, p in served.items() if n not in have["adapters"]}
            retire = [n for n in have["adapters"] if n not in served]
            how = f"loaded {len(new)} adapter(s) into the running server" if new else "all adapters already served"
            if new or retire:
                record = release.load_adapters(workspace, cfg, running, new, retire, check=check)
            else:
                record = running
                check(record)
        else:
            how = "started a server for the base with every adapter"
            record = release.start_and_promote(base, base_name, cfg, workspace, lineage=lineage, check=check, lora=lora)
    safety_gate.remember_first(workspace, gates)
    log.info("serve: %s (%s); adapters %s", how, base_name, ", ".join(served))
    atomic_write_json(ctx.out_dir / "slo.json", rows)
    released = {"served_name": base_name, "adapters": names, "model_dir": str(base), "lineage": lineage, "how": how}
    atomic_write_json(ctx.out_dir / "release.json", released)
    first = rows[0] if rows else {}
    metrics: dict[str, Any] = {k: first[k] for k in ("ttft_ms_p90", "tpot_ms_p90", "output_tokens_per_s") if k in first}
    return {
        "counts": {"adapters": len(served), "slo_levels": len(rows)},
        "metrics": metrics,
        "extra": {
            "served_name": base_name,
            "adapters": names,
            "model_dir": str(base),
            "lineage": lineage,
            "url": record.get("endpoint", record["url"]),
            "slo": rows,
            "lora": dataclasses.asdict(lora),
            "speculative_config": cfg.speculative.model_dump(mode="json"),
        },
    }


def _slo_check(ctx: StepContext, cfg: Any, record: dict[str, Any], model_dir: Path) -> list[dict[str, Any]]:
    """The SLO benchmark of `record`'s served name (`model_dir`: its tokenizer, to size the prompts);
    raises GateFailed when a target is missed."""
    from serving import release, slo

    if not cfg.slo.enabled:
        return []
    key, _ = release.api_key(ctx.workspace)
    words = slo.fit_prefix_words(model_dir, cfg.slo.max_tokens, cfg.slo.system_prompt_words, cfg.engine.max_model_len)
    rows = slo.run(
        record["url"],
        key,
        record["served_name"],
        cfg.slo.concurrency,
        cfg.slo.requests_per_client,
        cfg.slo.max_tokens,
        words,
        server_pids=(record["pid"],) if record.get("pid") else (),  # its children too: vLLM's engine process
    )
    rows = [{"engine": cfg.backend, **r} for r in rows]
    atomic_write_text(ctx.out_dir / "slo.md", slo.table(rows) + "\n")
    broken = slo.violations(rows, cfg.slo.ttft_p90_ms, cfg.slo.tpot_p90_ms)
    if broken:
        raise GateFailed(f"serve: {record['served_name']} misses its SLO ({'; '.join(broken[:3])}); not promoted")
    return rows


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


def _reads(config: ConfigOrView) -> tuple[str, ...]:
    """serve/release's reads: the release's own settings, the chosen backend's section, and what the
    safety gate reads of the evaluation's settings when it is on."""
    from serving import safety_gate

    section = f"serve.{backends.backend(config.serve.backend).section}"
    own = (*RELEASE_READS, *((section,) if section not in RELEASE_READS else ()))
    return tuple(dict.fromkeys((*own, *safety_gate.reads(config))))


RELEASE_READS = (
    "serve.model",
    "serve.require_evaluation",
    "serve.gate",
    "serve.engine",  # every backend's start-up timeout and served context; vLLM's engine
    "serve.speculative",
    "serve.adapters",
    "serve.backend",
    "serve.smoke_prompt",
    "serve.smoke_max_tokens",
    "serve.slo",
)
RELEASE_STEPS = [
    Step(
        RELEASE,
        1,
        "Start the chosen model on its backend's server beside the running one, smoke-test, SLO-check, promote",
        reads=_reads,
        upstream=_upstream,
        finalize=_finalize,
        retries=0,
        # every registered backend's modules: which one runs is a read (serve.backend)
        code=(
            "serving.release",
            "lmforge.inference.vllm_server",
            "serving.slo",
            "serving.adapters",
            *(m for b in backends.backends().values() for m in b.code),
        ),
        libraries=tuple(dict.fromkeys(("openai", *(lib for b in backends.backends().values() for lib in b.libraries)))),
    ),
]
