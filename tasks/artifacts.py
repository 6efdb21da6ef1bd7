"""Prefect artifacts with stable keys, so each key builds a history in the UI.

- `<stage>-steps`: one row per step (cached or computed, seconds, key, output directory);
- `curation-stats`: input, quarantined, removed per reason, kept, tokens;
- `pretrain-summary` and `pretrain-anomalies`: final metrics and every rollback;
- `pipeline-lineage`: the chain of content addresses from raw input to model.
"""

from __future__ import annotations

from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact


def _status(manifest: dict[str, Any], status: str) -> str:
    return f"computed in {manifest['timings']['seconds']:.1f}s" if status == "computed" else status


def publish_stage(stage: str, manifests: dict[str, dict[str, Any]], status: dict[str, str]) -> None:
    rows = [{"step": name, "status": _status(m, status[name]), "key": m["key"], "output": m["dir"]}
            for name, m in manifests.items() if m["stage"] == stage]
    if not rows:
        return
    create_table_artifact(key=f"{stage}-steps", table=rows, description=f"lmforge {stage}: steps and cache status")
    lines = [f"# {stage}", "", "| step | status | output |", "|---|---|---|"]
    lines += [f"| `{r['step']}` | {r['status']} | `{r['output']}` |" for r in rows]
    create_markdown_artifact(key=f"{stage}-card", markdown="\n".join(lines), description=f"lmforge {stage} outputs")


def curation_rows(manifests: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    select = manifests["curate/select"]["counts"]
    rows = [{"metric": "input records", "value": select["input"]},
            {"metric": "quarantined (malformed)", "value": select["quarantined"]}]
    if "curate/ingest" in manifests:
        rows.append({"metric": "normalized (text changed)", "value": manifests["curate/ingest"]["counts"].get("normalized", 0)})
    rows += [{"metric": f"removed: {reason}", "value": n} for reason, n in select["removed"].items()]
    rows.append({"metric": "kept", "value": select["kept"]})
    rows += [{"metric": f"PII redacted: {kind}", "value": n} for kind, n in select["pii"].items()]
    if "curate/pack" in manifests:
        pack = manifests["curate/pack"]
        rows += [{"metric": "train tokens", "value": pack["counts"]["train_tokens"]},
                 {"metric": "validation tokens", "value": pack["counts"]["val_tokens"]},
                 {"metric": "unigram entropy (nats)", "value": round(pack["metrics"]["unigram_entropy_nats"], 3)}]
    return rows


def publish_curation(manifests: dict[str, dict[str, Any]]) -> None:
    if "curate/select" in manifests:
        create_table_artifact(key="curation-stats", table=curation_rows(manifests),
                              description="input = kept + removed + quarantined")


def publish_pretrain(manifest: dict[str, Any]) -> None:
    metrics = manifest["metrics"]
    rows = [{"metric": k, "value": v} for k, v in metrics.items() if isinstance(v, (int, float, str))]
    create_table_artifact(key="pretrain-summary", table=rows, description="final training metrics")
    publish_anomalies(manifest["extra"].get("anomalies", []))


def publish_anomalies(rows: list[dict[str, Any]], diverged: bool = False) -> None:
    if rows:
        create_table_artifact(key="pretrain-anomalies", table=rows,
                              description="training stopped: too many anomalies in a row" if diverged else
                              "loss spikes / non-finite losses: rolled back and skipped")


def publish_lineage(manifests: dict[str, dict[str, Any]], status: dict[str, str]) -> str:
    lines = ["# lmforge lineage", "", "| step | key | reads | output digest | status |", "|---|---|---|---|---|"]
    for name, m in manifests.items():
        reads = ", ".join(f"{u}@{v['key'][:8]}" for u, v in m["inputs"].items()) or "raw inputs"
        lines.append(f"| `{name}` | `{m['key']}` | {reads} | `{m['digest'][:12]}` | {_status(m, status[name])} |")
    markdown = "\n".join(lines)
    create_markdown_artifact(key="pipeline-lineage", markdown=markdown,
                             description="content addresses from raw text to model")
    return markdown
