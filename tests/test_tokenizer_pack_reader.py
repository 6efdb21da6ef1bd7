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


def _pack(directory: Path, lengths: list[int]) -> Path:
    """A one-shard pack of documents of `lengths` tokens (random ids), as curate/pack writes it."""
    import pyarrow as pa

    directory.mkdir()
    stream = np.random.default_rng(0).integers(1, 90, sum(lengths)).astype("<u2")
    stream.tofile(directory / "s0.bin")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    ids = [f"d{i}" for i in range(len(lengths))]
    pq.write_table(pa.table({"id": ids, "start": starts, "length": lengths}), directory / "s0.parquet")
    shard = {"shard": "s0", "file": "s0.bin", "docs": "s0.parquet", "num_tokens": int(sum(lengths))}
    index = {"vocab_size": 100, "eos_id": 0, "dtype": "uint16", "splits": {"train": [shard], "val": []}}
    (directory / "index.json").write_text(json.dumps(index))
    return directory


def test_document_positions_restart_at_every_document_start(tmp_path: Path) -> None:
    windows = TokenWindows(_pack(tmp_path / "pack", [5, 12, 3, 20, 7, 9, 30]), "train", 16)  # starts 0 5 17 20 40
    positions = windows.positions([0, 1, 2])
    assert positions[0].tolist() == [0, 1, 2, 3, 4] + list(range(11))
    assert positions[1].tolist() == [0, 0, 1, 2] + list(range(12))  # 16: the tail of a document; 17 and 20 start
    assert positions[2].tolist() == list(range(8)) + list(range(7)) + [0]  # 40 and 47 start


def test_a_packed_document_sees_only_itself(tmp_path: Path) -> None:
    """pretrain.document_mask: with the positions above (and no cache), transformers masks across
    document boundaries, so the second document's logits in a packed window are the logits it gets
    alone; attending across changes them."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    windows = TokenWindows(_pack(tmp_path / "pack", [5, 12, 3, 20]), "train", 16)
    config = LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids = torch.from_numpy(windows.batch([0]))[:, :-1]
    with torch.no_grad():
        alone = model(input_ids=ids[:, 5:]).logits
        for implementation in ("sdpa", "eager"):
            model.config._attn_implementation = implementation
            packed = model(input_ids=ids, position_ids=torch.from_numpy(windows.positions([0]))).logits
            assert (packed[:, 5:] - alone).abs().max() < 1e-5, implementation
        across = model(input_ids=ids).logits
    assert (across[:, 5:] - alone).abs().max() > 1e-3
