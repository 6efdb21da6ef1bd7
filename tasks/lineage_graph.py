"""The lineage as a picture: one column per stage, from raw inputs on the left to the served model.

Each step is a box in its stage's column (the stage name heads it): its name, its key, and whether
this run computed or reused it; arrows follow what each step read. Which flow run computed each
output is a lettered legend under the columns, so the boxes stay narrow. Drawn with matplotlib (no
graphviz on the machines lmforge targets).

The UI shows the picture scaled to its page's width, about DISPLAY_WIDTH_PX wide. So the figure
is only as wide as its columns need (each as wide as its longest step name), and its type is
sized for that width: `text_px(points, figure width)` is how high a text is once scaled, about
13 px for a step name and 11.5 px for a key with lmforge's six stages (`tests/test_lineage_graph.py`
holds the limits). Tall is fine: the page scrolls.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COLORS = {"computed": "#cfe8cf", "cached": "#dde6f5"}
WORDS = {"computed": "computed", "cached": "reused"}
TITLE = "lmforge lineage: raw inputs → served model"
DISPLAY_WIDTH_PX = 1000  # how wide the Prefect UI shows an artifact picture, about
NAME_PT, KEY_PT, NOTE_PT, STAGE_PT, TITLE_PT = 13.0, 11.5, 10.0, 14.0, 13.0
DPI = 110  # the PNG is a little wider than it is shown: scaled down, never up
# layout, in inches
BOX_H, ROW_GAP, COL_GAP, PAD = 0.74, 0.22, 0.38, 0.08
LEFT, RIGHT, TOP, NOTE_STEP = 0.45, 0.2, 1.1, 0.26


def text_px(points: float, figure_width_in: float, display_width_px: float = DISPLAY_WIDTH_PX) -> float:
    """How many pixels high `points` of type are once a figure this wide is shown `display_width_px` wide."""
    return points / 72 * display_width_px / figure_width_in


def _text_width_in(text: str, points: float, **font: Any) -> float:
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextPath

    return TextPath((0, 0), text, size=points, prop=FontProperties(**font)).get_extents().width / 72


def short_name(step: str) -> str:
    """A step's name inside its stage's column: the column says the stage."""
    return step.split("/", 1)[-1]


@dataclass
class Layout:
    columns: dict[str, list[str]]  # stage -> its steps, in lifecycle order
    box_w: float
    width: float
    height: float

    def box(self, step: str) -> tuple[float, float]:
        """Lower-left corner of a step's box, in inches from the figure's lower left."""
        column, stage = next((i, s) for i, (s, steps) in enumerate(self.columns.items()) if step in steps)
        row = self.columns[stage].index(step)
        return LEFT + column * (self.box_w + COL_GAP), self.height - TOP - row * (BOX_H + ROW_GAP) - BOX_H


def layout(manifests: dict[str, dict[str, Any]], notes: tuple[str, ...] = ()) -> Layout:
    """Columns by stage in lifecycle order, each as wide as its widest text; room for the title and `notes`."""
    columns: dict[str, list[str]] = {}
    for name, manifest in manifests.items():
        columns.setdefault(manifest["stage"], []).append(name)
    widest = max(
        [_text_width_in(short_name(n), NAME_PT, weight="bold") for n in manifests]
        + [_text_width_in(m["key"][:12], KEY_PT, family="monospace") for m in manifests.values()]
        + [_text_width_in(f"{WORDS['computed']} · A", NOTE_PT)]
    )
    box_w = max(1.35, widest + 2 * PAD)
    lines = max([_text_width_in(TITLE, TITLE_PT, weight="bold")] + [_text_width_in(n, NOTE_PT + 1) for n in notes])
    width = LEFT + max(len(columns) * box_w + (len(columns) - 1) * COL_GAP, lines) + RIGHT
    rows = max(len(steps) for steps in columns.values())
    height = TOP + rows * (BOX_H + ROW_GAP) + 0.3 + len(notes) * NOTE_STEP
    return Layout(columns, box_w, width, height)


def run_letters(computed_by: dict[str, str], names: list[str]) -> dict[str, str]:
    """A letter per distinct run that computed something ("" when there is only one)."""
    runs = list(dict.fromkeys(computed_by.get(n, "") for n in names))
    if len(runs) <= 1:
        return {}
    letters = string.ascii_uppercase + string.ascii_lowercase
    return {run: letters[i] if i < len(letters) else str(i) for i, run in enumerate(runs)}


def draw_lineage(manifests: dict[str, dict[str, Any]], status: dict[str, str], computed_by: dict[str, str]) -> Any:
    """The figure (matplotlib); boxes and their texts carry gids: `box:STEP`, `name:STEP`, `key:STEP`, `stage:STAGE`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    names = list(manifests)
    letters = run_letters(computed_by, names)
    runs = list(letters) if letters else list(dict.fromkeys(computed_by.get(n, "") for n in names))
    notes = ["green: computed in this run · blue: reused from an earlier run · arrows: what each step read"]
    notes += (
        [f"{letters[r]}: {r}" for r in runs] if letters else [f"computed by: {runs[0]}"] if runs and runs[0] else []
    )
    deploy = manifests.get("serve/release")
    if deploy is not None:
        extra = deploy.get("extra", {})
        notes.append(f"serving {extra.get('served_name', '')} at {extra.get('url', '')}/v1")
    lay = layout(manifests, tuple(notes))
    fig = plt.figure(figsize=(lay.width, lay.height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, lay.width)
    ax.set_ylim(0, lay.height)
    ax.axis("off")
    ax.text(LEFT, lay.height - 0.3, TITLE, fontsize=TITLE_PT, fontweight="bold", va="center")

    where = {n: lay.box(n) for n in names}
    for stage, steps in lay.columns.items():  # a band behind each stage's steps, its name on top
        x, _ = where[steps[0]]
        bottom = where[steps[-1]][1]
        ax.add_patch(
            FancyBboxPatch(
                (x - 0.08, bottom - 0.08),
                lay.box_w + 0.16,
                lay.height - TOP - bottom + 0.16,
                boxstyle="round,pad=0,rounding_size=0.08",
                facecolor="#f4f4f4",
                edgecolor="none",
                zorder=0,
            )
        )
        ax.text(
            x + lay.box_w / 2,
            lay.height - TOP + 0.22,
            stage,
            ha="center",
            va="center",
            fontsize=STAGE_PT,
            fontweight="bold",
            color="#333333",
            gid=f"stage:{stage}",
        )

    for name in names:  # what each step read; boxes are drawn over the lines
        x, y = where[name]
        for upstream in manifests[name]["inputs"]:
            if upstream not in where:
                continue
            ux, uy = where[upstream]
            if ux == x:  # within a column: a bracket along its left edge, deeper the farther it reaches
                start, end = (ux, uy + BOX_H / 2), (x, y + BOX_H / 2)
                depth = 6 + 4 * min(round(abs(uy - y) / (BOX_H + ROW_GAP)), 5)  # points
                style = f"arc,angleA=180,angleB=180,armA={depth},armB={depth},rad=3"
            else:
                start, end, style = (ux + lay.box_w, uy + BOX_H / 2), (x, y + BOX_H / 2), "arc3,rad=0"
            ax.add_patch(
                FancyArrowPatch(
                    start,
                    end,
                    connectionstyle=style,
                    arrowstyle="-|>",
                    mutation_scale=8,
                    color="#8a8a8a",
                    lw=0.7,
                    alpha=0.55,
                    zorder=1,
                    shrinkA=0,
                    shrinkB=1,
                )
            )
        if not manifests[name]["inputs"]:
            ax.annotate(
                "raw",
                xy=(x, y + BOX_H / 2),
                xytext=(x - 0.42, y + BOX_H / 2),
                fontsize=NOTE_PT,
                va="center",
                ha="left",
                color="#555555",
                arrowprops={"arrowstyle": "-|>", "color": "#555555", "lw": 0.8},
            )

    for name in names:
        x, y = where[name]
        state = status.get(name, "cached")
        ax.add_patch(
            FancyBboxPatch(
                (x, y),
                lay.box_w,
                BOX_H,
                boxstyle="round,pad=0,rounding_size=0.06",
                facecolor=COLORS.get(state, "#eeeeee"),
                edgecolor="#555555",
                lw=0.8,
                zorder=2,
                gid=f"box:{name}",
            )
        )
        cx = x + lay.box_w / 2
        ax.text(
            cx,
            y + BOX_H * 0.75,
            short_name(name),
            ha="center",
            va="center",
            fontsize=NAME_PT,
            fontweight="bold",
            zorder=3,
            gid=f"name:{name}",
        )
        ax.text(
            cx,
            y + BOX_H * 0.45,
            manifests[name]["key"][:12],
            ha="center",
            va="center",
            fontsize=KEY_PT,
            family="monospace",
            zorder=3,
            gid=f"key:{name}",
        )
        run = letters.get(computed_by.get(name, ""), "")
        ax.text(
            cx,
            y + BOX_H * 0.17,
            WORDS.get(state, state) + (f" · {run}" if run else ""),
            ha="center",
            va="center",
            fontsize=NOTE_PT,
            color="#444444",
            zorder=3,
        )

    y = min(yy for _, yy in where.values()) - 0.1 - NOTE_STEP
    for note in notes:
        ax.text(
            LEFT,
            y,
            note,
            fontsize=NOTE_PT + 1,
            va="center",
            color="#1a5e1a" if note.startswith("serving") else "#333333",
        )
        y -= NOTE_STEP
    return fig


def render_lineage(
    manifests: dict[str, dict[str, Any]], status: dict[str, str], computed_by: dict[str, str], out: Path
) -> Path:
    import matplotlib.pyplot as plt

    fig = draw_lineage(manifests, status, computed_by)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out
