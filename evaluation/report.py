"""Tables and the comparison card of one evaluation: every model x task, deltas with intervals.

Per model and task: the primary metric with lm-eval's stderr and a 95% bootstrap interval over
items, the same metric on the clean subset (items no training source of that model's lineage
contained), and the contaminated share. Across the lineage (pretrained -> SFT -> DPO, and the
quantized model when the quantization stage adds it), each step is compared with the one before
it on their shared items with a paired bootstrap, so a change is reported as better, worse, or
no significant change. hf and vLLM results of the same model are checked against each other
within the configured tolerance (for item-averaged metrics at least two items' worth: vLLM on
CPU runs bf16 and hf fp32, so an item whose choices are nearly tied may go either way).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from evaluation import stats
from evaluation.backends import BACKENDS, REFERENCE, SERVED
from lmforge.engine.registry import role_names, roles
from lmforge.jsonl import read_jsonl


def sources_seen(model: str) -> set[str]:
    """What `model` trained on, as far as lmforge knows (`Role.saw`): a base model the user brings was
    trained on data nobody here has seen, so none of its items count as contaminated by the lineage."""
    return next((set(r.saw) for r in roles() if r.name == model), set())


BASE_UNKNOWN = (
    "The base model's own training data is unknown to lmforge and was not checked: a high base score may "
    "come from benchmark items in its pretraining data. The checks below cover every source this lineage "
    "trained on (curated documents, SFT and DPO data)."
)


def read_samples(result_dir: Path) -> list[dict[str, Any]]:
    return list(read_jsonl(result_dir / "samples.jsonl"))


def contaminated_ids(contamination: list[dict[str, Any]], task: str, sources: set[str]) -> set[str]:
    return {r["doc_id"] for r in contamination if r["task"] == task and set(r["sources"]) & sources}


def metric_row(
    model: str, backend: str, task: str, result: dict[str, Any], samples: list[dict[str, Any]], dirty: set[str]
) -> dict[str, Any]:
    metric = stats.PRIMARY.get(task) or result["metrics"][0]
    key = next(k for k in result["results"] if k.startswith(f"{metric},") and "_stderr" not in k)
    values = stats.item_values(samples, metric)
    estimate, low, high = stats.bootstrap(metric, list(values.values()))
    clean = [v for i, v in values.items() if i not in dirty]
    stderr = result["results"].get(key.replace(",", "_stderr,", 1))
    return {
        "model": model,
        "backend": backend,
        "task": task,
        "metric": metric,
        "value": result["results"][key],
        "stderr": stderr if isinstance(stderr, (int, float)) else None,
        "ci_low": low,
        "ci_high": high,
        "items": len(values),
        "clean_value": stats.aggregate(metric, clean),
        "clean_items": len(clean),
        "contaminated_share": round(len(dirty & set(values)) / max(len(values), 1), 4),
        "bootstrap_estimate": estimate,
        "by_length": stats.by_length(metric, values),  # the long-context tasks: [[tokens, value], ...]
    }


def comparisons(per_model: dict[str, dict[str, list[dict[str, Any]]]], backend: str) -> list[dict[str, Any]]:
    """Each model against the one before it in the lineage, per task, on shared items."""
    rows = []
    order = role_names()  # the lineage's models in the order they are made
    present = [m for m in order if m in per_model] + [m for m in per_model if m not in order]
    for before, after in zip(present, present[1:]):
        for task, samples_after in per_model[after].items():
            if task not in per_model[before]:
                continue
            metric = stats.PRIMARY.get(task) or next(iter(samples_after[0]["metrics"]), None) if samples_after else None
            if metric is None:
                continue
            result = stats.paired(
                metric, stats.item_values(per_model[before][task], metric), stats.item_values(samples_after, metric)
            )
            rows.append({"backend": backend, "task": task, "metric": metric, "from": before, "to": after, **result})
    return rows


def backend_agreement(rows: list[dict[str, Any]], tolerance: dict[str, float]) -> list[dict[str, Any]]:
    by_key = {(r["model"], r["task"], r["backend"]): r for r in rows}
    out = []
    for (model, task, backend), row in by_key.items():
        other = by_key.get((model, task, SERVED))
        if backend != REFERENCE or other is None:
            continue
        metric = row["metric"]
        diff = abs(row["value"] - other["value"])
        if metric in stats.RATIO_METRICS:
            diff = diff / max(abs(row["value"]), 1e-12)
        limit = tolerance.get(metric, 0.02)
        if metric not in stats.RATIO_METRICS:  # vLLM on CPU computes in bf16, hf in fp32: near-ties may flip
            limit = max(limit, 2 / max(row["items"], 1))  # two items' worth, on small item sets
        out.append(
            {
                "model": model,
                "task": task,
                "metric": metric,
                REFERENCE: row["value"],
                SERVED: other["value"],
                "difference": round(diff, 6),
                "relative": metric in stats.RATIO_METRICS,
                "tolerance": limit,
                "agree": diff <= limit,
            }
        )
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def card(
    rows: list[dict[str, Any]],
    deltas: list[dict[str, Any]],
    agreement: list[dict[str, Any]],
    contamination_summary: list[dict[str, Any]],
    flagged: list[dict[str, Any]] | None = None,
) -> str:
    lines = [
        "# lmforge evaluation",
        "",
        "## Results (95% bootstrap intervals over items)",
        "",
        "| model | backend | task | metric | value | 95% CI | clean subset | contaminated |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['backend']} | {r['task']} | {r['metric']} | {_fmt(r['value'])} | "
            f"[{_fmt(r['ci_low'])}, {_fmt(r['ci_high'])}] | {_fmt(r['clean_value'])} ({r['clean_items']}) | "
            f"{r['contaminated_share']:.1%} |"
        )
    lengths = [r for r in rows if r.get("by_length")]
    if lengths:
        lines += ["", "## By context length (tokens)", "", "| model | backend | task | metric | by length |"]
        lines.append("|---|---|---|---|---|")
        for r in lengths:
            cells = ", ".join(f"{length}: {_fmt(v)}" for length, v in r["by_length"])
            lines.append(f"| {r['model']} | {r['backend']} | {r['task']} | {r['metric']} | {cells} |")
    lines += [
        "",
        "## Along the lineage (paired bootstrap on shared items)",
        "",
        "| backend | task | metric | change | delta | 95% CI | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for d in deltas:
        lines.append(
            f"| {d['backend']} | {d['task']} | {d['metric']} | {d['from']} -> {d['to']} | {_fmt(d['delta'])} | "
            f"[{_fmt(d['low'])}, {_fmt(d['high'])}] | {d.get('verdict', '')} |"
        )
    if agreement:
        lines += [
            "",
            f"## {BACKENDS[REFERENCE].label} vs {BACKENDS[SERVED].label}",
            "",
            f"| model | task | metric | {BACKENDS[REFERENCE].label} | {BACKENDS[SERVED].label} | difference | within tolerance |",
            "|---|---|---|---|---|---|---|",
        ]
        for a in agreement:
            lines.append(
                f"| {a['model']} | {a['task']} | {a['metric']} | {_fmt(a[REFERENCE])} | {_fmt(a[SERVED])} | "
                f"{_fmt(a['difference'])}{' (rel.)' if a['relative'] else ''} | {'yes' if a['agree'] else 'NO'} |"
            )
    if contamination_summary:
        lines += ["", "## Contamination", ""]
        if any(r["model"] == "base" for r in rows):
            lines += [BASE_UNKNOWN, ""]
        lines += [
            f"Rule (curation's decontamination applies the same): {contamination_summary[0].get('rule', '-')}.",
            "",
            "| task | items | contaminated | by path | share | worst source |",
            "|---|---|---|---|---|---|",
        ]
        for c in contamination_summary:
            paths = ", ".join(f"{p} {n}" for p, n in c.get("by_path", {}).items()) or "-"
            lines.append(
                f"| {c['task']} | {c['items']} | {c['contaminated']} | {paths} | {c['share']:.1%} | "
                f"{c['worst_source'] or '-'} |"
            )
    if flagged:
        lines += [
            "",
            "### Flagged items",
            "",
            "| task | item | path | n-gram overlap | similarity | source | training document | span |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in flagged:
            span = str(r.get("span") or "")[:80].replace("|", "\\|")
            lines.append(
                f"| {r['task']} | {r['doc_id']} | {r.get('path') or '-'} | {r['overlap']:.2f} | "
                f"{r.get('similarity') or 0.0:.2f} | {r['source']} | {r['train_doc_id']} | {span} |"
            )
    return "\n".join(lines) + "\n"
