"""Shared fixtures: small configs, one curated workspace per session, one Prefect test server."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# A demo corpus small enough to curate in seconds, still with every kind of noise.
SMALL_CURATE = [
    "curate.demo.max_stdlib_files=25", "curate.demo.max_pypi_docs=60", "curate.demo.num_exact_duplicates=30",
    "curate.demo.num_near_duplicates=48", "curate.demo.num_boilerplate=16", "curate.demo.num_spam=16",
    "curate.demo.num_encoding_junk=10", "curate.demo.num_short=10", "curate.demo.num_long=1",
    "curate.demo.num_pii_docs=10", "curate.demo.num_contaminated=6", "curate.docs_per_shard=300",
    "curate.tokenizer.vocab_size=1024", "curate.pack.val_fraction=0.1",
]
# A model that trains in seconds on 2 CPU ranks.
SMALL_PRETRAIN = [
    "pretrain.model.hidden_size=64", "pretrain.model.intermediate_size=172", "pretrain.model.num_layers=2",
    "pretrain.model.num_heads=4", "pretrain.model.num_kv_heads=2", "pretrain.seq_len=64",
    "pretrain.global_batch_size=8", "pretrain.distributed.micro_batch_size=4", "pretrain.max_steps=160",
    "pretrain.optim.warmup_steps=5", "pretrain.optim.lr=1e-2", "pretrain.checkpoint.every_steps=20",
    "pretrain.eval_every=40", "pretrain.eval_batches=4", "pretrain.log_every=20",
]


def small_config(workspace: Path, *extra: str):
    from lmforge.config import load_config

    return load_config("tiny-cpu", [*SMALL_CURATE, *SMALL_PRETRAIN, *extra], str(workspace))


@pytest.fixture(scope="session")
def curated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A workspace with the small demo corpus curated once per session (no Prefect)."""
    from lmforge.executor import run_pipeline_locally

    workspace = tmp_path_factory.mktemp("curated")
    manifests = run_pipeline_locally(small_config(workspace), ["curate"])
    return workspace, manifests


@pytest.fixture
def curated_copy(curated: tuple[Path, dict], tmp_path: Path) -> Path:
    """A private copy of the curated workspace that a test may modify."""
    target = tmp_path / "ws"
    shutil.copytree(curated[0], target, symlinks=True)
    return target


@pytest.fixture(scope="session")
def prefect_server():
    """One temporary Prefect API for every test that runs flows or tasks."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
