"""The alignment stage's registration: a pretrained model in, SFT, DPO, reward and RL models out."""

from __future__ import annotations

from typing import Any

from lmforge.engine.stage import ArtifactSpec, Resources, Stage
from training.align.config import AlignConfig, AlignFaultConfig


def _steps() -> list[Any]:
    from training.align.steps import ALIGN_STEPS

    return ALIGN_STEPS


def _fmt(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, list) and all(isinstance(v, float) for v in value):
        return "[" + ", ".join(f"{v:.4f}" for v in value) + "]"
    return value


def _artifacts(
    manifests: dict[str, dict[str, Any]], status: dict[str, str], error: BaseException | None
) -> list[ArtifactSpec]:
    specs = []
    data = manifests.get("align/data")
    if data:
        rows = [{"data": kind, **{k: v for k, v in c.items() if k != "by_task"}} for kind, c in data["counts"].items()]
        specs.append(ArtifactSpec("align-data", "table", rows, "input = train + held-out + quarantined + duplicates"))
    for step in ("align/sft", "align/dpo", "align/reward", "align/rl"):
        manifest = manifests.get(step)
        if manifest is None:
            continue
        rows = [
            {"metric": k, "value": _fmt(v)}
            for k, v in manifest["metrics"].items()
            if isinstance(v, (int, float, list)) and not k.endswith("_by_task") and not k.startswith("examples_")
        ]
        name = step.split("/")[1]
        specs.append(
            ArtifactSpec(
                f"align-{name}-summary",
                "table",
                rows,
                f"{name.upper()}: held-out figures before/after (95% bootstrap intervals), training",
            )
        )
        if manifest["extra"].get("warnings"):
            specs.append(
                ArtifactSpec(
                    f"align-{name}-warnings",
                    "markdown",
                    "\n".join(f"- **warning**: {w}" for w in manifest["extra"]["warnings"]),
                    f"{name.upper()} warnings",
                )
            )
    return specs


def _summary(manifests: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    for step, role in (("align/sft", "SFT"), ("align/dpo", "DPO"), ("align/rl", "RL")):
        if step in manifests:
            m = manifests[step]["metrics"]
            lines.append(
                f"{role}:     {manifests[step]['dir']}/hf  (held-out exact match "
                f"{m.get('exact_match_before', float('nan')):.3f} -> {m.get('exact_match_after', float('nan')):.3f})"
            )
    if "align/reward" in manifests:
        m = manifests["align/reward"]["metrics"]
        low, high = m.get("pairwise_accuracy_ci", [float("nan")] * 2)
        lines.append(
            f"reward:  {manifests['align/reward']['dir']}/hf  (held-out pairwise accuracy "
            f"{m.get('pairwise_accuracy', float('nan')):.3f} [{low:.3f}, {high:.3f}])"
        )
    return lines


def _roles() -> tuple[Any, ...]:
    """One model role per registered method that trains a policy (`hf-model:<name>`)."""
    from training.align.methods import methods

    return tuple(m.role() for m in methods().values() if m.role() is not None)


STAGE = Stage(
    name="align",
    description="Alignment with TRL on N ranks, from the user's or built-in data: SFT (full, LoRA, QLoRA), then "
    "the recipe's DPO, reward model and online RL (GRPO/RLOO).",
    config_model=AlignConfig,
    debug_model=AlignFaultConfig,
    steps=_steps,
    after=("pretrain",),
    artifacts=_artifacts,
    resources=Resources(pool="gpu", gpus=-1),
    packages=("training",),
    summary=_summary,
    roles=_roles,
)
