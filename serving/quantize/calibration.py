"""Calibration samples drawn from the lineage, so a quantized model says exactly what it was calibrated on.

Samples come from the curated pretraining documents (`kept/`) and, for a chat model, from the
SFT training data rendered with the model's chat template (the text it will see when served).
Which records are drawn depends only on the seed and the sources' contents: each record's
`(seed, source, id)` hash orders the candidates, so adding a record elsewhere in a source does
not reshuffle the rest. `calibration.jsonl` keeps each sample's source, id and text.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash

from lmforge.jsonl import read_jsonl


def _rank(seed: int, source: str, record_id: str) -> int:
    return xxhash.xxh64_intdigest(f"{source}:{record_id}".encode(), seed=seed)


def _smallest(candidates: Iterator[tuple[str, Any]], count: int, seed: int, source: str) -> list[tuple[str, Any]]:
    """The `count` candidates with the smallest hash rank, in rank order (a seeded sample without replacement)."""
    import heapq

    ranked = ((_rank(seed, source, record_id), record_id, payload) for record_id, payload in candidates)
    return [
        (record_id, payload) for _, record_id, payload in heapq.nsmallest(count, ranked, key=lambda r: (r[0], r[1]))
    ]


def documents(kept_dir: Path, max_chars: int) -> Iterator[tuple[str, str]]:
    import pyarrow.parquet as pq

    seen: set[str] = set()
    for path in sorted(kept_dir.glob("*.parquet")):
        for row in pq.read_table(path, columns=["id", "text"]).to_pylist():
            if row["id"] not in seen:  # an up-sampled document is one candidate
                seen.add(row["id"])
                yield row["id"], row["text"][:max_chars]


def chats(train_jsonl: Path) -> Iterator[tuple[str, list[dict[str, str]]]]:
    for record in read_jsonl(train_jsonl):
        yield record["id"], record["messages"]


def draw(
    kept_dir: Path,
    chat_file: Path | None,
    tokenizer_dir: Path,
    num_samples: int,
    sft_fraction: float,
    seed: int,
    max_chars: int,
) -> list[dict[str, str]]:
    """`num_samples` samples: a share from the chats (when given), the rest from the documents."""
    from transformers import AutoTokenizer

    num_chat = round(num_samples * sft_fraction) if chat_file is not None else 0
    samples: list[dict[str, str]] = []
    if num_chat and chat_file is not None:  # num_chat is 0 without a chat file
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        for record_id, messages in _smallest(chats(chat_file), num_chat, seed, "chat"):
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            assert isinstance(text, str)  # tokenize=False: the rendered chat
            samples.append({"source": "chat", "id": record_id, "text": text})
    for record_id, text in _smallest(documents(kept_dir, max_chars), num_samples - len(samples), seed, "documents"):
        samples.append({"source": "documents", "id": record_id, "text": text})
    return samples
