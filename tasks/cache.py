"""A Prefect cache policy built on lmforge's stage keys.

Prefect's default policy hashes the inputs *and the run id*, so nothing is ever reused
across runs. This policy's key is the step's content address (plus the workspace), and it
is only offered to Prefect when the step's output on disk is complete and verified. When
the output is missing or damaged, the stale Prefect record is deleted first, so Prefect
runs the task (which recomputes) instead of returning a manifest for files that are gone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect.cache_policies import CachePolicy

from lmforge.executor import graph, plan_step
from lmforge.hashing import digest
from lmforge.store import StageStore


def results_dir(workspace: str | Path) -> Path:
    return Path(workspace).resolve() / ".prefect" / "results"


def prefect_key(store: StageStore, step_name: str, key: str) -> str:
    return f"lmforge-{digest(str(store.root), 8)}-{step_name.replace('/', '-')}-{key}"


@dataclass
class StageKeyPolicy(CachePolicy):
    def compute_key(self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str | None:
        config = inputs["config"]
        store = StageStore(config.workspace, config.runtime.verify)
        plan = plan_step(graph().get(inputs["step_name"]), config, store, inputs["upstream"])
        key = prefect_key(store, plan.step.name, plan.key)
        if plan.cached:
            # Prefect may answer from its cache without running the task: the reuse still counts
            # as this step's latest use, which is what `lmforge explain` compares against
            store.record_use(plan.step.name, plan.manifest)  # type: ignore[arg-type]
        else:
            (results_dir(config.workspace) / key).unlink(missing_ok=True)
        return key
