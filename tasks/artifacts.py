"""Prefect artifacts with stable keys, so each key builds a history in the UI.

Every stage gets `<stage>-steps` (one row per step: cached or computed, seconds, key,
output directory) and `<stage>-card`; a stage's own artifacts (`curation-stats`,
`pretrain-summary`, ...) are described by the stage as plain `ArtifactSpec`s and
published here; `pipeline-lineage` is the chain of content addresses from raw input to
the last product.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from lmforge.stage import ArtifactSpec


def _status(manifest: dict[str, Any], status: str) -> str:
    return f"computed in {manifest['timings']['seconds']:.1f}s" if status == "computed" else status


def publish(spec: ArtifactSpec) -> None:
    if spec.kind == "table":
        create_table_artifact(key=spec.key, table=spec.data, description=spec.description)
    elif spec.kind == "markdown":
        create_markdown_artifact(key=spec.key, markdown=spec.data, description=spec.description)
    elif spec.kind == "link":
        create_link_artifact(key=spec.key, link=spec.data, description=spec.description)
    elif spec.kind == "image":
        create_markdown_artifact(key=spec.key, markdown=image_markdown(Path(spec.data), spec.description),
                                 description=spec.description)
    else:
        raise ValueError(f"artifact {spec.key}: unknown kind {spec.kind!r}")


def image_markdown(png: Path, title: str) -> str:
    """A PNG inlined as a data URI: the UI shows it without serving any file."""
    import base64

    data = base64.b64encode(png.read_bytes()).decode()
    return f"### {title}\n\n![{title}](data:image/png;base64,{data})\n\n`{png}`"


def publish_stage(stage: str, manifests: dict[str, dict[str, Any]], status: dict[str, str]) -> None:
    rows = [{"step": name, "status": _status(m, status[name]), "key": m["key"], "output": m["dir"]}
            for name, m in manifests.items() if m["stage"] == stage]
    if not rows:
        return
    create_table_artifact(key=f"{stage}-steps", table=rows, description=f"lmforge {stage}: steps and cache status")
    lines = [f"# {stage}", "", "| step | status | output |", "|---|---|---|"]
    lines += [f"| `{r['step']}` | {r['status']} | `{r['output']}` |" for r in rows]
    create_markdown_artifact(key=f"{stage}-card", markdown="\n".join(lines), description=f"lmforge {stage} outputs")


def publish_lineage(manifests: dict[str, dict[str, Any]], status: dict[str, str]) -> str:
    lines = ["# lmforge lineage", "", "| step | key | reads | output digest | status |", "|---|---|---|---|---|"]
    for name, m in manifests.items():
        reads = ", ".join(f"{u}@{v['key'][:8]}" for u, v in m["inputs"].items()) or "raw inputs"
        lines.append(f"| `{name}` | `{m['key']}` | {reads} | `{m['digest'][:12]}` | {_status(m, status[name])} |")
    markdown = "\n".join(lines)
    create_markdown_artifact(key="pipeline-lineage", markdown=markdown,
                             description="content addresses from raw text to model")
    return markdown
