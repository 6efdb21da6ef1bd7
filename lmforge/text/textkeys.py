"""Word n-gram keys of a text: what decides whether a training text contains an evaluation item.

Two stages ask that question and must get the same answer: curation's decontamination removes
a training document that contains an item (`data_prep.decontaminate`), and the evaluation stage
flags an item some training source contained (`evaluation.contamination`). Both use these
functions, so a document removed here is exactly one that check would have flagged.

- `words`: lowercase, every run of non-alphanumerics one space; digits kept ("3 + 5" and
  "4 + 6" are different questions), and so is the arithmetic between two numbers, as a word
  ("6 + 0 = 6" is "6 plus 0 equals 6", not the same words as "6 - 0 = 6"). Not the near-dedup view of `data_prep.textnorm`, which
  folds digits and strips accents to find near-copies of documents.
- `gram_keys`: each distinct word is hashed once (xxh64) and n-gram keys are formed with
  position-dependent odd multipliers, so no Python object is made per n-gram.
- `whole_key`: the whole normalised text, for items too short for n-grams.
"""

from __future__ import annotations

import re

import numpy as np
import xxhash

_NON_WORD = re.compile(r"[\W_]+", re.UNICODE)
_ARITHMETIC = re.compile(r"(?<=\d)\s*([-+*/=])\s*(?=\d)")
_OPERATOR_WORDS = {"+": " plus ", "-": " minus ", "*": " times ", "/": " over ", "=": " equals "}
_MULTIPLIERS = np.random.default_rng(20241123).integers(1, 2**63, size=64, dtype=np.uint64) | np.uint64(1)


def words(text: str) -> list[str]:
    lowered = _ARITHMETIC.sub(lambda m: _OPERATOR_WORDS[m.group(1)], text.lower())
    return _NON_WORD.sub(" ", lowered).split()


def gram_keys(tokens: list[str], n: int, cache: dict[str, int] | None = None) -> np.ndarray:
    """One 64-bit key per word n-gram of `tokens` (empty when there are fewer than n words)."""
    if len(tokens) < n:
        return np.zeros(0, dtype=np.uint64)
    cache = {} if cache is None else cache
    hashes = np.fromiter(
        (cache[w] if w in cache else cache.setdefault(w, xxhash.xxh64_intdigest(w.encode())) for w in tokens),
        dtype=np.uint64,
        count=len(tokens),
    )
    width = len(tokens) - n + 1
    with np.errstate(over="ignore"):
        keys = hashes[:width] * _MULTIPLIERS[0]
        for k in range(1, n):
            keys = keys + hashes[k : k + width] * _MULTIPLIERS[k]
    return keys


def whole_key(tokens: list[str]) -> int:
    return xxhash.xxh64_intdigest(" ".join(tokens).encode())
