"""Verified, atomic training checkpoints.

Layout of one checkpoint (`checkpoints/step-00000050/`):
    engine/state/...   DeepSpeed's own files (model, ZeRO optimizer shards, scheduler)
    rank-00000.json    per-rank RNG states and data-schedule position
    trainer.json       step, tokens seen, guardrail state, LR scale, skipped batches
    CHECKSUMS.json     SHA-256 of every file above, written last

Everything is written into `.tmp-step-*` and renamed into place only after the checksums
are written, so a crash never leaves a half checkpoint under a real name. Before loading,
the checksums are verified; a damaged checkpoint is renamed `.corrupt-*` and the previous
one is used. DeepSpeed unpickles its own files (`weights_only=False` in its loader); the
checksum check means only files this run wrote and recorded are ever unpickled.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.hashing import atomic_write_json, file_sha256

log = logging.getLogger(__name__)
ENGINE_TAG = "state"
CHECKSUMS = "CHECKSUMS.json"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete-looking checkpoints, newest first."""
    if not root.exists():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")), reverse=True)


def verify(directory: Path) -> str | None:
    """None when every recorded file is present and matches; otherwise what is wrong."""
    try:
        recorded = json.loads((directory / CHECKSUMS).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return "no CHECKSUMS.json"
    for rel, sha in recorded.items():
        path = directory / rel
        if not path.exists():
            return f"missing {rel}"
        if file_sha256(path) != sha:
            return f"checksum mismatch in {rel}"
    return None


def latest_verified(root: Path) -> Path | None:
    """The newest checkpoint that verifies; damaged ones are set aside, never loaded."""
    for candidate in list_checkpoints(root):
        problem = verify(candidate)
        if problem is None:
            return candidate
        set_aside(candidate, problem)
    return None


def set_aside(candidate: Path, problem: str) -> Path:
    """Rename a damaged checkpoint out of the way, under a name no later one can collide with
    (the same step can be damaged twice: a replay after a rollback reaches it again)."""
    target = candidate.with_name(f".corrupt-{candidate.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    log.warning(
        "checkpoint %s is damaged (%s); set aside as %s, trying the previous one", candidate.name, problem, target.name
    )
    candidate.rename(target)
    return target


def seal(directory: Path) -> None:
    """Record the SHA-256 of every file of a written checkpoint, last: until this exists it is incomplete."""
    files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != CHECKSUMS)
    atomic_write_json(directory / CHECKSUMS, {rel: file_sha256(directory / rel) for rel in files})


def rng_state() -> dict[str, Any]:
    import torch

    np_state = np.random.get_state()
    assert isinstance(np_state, tuple)  # the legacy global generator is MT19937: its state is a tuple
    state = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def save(
    engine: Any,
    root: Path,
    step: int,
    trainer_state: dict[str, Any],
    rank_state: dict[str, Any],
    rank: int,
    keep_last: int,
    barrier: Any,
    extra_files: dict[str, Path] | None = None,
) -> Path:
    """Collective: every rank calls this. Returns the final checkpoint directory.

    `extra_files` (rank 0): {name: path} copied in when they exist, e.g. the metrics history,
    so a resume can rebuild outputs that were lost since."""
    tmp = root / f".tmp-step-{step:08d}"
    final = step_dir(root, step)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    engine.save_checkpoint(str(tmp / "engine"), tag=ENGINE_TAG, client_state={"lmforge_step": step}, save_latest=False)
    atomic_write_json(tmp / f"rank-{rank:05d}.json", rank_state)
    barrier()
    if rank == 0:
        atomic_write_json(tmp / "trainer.json", trainer_state)
        for name, source in (extra_files or {}).items():
            if source.exists():
                shutil.copy2(source, tmp / name)
        seal(tmp)
        if final.exists():  # a replay after rollback reaches the same step again
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(root)[keep_last:]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def read_trainer_state(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "trainer.json").read_text())


def load(engine: Any, directory: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore engine state; returns (trainer state, this rank's state).

    A rank that did not exist when the checkpoint was written (the run now has more ranks)
    takes rank 0's record: the data position is the same on every rank.
    """
    path, _ = engine.load_checkpoint(
        str(directory / "engine"), tag=ENGINE_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load {directory}")
    own = directory / f"rank-{rank:05d}.json"
    if not own.exists():
        own = directory / "rank-00000.json"
    return read_trainer_state(directory), json.loads(own.read_text())
