"""The quantization gate: is each checkpoint as good as the model it came from, measured the same way?

Both the unquantized model and every checkpoint are evaluated on the vLLM backend (how they
would be served) on the same tasks and items, through the evaluation stage's cached metric runs.
Per task, the primary metric is compared on the shared items with a paired bootstrap:

- higher-is-better metrics fail when they drop by more than `gate.max_drop` (absolute), or,
  with `not_significantly_worse`, when the paired 95% interval of the change lies below zero;
- perplexities fail when quantized / unquantized exceeds `gate.max_perplexity_ratio`.

A checkpoint that fails any task is not eligible; the smallest eligible checkpoint (bytes on
disk) is chosen; with none eligible, serving falls back to the unquantized model and says so.
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
    identity: dict[str, Any],
    work_dir: Path,
    base: tuple[str, Path, str],
    checkpoints: dict[str, tuple[Path, str]],
) -> dict[str, list[dict[str, Any]]]:
    """Evaluate the unquantized model and each checkpoint on vLLM; {scheme: per-task comparison rows}."""
    from evaluation.runs import evaluate_model

    role, base_dir, base_digest = base

    def measure(role_: str, model_dir: Path, model_digest: str, where: Path) -> dict[str, tuple[str, float, Any]]:
        return _per_task(
            evaluate_model(config, workspace, tasks, identity, model_dir, model_digest, SERVED, role_, where)
        )

    # on CPU the unquantized model and the checkpoints are measured side by side (a server each; a vLLM
    # start is mostly single-threaded); on GPUs one at a time, as each server claims
    # engine.gpu_memory_utilization of the same free GPUs. In this step's context: its lock and deadline.
    with ThreadPoolExecutor(max_workers=1 if _cuda() else len(checkpoints) + 1) as pool:
        unquantized = pool.submit(
            contextvars.copy_context().run, measure, role, base_dir, base_digest, work_dir / "unquantized"
        )
        futures = {
            scheme: pool.submit(
                contextvars.copy_context().run, measure, f"{role}-{scheme}", model_dir, digest, work_dir / scheme
            )
            for scheme, (model_dir, digest) in checkpoints.items()
        }
        reference = unquantized.result()
        measured = {scheme: future.result() for scheme, future in futures.items()}
    comparisons = {}
    for scheme, results in measured.items():
        rows = []
        for task, (metric, value, items) in results.items():
            _, base_value, base_items = reference[task]
            rows.append(comparison_row(task, metric, base_value, value, base_items, items))
        comparisons[scheme] = rows
    return comparisons


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
) -> dict[str, Any]:
    """The verdict: per scheme eligible or not (and why), and the checkpoint to serve.

    A scheme in `unservable` (vLLM cannot serve it on this host) is ineligible with that reason."""
    unservable = unservable or {}
    schemes = {}
    for scheme, rep in reports.items():
        rows = comparisons.get(scheme, [])
        failed = [unservable[scheme]] if scheme in unservable else failures(gate, rows) if gate.enabled else []
        schemes[scheme] = {
            "eligible": not failed,
            "failures": failed,
            "bytes": rep["bytes"],
            "compression_ratio": rep["compression_ratio"],
            "bits_per_parameter": rep["bits_per_parameter"],
            "model_dir": rep["model_dir"],
            "step": f"quantize/{scheme}",
            "key": sources[scheme]["key"],
            "digest": sources[scheme]["digest"],
            "comparisons": rows,
            "measured": gate.enabled and scheme not in unservable,
        }
    eligible = sorted((s for s, o in schemes.items() if o["eligible"]), key=lambda s: schemes[s]["bytes"])
    chosen = eligible[0] if eligible else None
    if chosen:
        decision = (
            f"quantization gate: {chosen} ships ({schemes[chosen]['compression_ratio']:.2f}x of bf16"
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
        "decision": decision,
        "gate": {"max_drop": gate.max_drop, "max_perplexity_ratio": gate.max_perplexity_ratio, "enabled": gate.enabled},
    }
