"""The train/validation split, by groups of documents that share text.

A split by document id holds out documents whose text also sits in training documents: a
paragraph quoted in two reference pages, a lightly edited copy below near-dedup's threshold,
templated pages. The held-out evaluation built from that split (lmforge_continuation,
lmforge_heldout_ppl) then scores memorised text, and the contamination gate flags it (63% and
50% of the demo's items, before this). Grouping first, then splitting whole groups, is what
makes held-out text held out:

- two documents are **linked** when they share at least `link_min_shared` distinct word
  `link_ngram`-grams (the contamination check's word view, `lmforge.text.textkeys`), not
  counting n-grams held by more than `link_max_docs` documents (stock phrases link nothing);
  that covers shared paragraphs, near-duplicate clusters at any Jaccard and partial copies alike;
- a **group** is a connected component of links; it is held out when the hash of its first
  document's id (the rule pack used per document) falls under `val_fraction`, so the split stays
  stable when unrelated documents come or go;
- a group holding more than `max_group_share` of the documents stays in training: one giant
  group (a family of reference pages that quote each other) held out would be most of the
  validation set and no longer the share asked for.

Per kept shard `curate/split` computes each document's distinct n-gram keys (a unit); the
finalize step sorts them once across the corpus (12 bytes per document and distinct n-gram)
and writes `split.parquet` (id, group, split) for `curate/pack`. The evaluation stage's
contamination check then confirms the held-out tasks against the training side.

By hand: connected components are scipy's; no library groups a corpus by shared n-grams for
splitting (datatrove and NeMo Curator remove duplicates; they do not split).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from data_prep.records import write_table
from lmforge.text.textkeys import gram_keys, words

SPLIT_SCHEMA = pa.schema([("id", pa.string()), ("group", pa.string()), ("split", pa.string())])


def is_validation(key: str, val_fraction: float, seed: int) -> bool:
    return xxhash.xxh64_intdigest(key.encode(), seed=seed) % 1_000_000 < val_fraction * 1_000_000


def shard_keys(texts: list[str], n: int) -> dict[str, np.ndarray]:
    """Each document's distinct word n-gram keys, with its row in the shard."""
    cache: dict[str, int] = {}
    keys, rows = [], []
    for row, text in enumerate(texts):
        unique = np.unique(gram_keys(words(text), n, cache))
        keys.append(unique)
        rows.append(np.full(len(unique), row, dtype=np.int64))
    empty = np.zeros(0, dtype=np.uint64)
    return {
        "key": np.concatenate(keys) if keys else empty,
        "doc": np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64),
    }


def linked_pairs(key: np.ndarray, doc: np.ndarray, n_docs: int, min_shared: int, max_docs: int) -> np.ndarray:
    """(k, 2) document pairs sharing at least `min_shared` keys, each key held by at most `max_docs`."""
    order = np.argsort(key, kind="stable")
    key, doc = key[order], doc[order]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if len(key) else np.zeros(0, dtype=np.int64)
    sizes = np.diff(np.r_[starts, len(key)])
    codes = []
    for m in np.unique(sizes[(sizes >= 2) & (sizes <= max_docs)]):
        block = doc[starts[sizes == m][:, None] + np.arange(m)]  # (runs of size m, m): distinct documents
        i, j = np.triu_indices(int(m), 1)
        a, b = block[:, i].ravel(), block[:, j].ravel()
        codes.append(np.minimum(a, b) * n_docs + np.maximum(a, b))
    if not codes:
        return np.zeros((0, 2), dtype=np.int64)
    pairs, counts = np.unique(np.concatenate(codes), return_counts=True)
    linked = pairs[counts >= min_shared]
    return np.stack([linked // n_docs, linked % n_docs], axis=1)


def groups(pairs: np.ndarray, n_docs: int) -> np.ndarray:
    """Per document, the index of the first document of its group (connected component)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    graph = coo_matrix((np.ones(len(pairs), dtype=np.int8), (pairs[:, 0], pairs[:, 1])), shape=(n_docs, n_docs))
    labels = connected_components(graph, directed=False)[1]
    first = np.full(labels.max() + 1 if n_docs else 0, n_docs, dtype=np.int64)
    np.minimum.at(first, labels, np.arange(n_docs))
    return first[labels]


def decide_split(
    ids: list[str], root: np.ndarray, val_fraction: float, seed: int, max_group_share: float | None
) -> tuple[np.ndarray, dict[str, Any]]:
    """(held out per document, counts): whole groups, by the hash of their first document's id."""
    n_docs = len(ids)
    limit = max((val_fraction / 2 if max_group_share is None else max_group_share) * n_docs, 1)
    size = np.bincount(root, minlength=n_docs)
    roots = np.flatnonzero(size)
    too_big = roots[size[roots] > limit]
    held_roots = np.array(
        [r for r in roots if size[r] <= limit and is_validation(ids[r], val_fraction, seed)], dtype=np.int64
    )
    held = np.isin(root, held_roots)
    counts = {
        "docs": n_docs,
        "groups": len(roots),
        "grouped_docs": int(size[roots][size[roots] > 1].sum()),
        "largest_group": int(size.max()) if n_docs else 0,
        "too_large_groups": len(too_big),
        "docs_in_too_large_groups": int(size[too_big].sum()),
        "val_docs": int(held.sum()),
        "val_groups": len(held_roots),
    }
    return held, counts


def write_split(path: Path, ids: list[str], root: np.ndarray, held: np.ndarray) -> None:
    table = pa.table(
        {
            "id": pa.array(ids, pa.string()),
            "group": pa.array([ids[r] for r in root], pa.string()),
            "split": pa.array(np.where(held, "val", "train").tolist(), pa.string()),
        },
        schema=SPLIT_SCHEMA,
    )
    write_table(path, table)


def held_out_ids(path: Path) -> set[str]:
    table = pq.read_table(path, columns=["id", "split"]).to_pydict()
    return {i for i, s in zip(table["id"], table["split"]) if s == "val"}
