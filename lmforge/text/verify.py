"""The one check of a verifiable answer, shared by every place that scores one.

Used by the alignment stage's held-out exact match (`training.align.heldout`), by online RL's
verifiable reward (`training.align.rewards`) and, copied beside the task YAMLs, by the
evaluation's `lmforge_chat_exact` task (lm-eval loads it from `utils.py`), so a model is paid
during RL for exactly what evaluation counts as right.

The rule is lm-eval's for that task: the answer ends at the first newline (generation stops
there), surrounding whitespace does not count, case and punctuation do.

This file must import nothing outside the standard library: lm-eval loads it by path.
"""

from __future__ import annotations


def extract(completion: str) -> str:
    """The answer a completion gives: its first line, without surrounding whitespace."""
    return completion.strip().split("\n", 1)[0].strip()


def is_correct(completion: str, answer: str) -> bool:
    """Whether `completion` gives exactly the verified `answer`."""
    return extract(completion) == answer.strip()


def partial_credit(completion: str, answer: str) -> float:
    """1.0 for an exact answer, else a share in [0, 0.5) of how close it is (character-level
    similarity): a denser signal for a model that is rarely exactly right."""
    from difflib import SequenceMatcher

    got, want = extract(completion), answer.strip()
    if got == want:
        return 1.0
    return 0.5 * SequenceMatcher(None, got, want).ratio() * (0.999 if got else 0.0)
