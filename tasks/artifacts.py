"""Prefect artifacts with stable keys, so each key builds a history in the UI.

Every stage gets `<stage>-steps` (one row per step: cached or computed, seconds, key,
output directory) and `<stage>-card`; a stage's own artifacts (`curation-stats`,
`pretrain-summary`, ...) are described by the stage as plain `ArtifactSpec`s and
published here; `pipeline-lineage` is the chain of content addresses from raw input to
the last product.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from lmforge.engine.stage import ArtifactSpec


def _status(manifest: dict[str, Any], status: str) -> str:
    return f"computed in {manifest['timings']['seconds']:.1f}s" if status == "computed" else status


def artifact_key(text: str) -> str:
    """Prefect's artifact keys take lowercase letters, digits and dashes only (`base_model-steps` is refused)."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower())


def publish(spec: ArtifactSpec) -> None:
    spec = replace(spec, key=artifact_key(spec.key))
    if spec.kind == "table":
        create_table_artifact(key=spec.key, table=spec.data, description=spec.description)
    elif spec.kind == "markdown":
        create_markdown_artifact(key=spec.key, markdown=spec.data, description=spec.description)
    elif spec.kind == "link":
        create_link_artifact(key=spec.key, link=spec.data, description=spec.description)
    elif spec.kind == "image":
        create_markdown_artifact(
            key=spec.key, markdown=image_markdown(Path(spec.data), spec.description), description=spec.description
        )
    else:
        raise ValueError(f"artifact {spec.key}: unknown kind {spec.kind!r}")


def image_markdown(png: Path, title: str) -> str:
    """A PNG inlined as a data URI: the UI shows it without serving any file."""
    import base64

    data = base64.b64encode(png.read_bytes()).decode()
    return f"### {title}\n\n![{title}](data:image/png;base64,{data})\n\n`{png}`"


def publish_stage(
    stage: str, manifests: dict[str, dict[str, Any]], status: dict[str, str], links: dict[str, str] | None = None
) -> None:
    """`<stage>-steps` and `<stage>-card`; `links`: the MLflow run of each step logged in this run."""
    links = links or {}
    rows = [
        {"step": name, "status": _status(m, status[name]), "key": m["key"], "output": m.get("url") or m["dir"]}
        | ({"mlflow": links.get(name, "")} if links else {})
        for name, m in manifests.items()
        if m["stage"] == stage
    ]
    if not rows:
        return
    create_table_artifact(
        key=artifact_key(f"{stage}-steps"), table=rows, description=f"lmforge {stage}: steps and cache status"
    )
    lines = [f"# {stage}", "", "| step | status | output |", "|---|---|---|"]
    lines += [f"| `{r['step']}` | {r['status']} | `{r['output']}` |" for r in rows]
    lines += ["", *(f"MLflow run ({step}): {link}" for step, link in links.items())] if links else []
    create_markdown_artifact(
        key=artifact_key(f"{stage}-card"), markdown="\n".join(lines), description=f"lmforge {stage} outputs"
    )


def made_by(manifest: dict[str, Any], runs: dict[str, dict[str, Any]] | None = None) -> str:
    """Which flow run (and work pool, host) computed an output, from the record in its manifest."""
    record = manifest.get("made_by") or {}
    run = record.get("flow_run_name") or ((runs or {}).get(manifest["stage"], {}).get("flow_run"))
    parts = [f"run {run}" if run else "outside Prefect (--local)"]
    if record.get("work_pool"):
        parts.append(f"pool {record['work_pool']}")
    parts.append(f"host {record.get('host', '?')}")
    if record.get("slurm_job_id"):
        parts.append(f"SLURM job {record['slurm_job_id']}")
    return ", ".join(parts)


def publish_lineage(
    manifests: dict[str, dict[str, Any]],
    status: dict[str, str],
    runs: dict[str, dict[str, Any]] | None = None,
    mlflow_run: str | None = None,
) -> str:
    """The chain of content addresses, who computed each output, and (as an image) the graph;
    `mlflow_run`: where the pipeline run's MLflow run is, when steps were logged."""
    lines = [
        "# lmforge lineage",
        "",
        "| step | key | reads | output digest | this run | computed by |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in manifests.items():
        reads = ", ".join(f"{u}@{v['key'][:8]}" for u, v in m["inputs"].items()) or "raw inputs"
        lines.append(
            f"| `{name}` | `{m['key']}` | {reads} | `{m['digest'][:12]}` | {_status(m, status[name])} | "
            f"{made_by(m, runs)} |"
        )
    urls = [m["url"] for m in manifests.values() if m.get("url")]
    if urls:  # a workspace on object storage: every output above is under it
        lines += ["", f"Workspace: `{urls[0].rsplit('/', 3)[0]}` (`<step>/<key>/` under it)"]
    if runs:
        lines += [
            "",
            "## Stage runs (runtime.dispatch: deployments)",
            "",
            "| stage | child flow run | work pool | deployment |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {r['stage']} | {r['flow_run']} (`{r['flow_run_id']}`) | {r['work_pool']} | {r['deployment']} |"
            for r in runs.values()
        ]
    if mlflow_run:
        lines += ["", f"MLflow run: {mlflow_run}"]
    markdown = "\n".join(lines)
    create_markdown_artifact(
        key="pipeline-lineage", markdown=markdown, description="content addresses from raw text to model"
    )
    _publish_lineage_graph(manifests, status, runs)
    return markdown


def _publish_lineage_graph(
    manifests: dict[str, dict[str, Any]], status: dict[str, str], runs: dict[str, dict[str, Any]] | None
) -> None:
    import logging

    from tasks.lineage_graph import render_lineage

    if not manifests:
        return
    workspace = Path(next(iter(manifests.values()))["dir"]).parents[2]
    computed_by = {n: made_by(m, runs) for n, m in manifests.items()}
    png = lineage_png(workspace / ".lmforge" / "ui", manifests, status, computed_by)
    try:
        if not png.exists():  # a rerun that reused every output draws the same picture: drawn once
            tmp = png.with_name(f".tmp-{os.getpid()}-{png.name}")  # still .png: matplotlib picks the format by it
            os.replace(render_lineage(manifests, status, computed_by, tmp), png)
    except Exception as exc:  # noqa: BLE001 - a picture is never a reason to fail a run
        logging.getLogger("lmforge.tasks").warning("could not render the lineage graph: %s", exc)
        return
    publish(ArtifactSpec("pipeline-lineage-graph", "image", str(png), "lineage from raw inputs to the served model"))


def lineage_png(
    ui: Path, manifests: dict[str, dict[str, Any]], status: dict[str, str], computed_by: dict[str, str]
) -> Path:
    """The lineage picture's file, named by a digest of everything drawn in it and of the code drawing it."""
    from lmforge.hashing import digest, file_sha256
    from tasks import lineage_graph

    drawn = {
        name: [
            m["stage"],
            m["key"],
            list(m["inputs"]),
            status.get(name),
            computed_by.get(name),
            {k: m.get("extra", {}).get(k) for k in ("served_name", "url")},
        ]
        for name, m in manifests.items()
    }
    return ui / f"lineage-{digest([drawn, file_sha256(lineage_graph.__file__)], length=16)}.png"
