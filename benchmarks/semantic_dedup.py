"""Semantic dedup on the planted paraphrase set: recall and false positives beside MinHash's, and the
pair search + decision beside semhash's `self_deduplicate` on the same embeddings.

    .venv/bin/python benchmarks/semantic_dedup.py [--sizes 2000 20000] [--repeats 3]

For each size N, `tests/paraphrases.planted_set(N, N // 10, topics=...)`: N documents, a tenth
of them paraphrases of others (sentences reordered, about a third of the content words swapped
for synonyms, names swapped), in topics of 50 documents sharing a vocabulary (at most 120 topics:
the generator's word list runs out beyond, so 20,000 documents are 167 a topic).

1. Embeddings: lmforge's corpus encoder (data_prep/semantic.py: hashed word 1-2-gram TF-IDF with the
   IDF of the whole set, randomly projected to 512 dimensions), timed once; both dedups below get
   these same vectors.
2. lmforge: k-means clusters (`cluster_docs` 10,000, each document in its 2 nearest), exact pairs within a cluster at or above
   the threshold, the quality-ordered greedy decision. semhash 0.5: `SemHash.from_embeddings`
   (its exact-text grouping and a usearch index, its default backend) then `self_deduplicate`.
   Best of `--repeats`; docs/s and the ratio lmforge / semhash (the issue's bar: >= 0.9).
3. MinHash (lmforge's near-dedup: 14 bands x 8 rows, word 5-grams, exact Jaccard >= 0.8) on the
   same documents.

A planted pair is found when exactly one of its two documents is removed; a removal is false when
the document is in no planted pair. Recall = found / planted pairs; false positive rate = false
removals / documents in no planted pair.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from data_prep import semantic  # noqa: E402
from data_prep.minhash import MinHasher, band_keys, candidate_pairs, exact_jaccard  # noqa: E402
from tests.paraphrases import PlantedSet, planted_set  # noqa: E402


def score(planted: PlantedSet, removed: set[int]) -> dict[str, float]:
    in_pair = {i for pair in planted.pairs() for i in pair}
    found = sum((a in removed) != (b in removed) for a, b in planted.pairs())
    false = len(removed - in_pair)
    return {
        "recall": found / len(planted.pairs()),
        "false_removals": false,
        "fpr": false / (len(planted.texts) - len(in_pair)),
    }


def embed(texts: list[str]) -> tuple[np.ndarray, float]:
    start = time.perf_counter()
    frequencies = [semantic.document_frequencies(texts[i : i + 1000], 2) for i in range(0, len(texts), 1000)]
    encoder = semantic.CorpusEncoder(semantic.idf_from(frequencies, len(texts)), 2, 512, 0)
    vectors = encoder.encode(texts)
    return vectors, time.perf_counter() - start


def lmforge_dedup(vectors: np.ndarray, threshold: float) -> set[int]:
    n = len(vectors)
    labels = semantic.clusters(vectors, 10000, 0, 2)
    a, b, cosine = semantic.similar_pairs(vectors, labels, threshold)
    d = semantic.decide(a, b, cosine, np.ones(n, bool), threshold, np.full(n, np.nan), np.ones(n))
    return set(d.removed.tolist())


class Precomputed:
    """semhash wants an encoder object; the vectors are given, so it is never called."""

    def encode(self, inputs: Any, **kwargs: Any) -> np.ndarray:
        raise AssertionError("semhash re-encoded the records")


def semhash_dedup(vectors: np.ndarray, texts: list[str], threshold: float) -> set[int]:
    from semhash import SemHash

    result = SemHash.from_embeddings(vectors, texts, model=Precomputed()).self_deduplicate(threshold=threshold)
    where = {t: i for i, t in enumerate(texts)}
    return {where[d.record] for d in result.filtered}


def minhash_dedup(texts: list[str]) -> set[int]:
    hasher = MinHasher(num_perm=112, ngram=5, seed=1)
    signatures = hasher.signatures(texts)
    pairs = candidate_pairs(band_keys(signatures, 14, 8))
    shingles = [hasher.shingles(t) for t in texts]
    removed: set[int] = set()
    for a, b in sorted(map(tuple, pairs.tolist())):
        if a not in removed and exact_jaccard(shingles[a], shingles[b]) >= 0.8:
            removed.add(b)
    return removed


def best_of(repeats: int, fn: Any, *args: Any) -> tuple[Any, float]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn(*args)
        times.append(time.perf_counter() - start)
    return out, min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threshold", type=float, default=0.4)  # the planted set's (the default is 0.5)
    args = parser.parse_args()
    print(f"threshold {args.threshold}, best of {args.repeats}\n")
    print("| docs | method | recall | false removals | FPR | dedup docs/s | vs semhash |")
    print("|---|---|---|---|---|---|---|")
    for n in args.sizes:
        planted = planted_set(n, n // 10, topics=min(max(40, n // 50), 120))
        vectors, embed_s = embed(planted.texts)
        mine, mine_s = best_of(args.repeats, lmforge_dedup, vectors, args.threshold)
        theirs, theirs_s = best_of(args.repeats, semhash_dedup, vectors, planted.texts, args.threshold)
        start = time.perf_counter()
        near = minhash_dedup(planted.texts)
        near_s = time.perf_counter() - start
        rows = [
            ("lmforge semantic", mine, mine_s, f"{theirs_s / mine_s:.2f}x"),
            ("semhash (same vectors)", theirs, theirs_s, "1.00x"),
            ("MinHash J>=0.8", near, near_s, ""),
        ]
        for name, removed, seconds, ratio in rows:
            s = score(planted, removed)
            print(
                f"| {n} | {name} | {s['recall']:.3f} | {s['false_removals']} | {s['fpr']:.1e} | "
                f"{n / seconds:,.0f} | {ratio} |"
            )
        print(f"| {n} | (embedding, corpus encoder) | | | | {n / embed_s:,.0f} | |")


if __name__ == "__main__":
    main()
