"""The whole lifecycle of a model, top to bottom.

    raw text --curate--> kept documents, tokenizer, packed tokens
             --pretrain--> checkpoints, Hugging Face model
    (alignment, evaluation with contamination gates, quantization and vLLM serving are the
    next stages; each is a flow of the same shape.)

Every stage is a subflow whose steps are cached on content addresses, so rerunning the
pipeline recomputes only what a change invalidated, and `lmforge explain` says why.
Parameters are plain values so the flow can be a deployment: `prefect deployment run
'lmforge-pipeline/tiny-cpu' --param overrides='["pretrain.max_steps=50"]'`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from flows.curate import curate_flow
from flows.pretrain import pretrain_flow
from lmforge.config import load_config
from lmforge.executor import graph
from tasks.artifacts import publish_lineage
from tasks.logs import set_library_log_level

STAGE_FLOWS = {"curate": curate_flow, "pretrain": pretrain_flow}


@flow(name="lmforge-pipeline", flow_run_name="{preset}")
def pipeline(preset: str = "tiny-cpu", overrides: list[str] | None = None, workspace: str | None = None,
             stages: list[str] | None = None) -> dict[str, Any]:
    """Run `stages` (default: the config's `stages`) and whatever they need upstream."""
    config = load_config(preset, overrides or [], workspace)
    set_library_log_level(config.runtime.log_level)
    if stages:
        config.stages = stages  # type: ignore[assignment]
    needed = {step.stage for step in graph().active(config, config.stages)}
    manifests: dict[str, dict[str, Any]] = {}
    status: dict[str, str] = {}
    for stage, stage_flow in STAGE_FLOWS.items():
        if stage in needed:
            outcome = stage_flow(config, manifests)
            manifests.update(outcome["manifests"])
            status.update(outcome["status"])
    publish_lineage(manifests, status)
    computed = sum(s == "computed" for s in status.values())
    get_run_logger().info("%d steps: %d cache hits, %d computed", len(status), len(status) - computed, computed)
    return {"workspace": config.workspace,
            "steps": {name: {"key": m["key"], "dir": m["dir"], "status": status[name], "counts": m["counts"]}
                      for name, m in manifests.items()}}
