"""Tokenize kept documents and pack them into binary token shards.

Per kept shard: documents are encoded, an EOS token ends each one, and the token stream
goes to `tokens/<shard>.train.bin` or `.val.bin` (raw little-endian uint16 when the
vocabulary fits, else uint32). Which documents are held out is `curate/split`'s decision
(data_prep/split.py: whole groups of documents that share text). Upsampled documents appear `repeat` times in train (the
extra copies shuffled with a seed after the first pass, so they rarely sit next to the original;
the reader shuffles windows again). A sidecar
`<shard>.<split>.docs.parquet` maps token offsets back to document ids, so a bad batch
can be traced to the documents in it.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data_prep.records import temp_path, write_rows
from data_prep.tokenizer import EOS, load_tokenizer

DOCS_SCHEMA = pa.schema([("id", pa.string()), ("domain", pa.string()), ("start", pa.int64()), ("length", pa.int64())])
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = temp_path(path)
    tmp.write_bytes(data)
    tmp.replace(path)


def pack_shard(
    kept_path: Path,
    tokenizer_dir: Path,
    out_dir: Path,
    shard: str,
    held_out: set[str],
    seed: int,
    eos: int | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """Encode one kept shard; returns (files written, token counts per split and domain).

    Each document is its tokens (no BOS or other special tokens a base's tokenizer would add)
    followed by EOS: `eos` (the tokenizer's end-of-text id), lmforge's own by default."""
    tokenizer = load_tokenizer(tokenizer_dir)
    eos = tokenizer.token_to_id(EOS) if eos is None else eos
    dtype = token_dtype(tokenizer.get_vocab_size())
    table = pq.read_table(kept_path, columns=["id", "text", "domain", "repeat"]).to_pydict()
    encoded = [e.ids for e in tokenizer.encode_batch(table["text"], add_special_tokens=False)]
    order: dict[str, list[int]] = {"train": [], "val": []}
    for i, doc_id in enumerate(table["id"]):
        order["val" if doc_id in held_out else "train"].append(i)
    rng = random.Random(f"{seed}:{shard}")
    extra = [i for i in order["train"] for _ in range(table["repeat"][i] - 1)]
    rng.shuffle(extra)
    order["train"] += extra
    files: list[str] = []
    result: dict[str, Any] = {"shard": shard, "tokens": {}, "domain_tokens": {}, "docs": {}}
    (out_dir / "tokens").mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        rows, chunks, offset = [], [], 0
        domain_tokens: Counter[str] = Counter()
        for i in order[split]:
            ids = encoded[i] + [eos]
            rows.append({"id": table["id"][i], "domain": table["domain"][i], "start": offset, "length": len(ids)})
            chunks.append(np.asarray(ids, dtype=dtype))
            offset += len(ids)
            domain_tokens[table["domain"][i]] += len(ids)
        stream = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
        if split == "train":
            counts = np.bincount(stream.astype(np.int64), minlength=tokenizer.get_vocab_size())
            np.save(out_dir / "tokens" / f"{shard}.train.counts.npy", counts)
            files.append(f"tokens/{shard}.train.counts.npy")
        _write_atomic(out_dir / "tokens" / f"{shard}.{split}.bin", stream.astype("<" + dtype.str[1:]).tobytes())
        write_rows(out_dir / "tokens" / f"{shard}.{split}.docs.parquet", rows, DOCS_SCHEMA)
        files += [f"tokens/{shard}.{split}.bin", f"tokens/{shard}.{split}.docs.parquet"]
        result["tokens"][split] = int(offset)
        result["docs"][split] = len(rows)
        result["domain_tokens"][split] = dict(domain_tokens)
    return files, result


def unigram_entropy(counts: np.ndarray) -> float:
    """Entropy (nats/token) of the unigram distribution: the loss of a model that ignores context."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
