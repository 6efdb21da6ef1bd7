"""What the UI shows besides logs and tables: progress that moves, and curves.

- `ProgressReporter`: one Prefect progress artifact per long step (`progress-<stage>-<step>`),
  updated while the step runs from what the step's own `progress(ctx)` reads off its output
  folder (training steps done, tasks evaluated, SLO levels measured) or from units finished.
  A thread polls, so the domain code knows nothing of Prefect.
- `step_images`: the training and alignment curves (loss, validation loss, gradient norm, MFU,
  DPO rewards) rendered with matplotlib from `metrics.jsonl`, published as image artifacts.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from pathlib import Path
from typing import Any

from lmforge.jsonl import read_jsonl

log = logging.getLogger("lmforge.tasks")
POLL_S = 3.0


def progress_key(step_name: str) -> str:
    return "progress-" + step_name.replace("/", "-").replace("_", "-").lower()


class ProgressReporter:
    """A progress artifact for one step run; `update(done, total)` from any thread of the task."""

    def __init__(self, step_name: str) -> None:
        self.step_name = step_name
        self.artifact_id: Any = None
        self.last = -1.0
        self.lock = threading.Lock()
        self.context = contextvars.copy_context()  # the task run's: artifacts attach to it
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    def update(self, done: float, total: float) -> None:
        if total <= 0:
            return
        percent = round(min(100.0, 100.0 * done / total), 1)
        with self.lock:
            if percent == self.last:
                return
            self.last = percent
            try:
                self.context.run(self._publish, percent)
            except Exception as exc:  # noqa: BLE001 - progress is cosmetic; never fail a step for it
                log.debug("progress artifact for %s: %s", self.step_name, exc)

    def _publish(self, percent: float) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        if self.artifact_id is None:
            self.artifact_id = create_progress_artifact(
                percent, key=progress_key(self.step_name), description=f"{self.step_name}: progress of this run"
            )
        else:
            update_progress_artifact(self.artifact_id, percent)

    def watch(self, read: Any) -> None:
        """Poll `read()` -> (done, total) | None every few seconds until `stop()`."""

        def loop() -> None:
            while not self.stop_event.wait(POLL_S):
                try:
                    found = read()
                except (OSError, ValueError, KeyError):  # a file half-written: next time
                    continue
                if found:
                    self.update(*found)

        self.thread = threading.Thread(target=loop, name=f"progress-{self.step_name}", daemon=True)
        self.thread.start()

    def stop(self, finished: bool) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=POLL_S + 1)
        if finished and self.artifact_id is not None:
            self.update(1, 1)


# -- curves --------------------------------------------------------------------------------------------

CURVES = {  # step -> panels: (title, [(metric key, label)])
    "pretrain/train": [
        ("loss", [("loss", "train"), ("val_loss", "validation")]),
        ("gradient norm", [("grad_norm", "")]),
        ("MFU", [("mfu", "")]),
        ("tokens/s", [("tokens_per_s", "")]),
    ],
    "align/sft": [
        ("loss", [("loss", "train"), ("eval_loss", "held-out")]),
        ("gradient norm", [("grad_norm", "")]),
        ("held-out exact match", [("heldout_exact_match", "")]),
        ("tokens/s", [("tokens_per_s", "")]),
    ],
    "align/dpo": [
        ("loss", [("loss", "train")]),
        ("rewards", [("rewards/chosen", "chosen"), ("rewards/rejected", "rejected"), ("rewards/margins", "margin")]),
        ("reward accuracy", [("rewards/accuracies", "")]),
        ("held-out exact match", [("heldout_exact_match", "")]),
    ],
}


def render_curves(
    metrics_file: Path, panels: list[tuple[str, list[tuple[str, str]]]], title: str, out: Path
) -> Path | None:
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


def step_images(stage: str, manifests: dict[str, dict[str, Any]]) -> list[Any]:
    """Image artifacts of the training curves of the stage's steps in `manifests`."""
    from lmforge.stage import ArtifactSpec

    specs = []
    for step, panels in CURVES.items():
        manifest = manifests.get(step)
        if manifest is None or manifest.get("stage") != stage:
            continue
        directory = Path(manifest["dir"])
        if not (directory / "metrics.jsonl").exists():
            continue
        title = f"{step} @ {manifest['key'][:8]}"
        # beside the workspace's other UI files, not inside the finished (checksummed) output
        png: Path | None  # None when render_curves could not draw them
        png, drawn = curves_png(directory.parents[2] / ".lmforge" / "ui", step, manifest, panels, title)
        try:
            if not drawn:
                png = render_curves(directory / "metrics.jsonl", panels, title, png)
        except Exception as exc:  # noqa: BLE001 - a picture is never a reason to fail a stage
            log.warning("could not render the curves of %s: %s", step, exc)
            continue
        if png is not None:
            key = step.replace("/", "-") + "-curves"
            specs.append(
                ArtifactSpec(
                    key,
                    "image",
                    str(png),
                    f"{step} curves (TensorBoard: tensorboard --logdir {directory / 'tensorboard'})",
                )
            )
    return specs
