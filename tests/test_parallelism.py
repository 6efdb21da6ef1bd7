"""Tensor + sequence parallelism on a device mesh, for real: ranks launched by torchrun on gloo,
each run compared with one rank training the same model on the same global batch (fp32).

One launch per property: the 1-rank reference; TP=2 with a rank SIGKILLed at step 25 (its Prefect
retry resumes from step 20); FSDP=2; FSDP=2 resumed from the TP run's step-10 checkpoint; and
FSDP 2 x TP 2 on 4 ranks resumed from the FSDP=2 run's step-20 checkpoint (a mesh change both ways).
Pipeline stages: PP=2 against one rank (untied embeddings), its checkpoint resumed without stages,
and one rank's checkpoint resumed by PP 2 x TP 2 on 4 ranks. Alignment on transformers' own plans:
SFT then DPO at TP=2 through a killed rank against one rank.

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
    and one rank's step-20 checkpoint into GPipe stages split by tensor parallelism (PP 2 x TP 2 on 4
    ranks: sequence-split activations between stages, loss parallel on the last); both end at one
    rank's weights."""
    out = _resume_from(pp_two, tmp_path / "a", 10)
    flat = _run(tmp_path / "a", *UNTIED, *FSDP2_2)
    assert "resumed from step-00000010" in (out / "logs" / "rank-0.log").read_text()
    assert _weight_gap(_weights(flat), _weights(one_rank_untied)) < TOLERANCE
    out = _resume_from(one_rank_untied, tmp_path / "b", 20)
    both = ("pretrain.distributed.num_ranks=4", "pretrain.distributed.pipeline_parallel=2")
    staged = _run(tmp_path / "b", *UNTIED, *both, "pretrain.distributed.tensor_parallel=2",
                  "pretrain.distributed.pipeline_schedule=gpipe")  # fmt: skip
    plan = staged["extra"]["plan"]
    assert plan["degrees"] == {"pp": 2, "tp": 2} and plan["world_size"] == 4
    assert "resumed from step-00000020" in (out / "logs" / "rank-0.log").read_text()
    assert max(_loss_gaps(_metrics(staged)[20:], _metrics(one_rank_untied)[20:])) < TOLERANCE
    assert _weight_gap(_weights(staged), _weights(one_rank_untied)) < TOLERANCE
    assert staged["metrics"]["parity_max_abs_logit_diff"] <= 1e-3  # stages and tensor slices merged whole


def test_pipeline_settings_are_refused_in_one_line() -> None:
    from lmforge.config import load_config

    with pytest.raises(ConfigError, match="needs an engine that trains on a device mesh"):
        load_config("tiny-cpu", ["pretrain.distributed.backend=deepspeed", *UNTIED, *PP2])


# -- alignment under transformers' own tensor-parallel plans ------------------------------------------

# SFT then DPO on the 1-rank run's model (2 key/value heads), fp32, short: one rank against TP=2 (both
# ranks one tensor-parallel group, so the same global batch), a rank SIGKILLed after SFT's step 7
ALIGN = (
    "align.recipe=[sft, dpo]",
    "align.precision=fp32",
    "align.sft.max_steps=12",
    "align.sft.save_steps=6",
    "align.sft.eval_every=6",
    "align.sft.global_batch_size=16",
    "align.sft.micro_batch_size=8",
    "align.dpo.max_steps=6",
    "align.dpo.save_steps=6",
    "align.dpo.eval_every=6",
    "align.dpo.global_batch_size=16",
    "align.dpo.micro_batch_size=8",
    "align.eval_generations=8",
)
ALIGN_TP2 = ("align.distributed.num_ranks=2", "align.distributed.tensor_parallel=2")


def _align(pretrained: dict, workspace: Path, *overrides: str) -> dict:
    shutil.copytree(Path(pretrained["dir"]).parents[2], workspace)
    return run_pipeline_locally(small_config(workspace, *MESH_MODEL, *ALIGN, *overrides), ["align"])


def _logged(step: dict) -> dict[int, dict]:
    """The last row logged for each step (a resumed run logs the steps after its checkpoint again)."""
    rows = [json.loads(line) for line in (Path(step["dir"]) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r and r.get("step")}


def test_sft_and_dpo_under_transformers_tensor_parallel_match_one_rank_through_a_killed_rank(
    one_rank: dict, tmp_path: Path
) -> None:
    import threading

    from tests.test_align import _kill_rank_when

    reference = _align(one_rank, tmp_path / "one", "align.distributed.num_ranks=1")
    done = threading.Event()
    killer = threading.Thread(target=_kill_rank_when, args=(tmp_path / "tp", 1, 7, done), daemon=True)
    killer.start()
    try:
        split = _align(one_rank, tmp_path / "tp", *ALIGN_TP2)
    finally:
        done.set()
    for name, steps in (("align/sft", 12), ("align/dpo", 6)):
        tp, ref = split[name], reference[name]
        assert tp["extra"]["tensor_parallel"] == 2 and tp["extra"]["world_size"] == 2
        tp_rows, ref_rows = _logged(tp), _logged(ref)
        assert sorted(tp_rows) == sorted(ref_rows) == list(range(1, steps + 1)), name
        gaps = [abs(tp_rows[s]["loss"] - ref_rows[s]["loss"]) / abs(ref_rows[s]["loss"]) for s in ref_rows]
        assert max(gaps) < TOLERANCE, (name, gaps)
        assert _weight_gap(_weights(tp), _weights(ref)) < TOLERANCE, name  # measured: 8e-6 (SFT), 1.2e-5 (DPO)
    sft_losses = [r["loss"] for _, r in sorted(_logged(reference["align/sft"]).items())]
    assert sft_losses[-1] < sft_losses[0]  # it trains: the comparison is not of two flat lines
    # SFT's key is one rank's (how the work is spread is not what is trained); DPO's differs, as its
    # upstream SFT model's bytes do (the two runs agree to fp32 rounding, not bit for bit)
    assert split["align/sft"]["key"] == reference["align/sft"]["key"]
    sft = Path(split["align/sft"]["dir"])
    assert split["align/sft"]["counts"]["attempts"] == 2
    assert "resuming from checkpoint-6" in (sft / "logs" / "rank-0.log").read_text()
    assert "tensor parallel 2 (transformers' plan)" in (sft / "logs" / "rank-0.log").read_text()


def test_alignment_tensor_parallel_settings_are_refused_in_one_line(tmp_path: Path) -> None:
    from lmforge.config import load_config
    from training.parallel.dims.tensor import align_model_problem, align_trainer_arguments, align_world_problem

    # accelerate's ParallelismConfig for the Trainer: TP alone, or FSDP2 replicas beside it on a 2-D mesh
    alone = align_trainer_arguments(2, 2, mesh_engine=True)["parallelism_config"]
    assert alone.tp_size == 2 and (alone.dp_shard_size or 1) == 1
    both = align_trainer_arguments(2, 4, mesh_engine=True)["parallelism_config"]
    assert (both.dp_shard_size, both.tp_size) == (2, 2)
    assert align_trainer_arguments(1, 4, mesh_engine=True) == {}
    for extra, message in (
        (["align.method=lora"], "method lora trains adapters on split layers"),
        (["align.recipe=[sft, kto]"], "kto does not train under tensor parallelism"),
        (["align.distributed.num_ranks=3"], "does not divide num_ranks 3"),
        (["align.distributed.zero_stage=2"], "ZeRO stage 2 is not composed"),
    ):
        with pytest.raises(ConfigError, match=message) as info:
            load_config("tiny-cpu", [*ALIGN_TP2, *extra], str(tmp_path))
        assert "\n" not in str(info.value)
    assert align_world_problem(4, 1, 2, mesh_engine=False) is not None  # replicas need FSDP2's sharding
    assert align_world_problem(4, 1, 2, mesh_engine=True) is None and align_world_problem(2, 1, 2, False) is None
    assert "more than the 2 ranks of a node" in align_world_problem(4, 2, 4, True)
    llama = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 64,
             "vocab_size": 256, "hidden_size": 64}  # fmt: skip
    assert "num_key_value_heads 1" in align_model_problem(llama, 2, "base/config.json")
    assert align_model_problem({**llama, "num_key_value_heads": 2}, 2, "x") is None
    assert "no tensor-parallel plan" in align_model_problem({"model_type": "gpt2", "vocab_size": 256}, 2, "x")
