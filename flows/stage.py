"""Run the steps of one stage as Prefect tasks, in dependency order, independent steps concurrently."""

from __future__ import annotations

import time
from typing import Any

from lmforge.executor import graph
from tasks.steps import step_task


def run_stage_steps(stage: str, config: Any, manifests: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Submit the stage's active steps; upstream outputs of earlier stages come in `manifests`.

    Returns the manifests and, per step, "cached" (Prefect's cache, keyed on the step's
    content address), "reused" (output found complete in the store) or "computed".
    """
    started = time.time()
    futures: dict[str, Any] = {}
    for step in graph().active(config, config.stages):
        if step.stage != stage:
            continue
        upstream = {name: futures.get(name, manifests.get(name)) for name in step.upstream(config)}
        futures[step.name] = step_task(step.name, config).submit(step.name, config, upstream)
    results = {name: future.result() for name, future in futures.items()}
    status = {name: "cached" if futures[name].state.name == "Cached"
              else "reused" if m["timings"]["finished_at"] < started else "computed"
              for name, m in results.items()}
    return results, status
