"""Broken encoding: replacement characters, C1 controls, mojibake.

Statistics from the shared pass (data_prep.heuristics.compute_stats); thresholds applied by curate/select.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from data_prep.filters.base import CurationFilter, FilterBase, Stats, failing


class EncodingConfig(FilterBase):
    max_bad_char_ratio: float = Field(
        0.01, ge=0.0, le=1.0, description="Max fraction of replacement/mojibake/C1-control characters."
    )


def encoding_failures(stats: Stats, cfg: EncodingConfig) -> list[str]:
    return failing("encoding", cfg.enabled, [("bad_chars", cfg.max_bad_char_ratio, stats["bad_char_ratio"], "max")])


class Encoding(CurationFilter):
    name = "encoding"
    description = "Broken encoding: replacement characters, C1 controls, mojibake."
    config = EncodingConfig
    stat_fields = ()
    code = ("data_prep.filters.encoding", "data_prep.heuristics")

    def failures(self, stats: Stats, cfg: Any) -> list[str]:
        return encoding_failures(stats, cfg)
