"""Per-item metrics from lm-eval's sample logs, their 95% bootstrap intervals, and paired comparisons.

lm-eval reports a standard error per metric; an interval computed from the items themselves
is what lets "DPO improved task X" be a claim: two models evaluated on the same items are
compared item by item (a paired bootstrap over the shared items), so the noise of which items
happen to be in the set cancels. Perplexities are ratios over the whole set (exp of total
negative log-likelihood over total words or bytes), and are resampled as such, not averaged.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

RATIO_METRICS = {"word_perplexity", "byte_perplexity", "bits_per_byte", "token_perplexity"}
LOWER_IS_BETTER = RATIO_METRICS
PRIMARY = {
    "lmforge_continuation": "acc_norm",
    "lmforge_heldout_ppl": "word_perplexity",
    "lmforge_chat_exact": "exact_match",
    "lmforge_preference": "acc",
    "lmforge_humaneval": "pass@1",
    "lmforge_passkey": "acc",
    "lmforge_ppl_by_length": "token_perplexity",
}
LENGTH_ID = re.compile(r"L(\d+)-")  # the long-context tasks' item ids start with their length


def by_length(metric: str, values: dict[str, Any]) -> list[list[float]]:
    """[[length, the metric over that length's items], ...] by length, for items whose ids say their
    length (else [])."""
    groups: dict[int, list[Any]] = {}
    for item, value in values.items():
        if match := LENGTH_ID.match(item):
            groups.setdefault(int(match.group(1)), []).append(value)
    return [[length, aggregate(metric, groups[length])] for length in sorted(groups)]


def item_values(rows: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    """{item id: value} -- a number, or (log-likelihood, words or bytes) for a perplexity."""
    return {row["id"]: row["metrics"][metric] for row in rows if metric in row["metrics"]}


def aggregate(metric: str, values: list[Any]) -> float:
    if not values:
        return float("nan")
    if metric in RATIO_METRICS:
        ll = sum(v[0] for v in values)
        count = sum(v[1] for v in values)
        if metric == "bits_per_byte":
            return -ll / count / math.log(2)
        return math.exp(-ll / count)
    return float(np.mean([float(v) for v in values]))


def bootstrap(metric: str, values: list[Any], iters: int = 1000, seed: int = 0) -> tuple[float, float, float]:
    """(estimate, low, high) with a 95% percentile interval over resampled items."""
    estimate = aggregate(metric, values)
    if len(values) < 2:
        return estimate, float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(values), size=(iters, len(values)))
    if metric in RATIO_METRICS:
        ll = np.array([v[0] for v in values], dtype=np.float64)
        count = np.array([v[1] for v in values], dtype=np.float64)
        ratio = -ll[picks].sum(axis=1) / count[picks].sum(axis=1)
        draws = ratio / math.log(2) if metric == "bits_per_byte" else np.exp(ratio)
    else:
        draws = np.array([float(v) for v in values])[picks].mean(axis=1)
    return estimate, float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))


def paired(
    metric: str, before: dict[str, Any], after: dict[str, Any], iters: int = 1000, seed: int = 0
) -> dict[str, Any]:
    """after - before on the items both have, with a paired bootstrap interval."""
    shared = sorted(set(before) & set(after))
    if not shared:
        return {"items": 0, "delta": float("nan"), "low": float("nan"), "high": float("nan")}
    b = [before[i] for i in shared]
    a = [after[i] for i in shared]
    delta = aggregate(metric, a) - aggregate(metric, b)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(shared), size=(iters, len(shared)))
    draws = (
        np.array([aggregate(metric, [a[k] for k in p]) - aggregate(metric, [b[k] for k in p]) for p in picks])
        if metric in RATIO_METRICS
        else (np.array([float(x) for x in a]) - np.array([float(x) for x in b]))[picks].mean(axis=1)
    )
    low, high = float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))
    better = (delta < 0) if metric in LOWER_IS_BETTER else (delta > 0)
    significant = not (low <= 0 <= high)
    return {
        "items": len(shared),
        "delta": delta,
        "low": low,
        "high": high,
        "verdict": ("better" if better else "worse") if significant else "no significant change",
    }
