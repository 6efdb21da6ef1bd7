"""Tokenizer (HF format, chat template), packed shards, and the training reader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from training.reader import BatchSchedule, TokenWindows


def _dirs(curated: tuple[Path, dict]) -> tuple[Path, Path, Path]:
    _, manifests = curated
    return (
        Path(manifests["curate/tokenizer"]["dir"]),
        Path(manifests["curate/pack"]["dir"]),
        Path(manifests["curate/select"]["dir"]),
    )


def test_tokenizer_loads_with_autotokenizer_and_has_a_chat_template(curated) -> None:
    from transformers import AutoTokenizer

    tokenizer_dir, _, _ = _dirs(curated)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    ids = tok("def add(a, b):\n    return a + b")["input_ids"]
    assert tok.decode(ids) == "def add(a, b):\n    return a + b"  # byte-level: lossless
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    fertility = json.loads((tokenizer_dir / "fertility.json").read_text())
    assert "lang=en" in fertility and "domain=code" in fertility and all(v > 1 for v in fertility.values())


def test_packed_stream_is_documents_separated_by_eos(curated) -> None:
    from tokenizers import Tokenizer

    tokenizer_dir, pack_dir, select_dir = _dirs(curated)
    index = json.loads((pack_dir / "index.json").read_text())
    assert index["dtype"] == "uint16"
    shard = index["splits"]["train"][0]
    stream = np.fromfile(pack_dir / shard["file"], dtype="<u2")
    docs = pq.read_table(pack_dir / shard["docs"]).to_pylist()
    assert len(stream) == shard["num_tokens"] == docs[-1]["start"] + docs[-1]["length"]
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    kept = {r["id"]: r["text"] for r in pq.read_table(select_dir / "kept" / f"{shard['shard']}.parquet").to_pylist()}
    first = docs[0]
    tokens = stream[first["start"] : first["start"] + first["length"]]
    assert tokens[-1] == index["eos_id"]
    assert tokenizer.decode(tokens[:-1].tolist()) == kept[first["id"]]


def test_validation_split_is_disjoint_and_stable(curated) -> None:
    _, pack_dir, _ = _dirs(curated)
    index = json.loads((pack_dir / "index.json").read_text())
    ids = {
        split: {r["id"] for s in index["splits"][split] for r in pq.read_table(pack_dir / s["docs"]).to_pylist()}
        for split in ("train", "val")
    }
    assert ids["val"] and not ids["train"] & ids["val"]


def test_windows_are_memory_mapped_views_of_the_stream(curated) -> None:
    _, pack_dir, _ = _dirs(curated)
    windows = TokenWindows(pack_dir, "train", 32)
    shard, start = windows.locate(3)
    raw = np.fromfile(pack_dir / windows.shards[shard]["file"], dtype="<u2")
    assert np.array_equal(windows[3], raw[start : start + 33])
    described = windows.describe(3)
    assert described["doc_ids"] and described["token_offset"] == start


def test_schedule_is_deterministic_resumable_and_disjoint_across_ranks() -> None:
    ranks = [BatchSchedule(1000, 4, 2, r, seed=7) for r in range(2)]
    first = [ranks[r].next()[1] for r in range(2) for _ in range(3)]
    assert not set(first[0]) & set(first[3])  # ranks see different windows
    again = BatchSchedule(1000, 4, 2, 0, seed=7)
    assert [again.next()[1] for _ in range(3)] == first[:3]
    resumed = BatchSchedule(1000, 4, 2, 0, seed=7)
    resumed.load_state_dict(ranks[0].state_dict())
    assert resumed.next() == ranks[0].next()
    skipping = BatchSchedule(1000, 4, 2, 0, seed=7)
    skipping.skip(8)
    assert [skipping.next()[0] for _ in range(2)] == [0, 16]
    assert skipping.index_of(16) == 2 and skipping.index_of(12) is None


def _step_windows(micro: int, world: int, per_step: int, state: dict | None = None) -> tuple[set[int], dict]:
    covered: set[int] = set()
    schedules = [BatchSchedule(500, micro, world, rank, seed=3) for rank in range(world)]
    for schedule in schedules:
        if state:
            schedule.load_state_dict(state)
        for _ in range(per_step):
            covered.update(schedule.next()[1])
    return covered, schedules[0].state_dict()


def test_an_optimizer_step_covers_the_same_windows_however_it_is_split() -> None:
    """Global batch 8: 1 rank x 2 micro-batches of 4 == 2 ranks x 1 micro-batch of 4 == 4 ranks x 2."""
    assert _step_windows(4, 1, 2)[0] == _step_windows(4, 2, 1)[0] == _step_windows(2, 4, 1)[0]


def test_a_resumed_run_may_split_the_batch_differently() -> None:
    """State saved by 2 ranks x 4 continues with 4 ranks x 2 at exactly the same windows."""
    _, after_first = _step_windows(4, 2, 1)
    second_original, _ = _step_windows(4, 2, 1, after_first)
    second_resplit, _ = _step_windows(2, 4, 1, after_first)
    assert second_original == second_resplit


def test_schedule_refuses_too_little_data() -> None:
    with pytest.raises(ValueError, match="fewer than one micro-batch"):
        BatchSchedule(3, 4, 1, 0, seed=0)
