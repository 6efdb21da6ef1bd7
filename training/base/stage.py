"""The base-model stage's registration: a model the user brings, as the first model of the lineage."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmforge.engine.stage import ArtifactSpec, Role, Stage
from training.base.config import BaseModelConfig

if TYPE_CHECKING:
    from lmforge.config import PipelineBase


def _steps() -> list[Any]:
    from training.base.steps import BASE_STEPS

    return BASE_STEPS


def _check(config: PipelineBase, source: str) -> None:
    if config.base_model.path:
        from training.base.prepare import check_base

        check_base(config.base_model.path, config.base_model.trust_remote_code, source)


def _artifacts(
    manifests: dict[str, dict[str, Any]], status: dict[str, str], error: BaseException | None
) -> list[ArtifactSpec]:
    manifest = manifests.get("base_model/import")
    if manifest is None:
        return []
    extra = manifest["extra"]
    rows = [
        {"field": k, "value": json_value}
        for k, json_value in (
            ("source", extra["source"]),
            ("architecture", extra["architecture"]),
            ("parameters", extra["params"]),
            ("chat template", extra["chat_template"]),
            ("added tokens", ", ".join(extra["added_tokens"]) or "none"),
            ("embeddings resized", extra["resized_embeddings"]),
            ("context", extra["context"]),
        )
    ]
    return [ArtifactSpec("base-model", "table", rows, "the base model this lineage starts from")]


def _summary(manifests: dict[str, dict[str, Any]]) -> list[str]:
    m = manifests.get("base_model/import")
    return [f"base:    {m['extra']['source']} ({m['extra']['architecture']})"] if m else []


STAGE = Stage(
    name="base_model",
    description="A base model the user brings (any Hugging Face causal LM): checked, fingerprinted, chat-ready.",
    config_model=BaseModelConfig,
    steps=_steps,
    artifacts=_artifacts,
    packages=("training",),
    summary=_summary,
    check=_check,
    roles=(Role("base"),),  # trained on data lmforge never saw
)
