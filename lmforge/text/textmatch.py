"""The contamination rule: does a training text contain an evaluation item?

Both stages that ask apply this one rule, with the same settings (`evaluate.contamination`):
curation's decontamination removes a training document that contains an item
(`data_prep.decontaminate`), and the evaluation stage's gate flags an item a training source
contained (`evaluation.contamination`). So a model trained after decontamination passes the gate.

For one (item, document) pair, on word tokens (`lmforge.text.textkeys.words`: lowercase, runs of
non-alphanumerics one space, so whitespace and line breaks never matter):

- **whole-text**: items shorter than `fuzzy_ngram` words are contained only in a document whose
  whole normalised text is the item (a few words are everywhere otherwise);
- **exact** (the fast path, items of at least `ngram` words): at least `min_coverage` of the
  item's word `ngram`-grams occur in the document;
- **fuzzy** (every item of at least `fuzzy_ngram` words): the item's best-aligned window of the
  document is at least `min_similarity` similar, token by token (Indel similarity,
  `1 - (insertions + deletions) / (len(item) + len(window))`: one replaced word in ten gives 0.90,
  one dropped word in ten 0.95). This finds items with every `ngram`-window edited, which the
  exact path cannot. An item shorter than `ngram` words is contained only with at most
  `SHORT_EDITS` (one) word inserted or dropped: templated prompts ("Reverse the order of these
  words: snow flag moon" / "...: snow moon") differ from their siblings by a slot word, which a
  similarity threshold cannot tell from an edit; and its numbers must all be there, in order ("How
  many words are in: horse hill 2" is not "...: horse hill king 3" with a word dropped).
  Measured on the built-in chat data split as `gpu-1node` splits it (2,000 per skill): a
  similarity bar shrinking with the square of the length flagged 22 of 500 held-out items (4.4%,
  over that preset's 1% gate); this rule flags 1 (the same question rephrased, same answer).

The fuzzy path touches only candidates: documents (or, in decontamination, items) that share at
least `CANDIDATE_SHARE` of the item's distinct `fuzzy_ngram`-grams, found through the same
hashed n-gram keys the exact path uses; at most `MAX_CANDIDATES` of them, those sharing most,
are aligned. The alignment is rapidfuzz's `partial_ratio_alignment` over token lists (C++; its
Indel ratio on the best window). Why partly by hand: no library retrieves candidates from a
lineage's n-gram index; the similarity itself is rapidfuzz's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rapidfuzz import fuzz
from rapidfuzz.distance import Indel

CANDIDATE_SHARE = 0.1  # an item's 5-grams a candidate must share: 10% word edits leave about half of them
MAX_CANDIDATES = 8  # candidates aligned per item (the ones sharing most)
SHORT_EDITS = 1  # words an item under `ngram` words may have inserted or dropped and still be the same item


@dataclass(frozen=True)
class Rule:
    ngram: int = 13
    fuzzy_ngram: int = 5
    min_coverage: float = 0.3
    min_similarity: float = 0.8

    def describe(self) -> str:
        """The rule in one line, as reports and records state it."""
        return (
            f"exact: >= {self.min_coverage:g} of the item's {self.ngram}-grams; "
            f"fuzzy: best-window token similarity >= {self.min_similarity:g} "
            f"({self.fuzzy_ngram}-gram candidates; under {self.ngram} words: at most {SHORT_EDITS} word inserted or "
            f"dropped, numbers unchanged); whole text under {self.fuzzy_ngram} words"
        )

    def path_for(self, item: list[str]) -> str:
        return "whole-text" if len(item) < self.fuzzy_ngram else "exact+fuzzy" if len(item) >= self.ngram else "fuzzy"


def exact_overlap(item: list[str], doc: list[str], n: int) -> tuple[float, str]:
    """(share of the item's word n-grams that occur in the document, the item span they cover)."""
    doc_grams = {tuple(doc[i : i + n]) for i in range(len(doc) - n + 1)}
    hits = [i for i in range(len(item) - n + 1) if tuple(item[i : i + n]) in doc_grams]
    if not hits:
        return 0.0, ""
    return len(hits) / (len(item) - n + 1), " ".join(item[hits[0] : hits[-1] + n])


def aligned_similarity(item: list[str], doc: list[str]) -> tuple[float, int, int]:
    """(token similarity of the item to its best-aligned window of the document, window start, end).

    A document shorter than the item is compared whole: a fragment of an item does not contain it.
    """
    if not item or not doc:
        return 0.0, 0, 0
    if len(doc) <= len(item):
        return Indel.normalized_similarity(item, doc), 0, len(doc)
    found = fuzz.partial_ratio_alignment(item, doc)
    if found is None:  # only with a score_cutoff, which is not given
        return 0.0, 0, 0
    return found.score / 100.0, found.dest_start, found.dest_end


def decide(item: list[str], doc: list[str], rule: Rule) -> dict[str, Any]:
    """The rule on one pair: {contained, path (the rule that fired, else the last one tried), overlap, similarity,
    span (the document's aligned window, or the item's span the exact path matched)}."""
    if len(item) < rule.fuzzy_ngram:
        same = item == doc
        text = " ".join(item) if same else ""
        return {
            "contained": same,
            "path": "whole-text",
            "overlap": float(same),
            "similarity": float(same),
            "span": text,
        }
    overlap, span = exact_overlap(item, doc, rule.ngram) if len(item) >= rule.ngram else (0.0, "")
    similarity, start, end = aligned_similarity(item, doc)
    exact = overlap >= rule.min_coverage
    if len(item) >= rule.ngram:
        fuzzy = similarity >= rule.min_similarity
    else:  # a short item: the best window, give or take a word at either end, within SHORT_EDITS of it
        start, end = min(
            ((s, e) for s in (start - 1, start, start + 1) for e in (end - 1, end, end + 1) if 0 <= s < e <= len(doc)),
            key=lambda bounds: Indel.distance(item, doc[bounds[0] : bounds[1]]),
            default=(start, end),
        )
        window = doc[start:end]
        fuzzy = Indel.distance(item, window) <= SHORT_EDITS and _numbers(item) == _numbers(window)
        similarity = Indel.normalized_similarity(item, window) if end > start else 0.0
    return {
        "contained": exact or fuzzy,
        "path": "exact" if exact else "fuzzy",
        "overlap": round(overlap, 4),
        "similarity": round(similarity, 4),
        "span": span if exact else " ".join(doc[start:end]) if fuzzy else "",
    }


def _numbers(tokens: list[str]) -> list[str]:
    """The numbers of a text, in order: in a short item they are the question or the answer, never an edit."""
    return [t for t in tokens if t.isdigit()]
