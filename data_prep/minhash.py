"""Vectorized MinHash signatures, LSH candidate search and exact verification.

Defaults follow FineWeb/datatrove: word 5-gram shingles of the normalized text,
112 permutations as 14 bands x 8 rows, 64-bit hashing. The signatures are datasketch's
MinHash with its 64-bit scheme (`MinHash(num_perm, seed, scheme="affine64")`): the same
permutations, taken from datasketch, and the same construction (MurmurHash3 fmix64 pre-mix,
then h_i(x) = a_i * x + b_i mod 2^64 with a_i odd), so a signature here is bit-identical to
`datasketch.MinHash.update_batch` over the document's shingle keys and can be handed to
datasketch (`LeanMinHash`, `MinHashLSH`) as is. What differs is only how it is computed:

- words are hashed once (xxh64, memoized per batch) and n-gram shingle keys are formed
  with numpy arithmetic, so no Python object is made per shingle;
- the permutations are applied to a whole batch of documents at once and reduced per
  document with `np.minimum.reduceat`, in column chunks so one huge document cannot blow
  memory up.

LSH only proposes candidates; each candidate pair is then verified with the exact
Jaccard of the two shingle sets, so precision does not depend on band luck, and the
similarity is stored as an edge (selection later clusters edges at its threshold).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import xxhash

from data_prep.textnorm import dedup_words

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)
_CHUNK_COLUMNS = 1 << 15
_SMALL_BUCKET = 32


def _mix64(x: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finalizer (datasketch's affine64 pre-mix): every input bit reaches every output bit."""
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(0xFF51AFD7ED558CCD)
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(0xC4CEB9FE1A85EC53)
    return x ^ (x >> np.uint64(33))


@dataclass(frozen=True)
class MinHasher:
    num_perm: int = 112
    ngram: int = 5
    seed: int = 1

    def __post_init__(self) -> None:
        from datasketch import MinHash

        a, b = MinHash(num_perm=self.num_perm, seed=self.seed, scheme="affine64").permutations
        object.__setattr__(self, "_a", np.asarray(a, dtype=np.uint64).reshape(-1, 1))
        object.__setattr__(self, "_b", np.asarray(b, dtype=np.uint64).reshape(-1, 1))
        # distinct odd multipliers combine the n word hashes of a shingle position-sensitively
        rng = np.random.default_rng(self.seed)
        object.__setattr__(self, "_pos", rng.integers(1, 2**63, size=self.ngram, dtype=np.uint64) | np.uint64(1))

    def shingle_keys(self, text: str, cache: dict[str, int] | None = None) -> np.ndarray:
        """One 64-bit key per word n-gram (with repeats): what datasketch's `hashfunc` would return."""
        words = dedup_words(text)
        if not words:
            return np.zeros(0, dtype=np.uint64)
        cache = {} if cache is None else cache
        hashes = np.fromiter(
            (cache[w] if w in cache else cache.setdefault(w, xxhash.xxh64_intdigest(w.encode())) for w in words),
            dtype=np.uint64, count=len(words),
        )
        n = min(self.ngram, len(hashes))
        width = len(hashes) - n + 1
        with np.errstate(over="ignore"):
            combined = hashes[:width] * self._pos[0]
            for k in range(1, n):
                combined = combined + hashes[k : k + width] * self._pos[k]
            return combined + np.uint64(n)

    def shingles(self, text: str, cache: dict[str, int] | None = None) -> np.ndarray:
        """Unique pre-mixed 64-bit shingle hashes of the document (datasketch's fmix64 of each key)."""
        return np.unique(_mix64(self.shingle_keys(text, cache)))

    def signatures(self, texts: list[str]) -> np.ndarray:
        """(len(texts), num_perm) uint64 signatures; empty documents get all-max rows."""
        cache: dict[str, int] = {}
        return self.signatures_of([self.shingles(t, cache) for t in texts])

    def signatures_of(self, shingle_sets: list[np.ndarray]) -> np.ndarray:
        sig = np.full((len(shingle_sets), self.num_perm), _MASK, dtype=np.uint64)
        lengths = np.array([len(s) for s in shingle_sets], dtype=np.int64)
        if lengths.sum() == 0:
            return sig
        flat = np.concatenate(shingle_sets)
        owner = np.repeat(np.arange(len(shingle_sets)), lengths)
        for start in range(0, len(flat), _CHUNK_COLUMNS):
            cols = flat[start : start + _CHUNK_COLUMNS]
            docs = owner[start : start + _CHUNK_COLUMNS]
            with np.errstate(over="ignore"):
                permuted = cols[None, :] * self._a + self._b
            # segment starts inside this chunk: first column and every change of document
            starts = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])
            mins = np.minimum.reduceat(permuted, starts, axis=1)
            rows = docs[starts]
            sig[rows] = np.minimum(sig[rows], mins.T)
        return sig


def band_keys(signatures: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(num_docs, bands) uint64 keys; equal keys = identical band (collisions ~2^-64)."""
    shaped = signatures[:, : bands * rows].reshape(len(signatures), bands, rows)
    weights = np.random.default_rng(0).integers(1, 2**63, size=rows, dtype=np.uint64) | np.uint64(1)
    with np.errstate(over="ignore"):
        return _mix64((shaped * weights).sum(axis=2, dtype=np.uint64))


def candidate_pairs(keys: np.ndarray) -> np.ndarray:
    """Unique (i, j), i < j, of documents sharing a bucket in any band of a (docs, bands) key array."""
    return candidate_pairs_by_band(keys[:, band] for band in range(keys.shape[1]))


def candidate_pairs_by_band(columns: Iterable[np.ndarray]) -> np.ndarray:
    """Unique (i, j), i < j, of documents sharing a bucket in any band, one band's keys at a time.

    Only one band (8 bytes per document) is in memory at once, so the whole corpus's
    signatures never have to be. Small buckets give all their pairs; big ones (boilerplate
    copied thousands of times) give a star around their first member, so work stays linear.
    """
    found: list[np.ndarray] = []
    for column in columns:
        order = np.argsort(column, kind="stable")
        sorted_keys = column[order]
        bounds = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1], True])
        sizes = np.diff(bounds)
        for start, size in zip(bounds[:-1][sizes > 1], sizes[sizes > 1]):
            members = np.sort(order[start : start + size])
            if size <= _SMALL_BUCKET:
                pairs = np.array(list(itertools.combinations(members, 2)), dtype=np.int64)
            else:
                pairs = np.stack([np.full(size - 1, members[0]), members[1:]], axis=1)
            found.append(pairs)
    if not found:
        return np.zeros((0, 2), dtype=np.int64)
    return np.unique(np.concatenate(found), axis=0)


def exact_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard of two unique-sorted shingle hash arrays."""
    if len(a) == 0 and len(b) == 0:
        return 1.0
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter)


def estimated_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    return float(np.mean(sig_a == sig_b))
