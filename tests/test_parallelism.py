"""Tensor + sequence parallelism on a device mesh, for real: ranks launched by torchrun on gloo,
each run compared with one rank training the same model on the same global batch (fp32).

One launch per property: the 1-rank reference; TP=2 with a rank SIGKILLed at step 25 (its Prefect
retry resumes from step 20); FSDP=2; FSDP=2 resumed from the TP run's step-10 checkpoint; and
FSDP 2 x TP 2 on 4 ranks resumed from the FSDP=2 run's step-20 checkpoint (a mesh change both ways).

Marked slow: each run starts real processes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lmforge.engine.executor import run_pipeline_locally
from lmforge.errors import ConfigError
from tests.conftest import small_config
from tests.test_pretrain_deepspeed import _metrics, pretrain_with_a_killed_rank

pytestmark = pytest.mark.slow

# the session's small model with 2 key/value heads (so 2 tensor-parallel ranks split them), in fp32
# (bf16 hosts would otherwise compare rounding), 30 steps with a checkpoint every 10
MESH_MODEL = (
    "pretrain.model.num_kv_heads=2",
    "pretrain.precision=fp32",
    "pretrain.max_steps=30",
    "pretrain.checkpoint.every_steps=10",
    "pretrain.eval_every=10",
    "pretrain.distributed.backend=fsdp2",
    "pretrain.distributed.sharding=full",
)
TP2 = ("pretrain.distributed.num_ranks=2", "pretrain.distributed.tensor_parallel=2")
FSDP2_2 = ("pretrain.distributed.num_ranks=2",)
TOLERANCE = 1e-4


def _weights(manifest: dict) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(manifest["dir"]) / "hf" / "model.safetensors"))


def _weight_gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _loss_gaps(run: list[dict], reference: list[dict]) -> list[float]:
    return [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(run, reference)]


def _run(workspace: Path, *overrides: str) -> dict:
    return run_pipeline_locally(small_config(workspace, *MESH_MODEL, *overrides), ["pretrain"])["pretrain/train"]


def _resume_from(source: dict, workspace: Path, step: int) -> Path:
    """A copy of a finished run's workspace with everything after checkpoint `step` removed."""
    shutil.copytree(Path(source["dir"]).parents[2], workspace)
    out = workspace / "pretrain" / "train" / source["key"]
    (out / "manifest.json").unlink()
    shutil.rmtree(out / "hf")
    for ckpt in (out / "checkpoints").glob("step-*"):
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)
    return out


@pytest.fixture(scope="module")
def one_rank(curated: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory) -> dict:
    workspace = tmp_path_factory.mktemp("mesh-1")
    shutil.copytree(curated[0], workspace, dirs_exist_ok=True)
    return _run(workspace, "pretrain.distributed.num_ranks=1")


@pytest.fixture(scope="module")
def fsdp_two(curated: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory) -> dict:
    workspace = tmp_path_factory.mktemp("mesh-fsdp2")
    shutil.copytree(curated[0], workspace, dirs_exist_ok=True)
    return _run(workspace, *FSDP2_2)


@pytest.fixture(scope="module")
def tp_two(curated: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory, prefect_server) -> dict:
    """TP=2 under the Prefect pipeline, rank 1 SIGKILLed at step 25 and resumed from step 20."""
    workspace = tmp_path_factory.mktemp("mesh-tp2") / "ws"
    return pretrain_with_a_killed_rank(curated[0], workspace, *MESH_MODEL, *TP2)


def test_tensor_parallel_matches_one_rank_through_a_killed_rank(tp_two: dict, one_rank: dict) -> None:
    assert tp_two["key"] == one_rank["key"]  # how the work is spread is not what is trained
    plan = tp_two["extra"]["plan"]
    assert plan["degrees"] == {"tp": 2} and plan["world_size"] == 2 and plan["grad_accum"] == 2
    log = (Path(tp_two["dir"]) / "logs" / "rank-0.log").read_text()
    assert "resumed from step-00000020" in log
    tp, ref = _metrics(tp_two), _metrics(one_rank)
    assert [r["step"] for r in tp] == list(range(1, 31))
    gaps = _loss_gaps(tp, ref)
    assert max(gaps) < TOLERANCE, gaps
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.5  # it learns: the comparison is not of two flat lines
    assert _weight_gap(_weights(tp_two), _weights(one_rank)) < TOLERANCE
    assert tp_two["metrics"]["parity_max_abs_logit_diff"] <= 1e-3  # the export is one whole model


def test_fsdp_two_matches_one_rank(fsdp_two: dict, one_rank: dict) -> None:
    assert fsdp_two["extra"]["plan"]["degrees"] == {}
    gaps = _loss_gaps(_metrics(fsdp_two), _metrics(one_rank))
    assert len(gaps) == 30 and max(gaps) < TOLERANCE, gaps
    assert _weight_gap(_weights(fsdp_two), _weights(one_rank)) < TOLERANCE


def test_a_tensor_parallel_checkpoint_resumes_under_fsdp(tp_two: dict, fsdp_two: dict, tmp_path: Path) -> None:
    """DCP reshards DTensors: TP=2's step-10 shards load into FSDP=2 and the run continues to the weights
    of an uninterrupted FSDP=2 run."""
    out = _resume_from(tp_two, tmp_path / "ws", 10)
    manifest = _run(tmp_path / "ws", *FSDP2_2)
    assert manifest["extra"]["plan"]["degrees"] == {}
    assert "resumed from step-00000010" in (out / "logs" / "rank-0.log").read_text()
    assert _weight_gap(_weights(manifest), _weights(fsdp_two)) < TOLERANCE


def test_four_ranks_fsdp_by_tp_resume_an_fsdp_checkpoint_and_match_one_rank(
    fsdp_two: dict, one_rank: dict, tmp_path: Path
) -> None:
    """FSDP 2 x TP 2 on 4 ranks (a 2-D mesh), from the FSDP=2 run's step-20 checkpoint: the other direction
    of a layout change, and the composed mesh's steps 21-30 against the 1-rank run's."""
    out = _resume_from(fsdp_two, tmp_path / "ws", 20)
    manifest = _run(tmp_path / "ws", "pretrain.distributed.num_ranks=4", "pretrain.distributed.tensor_parallel=2")
    plan = manifest["extra"]["plan"]
    assert plan["degrees"] == {"tp": 2} and plan["world_size"] == 4 and plan["grad_accum"] == 1
    assert "resumed from step-00000020" in (out / "logs" / "rank-0.log").read_text()
    gaps = _loss_gaps(_metrics(manifest)[20:], _metrics(one_rank)[20:])
    assert len(gaps) == 10 and max(gaps) < TOLERANCE, gaps
    assert _weight_gap(_weights(manifest), _weights(one_rank)) < TOLERANCE
    layout = json.loads(next((out / "checkpoints").glob("step-00000030/trainer.json")).read_text())["layout"]
    assert layout["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2}


def test_mesh_settings_are_checked_when_the_config_loads() -> None:
    from lmforge.config import load_config

    with pytest.raises(ConfigError, match="tensor_parallel 2 needs an engine that trains on a device mesh"):
        load_config("tiny-cpu", ["pretrain.distributed.backend=deepspeed", *TP2])
    with pytest.raises(ConfigError, match="global_batch_size 8 is not a multiple"):
        load_config("tiny-cpu", [*TP2, "pretrain.global_batch_size=8", "pretrain.distributed.micro_batch_size=16"])


# -- pipeline parallelism: untied embeddings (the embedding and the head sit on different stages) --

UNTIED = ("pretrain.model.tie_embeddings=false",)
PP2 = ("pretrain.distributed.num_ranks=2", "pretrain.distributed.pipeline_parallel=2")


@pytest.fixture(scope="module")
def one_rank_untied(curated: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory) -> dict:
    workspace = tmp_path_factory.mktemp("mesh-1-untied")
    shutil.copytree(curated[0], workspace, dirs_exist_ok=True)
    return _run(workspace, *UNTIED, "pretrain.distributed.num_ranks=1")


@pytest.fixture(scope="module")
def pp_two(curated: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory) -> dict:
    workspace = tmp_path_factory.mktemp("mesh-pp2")
    shutil.copytree(curated[0], workspace, dirs_exist_ok=True)
    return _run(workspace, *UNTIED, *PP2)  # the default schedule, 1F1B


def test_pipeline_parallel_matches_one_rank(pp_two: dict, one_rank_untied: dict) -> None:
    assert pp_two["key"] == one_rank_untied["key"]
    plan = pp_two["extra"]["plan"]
    assert plan["degrees"] == {"pp": 2} and plan["mesh"]["pp"] == 2 and plan["grad_accum"] == 2
    pp, ref = _metrics(pp_two), _metrics(one_rank_untied)
    gaps = _loss_gaps(pp, ref)
    assert len(gaps) == 30 and max(gaps) < TOLERANCE, gaps
    assert [r["grad_norm"] for r in pp] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-4)  # over both stages
    val = [(a["val_loss"], b["val_loss"]) for a, b in zip(pp, ref) if "val_loss" in b]
    assert val and all(abs(a - b) / b < TOLERANCE for a, b in val)
    assert _weight_gap(_weights(pp_two), _weights(one_rank_untied)) < TOLERANCE
    assert pp_two["metrics"]["parity_max_abs_logit_diff"] <= 1e-3  # the stages' slices merged into one model


def test_a_pipeline_checkpoint_resumes_without_stages_and_back(
    pp_two: dict, one_rank_untied: dict, tmp_path: Path
) -> None:
    """Each stage's DCP shards carry the whole model's names: PP's step-10 checkpoint loads into FSDP 2,
    and one rank's step-20 checkpoint into GPipe stages; both end at one rank's weights."""
    out = _resume_from(pp_two, tmp_path / "a", 10)
    flat = _run(tmp_path / "a", *UNTIED, *FSDP2_2)
    assert "resumed from step-00000010" in (out / "logs" / "rank-0.log").read_text()
    assert _weight_gap(_weights(flat), _weights(one_rank_untied)) < TOLERANCE
    out = _resume_from(one_rank_untied, tmp_path / "b", 20)
    staged = _run(tmp_path / "b", *UNTIED, *PP2, "pretrain.distributed.pipeline_schedule=gpipe")
    assert "resumed from step-00000020" in (out / "logs" / "rank-0.log").read_text()
    assert max(_loss_gaps(_metrics(staged)[20:], _metrics(one_rank_untied)[20:])) < TOLERANCE
    assert _weight_gap(_weights(staged), _weights(one_rank_untied)) < TOLERANCE


def test_pipeline_settings_are_refused_in_one_line() -> None:
    from lmforge.config import load_config

    with pytest.raises(ConfigError, match="needs an engine that trains on a device mesh"):
        load_config("tiny-cpu", ["pretrain.distributed.backend=deepspeed", *UNTIED, *PP2])
