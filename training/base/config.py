"""Typed configuration of a base model the user brings (`base_model:` in a preset)."""

from __future__ import annotations

from pydantic import Field, field_validator

from lmforge.configbase import StrictModel, runtime_field


class BaseModelConfig(StrictModel):
    """An existing causal LM to start from: a local Hugging Face directory or `hf:ORG/NAME`.

    The path is not identity (a moved copy of the same files is the same model): the content
    of its weights, config, tokenizer and generation config is, or the resolved hub commit.
    """

    path: str = runtime_field(
        "",
        description="A local Hugging Face model directory, or hf:ORG/NAME (with `revision`); empty: no base "
        "model, lmforge pretrains its own from scratch.",
    )
    revision: str = Field("main", description="Hub revision (branch, tag or commit) for an hf: path.")
    trust_remote_code: bool = Field(
        False, description="Allow a model whose code ships inside its repository (auto_map) to run."
    )

    @field_validator("path")
    @classmethod
    def _one_line(cls, value: str) -> str:
        if "\n" in value:
            raise ValueError("must be one line")
        return value.strip()

    @property
    def enabled(self) -> bool:
        return bool(self.path)
