"""The curation stage's registration: raw text in, curated documents, a tokenizer and token shards out."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from data_prep.config import CurateConfig
from lmforge.engine.stage import ArtifactSpec, Stage
from lmforge.errors import ConfigError

if TYPE_CHECKING:
    from lmforge.config import PipelineBase


def _steps() -> list[Any]:
    from data_prep.steps import CURATE_STEPS

    return CURATE_STEPS


def curation_rows(manifests: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """input = kept + removed + quarantined, then what packing made of the kept documents."""
    select = manifests["curate/select"]["counts"]
    rows = [
        {"metric": "input records", "value": select["input"]},
        {"metric": "quarantined (malformed)", "value": select["quarantined"]},
    ]
    if "curate/ingest" in manifests:
        rows.append(
            {"metric": "normalized (text changed)", "value": manifests["curate/ingest"]["counts"].get("normalized", 0)}
        )
    rows += [{"metric": f"removed: {reason}", "value": n} for reason, n in select["removed"].items()]
    rows.append({"metric": "kept", "value": select["kept"]})
    rows += [{"metric": f"PII redacted: {kind}", "value": n} for kind, n in select["pii"].items()]
    if "curate/pack" in manifests:
        pack = manifests["curate/pack"]
        rows += [
            {"metric": "train tokens", "value": pack["counts"]["train_tokens"]},
            {"metric": "validation tokens", "value": pack["counts"]["val_tokens"]},
            {"metric": "unigram entropy (nats)", "value": round(pack["metrics"]["unigram_entropy_nats"], 3)},
        ]
    return rows


def _artifacts(
    manifests: dict[str, dict[str, Any]], status: dict[str, str], error: BaseException | None
) -> list[ArtifactSpec]:
    if "curate/select" not in manifests:
        return []
    return [ArtifactSpec("curation-stats", "table", curation_rows(manifests), "input = kept + removed + quarantined")]


def _check(config: PipelineBase, source: str) -> None:
    from lmforge.inputs import expand_inputs

    for index, pattern in enumerate(config.curate.inputs):
        try:
            matched = expand_inputs([pattern])
        except ConfigError as exc:
            raise ConfigError(f"{source}: curate.inputs[{index}]: {exc}") from None
        if pattern.startswith("builtin:"):
            from data_prep.sources import get_source

            try:
                get_source(pattern)
            except ConfigError as exc:
                raise ConfigError(f"{source}: curate.inputs[{index}]: {exc}") from None
        if not matched and not pattern.startswith("hf:"):
            raise ConfigError(f"{source}: curate.inputs[{index}]: no file matches {pattern!r}")
    for index, ref in enumerate(config.curate.quality_classifier.reference):
        if not Path(ref).is_file():
            raise ConfigError(f"{source}: curate.quality_classifier.reference[{index}]: not a file: {ref}")
    from data_prep.filters import filters

    for family in filters().values():  # files a filter's statistics read (a labelled file to train on)
        section = getattr(config.curate, family.name)
        for path in family.files(section) if section.enabled else []:
            if not Path(path).is_file():
                raise ConfigError(f"{source}: curate.{family.name}: not a file: {path}")
    sd = config.curate.semantic_dedup
    if sd.enabled and sd.encoder:
        from data_prep.semantic import folder_kind

        try:
            folder_kind(Path(sd.encoder))
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None


STAGE = Stage(
    name="curate",
    description="Curation: ingest and quarantine, dedup, language ID, quality filters, PII, mixing, tokenizer, packing.",
    config_model=CurateConfig,
    steps=_steps,
    artifacts=_artifacts,
    packages=("data_prep",),
    check=_check,
)
