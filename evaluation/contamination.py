"""Contamination: did a training source of this lineage contain an evaluation item?

Every training source the lineage used (curated pretraining documents of the training split,
SFT data, DPO data) gets a hashed word n-gram index, built once as a cached step and reused by
every evaluation. Each item of every configured task (its prompt and reference answer) is then
checked against each index with the rule of `lmforge.text.textmatch`, which curation's
decontamination applies too:

- the **exact** path (items of at least `ngram` words, 13 by default): at least `min_coverage` of
  the item's n-grams occur in the source -- a ratio, so one shared phrase in a long item does not
  count -- verified on the document holding most of them;
- the **fuzzy** path (items of at least `fuzzy_ngram` words, 5): documents sharing a tenth of the
  item's `fuzzy_ngram`-grams are candidates (n-grams held by more than `COMMON` documents say
  nothing and are skipped), and the item is contaminated when its best-aligned window of one of
  them is at least `min_similarity` similar token by token -- an item with three words of a
  short prompt changed has no intact 13-gram left, and is found here;
- shorter items are checked whole: contaminated only if a training record has exactly the same
  normalised text.

Each finding records the path that fired, the overlap and similarity, the training document and
the span. Hashing is numpy (`lmforge.text.textkeys`): an index is two sorted arrays per n-gram size (key,
document number), 12 bytes per (document, distinct n-gram). `benchmarks/contamination.py` measures
it against a Python set of n-gram strings.

Why by hand: lm-eval's decontamination is a stub for this use (it needs pre-built 13-gram
files of The Pile), and no maintained library indexes a lineage's sources this way; the
similarity is rapidfuzz's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.text.textkeys import gram_keys, whole_key, words
from lmforge.text.textmatch import CANDIDATE_SHARE, MAX_CANDIDATES, Rule, decide

COMMON = 1000  # a fuzzy n-gram held by more documents than this says nothing about which one holds the item


# -- building an index ------------------------------------------------------------------------------


def build_index(records: Iterable[tuple[str, str]], out_dir: Path, rule: Rule, chunk: int = 5000) -> dict[str, int]:
    """Index (id, text) records into `out_dir`; returns counts. Memory: the pairs of one n, sorted once.

    The texts are kept beside the index (`texts.parquet`), so a hit can be verified without
    going back to the source.
    """
    import pyarrow.parquet as pq

    ids: list[str] = []
    writer: pq.ParquetWriter | None = None
    batch: list[str] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    whole: list[int] = []
    pairs: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {rule.ngram: [], rule.fuzzy_ngram: []}
    buffers: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {n: ([], []) for n in pairs}
    cache: dict[str, int] = {}
    for number, (record_id, text) in enumerate(records):
        tokens = words(text)
        ids.append(record_id)
        batch.append(text)
        if len(batch) >= chunk:
            writer = _write_texts(writer, out_dir, batch)
        whole.append(whole_key(tokens))
        for n, (keys, owners) in buffers.items():
            unique = np.unique(gram_keys(tokens, n, cache))
            keys.append(unique)
            owners.append(np.full(len(unique), number, dtype=np.int32))
            if len(keys) >= chunk:
                pairs[n].append((np.concatenate(keys), np.concatenate(owners)))
                keys.clear()
                owners.clear()
        if len(cache) > 2_000_000:  # the word-hash cache is a speed-up, not a requirement
            cache.clear()
    writer = _write_texts(writer, out_dir, batch)
    if writer is not None:
        writer.close()
    counts = {"records": len(ids)}
    for n, (keys, owners) in buffers.items():
        if keys:
            pairs[n].append((np.concatenate(keys), np.concatenate(owners)))
        all_keys = np.concatenate([k for k, _ in pairs[n]]) if pairs[n] else np.zeros(0, np.uint64)
        all_owners = np.concatenate([o for _, o in pairs[n]]) if pairs[n] else np.zeros(0, np.int32)
        order = np.argsort(all_keys, kind="stable")
        np.save(out_dir / f"keys_{n}.npy", all_keys[order])
        np.save(out_dir / f"docs_{n}.npy", all_owners[order])
        counts[f"ngrams_{n}"] = int(len(all_keys))
    np.save(out_dir / "whole.npy", np.array(whole, dtype=np.uint64))
    (out_dir / "ids.json").write_text(json.dumps(ids))
    return counts


def _write_texts(writer, out_dir: Path, batch: list[str]):  # type: ignore[no-untyped-def]
    import pyarrow as pa
    import pyarrow.parquet as pq

    if batch:
        table = pa.table({"text": pa.array(batch, pa.large_string())})
        writer = writer or pq.ParquetWriter(out_dir / "texts.parquet", table.schema, compression="zstd")
        writer.write_table(table)
        batch.clear()
    return writer


class Index:
    """A built index, memory-mapped."""

    def __init__(self, directory: Path, rule: Rule):
        self.directory, self.rule = directory, rule
        self.keys = {n: np.load(directory / f"keys_{n}.npy", mmap_mode="r") for n in (rule.ngram, rule.fuzzy_ngram)}
        self.docs = {n: np.load(directory / f"docs_{n}.npy", mmap_mode="r") for n in self.keys}
        whole = np.load(directory / "whole.npy")
        self.whole = {int(k): i for i, k in enumerate(whole)}
        self.ids: list[str] = json.loads((directory / "ids.json").read_text())
        self._texts: Any = None

    def text(self, number: int) -> str:
        """A training record's text (only candidates are ever read back)."""
        import pyarrow.parquet as pq

        if self._texts is None:
            self._texts = pq.read_table(self.directory / "texts.parquet", memory_map=True).column("text")
        return self._texts[number].as_py()

    def _ranges(self, keys: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Per key, where its entries start and end in the sorted n-gram table (equal: absent)."""
        table = self.keys[n]
        return np.searchsorted(table, keys, side="left"), np.searchsorted(table, keys, side="right")

    def lookup(self, keys: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(per key: found?, document numbers holding the found keys, with repeats)."""
        owners = self.docs[n]
        left, right = self._ranges(keys, n)
        found = right > left
        holders = [owners[a : min(b, a + 50)] for a, b in zip(left[found], right[found])]
        return found, np.concatenate(holders) if holders else np.zeros(0, np.int32)

    def candidates(self, tokens: list[str]) -> list[int]:
        """Documents sharing at least CANDIDATE_SHARE of the item's distinct fuzzy n-grams, those sharing most first."""
        n = self.rule.fuzzy_ngram
        keys = np.unique(gram_keys(tokens, n))
        owners = self.docs[n]
        left, right = self._ranges(keys, n)
        rare = (right > left) & (right - left <= COMMON)
        holders = [owners[a:b] for a, b in zip(left[rare], right[rare])]
        if not holders:
            return []
        docs, shared = np.unique(np.concatenate(holders), return_counts=True)
        enough = shared >= max(1, int(np.ceil(CANDIDATE_SHARE * len(keys))))
        order = np.argsort(-shared[enough], kind="stable")[:MAX_CANDIDATES]
        return [int(d) for d in docs[enough][order]]


# -- checking items ---------------------------------------------------------------------------------


def check_item(tokens: list[str], index: Index, fuzzy: bool = True) -> dict[str, Any]:
    """The verified match of one item against one source (contaminated or not), by `lmforge.text.textmatch`'s rule.

    `fuzzy=False` applies the exact path alone (what the benchmark compares with)."""
    rule = index.rule if fuzzy else replace(index.rule, min_similarity=float("inf"))
    if len(tokens) < rule.fuzzy_ngram:
        hit = index.whole.get(whole_key(tokens))
        score = float(hit is not None)
        found = {"contaminated": hit is not None, "path": "whole-text", "overlap": score, "similarity": score}
        return found | ({"train_doc_id": index.ids[hit], "span": " ".join(tokens)} if hit is not None else {})
    candidates = index.candidates(tokens) if fuzzy else []
    coverage = 0.0
    if len(tokens) >= rule.ngram:  # the exact path: the document holding most of the item's n-grams
        found_keys, holders = index.lookup(gram_keys(tokens, rule.ngram), rule.ngram)
        coverage = float(found_keys.mean()) if len(found_keys) else 0.0
        if coverage >= rule.min_coverage and len(holders):
            candidates = [int(np.bincount(holders).argmax()), *candidates]
    best: dict[str, Any] = {"contained": False, "path": rule.path_for(tokens), "overlap": 0.0, "similarity": 0.0}
    for number in dict.fromkeys(candidates):
        verdict = decide(tokens, words(index.text(number)), rule) | {"train_doc_id": index.ids[number]}
        if _rank(verdict) > _rank(best):
            best = verdict
    contained = best.pop("contained")
    best["span"] = str(best.get("span") or "")[:500]
    return {"contaminated": contained, **best, "overlap": best["overlap"] or round(coverage, 4)}


def _rank(verdict: dict[str, Any]) -> tuple[bool, bool, float, float]:
    """Contained first, by the exact path before the fuzzy one, then the closest."""
    return (
        verdict["contained"],
        verdict["contained"] and verdict["path"] == "exact",
        verdict["similarity"] or 0.0,
        verdict["overlap"],
    )


def check_tasks(
    items: dict[str, list[dict[str, str]]], indexes: dict[str, Index], rule: Rule
) -> Iterator[dict[str, Any]]:
    """One record per item of every task: the worst verified match over all sources, with the rule that decided."""
    described = rule.describe()
    for task, task_items in items.items():
        for item in task_items:
            tokens = words(item["text"])
            matches = {source: check_item(tokens, index) for source, index in indexes.items()}
            flagged = {s: m for s, m in matches.items() if m["contaminated"]}
            worst_source = (
                max(matches, key=lambda s: (matches[s]["contaminated"], matches[s]["similarity"] or 0.0))
                if matches
                else None
            )
            worst = matches.get(worst_source, {}) if worst_source else {}
            yield {
                "task": task,
                "doc_id": item["id"],
                "contaminated": bool(flagged),
                "path": worst.get("path") if flagged else None,
                "overlap": worst.get("overlap", 0.0),
                "similarity": worst.get("similarity", 0.0),
                "source": worst_source if flagged else None,
                "train_doc_id": worst.get("train_doc_id") if flagged else None,
                "span": worst.get("span") if flagged else None,
                "sources": sorted(flagged),
                "checked_by": rule.path_for(tokens),
                "rule": described,
            }
