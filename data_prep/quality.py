"""A DCLM-style fastText quality classifier.

Positives are curated reference prose (by default Python's own reference documentation,
which ships with every Python); negatives are a seeded sample of the pool being filtered.
The classifier learns "reads like the reference" and its probability becomes a
per-document attribute; selection applies a threshold or a keep-fraction.
"""

from __future__ import annotations

import random
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from data_prep.config import QualityClassifierConfig
from lmforge.jsonl import read_jsonl

POSITIVE, NEGATIVE = "__label__hq", "__label__lq"
_WS = re.compile(r"\s+")


def fasttext_line(text: str, max_chars: int = 4000) -> str:
    """The classifier's view of a document: lowercased, one line, bounded length."""
    return _WS.sub(" ", text[:max_chars].lower()).strip()


def builtin_reference(chunk_chars: int = 2000) -> list[str]:
    """Python's reference documentation split into paragraph-aligned chunks."""
    import pydoc_data.topics

    chunks: list[str] = []
    for name in sorted(pydoc_data.topics.topics):
        current = ""
        for paragraph in pydoc_data.topics.topics[name].split("\n\n"):
            current = f"{current}\n\n{paragraph}" if current else paragraph
            if len(current) >= chunk_chars:
                chunks.append(current)
                current = ""
        if len(current) > 200:
            chunks.append(current)
    return chunks


def read_reference(paths: list[str]) -> Iterator[str]:
    """Texts from JSONL (`text` field), Parquet (`text` column) or plain-text files."""
    for path in paths:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            yield from (t for t in pq.read_table(path, columns=["text"]).column("text").to_pylist() if t)
        elif path.endswith((".jsonl", ".json")):
            for row in read_jsonl(Path(path)):
                text = row.get("text")
                if isinstance(text, str) and text.strip():
                    yield text
        else:
            yield Path(path).read_text(encoding="utf-8")


def train_classifier(
    positives: list[str], negatives: list[str], cfg: QualityClassifierConfig, model_path: Path
) -> dict[str, float]:
    """Train, save the model, and report accuracy on a 10% held-out split of each class."""
    from data_prep.langid import fasttext_module

    fasttext = fasttext_module()
    rng = random.Random(cfg.seed)
    examples = [(POSITIVE, t) for t in positives] + [(NEGATIVE, t) for t in negatives]
    rng.shuffle(examples)
    held = max(1, len(examples) // 10)
    train, test = examples[held:], examples[:held]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as handle:
        handle.writelines(f"{label} {fasttext_line(text)}\n" for label, text in train)
    try:
        model = fasttext.train_supervised(
            input=handle.name,
            epoch=cfg.epochs,
            lr=cfg.lr,
            wordNgrams=cfg.word_ngrams,
            dim=cfg.dim,
            bucket=cfg.bucket,
            thread=1,
            seed=cfg.seed,
            verbose=0,
            minCount=2,
        )
    finally:
        Path(handle.name).unlink()
    model.save_model(str(model_path))
    scores = QualityScorer(model_path).score([t for _, t in test])
    correct = sum((s >= 0.5) == (label == POSITIVE) for s, (label, _) in zip(scores, test))
    return {"train_examples": len(train), "heldout_examples": len(test), "heldout_accuracy": correct / len(test)}


class QualityScorer:
    """P(reference-like) for a batch of documents."""

    def __init__(self, model_path: Path):
        from data_prep.langid import _load

        self._model = _load(str(model_path)).f

    def score(self, texts: list[str]) -> list[float]:
        # k=1 only: the binding's batch call returns wrong probabilities for k>1; with two
        # classes the top-1 probability determines the other.
        labels, probs = self._model.multilinePredict([fasttext_line(t) for t in texts], 1, 0.0, "replace")
        return [
            float(min(p[0], 1.0)) if lab and lab[0] == POSITIVE else float(max(0.0, 1.0 - p[0])) if lab else 0.0
            for lab, p in zip(labels, probs)
        ]
