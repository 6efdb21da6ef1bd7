"""Training curves drawn from a step's `metrics.jsonl` with matplotlib (Agg, no display).

Shared by the Prefect image artifacts (`tasks.progress.step_images`) and the MLflow artifacts
(`lmforge.tracking`); nothing here imports an orchestrator.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

from lmforge.jsonl import read_jsonl

Panels = tuple[tuple[str, tuple[tuple[str, str], ...]], ...]  # (title, ((metric key, label), ...))


@functools.cache  # the registry is read once per process; a stage's steps() builds its steps anew
def panels(step: str) -> Panels:
    """The curves `step` declares (`Step.curves`: pretrain/train, each alignment method's step), or ()."""
    from lmforge.engine.registry import stages

    for stage in stages():
        for candidate in stage.steps():
            if candidate.name == step:
                return tuple(candidate.curves)
    return ()


def render_curves(metrics_file: Path, panels: Panels, title: str, out: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(read_jsonl(metrics_file))
    if not rows:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), squeeze=False)
    for ax, (name, series) in zip(axes[0], panels):
        for key, label in series:
            points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if points:
                ax.plot(*zip(*points), label=label or key, marker="." if len(points) < 30 else None)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if any(label for _, label in series):
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    save_png(fig, out, dpi=80)
    plt.close(fig)
    return out


def save_png(fig: Any, out: Path, dpi: int) -> None:
    """Write whole or not at all: a picture found at `out` is reused by later runs."""
    import os

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    fig.savefig(tmp, dpi=dpi, format="png")
    os.replace(tmp, out)


def curves_png(ui: Path, step: str, manifest: dict[str, Any], panels: Any, title: str) -> tuple[Path, bool]:
    """Where the curves of a step output are drawn, and whether they are drawn there already.

    The name is a digest of what the picture is drawn from (the checksummed metrics.jsonl, the
    panels, the title), so a cached step's curves are drawn once, not on every run.
    """
    from lmforge.hashing import digest

    source = manifest.get("outputs", {}).get("metrics.jsonl", {}).get("sha256")
    png = ui / f"{step.replace('/', '-')}-{manifest['key']}-{digest([source, panels, title], length=12)}.png"
    return png, source is not None and png.exists()
