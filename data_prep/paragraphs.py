"""Paragraph dedup: a paragraph repeated across documents is kept once, in its first document.

MinHash sees whole documents: a licence text, a cookie notice or a reference paragraph copied
into hundreds of otherwise different pages passes it, and so does a held-out document whose
paragraphs also sit in training documents (the demo's held-out evaluation was 63% such text).
Dolma and CCNet remove repeated paragraphs (or lines) across the corpus; this is that rule:

- a paragraph is a block of text between blank lines (ingest has already normalized line
  endings and runs of blank lines); its key is a 64-bit hash of its near-dedup view
  (`data_prep.textnorm.dedup_words`: case, punctuation, accents and digits folded), so a copy
  re-wrapped or re-punctuated is still a copy;
- `curate/paragraphs` hashes every paragraph of a shard (a unit, in parallel, like MinHash's
  signatures); `curate/select` decides across the corpus on those numpy columns, after the
  document filters and document dedup, among the documents still kept: the first such document
  holding a paragraph keeps it, later ones lose it;
- a document whose repeated paragraphs are more than `max_repeated_fraction` of its characters
  is removed whole (reason `paragraph_dedup`); then owners are decided again among the documents
  left, so a paragraph whose first holder was removed stays in the next one;
- paragraphs shorter than `min_chars` (normalized) are never repeats: a heading or a one-line
  code block repeats by nature.

Removed paragraphs are kept (`removed_paragraphs/<shard>.parquet`: id, paragraph number, text,
reason, the document that keeps the copy) and counted. By hand: datatrove and Dolma do this with
a Bloom filter or a hash table inside their own pipelines; here it is a few numpy sorts on
columns already split by shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from data_prep.textnorm import dedup_words

SEPARATOR = "\n\n"
REASON = "paragraph_dedup"


def paragraphs(text: str) -> list[str]:
    return text.split(SEPARATOR)


def shard_columns(texts: list[str]) -> dict[str, np.ndarray]:
    """Per paragraph of every document, in order: its document (row in the shard), its number in
    the document, the key of its normalized text, its length in characters and normalized."""
    doc, number, key, chars, norm = [], [], [], [], []
    for row, text in enumerate(texts):
        for i, paragraph in enumerate(paragraphs(text)):
            view = " ".join(dedup_words(paragraph))
            doc.append(row)
            number.append(i)
            key.append(xxhash.xxh3_64_intdigest(view.encode()))
            chars.append(len(paragraph))
            norm.append(len(view))
    return {
        "doc": np.asarray(doc, dtype=np.int64),
        "number": np.asarray(number, dtype=np.int32),
        "key": np.asarray(key, dtype=np.uint64),
        "chars": np.asarray(chars, dtype=np.int64),
        "norm": np.asarray(norm, dtype=np.int64),
    }


@dataclass
class ParagraphDecisions:
    """What paragraph dedup decided, for the whole corpus (document indices are corpus-wide)."""

    removed_docs: np.ndarray  # document indices removed whole, ascending
    removed_owner: np.ndarray  # for each: the document holding the first copy of its first repeat
    doc: np.ndarray  # paragraphs removed from kept documents: their document (ascending),
    number: np.ndarray  # their number in it,
    owner: np.ndarray  # and the document that keeps the copy
    chars: np.ndarray  # their length in characters


def _owners(key: np.ndarray) -> np.ndarray:
    """For each paragraph, the index (into `key`) of the first paragraph with its key. Paragraphs are
    in corpus order (document, then position), so a stable sort keeps equal keys in that order."""
    order = np.argsort(key, kind="stable")
    ordered = key[order]
    starts = np.r_[True, ordered[1:] != ordered[:-1]] if len(key) else np.zeros(0, dtype=bool)
    first = np.empty(len(key), dtype=np.int64)
    first[order] = order[np.flatnonzero(starts)][np.cumsum(starts) - 1]
    return first


def decide(
    columns: dict[str, np.ndarray], eligible: np.ndarray, min_chars: int, max_repeated_fraction: float
) -> ParagraphDecisions:
    """`columns`: `shard_columns` of the whole corpus with `doc` made corpus-wide; `eligible`: per
    document, whether it takes part (kept so far, and not in a skipped domain)."""
    doc, number, key = columns["doc"], columns["number"], columns["key"]
    total_chars = np.bincount(doc, weights=columns["chars"], minlength=len(eligible))
    take = eligible[doc] & (columns["norm"] >= min_chars)
    index = np.flatnonzero(take)

    def repeats(within: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        first = _owners(key[within])
        repeated = first != np.arange(len(within))
        return within[repeated], within[first[repeated]]

    repeated, first = repeats(index)
    share = np.bincount(doc[repeated], weights=columns["chars"][repeated], minlength=len(eligible))
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(total_chars > 0, share / np.maximum(total_chars, 1), 0.0)
    removed = np.flatnonzero(eligible & (share > max_repeated_fraction))
    # the owner of a removed document's first repeated paragraph (repeats are in corpus order)
    dropped = np.isin(doc[repeated], removed)
    by_doc = doc[repeated][dropped]
    firsts = np.unique(by_doc, return_index=True)[1]
    removed_owner = doc[first[dropped]][firsts]
    # owners again among the documents left, so no paragraph loses its last kept copy
    left = index[~np.isin(doc[index], removed)]
    repeated, first = repeats(left)  # ascending: by document, then position
    return ParagraphDecisions(
        removed_docs=removed,
        removed_owner=removed_owner.astype(np.int64),
        doc=doc[repeated],
        number=number[repeated],
        owner=doc[first],
        chars=columns["chars"][repeated],
    )
