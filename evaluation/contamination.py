"""Contamination: did a training source of this lineage contain an evaluation item?

Every training source the lineage used (curated pretraining documents of the training split,
SFT data, DPO data) gets a hashed word n-gram index, built once as a cached step and reused by
every evaluation. Each item of every configured task (its prompt and reference answer) is then
checked against each index:

- text is normalised (lowercase, every run of non-alphanumerics a single space; digits kept,
  since "3 + 5" and "4 + 6" are different questions) by `lmforge.textkeys`, which curation's
  decontamination uses too;
- items of at least `ngram` words are checked with `ngram`-grams (13 by default), shorter ones
  with `short_ngram`-grams (8); an item is contaminated when at least `min_coverage` of its
  n-grams occur in the source -- a ratio, so one shared phrase in a long item does not count;
- items shorter than `short_ngram` words are checked whole: contaminated only if a training
  record has exactly the same normalised text;
- a hit is then verified exactly: the training document that holds most of the item's n-grams is
  read back and the item's word n-grams are intersected with its own (strings, not hashes), which
  gives the overlap ratio and the matching span recorded for the item.

Hashing is numpy (`lmforge.textkeys`): each distinct word is hashed once (xxh64) and n-gram keys
are formed with position-dependent odd multipliers, so no Python object is made per n-gram. An
index is two sorted arrays (n-gram key, document number): 12 bytes per (document, distinct n-gram).
`benchmarks/contamination.py` measures it against a Python set of n-gram strings.

Why by hand: lm-eval's decontamination is a stub for this use (it needs pre-built 13-gram
files of The Pile), and no maintained library indexes a lineage's sources this way.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.textkeys import gram_keys, whole_key, words


@dataclass(frozen=True)
class Settings:
    ngram: int = 13
    short_ngram: int = 8
    min_coverage: float = 0.3


# -- building an index ------------------------------------------------------------------------------


def build_index(
    records: Iterable[tuple[str, str]], out_dir: Path, settings: Settings, chunk: int = 5000
) -> dict[str, int]:
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
    pairs: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {settings.ngram: [], settings.short_ngram: []}
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

    def __init__(self, directory: Path, settings: Settings):
        self.directory, self.settings = directory, settings
        self.keys = {
            n: np.load(directory / f"keys_{n}.npy", mmap_mode="r") for n in (settings.ngram, settings.short_ngram)
        }
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

    def lookup(self, keys: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(per key: found?, document numbers holding the found keys, with repeats)."""
        table, owners = self.keys[n], self.docs[n]
        left = np.searchsorted(table, keys, side="left")
        right = np.searchsorted(table, keys, side="right")
        found = right > left
        holders = [owners[a : min(b, a + 50)] for a, b in zip(left[found], right[found])]
        return found, np.concatenate(holders) if holders else np.zeros(0, np.int32)


# -- checking items ---------------------------------------------------------------------------------


def exact_overlap(item: list[str], doc: list[str], n: int) -> tuple[float, str]:
    """(share of the item's word n-grams that occur in the document, the item span they cover)."""
    if len(item) < n:
        return (1.0, " ".join(item)) if " ".join(item) in " ".join(doc) else (0.0, "")
    doc_grams = {tuple(doc[i : i + n]) for i in range(len(doc) - n + 1)}
    hits = [i for i in range(len(item) - n + 1) if tuple(item[i : i + n]) in doc_grams]
    total = len(item) - n + 1
    if not hits:
        return 0.0, ""
    return len(hits) / total, " ".join(item[hits[0] : hits[-1] + n])


def check_item(tokens: list[str], index: Index) -> dict[str, Any]:
    """The verified match of one item against one source (contaminated or not)."""
    s = index.settings
    if len(tokens) < s.short_ngram:
        hit = index.whole.get(whole_key(tokens))
        if hit is None:
            return {"contaminated": False, "overlap": 0.0, "checked_by": "whole-text"}
        return {
            "contaminated": True,
            "overlap": 1.0,
            "checked_by": "whole-text",
            "train_doc_id": index.ids[hit],
            "span": " ".join(tokens),
        }
    n = s.ngram if len(tokens) >= s.ngram else s.short_ngram
    keys = gram_keys(tokens, n)
    found, holders = index.lookup(keys, n)
    coverage = float(found.mean()) if len(found) else 0.0
    if coverage < s.min_coverage or not len(holders):
        return {"contaminated": False, "overlap": round(coverage, 4), "checked_by": f"{n}-gram"}
    best = int(np.bincount(holders).argmax())
    overlap, span = exact_overlap(tokens, words(index.text(best)), n)
    return {
        "contaminated": overlap >= s.min_coverage,
        "overlap": round(overlap, 4),
        "checked_by": f"{n}-gram",
        "train_doc_id": index.ids[best],
        "span": span[:500],
    }


def check_tasks(items: dict[str, list[dict[str, str]]], indexes: dict[str, Index]) -> Iterator[dict[str, Any]]:
    """One record per item of every task: the worst verified match over all sources."""
    for task, task_items in items.items():
        for item in task_items:
            tokens = words(item["text"])
            matches = {source: check_item(tokens, index) for source, index in indexes.items()}
            flagged = {s: m for s, m in matches.items() if m["contaminated"]}
            worst_source = (
                max(matches, key=lambda s: (matches[s]["contaminated"], matches[s]["overlap"])) if matches else None
            )
            worst = matches.get(worst_source, {}) if worst_source else {}
            yield {
                "task": task,
                "doc_id": item["id"],
                "contaminated": bool(flagged),
                "overlap": worst.get("overlap", 0.0),
                "source": worst_source if flagged else None,
                "train_doc_id": worst.get("train_doc_id") if flagged else None,
                "span": worst.get("span") if flagged else None,
                "sources": sorted(flagged),
                "checked_by": worst.get("checked_by"),
            }
