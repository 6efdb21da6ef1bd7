"""The lineage as a picture: raw inputs on the left, the served model on the right.

One column per stage, one box per step with its key, its cache status in this run and the flow
run that computed it; arrows follow what each step read. Drawn with matplotlib (no graphviz on
the machines lmforge targets), laid out by stage so it reads left to right like the pipeline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {"computed": "#cfe8cf", "cached": "#dde6f5"}


def layout(manifests: dict[str, dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """(x, y) per step: x by stage in lifecycle order, y by position within the stage."""
    stages: list[str] = []
    for manifest in manifests.values():
        if manifest["stage"] not in stages:
            stages.append(manifest["stage"])
    columns: dict[str, list[str]] = {s: [] for s in stages}
    for name, manifest in manifests.items():
        columns[manifest["stage"]].append(name)
    tallest = max(len(c) for c in columns.values())
    where = {}
    for x, stage in enumerate(stages):
        names = columns[stage]
        offset = (tallest - len(names)) / 2
        for y, name in enumerate(names):
            where[name] = (x * 3.2 + 1.6, tallest - (offset + y))
    return where


def render_lineage(manifests: dict[str, dict[str, Any]], status: dict[str, str], computed_by: dict[str, str],
                   out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    where = layout(manifests)
    width = max(x for x, _ in where.values()) + 2.2
    height = max(y for _, y in where.values()) + 1.2
    fig, ax = plt.subplots(figsize=(max(8.0, width * 1.25), max(4.0, height * 0.95)))
    raw = (0.0, height / 2)
    ax.text(*raw, "raw\ninputs", ha="center", va="center", fontsize=8, fontweight="bold")
    for name, manifest in manifests.items():
        x, y = where[name]
        sources = [where[u] for u in manifest["inputs"] if u in where] or ([raw] if not manifest["inputs"] else [])
        for sx, sy in sources:
            if sx == x:  # within a stage: an arc along the column's left edge, not through the boxes
                start = sx - 1.35
                props = {"color": "#aaaaaa", "lw": 0.6, "connectionstyle": f"arc3,rad={0.25 if sy > y else -0.25}"}
            else:
                start = sx + (1.35 if (sx, sy) != raw else 0.35)
                props = {"color": "#888888", "lw": 0.7}
            ax.annotate("", xy=(x - 1.35, y), xytext=(start, sy), arrowprops={"arrowstyle": "->", **props})
    for name, manifest in manifests.items():
        x, y = where[name]
        state = status.get(name, "cached")
        ax.add_patch(FancyBboxPatch((x - 1.35, y - 0.38), 2.7, 0.76, boxstyle="round,pad=0.02",
                                    facecolor=COLORS.get(state, "#eeeeee"), edgecolor="#555555", lw=0.8))
        ax.text(x, y + 0.16, name, ha="center", va="center", fontsize=7, fontweight="bold")
        ax.text(x, y - 0.04, f"{manifest['key'][:12]} · {state}", ha="center", va="center", fontsize=6, family="monospace")
        ax.text(x, y - 0.22, computed_by.get(name, "")[:44], ha="center", va="center", fontsize=5, color="#444444")
    deploy = manifests.get("serve/deploy")
    if deploy is not None:
        x, y = where["serve/deploy"]
        served = deploy["extra"].get("served_name", "")
        ax.text(x, y - 0.62, f"serving {served}\n{deploy['extra'].get('url', '')}/v1", ha="center", va="top",
                fontsize=6, color="#1a5e1a")
    ax.set_xlim(-0.6, width)
    ax.set_ylim(0.0, height + 0.2)
    ax.axis("off")
    ax.set_title("lmforge lineage (green: computed in this run, blue: reused)", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
