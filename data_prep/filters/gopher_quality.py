"""Gopher's quality rules (Rae et al. 2021), as datatrove's.

Statistics from the shared pass (data_prep.heuristics.compute_stats); thresholds applied by curate/select.
"""

from __future__ import annotations

from typing import Any

from data_prep.filters.base import CurationFilter, FilterBase, Stats, failing


class GopherQualityConfig(FilterBase):
    """Gopher quality rules (Rae et al. 2021), thresholds as in datatrove."""

    min_doc_words: int | None = 50
    max_doc_words: int | None = 100_000
    min_avg_word_length: float | None = 3
    max_avg_word_length: float | None = 10
    max_symbol_word_ratio: float | None = 0.1
    max_bullet_lines_ratio: float | None = 0.9
    max_ellipsis_lines_ratio: float | None = 0.3
    max_non_alpha_words_ratio: float | None = 0.8
    min_stop_words: int | None = 2


def gopher_quality_failures(stats: Stats, cfg: GopherQualityConfig) -> list[str]:
    return failing(
        "gopher_quality",
        cfg.enabled,
        [
            ("min_doc_words", cfg.min_doc_words, stats["n_words"], "min"),
            ("max_doc_words", cfg.max_doc_words, stats["n_words"], "max"),
            ("min_avg_word_length", cfg.min_avg_word_length, stats["avg_word_length"], "min"),
            ("max_avg_word_length", cfg.max_avg_word_length, stats["avg_word_length"], "max"),
            ("max_symbol_word_ratio", cfg.max_symbol_word_ratio, stats["symbol_word_ratio"], "max"),
            ("max_bullet_lines_ratio", cfg.max_bullet_lines_ratio, stats["bullet_lines_ratio"], "max"),
            ("max_ellipsis_lines_ratio", cfg.max_ellipsis_lines_ratio, stats["ellipsis_lines_ratio"], "max"),
            # datatrove's name: despite "max", documents with fewer alphabetic words than this fail.
            ("max_non_alpha_words_ratio", cfg.max_non_alpha_words_ratio, stats["alpha_words_ratio"], "min"),
            ("min_stop_words", cfg.min_stop_words, stats["n_stop_words"], "min"),
        ],
    )


class GopherQuality(CurationFilter):
    name = "gopher_quality"
    description = "Gopher's quality rules (Rae et al. 2021), as datatrove's."
    config = GopherQualityConfig
    stat_fields = ()
    code = ("data_prep.filters.gopher_quality", "data_prep.heuristics")

    def failures(self, stats: Stats, cfg: Any) -> list[str]:
        return gopher_quality_failures(stats, cfg)
