"""Vectorized MinHash signatures, LSH candidate search and exact verification.

Defaults follow FineWeb/datatrove: word 5-gram shingles of the normalized text,
112 permutations as 14 bands x 8 rows, 64-bit hashing. The signatures are datasketch's
MinHash with its 64-bit scheme (`MinHash(num_perm, seed, scheme="affine64")`): the same
permutations, taken from datasketch, and the same construction (MurmurHash3 fmix64 pre-mix,
then h_i(x) = a_i * x + b_i mod 2^64 with a_i odd), so a signature here is bit-identical to
`datasketch.MinHash.update_batch` over the document's shingle keys and can be handed to
datasketch (`LeanMinHash`, `MinHashLSH`) as is. What differs is only how it is computed:

- words are cut with one `bytes.translate` (`dedup_word_bytes`: the words of
  `textnorm.dedup_words`, without a regex substitution per word);
- words are hashed (xxh64) and n-gram shingle keys formed with numpy arithmetic over a
  whole batch of documents at once, so no Python object is made per shingle;
- the permutations are applied to a whole batch of documents at once and reduced per
  document with `np.minimum.reduceat`, in column chunks into one reused buffer, so one
  huge document cannot blow memory up.

LSH only proposes candidates; each candidate pair is then verified with the exact
Jaccard of the two shingle sets, so precision does not depend on band luck, and the
similarity is stored as an edge (selection later clusters edges at its threshold).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import xxhash

from data_prep.textnorm import _COMBINING_MARKS

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)
_CHUNK_COLUMNS = 1 << 14  # 112 x 16384 x 8 bytes = 14 MiB of permuted hashes at a time
_SMALL_BUCKET = 32


def _ascii_table(lower: bool) -> bytes:
    """Bytes translation: ASCII digits -> "0", other ASCII non-alphanumerics -> space, the rest kept."""
    table = bytearray(range(256))
    for code in range(128):
        char = chr(code)
        table[code] = ord("0") if char.isdigit() else ord(char.lower() if lower else char) if char.isalnum() else 32
    return bytes(table)


_ASCII_LOWER, _ASCII_KEEP = _ascii_table(lower=True), _ascii_table(lower=False)
_NON_ASCII_SEPARATOR = re.compile(r"[^\w\x00-\x7f]")  # what dedup_words' [\W_]+ removes outside ASCII
_NON_ASCII_DIGIT = re.compile(r"[^\D\x00-\x7f]")


def dedup_word_bytes(text: str) -> list[bytes]:
    """`textnorm.dedup_words(text)` as UTF-8 bytes (what the word hash reads), 2-8x faster.

    The same steps (lowercase, accents stripped, digits to 0, every other non-word character a
    separator), but the per-character work on ASCII is one `bytes.translate` instead of regex
    substitutions; `tests/test_dedup.py` checks the two agree on every Unicode character.
    """
    if text.isascii():
        return text.encode().translate(_ASCII_LOWER).split()
    simple = _NON_ASCII_SEPARATOR.sub(" ", _COMBINING_MARKS.sub("", unicodedata.normalize("NFD", text.lower())))
    if not simple.isascii():
        simple = _NON_ASCII_DIGIT.sub("0", simple)
    return simple.encode().translate(_ASCII_KEEP).split()


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
    # derived from the above in __post_init__: the permutations and the shingle position multipliers
    _a: np.ndarray = field(init=False, repr=False, compare=False)
    _b: np.ndarray = field(init=False, repr=False, compare=False)
    _pos: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from datasketch import MinHash

        a, b = MinHash(num_perm=self.num_perm, seed=self.seed, scheme="affine64").permutations
        object.__setattr__(self, "_a", np.asarray(a, dtype=np.uint64).reshape(-1, 1))
        object.__setattr__(self, "_b", np.asarray(b, dtype=np.uint64).reshape(-1, 1))
        # distinct odd multipliers combine the n word hashes of a shingle position-sensitively
        rng = np.random.default_rng(self.seed)
        object.__setattr__(self, "_pos", rng.integers(1, 2**63, size=self.ngram, dtype=np.uint64) | np.uint64(1))

    def batch_keys(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Shingle keys of every document, concatenated, and where each document's keys start
        (len(texts) + 1 bounds). One key per word n-gram, with repeats; a document shorter than
        n words has one key for all its words, an empty one none."""
        words: list[bytes] = []
        counts = np.empty(len(texts), dtype=np.int64)
        for i, text in enumerate(texts):
            doc = dedup_word_bytes(text)
            words += doc
            counts[i] = len(doc)
        # xxh64 of a short word costs less than looking it up in a memo
        hashes = np.fromiter(map(xxhash.xxh64_intdigest, words), dtype=np.uint64, count=len(words))
        n = self.ngram
        width = max(len(hashes) - n + 1, 0)
        combined = hashes[:width] * self._pos[0]
        for k in range(1, n):
            combined += hashes[k : k + width] * self._pos[k]
        combined += np.uint64(n)
        starts = np.cumsum(counts) - counts
        # positions whose n-gram lies inside one document
        owner = np.repeat(np.arange(len(texts)), counts)[:width]
        keys = combined[np.arange(width) + n <= (starts + counts)[owner]]
        key_counts = np.where(counts >= n, counts - n + 1, np.minimum(counts, 1))
        bounds = np.zeros(len(texts) + 1, dtype=np.int64)
        np.cumsum(key_counts, out=bounds[1:])
        short = np.flatnonzero((counts > 0) & (counts < n))
        if len(short):  # rare: one key over all the words, with the count as n
            full = np.empty(bounds[-1], dtype=np.uint64)
            full[np.repeat(counts >= n, key_counts)] = keys
            with np.errstate(over="ignore"):
                for doc in short:
                    h = hashes[starts[doc] : starts[doc] + counts[doc]]
                    full[bounds[doc]] = (h * self._pos[: len(h)]).sum(dtype=np.uint64) + np.uint64(len(h))
            keys = full
        return keys, bounds

    def shingle_keys(self, text: str) -> np.ndarray:
        """One 64-bit key per word n-gram (with repeats): what datasketch's `hashfunc` would return."""
        return self.batch_keys([text])[0]

    def shingles(self, text: str) -> np.ndarray:
        """Unique pre-mixed 64-bit shingle hashes of the document (datasketch's fmix64 of each key)."""
        return np.unique(_mix64(self.shingle_keys(text)))

    def shingle_sets(self, texts: list[str]) -> list[np.ndarray]:
        """`shingles` of each document, computed as one batch."""
        keys, bounds = self.batch_keys(texts)
        mixed = _mix64(keys)
        return [np.unique(mixed[bounds[i] : bounds[i + 1]]) for i in range(len(texts))]

    def signatures(self, texts: list[str]) -> np.ndarray:
        """(len(texts), num_perm) uint64 signatures; empty documents get all-max rows.

        Repeated shingles are not removed first: they cannot change a minimum."""
        keys, bounds = self.batch_keys(texts)
        return self._minima(_mix64(keys), bounds)

    def signatures_of(self, shingle_sets: list[np.ndarray]) -> np.ndarray:
        bounds = np.zeros(len(shingle_sets) + 1, dtype=np.int64)
        np.cumsum([len(s) for s in shingle_sets], out=bounds[1:])
        flat = np.concatenate(shingle_sets) if shingle_sets else np.zeros(0, dtype=np.uint64)
        return self._minima(flat.astype(np.uint64, copy=False), bounds)

    def _minima(self, mixed: np.ndarray, bounds: np.ndarray) -> np.ndarray:
        """Per document (keys mixed[bounds[d]:bounds[d+1]]), the minimum of each permutation."""
        num_docs = len(bounds) - 1
        sig = np.full((num_docs, self.num_perm), _MASK, dtype=np.uint64)
        if not len(mixed):
            return sig
        owner = np.repeat(np.arange(num_docs), np.diff(bounds))
        buffer = np.empty((self.num_perm, min(_CHUNK_COLUMNS, len(mixed))), dtype=np.uint64)
        for start in range(0, len(mixed), _CHUNK_COLUMNS):
            cols = mixed[start : start + _CHUNK_COLUMNS]
            docs = owner[start : start + _CHUNK_COLUMNS]
            permuted = buffer[:, : len(cols)]
            np.multiply(cols, self._a, out=permuted)
            permuted += self._b
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
    return _mix64((shaped * weights).sum(axis=2, dtype=np.uint64))


def candidate_pairs(keys: np.ndarray) -> np.ndarray:
    """Unique (i, j), i < j, of documents sharing a bucket in any band of a (docs, bands) key array."""
    return candidate_pairs_by_band(keys[:, band] for band in range(keys.shape[1]))


def candidate_pairs_by_band(columns: Iterable[np.ndarray]) -> np.ndarray:
    """Unique (i, j), i < j, of documents sharing a bucket in any band, one band's keys at a time.

    Only one band (8 bytes per document) is in memory at once, so the whole corpus's
    signatures never have to be. Small buckets give all their pairs; big ones (boilerplate
    copied thousands of times) give a star around their first member, so work stays linear.
    Buckets of one size are handled together, so the work per band is a few numpy calls.
    """
    found = np.zeros(0, dtype=np.int64)  # pairs as i * num_docs + j, sorted
    num_docs = 0
    for column in columns:
        num_docs = len(column)
        order = np.argsort(column, kind="stable")
        sorted_keys = column[order]
        bounds = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1], True])
        sizes, starts = np.diff(bounds), bounds[:-1]
        band: list[np.ndarray] = []
        for size in np.unique(sizes[sizes > 1]):
            members = np.sort(order[starts[sizes == size][:, None] + np.arange(size)], axis=1)
            if size <= _SMALL_BUCKET:
                first, second = np.triu_indices(size, k=1)
                i, j = members[:, first], members[:, second]
            else:
                i, j = members[:, :1], members[:, 1:]
            band.append((i * num_docs + j).ravel())
        if band:
            found = np.union1d(found, np.concatenate(band))
    return np.stack([found // max(num_docs, 1), found % max(num_docs, 1)], axis=1).astype(np.int64)


def exact_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard of two unique-sorted shingle hash arrays."""
    if len(a) == 0 and len(b) == 0:
        return 1.0
    if len(a) > len(b):
        a, b = b, a
    inter = int(np.count_nonzero(b[np.minimum(np.searchsorted(b, a), len(b) - 1)] == a)) if len(a) else 0
    return inter / (len(a) + len(b) - inter)


def estimated_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    return float(np.mean(sig_a == sig_b))
