"""Reading packed token shards for training: memory-mapped, deterministic, resumable, rank-sharded.

The shards are curation's `token-shards` product (written by `data_prep.pack`: `index.json`,
`tokens/*.bin` and their `.docs.parquet` sidecars); pretraining gets their folder, not curation's code.

`TokenWindows` reads the shards of a split as one token stream, in shard order, and cuts it
into windows of `seq_len + 1` tokens (inputs and shifted targets; consecutive windows share
one token) without copying: shards are `np.memmap`ed, and a window that crosses a shard
boundary is stitched from both. So no shard is skipped for being short and no shard's tail
is lost: only the stream's last `dropped_tokens` (< seq_len) are not in any window, and that
number is reported (pretraining's summary has it per split).

`BatchSchedule` fixes which windows every micro-batch holds. The window order is a
seeded permutation per epoch, concatenated over epochs; a global micro-batch starting at
position `p` of that order gives rank `r` the windows `p + r*M ... p + r*M + M - 1`
(M = micro-batch size, W = ranks; the next micro-batch starts at `p + M*W`). An optimizer
step of global batch B therefore always covers the same B windows however B is split
into ranks and accumulation steps, and the state -- the next position and the skipped
ranges, both counted in windows -- stays valid when a resumed run splits it differently.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq


class TokenWindows:
    """Random access to fixed-length token windows of one split of a pack output."""

    def __init__(self, pack_dir: str | Path, split: str, seq_len: int):
        self.pack_dir = Path(pack_dir)
        index = json.loads((self.pack_dir / "index.json").read_text())
        self.vocab_size: int = index["vocab_size"]
        self.eos_id: int = index["eos_id"]
        self.seq_len = seq_len
        dtype = np.dtype(index["dtype"]).newbyteorder("<")
        self.shards = [s for s in index["splits"][split] if s["num_tokens"] > 0]
        self._maps = [np.memmap(self.pack_dir / s["file"], dtype=dtype, mode="r") for s in self.shards]
        self._offsets = np.concatenate([[0], np.cumsum([len(m) for m in self._maps])]).astype(np.int64)
        self.total_tokens = int(self._offsets[-1])
        self._count = max(0, (self.total_tokens - 1) // seq_len)
        # tokens in no window: the stream's end (< seq_len), or everything when it is too short
        self.dropped_tokens = self.total_tokens - (self._count * seq_len + 1) if self._count else self.total_tokens
        self._docs: dict[int, dict[str, list[Any]]] = {}
        self._doc_starts: np.ndarray | None = None  # every document's first token in the whole stream

    def __len__(self) -> int:
        return self._count

    def locate(self, window: int) -> tuple[int, int]:
        """(shard number, token offset in that shard) of a window's first token."""
        position = window * self.seq_len
        shard = bisect.bisect_right(self._offsets, position) - 1
        return shard, int(position - self._offsets[shard])

    def __getitem__(self, window: int) -> np.ndarray:
        if not 0 <= window < self._count:
            raise IndexError(f"window {window} of {self._count}")
        shard, start = self.locate(window)
        wanted = self.seq_len + 1
        pieces = []
        while wanted:
            piece = self._maps[shard][start : start + wanted]
            pieces.append(np.asarray(piece, dtype=np.int64))
            wanted -= len(piece)
            shard, start = shard + 1, 0
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def batch(self, windows: list[int]) -> np.ndarray:
        return np.stack([self[w] for w in windows]) if windows else np.zeros((0, self.seq_len + 1), np.int64)

    def positions(self, windows: list[int]) -> np.ndarray:
        """Position ids of the windows' `seq_len` input tokens that restart at 0 at every document start
        inside a window (a window's first, partial document counts from the window's start). Given to the
        model without an attention mask, transformers reads each restart as a new sequence and builds a
        block-diagonal causal mask (`masking_utils.find_packed_sequence_indices`; flash-attention takes
        them as varlen boundaries): no token attends across a document boundary, and every document sees
        the positions it would see alone (pretrain.document_mask)."""
        if self._doc_starts is None:
            self._doc_starts = np.concatenate(
                [np.zeros(0, np.int64)]
                + [
                    np.asarray(pq.read_table(self.pack_dir / s["docs"], columns=["start"])["start"], np.int64)
                    + self._offsets[i]
                    for i, s in enumerate(self.shards)
                ]
            )
        index = np.arange(self.seq_len, dtype=np.int64)
        out = np.empty((len(windows), self.seq_len), np.int64)
        for row, window in enumerate(windows):
            first = window * self.seq_len
            lo, hi = np.searchsorted(self._doc_starts, [first + 1, first + self.seq_len])
            restart = np.zeros(self.seq_len, np.int64)
            restart[self._doc_starts[lo:hi] - first] = self._doc_starts[lo:hi] - first
            out[row] = index - np.maximum.accumulate(restart)
        return out

    def _shard_docs(self, shard: int) -> dict[str, list[Any]]:
        if shard not in self._docs:
            self._docs[shard] = pq.read_table(self.pack_dir / self.shards[shard]["docs"]).to_pydict()
        return self._docs[shard]

    def long_document_fraction(self, length: int | None = None) -> float:
        """The share of the split's tokens in documents of at least `length` tokens (default: seq_len),
        the ones a window can hold without crossing into another document (context extension's mix)."""
        length = length or self.seq_len
        long_tokens = total = 0
        for shard in range(len(self.shards)):
            lengths = np.asarray(
                pq.read_table(self.pack_dir / self.shards[shard]["docs"], columns=["length"])["length"]
            )
            total += int(lengths.sum())
            long_tokens += int(lengths[lengths >= length].sum())
        return long_tokens / total if total else 0.0

    def describe(self, window: int) -> dict[str, Any]:
        """Shard, token offset and the ids of the documents a window overlaps (for anomaly reports)."""
        first_shard, first_start = self.locate(window)
        shard, start, wanted, ids, shards = first_shard, first_start, self.seq_len + 1, [], []
        while wanted and shard < len(self.shards):
            docs = self._shard_docs(shard)
            end = min(start + wanted, len(self._maps[shard]))
            first = max(bisect.bisect_right(docs["start"], start) - 1, 0)
            for i in range(first, len(docs["start"])):
                if docs["start"][i] >= end:
                    break
                ids.append(docs["id"][i])
            shards.append(self.shards[shard]["shard"])
            wanted -= end - start
            shard, start = shard + 1, 0
        return {
            "window": int(window),
            "shard": shards[0],
            "shards": shards,
            "token_offset": first_start,
            "doc_ids": ids,
        }


@dataclass
class BatchSchedule:
    """Deterministic, resumable assignment of windows to (micro-batch, rank)."""

    num_windows: int
    micro_batch: int
    world_size: int
    rank: int
    seed: int
    position: int = 0
    skipped: list[tuple[int, int]] = field(default_factory=list)  # [start, start + length) in windows
    _epoch: int = -1
    _order: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.num_windows < self.span:
            raise ValueError(
                f"only {self.num_windows} windows of data: fewer than one micro-batch on every rank "
                f"({self.micro_batch} x {self.world_size}); use more data or a shorter seq_len"
            )

    @property
    def span(self) -> int:
        """Windows in one global micro-batch (all ranks)."""
        return self.micro_batch * self.world_size

    def _window_at(self, sequence_position: int) -> int:
        epoch, offset = divmod(sequence_position, self.num_windows)
        if epoch != self._epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._epoch = epoch
        return int(self._order[offset])  # type: ignore[index]

    def windows(self, start: int, rank: int | None = None) -> list[int]:
        """Windows of the global micro-batch starting at `start`, for `rank` (default: this rank)."""
        base = start + (self.rank if rank is None else rank) * self.micro_batch
        return [self._window_at(base + i) for i in range(self.micro_batch)]

    def next(self) -> tuple[int, list[int]]:
        """(start position, this rank's windows) of the next micro-batch; skipped ranges are passed over."""
        moved = True
        while moved:
            moved = False
            for begin, length in self.skipped:
                if begin <= self.position < begin + length:
                    self.position, moved = begin + length, True
        start = self.position
        self.position += self.span
        return start, self.windows(start)

    def skip(self, start: int) -> None:
        self.skipped.append((start, self.span))

    def index_of(self, start: int) -> int | None:
        """The micro-batch number of a start position (None when it is not on the micro-batch grid)."""
        return start // self.span if start % self.span == 0 else None

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "skipped": [list(r) for r in self.skipped]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        self.skipped = [(int(a), int(b)) for a, b in state.get("skipped", [])]
