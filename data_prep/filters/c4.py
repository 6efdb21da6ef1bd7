"""C4's rules (Raffel et al. 2020) at document level, as datatrove's C4QualityFilter.

Statistics from the shared pass (data_prep.heuristics.compute_stats); thresholds applied by curate/select.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from data_prep.filters.base import CurationFilter, FilterBase, Stats, failing


class C4Config(FilterBase):
    """C4 rules (Raffel et al. 2020) applied at document level, as datatrove's C4QualityFilter."""

    min_num_sentences: int | None = 5
    filter_lorem_ipsum: bool = True
    filter_curly_bracket: bool = True
    # The next parameters change how sentences are counted, so they are part of the heuristics key.
    filter_no_terminal_punct: bool = Field(False, description="FineWeb sets this off; C4 had it on.")
    min_words_per_line: int = 3
    max_word_length: int = 1000


def c4_failures(stats: Stats, cfg: C4Config) -> list[str]:
    # The two document flags are rules with threshold 0 when switched on.
    return failing(
        "c4",
        cfg.enabled,
        [
            ("too_few_sentences", cfg.min_num_sentences, stats["c4_num_sentences"], "min"),
            ("lorem_ipsum", 0 if cfg.filter_lorem_ipsum else None, int(stats["c4_has_lorem_ipsum"]), "max"),
            ("curly_bracket", 0 if cfg.filter_curly_bracket else None, int(stats["c4_has_curly_bracket"]), "max"),
        ],
    )


class C4(CurationFilter):
    name = "c4"
    description = "C4's rules (Raffel et al. 2020) at document level, as datatrove's C4QualityFilter."
    config = C4Config
    stat_fields = ("filter_no_terminal_punct", "min_words_per_line", "max_word_length")
    code = ("data_prep.filters.c4", "data_prep.heuristics")

    def failures(self, stats: Stats, cfg: Any) -> list[str]:
        return c4_failures(stats, cfg)
