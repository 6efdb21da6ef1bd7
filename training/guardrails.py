"""Loss-spike and non-finite-loss detection.

A step's loss is judged against the recent window of accepted losses, either as a ratio
to their mean or as a z-score (the std is floored at 1% of the mean so a flat loss curve
does not turn noise into "spikes"). The detector's state is saved in checkpoints so a
rollback or a resumed run judges exactly as an uninterrupted one would.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from training.config import GuardrailConfig


@dataclass
class SpikeDetector:
    cfg: GuardrailConfig
    history: deque[float] = field(default_factory=deque)
    consecutive: int = 0
    last_anomaly_step: int = -(10**9)

    def judge(self, loss: float) -> str | None:
        """'non_finite', 'spike', or None for a normal loss."""
        if not math.isfinite(loss):
            return "non_finite"
        if not self.cfg.enabled or len(self.history) < self.cfg.min_history:
            return None
        window = list(self.history)[-self.cfg.window :]
        mean = sum(window) / len(window)
        if self.cfg.spike_mode == "ratio":
            return "spike" if loss > self.cfg.spike_ratio * mean else None
        std = max(math.sqrt(sum((x - mean) ** 2 for x in window) / len(window)), 0.01 * abs(mean))
        return "spike" if (loss - mean) / std > self.cfg.spike_zscore else None

    def accept(self, loss: float) -> None:
        self.history.append(loss)
        while len(self.history) > self.cfg.window:
            self.history.popleft()

    def record_anomaly(self, step: int) -> int:
        """Count anomalies that come without real progress in between; returns the count."""
        self.consecutive = self.consecutive + 1 if step - self.last_anomaly_step <= self.cfg.window else 1
        self.last_anomaly_step = step
        return self.consecutive

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": list(self.history),
            "consecutive": self.consecutive,
            "last_anomaly_step": self.last_anomaly_step,
        }

    def load_state_dict(self, state: dict[str, Any], keep_anomaly_count: bool = False) -> None:
        self.history = deque(state["history"])
        if not keep_anomaly_count:
            self.consecutive = state["consecutive"]
            self.last_anomaly_step = state["last_anomaly_step"]
