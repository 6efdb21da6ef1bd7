"""Training metrics: FLOPs per token, MFU, memory, and where they are written.

Rank 0 writes one JSON line per logged step to `metrics.jsonl` and the same scalars to
TensorBoard event files under `tensorboard/`. Every checkpoint holds a copy of
`metrics.jsonl`; a resume restores the history from it and rebuilds the TensorBoard files
from that history, so a retried run's curves have no duplicate, orphaned or lost points,
even when files of the output were deleted since. A rollback cuts both back in place.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.config import ModelConfig

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

METRICS_FILE = "metrics.jsonl"


def flops_per_token(params: int, model: ModelConfig, seq_len: int, vocab_size: int) -> float:
    """Training FLOPs per token: 6N over the parameters that do a token's matmuls (an untied input
    embedding is a lookup; a mixture of experts counts its active parameters) plus attention scores (fwd+bwd)."""
    from training.planner import matmul_parameters

    active = matmul_parameters(params, model, vocab_size)  # a mixture of experts: the routed experts only
    return 6 * active + 12 * model.num_layers * model.hidden_size * seq_len


def memory_mb() -> float:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss / 2**20


def peak_memory_mb() -> float:
    """Peak device memory (CUDA max allocated), or this process's peak RSS on CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class MetricsWriter:
    """metrics.jsonl + TensorBoard, rank 0 only."""

    def __init__(self, out_dir: Path, resume_step: int, enabled: bool, history: Path | None = None):
        self.enabled = enabled
        self.out_dir = out_dir
        self.path = out_dir / METRICS_FILE
        self._tb: SummaryWriter | None = None
        resuming = enabled and history is not None and history.exists()
        if resuming:  # the checkpoint's copy is complete up to resume_step, whatever happened since
            shutil.copyfile(history, self.path)  # type: ignore[arg-type]
            shutil.rmtree(out_dir / "tensorboard", ignore_errors=True)
        self.rewind(resume_step)
        if resuming:  # event files are rebuilt from the history, so none can be missing or stale
            for line in self.path.read_text().splitlines():
                row = json.loads(line)
                self._scalars(row.pop("step"), row)

    def rewind(self, step: int) -> None:
        """Forget everything logged after `step` (a resume or a rollback goes back there)."""
        if not self.enabled:
            return
        if self.path.exists():
            kept = [
                line for line in self.path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))
        from torch.utils.tensorboard import SummaryWriter

        self.close()
        self._tb = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=step + 1)

    def log(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps({"step": step, **values}) + "\n")
        self._scalars(step, values)

    def _scalars(self, step: int, values: dict[str, Any]) -> None:
        for key, value in values.items():
            if isinstance(value, (int, float)):
                assert self._tb is not None, "rewind() opens the TensorBoard writer before anything is logged"
                self._tb.add_scalar(key.replace(".", "/"), value, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None


def last_logged_step(metrics_file: Path) -> int:
    """The step of the last line of a metrics file (read from its end), 0 when there is none."""
    if not metrics_file.exists():
        return 0
    with open(metrics_file, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        handle.seek(max(0, handle.tell() - 4096))
        lines = handle.read().decode(errors="replace").splitlines()
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0
