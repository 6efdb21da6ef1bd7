"""Domain mixing: resample domains towards target token shares.

Listed domains are resampled so that, among themselves, their token shares match the
normalized weights while their total stays the same; unlisted domains keep their natural
size. Downsampling drops a seeded random subset (recorded as removed, reason
`mix:downsampled`); upsampling repeats documents (the `repeat` column) up to `max_repeat`.
Token counts here are a character-based proxy; the pack step reports real token shares.
"""

from __future__ import annotations

import math
from collections import defaultdict

import xxhash

from data_prep.config import MixConfig


def _priority(doc_id: str, seed: int) -> int:
    """A stable pseudo-random order of documents that does not depend on corpus order."""
    return xxhash.xxh64_intdigest(doc_id.encode(), seed=seed)


def plan_mix(docs: list[tuple[str, str, int]], cfg: MixConfig) -> tuple[list[int], dict[str, dict[str, float]]]:
    """docs: (id, domain, tokens) of survivors -> (repeat per doc in input order, 0 = dropped; report per domain)."""
    tokens: dict[str, int] = defaultdict(int)
    by_domain: dict[str, list[int]] = defaultdict(list)
    for position, (_, domain, size) in enumerate(docs):
        tokens[domain] += size
        by_domain[domain].append(position)
    listed = {d: w for d, w in cfg.weights.items() if w > 0 and tokens.get(d)}
    total_listed = sum(tokens[d] for d in listed)
    weight_sum = sum(listed.values()) or 1.0
    repeats = [1] * len(docs)
    report: dict[str, dict[str, float]] = {}
    for domain, weight in listed.items():
        target = weight / weight_sum * total_listed
        ratio = min(target / tokens[domain], cfg.max_repeat)
        members = sorted(by_domain[domain], key=lambda p: (_priority(docs[p][0], cfg.seed), p))
        for position, repeat in _resample([(p, docs[p][2]) for p in members], ratio, target):
            repeats[position] = repeat
        report[domain] = {
            "target_share": weight / weight_sum,
            "natural_share": tokens[domain] / total_listed,
            "ratio": round(ratio, 4),
        }
    achieved = {d: sum(repeats[p] * docs[p][2] for p in by_domain[d]) for d in listed}
    achieved_total = sum(achieved.values()) or 1
    for domain in listed:
        report[domain]["achieved_share"] = achieved[domain] / achieved_total
    return repeats, report


def _resample(members: list[tuple[int, int]], ratio: float, target: float) -> list[tuple[int, int]]:
    """(position, repeat) for members in priority order: keep until the target, or repeat up to it."""
    out: list[tuple[int, int]] = []
    if ratio < 1:
        taken = 0
        for position, size in members:
            keep = 1 if taken < target else 0
            taken += size * keep
            out.append((position, keep))
        return out
    whole = math.floor(ratio)
    extra_target = (ratio - whole) * sum(size for _, size in members)
    extra = 0
    for position, size in members:
        bonus = 1 if extra < extra_target else 0
        extra += size * bonus
        out.append((position, whole + bonus))
    return out
