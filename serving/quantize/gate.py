"""The quantization gate: is each checkpoint as good as the model it came from, measured the same way?

Both the unquantized model and every checkpoint are evaluated on the vLLM backend (how they
would be served) on the same tasks and items, through the evaluation stage's cached metric runs.
Per task, the primary metric is compared on the shared items with a paired bootstrap:

- higher-is-better metrics fail when they drop by more than `gate.max_drop` (absolute), or,
  with `not_significantly_worse`, when the paired 95% interval of the change lies below zero;
- perplexities fail when quantized / unquantized exceeds `gate.max_perplexity_ratio`.

A checkpoint vLLM cannot serve on this host (`serving.quantize.schemes.serving_problem`) is
evaluated in transformers instead (compressed-tensors decompresses it; the unquantized model is
measured there too, so each comparison is like for like): its quality is known, but it is not
eligible to ship from here.

A checkpoint that fails any task is not eligible. `gate.choose` picks among the eligible ones:
`smallest` (bytes on disk) or `fastest` (vLLM output tokens/s, measured by `serving_speed` when
`gate.speed_requests` > 0). With none eligible, serving falls back to the unquantized model and says so.
"""

from __future__ import annotations

import contextvars
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from evaluation import report, stats
from evaluation.backends import SERVED
from lmforge.configbase import ConfigView
from serving.quantize.config import NOT_SIGNIFICANTLY_WORSE


def _per_task(directories: dict[str, Path]) -> dict[str, tuple[str, float, dict[str, Any]]]:
    """{task: (primary metric, value, per-item values)} of one model's results."""
    out = {}
    for task, directory in directories.items():
        result = json.loads((directory / "result.json").read_text())
        metric = stats.PRIMARY.get(task) or result["metrics"][0]
        key = next(k for k in result["results"] if k.startswith(f"{metric},") and "_stderr" not in k)
        out[task] = (metric, float(result["results"][key]), stats.item_values(report.read_samples(directory), metric))
    return out


def evaluate_all(
    config: ConfigView,
    workspace: Path,
    tasks: dict[str, Any],
    identities: dict[str, dict[str, Any]],
    work_dir: Path,
    base: tuple[str, Path, str],
    checkpoints: dict[str, tuple[Path, str, str]],
) -> dict[str, list[dict[str, Any]]]:
    """Evaluate each checkpoint on its backend (vLLM where it can be served here, else transformers)
    and the unquantized model on each backend used; {scheme: per-task comparison rows}.

    `checkpoints` is {scheme: (model dir, digest, backend)}; `identities` {backend: run identity}."""
    from evaluation.runs import evaluate_model

    role, base_dir, base_digest = base

    def measure(
        role_: str, model_dir: Path, model_digest: str, backend: str, where: Path
    ) -> dict[str, tuple[str, float, Any]]:
        return _per_task(
            evaluate_model(
                config, workspace, tasks, identities[backend], model_dir, model_digest, backend, role_, where
            )
        )

    used = sorted({backend for _, _, backend in checkpoints.values()})
    # on CPU the unquantized model and the checkpoints are measured side by side (a server each; a vLLM
    # start is mostly single-threaded); on GPUs one at a time, as each server claims
    # engine.gpu_memory_utilization of the same free GPUs. In this step's context: its lock and deadline.
    with ThreadPoolExecutor(max_workers=1 if _cuda() else len(checkpoints) + len(used)) as pool:
        unquantized = {
            backend: pool.submit(
                contextvars.copy_context().run,
                measure,
                role,
                base_dir,
                base_digest,
                backend,
                work_dir / ("unquantized" if backend == SERVED else f"unquantized-{backend}"),
            )
            for backend in used
        }
        futures = {
            scheme: pool.submit(
                contextvars.copy_context().run,
                measure,
                f"{role}-{scheme}",
                model_dir,
                digest,
                backend,
                work_dir / scheme,
            )
            for scheme, (model_dir, digest, backend) in checkpoints.items()
        }
        reference = {backend: future.result() for backend, future in unquantized.items()}
        measured = {scheme: future.result() for scheme, future in futures.items()}
    comparisons = {}
    for scheme, results in measured.items():
        rows = []
        for task, (metric, value, items) in results.items():
            _, base_value, base_items = reference[checkpoints[scheme][2]][task]
            rows.append(
                {
                    **comparison_row(task, metric, base_value, value, base_items, items),
                    "backend": checkpoints[scheme][2],
                }
            )
        comparisons[scheme] = rows
    return comparisons


def serving_speed(config: ConfigView, models: dict[str, Path], work_dir: Path, requests: int) -> dict[str, float]:
    """Output tokens/s of each model served alone by vLLM ({name: model dir}), one after another so that
    none shares the machine with another: `requests` streaming completions of 32 tokens from 4 clients,
    the SLO benchmark's `distinct` workload (serving/slo.py)."""
    from evaluation.runs import engine_config
    from lmforge.inference.vllm_server import TemporaryServer
    from serving import slo

    engine, speeds = engine_config(config), {}
    clients, max_tokens = min(4, requests), 32
    for name, model_dir in models.items():
        words = slo.fit_prefix_words(model_dir, max_tokens, 32, engine.max_model_len)
        with TemporaryServer(model_dir, engine, work_dir / f"speed-{name}", name) as server:
            rows = slo.run(
                server.base_url,
                server.api_key,
                name,
                [clients],
                max(1, requests // clients),
                max_tokens,
                words,
                workloads=("distinct",),
            )
        speeds[name] = round(float(rows[0]["output_tokens_per_s"]), 2)
    return speeds


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def comparison_row(
    task: str, metric: str, base_value: float, value: float, base_items: dict[str, Any], items: dict[str, Any]
) -> dict[str, Any]:
    """One metric of one checkpoint against the unquantized model: the delta on the shared items with its
    paired bootstrap interval (and the ratio, for a perplexity); what `failures` judges."""
    paired = stats.paired(metric, base_items, items)
    row = {
        "task": task,
        "metric": metric,
        "unquantized": base_value,
        "quantized": value,
        "delta": paired["delta"],
        "ci_low": paired["low"],
        "ci_high": paired["high"],
        "verdict": paired.get("verdict", ""),
        "items": paired["items"],
    }
    if metric in stats.RATIO_METRICS:
        row["ratio"] = value / base_value if base_value else math.inf
    return row


def failures(gate: Any, rows: list[dict[str, Any]]) -> list[str]:
    """What makes one checkpoint ineligible, one phrase per failing metric (empty: it passes)."""
    found = []
    for row in rows:
        name = f"{row['task']} {row['metric']}"
        if row["metric"] in stats.RATIO_METRICS:
            if row["ratio"] > gate.max_perplexity_ratio:
                found.append(
                    f"{name} rose {row['ratio']:.3f}x ({row['unquantized']:.4g} -> {row['quantized']:.4g}; "
                    f"limit {gate.max_perplexity_ratio}x)"
                )
            continue
        limit = gate.limit(row["metric"])
        drop = -row["delta"]
        if limit == NOT_SIGNIFICANTLY_WORSE:
            if row["verdict"] == "worse":
                found.append(
                    f"{name} is significantly worse: {row['delta']:+.3f}, 95% CI "
                    f"[{row['ci_low']:+.3f}, {row['ci_high']:+.3f}]"
                )
        elif limit is not None and drop > float(limit) + 1e-9:
            found.append(
                f"{name} dropped {drop:.3f} ({row['unquantized']:.3f} -> {row['quantized']:.3f}; limit {float(limit):.3f})"
            )
    return found


def decide(
    gate: Any,
    role: str,
    reports: dict[str, dict[str, Any]],
    comparisons: dict[str, list[dict[str, Any]]],
    sources: dict[str, dict[str, str]],
    unservable: dict[str, str] | None = None,
    speeds: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The verdict: per scheme eligible or not (and why), and the checkpoint to serve by `gate.choose`.

    A scheme in `unservable` (vLLM cannot serve it on this host) is measured where it could be (its
    comparisons, from transformers) but is ineligible here, with that reason beside any quality failure.
    `speeds` holds vLLM's output tokens/s of the unquantized model (under `role`) and of the served ones."""
    unservable, speeds = unservable or {}, speeds or {}
    schemes = {}
    for scheme, rep in reports.items():
        rows = comparisons.get(scheme, [])
        quality = failures(gate, rows) if gate.enabled else []
        failed = quality + ([unservable[scheme]] if scheme in unservable else [])
        schemes[scheme] = {
            "eligible": not failed,
            "failures": failed,
            "quality_passed": not quality if gate.enabled and rows else None,
            "servable_here": scheme not in unservable,
            "bytes": rep["bytes"],
            "compression_ratio": rep["compression_ratio"],
            "bits_per_parameter": rep["bits_per_parameter"],
            "model_dir": rep["model_dir"],
            "step": f"quantize/{scheme}",
            "key": sources[scheme]["key"],
            "digest": sources[scheme]["digest"],
            "comparisons": rows,
            "measured": bool(gate.enabled and rows),
            "measured_on": rows[0].get("backend", SERVED) if rows else None,
            "tokens_per_s": speeds.get(scheme),
            "speedup": round(speeds[scheme] / speeds[role], 3) if scheme in speeds and speeds.get(role) else None,
        }
    eligible = [s for s, o in schemes.items() if o["eligible"]]
    rule = getattr(gate, "choose", "smallest")
    if rule == "fastest" and eligible and all(schemes[s]["tokens_per_s"] for s in eligible):
        fastest = max(eligible, key=lambda s: (schemes[s]["tokens_per_s"], -schemes[s]["bytes"]))
        chosen: str | None = fastest
        why = f"the fastest that passes: {schemes[fastest]['tokens_per_s']:.0f} output tokens/s"
    else:
        chosen = min(eligible, key=lambda s: schemes[s]["bytes"]) if eligible else None
        why = "the smallest that passes" + (" (fastest asked, speed not measured)" if rule == "fastest" else "")
    if chosen:
        decision = (
            f"quantization gate: {chosen} ships ({schemes[chosen]['compression_ratio']:.2f}x of bf16, {why}"
            + (", every task within its limits" if gate.enabled else ", gate disabled: not measured")
            + ")"
        )
    else:
        decision = (
            f"quantization gate: no checkpoint passed ({', '.join(sorted(schemes))}); serving falls back to "
            f"the unquantized {role} model"
        )
    return {
        "model": role,
        "schemes": schemes,
        "chosen": chosen,
        "rule": rule,
        "decision": decision,
        "unquantized_tokens_per_s": speeds.get(role),
        "gate": {
            "max_drop": gate.max_drop,
            "max_perplexity_ratio": gate.max_perplexity_ratio,
            "enabled": gate.enabled,
            "choose": rule,
        },
    }
