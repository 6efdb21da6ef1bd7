"""Retry only what a retry can fix.

Prefect calls `should_retry` when a task run fails; configuration errors, divergence,
parity failures and other deterministic errors (`retryable = False`) end the run at once,
while killed ranks, preemption and I/O errors go on to the task's retry policy.
"""

from __future__ import annotations

import logging
from typing import Any

from lmforge.errors import is_retryable

log = logging.getLogger("lmforge.retry")


def should_retry(task: Any, task_run: Any, state: Any) -> bool:
    try:
        state.result()
    except Exception as exc:  # the failure we are judging
        retry = is_retryable(exc)
        log.info(
            "%s failed with %s: %s -> %s",
            task_run.name,
            type(exc).__name__,
            exc,
            "retrying (resumes from completed work)" if retry else "not retrying (would fail the same way)",
        )
        return retry
    return True
