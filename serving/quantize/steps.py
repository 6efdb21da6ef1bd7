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
from pathlib import Path
from typing import Any

from lmforge.configbase import pick
from lmforge.errors import ConfigError, DeterministicError, RetryableError
from lmforge.graph import Step, StepContext
from lmforge.hashing import atomic_write_json, atomic_write_text
from lmforge.stage import DOCUMENTS, TOKENIZER, Maybe, Product, hf_model
from serving.quantize.schemes import SCHEMES

log = logging.getLogger(__name__)
CALIBRATION, GATE = "quantize/calibration", "quantize/gate"
CHAT_DATA, EVAL_TASKS, QUANT_VERDICT = Product("chat-data"), Product("eval-tasks"), Product("quant-verdict")
ROLES = ("dpo", "sft", "pretrained")
REPO_ROOT = Path(__file__).resolve().parents[2]
QUANT_LOCK = REPO_ROOT / "requirements" / "quant.lock"


def _graph():  # type: ignore[no-untyped-def]
    from lmforge.executor import graph

    return graph()


def model_role(config: Any) -> str:
    """The model this lineage quantizes: `quantize.model`, or the last aligned one that exists."""
    wanted = ROLES if config.quantize.model == "auto" else (config.quantize.model,)
    for role in wanted:
        if _graph().has(hf_model(role), config):
            return role
    raise ConfigError(f"quantize.model={config.quantize.model}: no such model in this lineage "
                      "(is the stage that makes it switched off?)")


def quantized(scheme: str) -> Product:
    return Product("quantized-model", scheme)


def step_name(scheme: str) -> str:
    return f"quantize/{scheme}"


# -- calibration -----------------------------------------------------------------------------------

def _uses_chats(config: Any) -> bool:
    return model_role(config) in ("sft", "dpo") and config.quantize.calibration.sft_fraction > 0


def _calibration_identity(config: Any) -> dict[str, Any]:
    ident = pick(config, "quantize.calibration.num_samples", "quantize.calibration.seed",
                 "quantize.calibration.max_chars", "quantize.calibration.sft_fraction")
    ident["chat_model"] = _uses_chats(config)
    return ident


def _calibration_finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
    from serving.quantize.calibration import draw

    cfg = ctx.config.quantize.calibration
    chats = ctx.path(CHAT_DATA) / "train.jsonl" if ctx.has(CHAT_DATA) and _uses_chats(ctx.config) else None
    samples = draw(ctx.path(DOCUMENTS), chats, ctx.path(TOKENIZER), cfg.num_samples, cfg.sft_fraction,
                   cfg.seed, cfg.max_chars)
    atomic_write_text(ctx.out_dir / "calibration.jsonl", "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples))
    by_source: dict[str, int] = {}
    for sample in samples:
        by_source[sample["source"]] = by_source.get(sample["source"], 0) + 1
    return {"counts": {"samples": len(samples), **by_source},
            "extra": {"ids": {source: [s["id"] for s in samples if s["source"] == source] for source in by_source}}}


# -- one checkpoint per scheme ---------------------------------------------------------------------

def quantizer_python(config: Any) -> str:
    """The quantization environment's Python (llmcompressor), for calibrated schemes."""
    path = Path(config.quantize.python) if config.quantize.python else REPO_ROOT / ".venv-quant" / "bin" / "python"
    if not path.exists():
        raise ConfigError(f"calibrated quantization runs llmcompressor in its own environment, and {path} does not exist: "
                          "run `bash scripts/setup.sh` (it creates .venv-quant), set quantize.python, or set "
                          "quantize.calibration.enabled=false for round-to-nearest")
    return str(path)


def _pinned(distribution: str) -> str:
    """The version the quantization environment's lock pins (what `scripts/setup.sh` installs there)."""
    for line in QUANT_LOCK.read_text().splitlines() if QUANT_LOCK.exists() else []:
        if line.lower().startswith(f"{distribution}=="):
            return line.split("==", 1)[1].strip()
    return "unpinned"


def _scheme_identity(scheme: str):  # type: ignore[no-untyped-def]
    def identity(config: Any) -> dict[str, Any]:
        from lmforge.codeprint import library_version

        q = config.quantize
        fields = ["quantize.fault"] + (["quantize.group_size"] if SCHEMES[scheme].grouped else [])
        ident = pick(config, *fields)
        ident["scheme"] = scheme
        ident["model"] = model_role(config)
        if q.calibration.enabled:
            ident["method"] = "gptq+smoothquant" if SCHEMES[scheme].activation_bits == 8 else "gptq"
            ident["settings"] = pick(config, "quantize.calibration.max_seq_len", "quantize.calibration.dampening_frac",
                                     *(["quantize.calibration.smoothing_strength"] if SCHEMES[scheme].activation_bits == 8 else []))
            ident["quantizer"] = {"llmcompressor": _pinned("llmcompressor"), "compressed-tensors": _pinned("compressed-tensors")}
        else:
            ident["method"] = "rtn"
            ident["quantizer"] = {"compressed-tensors": library_version("compressed-tensors")}
        return ident

    return identity


def _scheme_upstream(config: Any) -> tuple[Any, ...]:
    model = hf_model(model_role(config))
    return (model, CALIBRATION) if config.quantize.calibration.enabled else (model,)


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _quantize(ctx: StepContext, scheme: str, model_dir: Path) -> dict[str, Any]:
    """Run the quantizer process; returns its result record."""
    import sys

    from lmforge import launcher

    q = ctx.config.quantize
    calibrated = q.calibration.enabled
    spec = {"scheme": scheme, "method": "gptq" if calibrated else "rtn", "group_size": q.group_size,
            "model_dir": str(model_dir), "out_dir": str(ctx.out_dir), "seed": q.calibration.seed,
            "max_seq_len": q.calibration.max_seq_len, "smoothing_strength": q.calibration.smoothing_strength,
            "dampening_frac": q.calibration.dampening_frac, "break_scale_factor": q.fault.break_scale_factor,
            "calibration_file": str(ctx.upstream_dir(CALIBRATION) / "calibration.jsonl") if calibrated else None}
    spec_path = ctx.out_dir / "quantize_spec.json"
    atomic_write_json(spec_path, spec)
    python = quantizer_python(ctx.config) if calibrated else sys.executable
    code, tail = launcher.run([python, "-m", "serving.quantize.entry", "--spec", str(spec_path)],
                              logging.getLogger("serving.quantize.entry"), tail_lines=6, what=f"the {scheme} quantizer",
                              noise=("it/s]", "Setting accelerator to CPU"))
    if code == 0:
        return json.loads((ctx.out_dir / "quantize_result.json").read_text())
    if "quantize.group_size" in tail:
        raise ConfigError(tail.split(" | ")[-1])
    if code >= 128:  # killed by a signal: quantization is short, the retry starts it again from scratch
        raise RetryableError(f"the {scheme} quantizer was killed (exit code {code}); last output: {tail}")
    raise DeterministicError(f"the {scheme} quantizer failed (exit code {code}): {tail}")


def _scheme_step(scheme: str) -> Step:
    def finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
        from serving.quantize.config import cpu_refusal
        from serving.quantize.report import measure

        if not _on_gpu() and (refusal := cpu_refusal([scheme])):
            raise ConfigError(refusal)
        role = model_role(ctx.config)
        model_dir = ctx.path(hf_model(role))
        result = _quantize(ctx, scheme, model_dir)
        report = {"scheme": scheme, "description": SCHEMES[scheme].describe(ctx.config.quantize.group_size),
                  "model": role, **result, **measure(model_dir, ctx.out_dir / "model")}
        if ctx.config.quantize.calibration.enabled:
            report["calibration"] = {"step": CALIBRATION, "key": ctx.upstream[CALIBRATION]["key"],
                                     "ids": ctx.upstream[CALIBRATION]["extra"]["ids"]}
        atomic_write_json(ctx.out_dir / "report.json", report)
        log.info("%s: %.2fx of bf16 (%.2f bits/parameter), mean layer error %.4f, quantized in %.1fs",
                 scheme, report["compression_ratio"], report["bits_per_parameter"], report["mean_layer_error"],
                 report["quantize_seconds"])
        return {"counts": {"quantized_layers": report["quantized_layers"], "calibration_samples": report["calibration_samples"]},
                "metrics": {k: report[k] for k in ("bytes", "bf16_bytes", "compression_ratio", "bits_per_parameter",
                                                   "mean_layer_error", "max_layer_error", "quantize_seconds")},
                "extra": {"scheme": scheme, "model": role, "model_dir": str(ctx.out_dir / "model"),
                          "method": result["method"]}}

    return Step(step_name(scheme), 1, f"{scheme}: {SCHEMES[scheme].describe(128)}, compressed-tensors format",
                identity=_scheme_identity(scheme), upstream=_scheme_upstream, finalize=finalize,
                enabled=lambda c: c.quantize.enabled and scheme in c.quantize.schemes,
                provides={quantized(scheme): "model"}, digest_paths=("model/",), retries=1,
                code=("serving.quantize.entry", "serving.quantize.schemes", "serving.quantize.report"),
                libraries=("compressed-tensors", "transformers", "torch"))


SCHEME_STEPS = [_scheme_step(name) for name in SCHEMES]


# -- the gate ----------------------------------------------------------------------------------------

def _gate_identity(config: Any) -> dict[str, Any]:
    from evaluation.runs import run_identity

    ident = pick(config, "quantize.gate")
    ident["run"] = run_identity(config, "vllm") if config.quantize.gate.enabled else None
    return ident


def _gate_upstream(config: Any) -> tuple[Any, ...]:
    schemes = [s.name for s in SCHEME_STEPS if s.enabled(config)]
    return (EVAL_TASKS, hf_model(model_role(config)), *schemes) if config.quantize.gate.enabled else \
        (hf_model(model_role(config)), *schemes)


def _gate_finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
    from serving.quantize.gate import decide, evaluate_all

    cfg = ctx.config.quantize
    role = model_role(ctx.config)
    checkpoints = {ctx.upstream[name]["extra"]["scheme"]: ctx.upstream[name] for name in ctx.upstream
                   if name.startswith("quantize/") and name != CALIBRATION}
    reports = {s: {**json.loads((Path(m["dir"]) / "report.json").read_text()), "model_dir": m["extra"]["model_dir"]}
               for s, m in checkpoints.items()}
    comparisons: dict[str, list[dict[str, Any]]] = {}
    if cfg.gate.enabled:
        tasks = ctx.manifest(EVAL_TASKS)["extra"]["tasks"]
        wanted = cfg.gate.tasks or ctx.config.evaluate.tasks
        tasks = {name: t for name, t in tasks.items() if name in wanted}
        model = hf_model(role)
        comparisons = evaluate_all(ctx.config, ctx.workspace, tasks, ctx.identity["run"], ctx.out_dir,
                                   (role, ctx.path(model), ctx.manifest(model)["digest"]),
                                   {s: (Path(m["extra"]["model_dir"]), m["digest"]) for s, m in checkpoints.items()})
    verdict = decide(cfg.gate, role, reports, comparisons, {s: {"key": m["key"], "digest": m["digest"]} for s, m in checkpoints.items()})
    atomic_write_json(ctx.out_dir / "verdict.json", verdict)
    atomic_write_json(ctx.out_dir / "report.json", {"verdict": verdict, "checkpoints": reports})
    for scheme, outcome in verdict["schemes"].items():
        if not outcome["eligible"]:
            log.warning("%s fails the quantization gate: %s; not eligible for serving", scheme, "; ".join(outcome["failures"]))
    log.info("%s", verdict["decision"])
    return {"counts": {"schemes": len(checkpoints), "eligible": sum(o["eligible"] for o in verdict["schemes"].values())},
            "extra": {"chosen": verdict["chosen"], "decision": verdict["decision"]}}


def _gate_progress(ctx: StepContext) -> tuple[float, float] | None:
    from evaluation.runs import progress

    return progress(ctx.out_dir)


QUANTIZE_STEPS = [
    Step(CALIBRATION, 1, "Calibration samples drawn by seed from the curated documents and the SFT data",
         identity=_calibration_identity, upstream=lambda c: (DOCUMENTS, TOKENIZER, Maybe(CHAT_DATA)),
         finalize=_calibration_finalize, enabled=lambda c: c.quantize.enabled and c.quantize.calibration.enabled,
         code=("serving.quantize.calibration",), libraries=("transformers",)),
    *SCHEME_STEPS,
    Step(GATE, 1, "Every checkpoint evaluated on vLLM against the unquantized model; the smallest that passes ships",
         identity=_gate_identity, upstream=_gate_upstream, finalize=_gate_finalize,
         enabled=lambda c: c.quantize.enabled and bool(c.quantize.schemes), provides={QUANT_VERDICT: ""},
         progress=lambda ctx: _gate_progress(ctx),
         code=("serving.quantize.gate", "evaluation.runs", "evaluation.stats"), libraries=("lm-eval",)),
]
