"""Reward functions the RL tests import by `module:function`, as a user's own would be."""

from __future__ import annotations

from typing import Any


def pays_for_length(completions: list[Any], **_: Any) -> list[float]:
    """Easy to game: more characters, more reward (up to 40), whatever they say."""
    texts = ["".join(m["content"] for m in c) if isinstance(c, list) else str(c) for c in completions]
    return [min(len(t), 40) / 40 for t in texts]


NOT_CALLABLE = 3
