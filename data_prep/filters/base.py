"""The interface every curation filter implements (see `data_prep.filters`)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from lmforge.configbase import StrictModel

Stats = dict[str, float | int | bool]
Check = tuple[str, float | int | None, float | int, str]  # (rule, threshold, value, "min" | "max")


class FilterBase(StrictModel):
    enabled: bool = Field(True, description="Switch this step off with --set curate.<step>.enabled=false.")
    skip_domains: list[str] = Field(
        default_factory=list, description="Domains this filter does not apply to (e.g. code for prose rules)."
    )


def failing(family: str, enabled: bool, checks: list[Check]) -> list[str]:
    """Rules whose threshold is set and crossed: "min" fails below it, "max" fails above it."""
    if not enabled:
        return []
    return [
        f"{family}:{rule}"
        for rule, threshold, value, kind in checks
        if threshold is not None and (value < threshold if kind == "min" else value > threshold)
    ]


class CurationFilter:
    """One family of document rules: its section `curate.<name>`, the statistics it needs, and the
    rules it reports as failed ("<name>:<rule>", every failing rule, in its own order).

    Statistics are computed once per document by `curate/heuristics` and kept as attribute
    columns; rules are applied by `curate/select`, so moving a threshold re-selects without
    recomputing. The built-in families share one pass (`data_prep.heuristics.compute_stats`); a
    family another package registers computes its own columns in `stats()`.
    """

    name: ClassVar[str]  # curate.<name>; its rules are "<name>:<rule>"
    description: ClassVar[str]
    config: ClassVar[type[FilterBase]]
    # the fields of its section that change its statistics (keyed into curate/heuristics);
    # every other field is a threshold, read by curate/select only
    stat_fields: ClassVar[tuple[str, ...]] = ()
    # reported before the language check (length is); the rest after it
    before_language: ClassVar[bool] = False
    # modules its rules and statistics run: part of the steps' code identity
    code: ClassVar[tuple[str, ...]] = ()
    # distributions whose versions shape its statistics (a classifier's library): recorded beside
    # curate/heuristics' key, so an upgrade is reported as drift
    libraries: ClassVar[tuple[str, ...]] = ()

    def stats(self, text: str, cfg: Any) -> Stats | None:
        """Its own statistics of one document (columns of curate/heuristics' attributes); None when
        the shared pass computes what it needs."""
        return None

    def stats_batch(self, texts: list[str], cfg: Any) -> list[Stats]:
        """Its own statistics of a shard's documents, in order: `stats` of each, unless a filter
        scores a batch faster at once (a classifier's predict call)."""
        return [self.stats(text, cfg) or {} for text in texts]

    def files(self, cfg: Any) -> list[str]:
        """Files outside the project its statistics read at run time (a user's labelled data):
        their content is part of curate/heuristics' key, as curation's inputs are."""
        return []

    def failures(self, stats: Stats, cfg: Any) -> list[str]:
        raise NotImplementedError
