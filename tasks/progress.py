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

from lmforge.curves import curves_png, render_curves
from lmforge.curves import panels as step_panels

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


# -- curves (drawn by lmforge.curves) ------------------------------------------------------------------


def step_images(stage: str, manifests: dict[str, dict[str, Any]]) -> list[Any]:
    """Image artifacts of the training curves of the stage's steps in `manifests`."""
    from lmforge.engine.stage import ArtifactSpec

    specs = []
    for step, manifest in manifests.items():
        if manifest is None or manifest.get("stage") != stage:
            continue
        panels = step_panels(step)
        if not panels:
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
