"""Document length in characters.

Statistics from the shared pass (data_prep.heuristics.compute_stats); thresholds applied by curate/select.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from data_prep.filters.base import CurationFilter, FilterBase, Stats, failing


class LengthConfig(FilterBase):
    min_chars: int = Field(100, ge=0, description="Documents shorter than this are removed.")
    max_chars: int = Field(500_000, ge=1, description="Documents longer than this are removed.")


def length_failures(stats: Stats, cfg: LengthConfig) -> list[str]:
    return failing(
        "length",
        cfg.enabled,
        [("too_short", cfg.min_chars, stats["n_chars"], "min"), ("too_long", cfg.max_chars, stats["n_chars"], "max")],
    )


class Length(CurationFilter):
    name = "length"
    description = "Document length in characters."
    config = LengthConfig
    stat_fields = ()
    before_language = True
    code = ("data_prep.filters.length", "data_prep.heuristics")

    def failures(self, stats: Stats, cfg: Any) -> list[str]:
        return length_failures(stats, cfg)
