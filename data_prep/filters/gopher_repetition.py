"""Gopher's repetition rules, as datatrove's.

Statistics from the shared pass (data_prep.heuristics.compute_stats); thresholds applied by curate/select.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from data_prep.filters.base import Check, CurationFilter, FilterBase, Stats, failing


class GopherRepetitionConfig(FilterBase):
    """Gopher repetition rules, thresholds as in datatrove."""

    dup_line_frac: float | None = 0.3
    dup_para_frac: float | None = 0.3
    dup_line_char_frac: float | None = 0.2
    dup_para_char_frac: float | None = 0.2
    top_n_grams: dict[int, float] = Field(default_factory=lambda: {2: 0.2, 3: 0.18, 4: 0.16})
    dup_n_grams: dict[int, float] = Field(
        default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}
    )


def gopher_repetition_failures(stats: Stats, cfg: GopherRepetitionConfig) -> list[str]:
    checks: list[Check] = [
        (name, getattr(cfg, name), stats[name], "max")
        for name in ("dup_para_frac", "dup_para_char_frac", "dup_line_frac", "dup_line_char_frac")
    ]
    # A KeyError here means the stats were computed with other n values (stale StatParams).
    for n, threshold in sorted(cfg.top_n_grams.items()):
        checks.append((f"top_{n}_gram", threshold, stats[f"top_{n}gram_char_frac"], "max"))
    for n, threshold in sorted(cfg.dup_n_grams.items()):
        checks.append((f"duplicated_{n}_n_grams", threshold, stats[f"dup_{n}gram_char_frac"], "max"))
    return failing("gopher_repetition", cfg.enabled, checks)


class GopherRepetition(CurationFilter):
    name = "gopher_repetition"
    description = "Gopher's repetition rules, as datatrove's."
    config = GopherRepetitionConfig
    stat_fields = ("top_n_grams", "dup_n_grams")
    code = ("data_prep.filters.gopher_repetition", "data_prep.heuristics")

    def failures(self, stats: Stats, cfg: Any) -> list[str]:
        return gopher_repetition_failures(stats, cfg)
