"""FineWeb's additional quality rules, as datatrove's.

Statistics from the shared pass (data_prep.heuristics.compute_stats); thresholds applied by curate/select.
"""

from __future__ import annotations

from typing import Any

from data_prep.filters.base import CurationFilter, FilterBase, Stats, failing


class FineWebConfig(FilterBase):
    """FineWeb's additional quality rules, thresholds as in datatrove."""

    line_punct_thr: float | None = 0.12
    line_punct_exclude_zero: bool = False
    short_line_thr: float | None = 0.67
    short_line_length: int = 30
    char_duplicates_ratio: float | None = 0.01
    new_line_ratio: float | None = 0.3


def fineweb_failures(stats: Stats, cfg: FineWebConfig) -> list[str]:
    punct = stats["fw_line_punct_ratio"]
    # line_punct_exclude_zero spares documents with no terminal punctuation at all.
    punct_thr = None if (punct == 0 and cfg.line_punct_exclude_zero) else cfg.line_punct_thr
    return failing(
        "fineweb",
        cfg.enabled,
        [
            ("line_punct_ratio", punct_thr, punct, "min"),
            ("short_line_ratio", cfg.short_line_thr, stats["fw_short_line_ratio"], "max"),
            ("char_dup_ratio", cfg.char_duplicates_ratio, stats["fw_char_dup_ratio"], "max"),
            ("list_ratio", cfg.new_line_ratio, stats["fw_new_line_ratio"], "max"),
        ],
    )


class FineWeb(CurationFilter):
    name = "fineweb"
    description = "FineWeb's additional quality rules, as datatrove's."
    config = FineWebConfig
    stat_fields = ("short_line_length",)
    code = ("data_prep.filters.fineweb", "data_prep.heuristics")

    def failures(self, stats: Stats, cfg: Any) -> list[str]:
        return fineweb_failures(stats, cfg)
