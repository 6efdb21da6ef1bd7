"""Pretraining on the FSDP2 backend for real: 2 CPU ranks on gloo under torchrun, DCP checkpoints,
a killed rank's retry, export and parity; compared with the DeepSpeed run of the same config.

Marked slow: each run starts real processes (about 15-30 s).
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
FSDP2 = "pretrain.distributed.backend=fsdp2"


@pytest.fixture(scope="module")
def fsdp2_trained(curated: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The session's small pretraining run again, on FSDP2 (the reference for its resume test)."""
    workspace = tmp_path_factory.mktemp("fsdp2")
    shutil.copytree(curated[0], workspace, dirs_exist_ok=True)
    return run_pipeline_locally(small_config(workspace, FSDP2), ["pretrain"])["pretrain/train"]


def _weights(manifest: dict) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(manifest["dir"]) / "hf" / "model.safetensors"))


def test_fsdp2_follows_deepspeeds_loss_trajectory(fsdp2_trained: dict, trained: dict) -> None:
    """Same seed, data and schedule as the DeepSpeed run: the same model up to reduction order."""
    assert fsdp2_trained["key"] == trained["key"]  # the backend is how, not what: the same cache identity
    plan = fsdp2_trained["extra"]["plan"]
    assert plan["backend"] == "fsdp2" and plan["strategy"].startswith("FSDP2 ")
    launch = json.loads((Path(fsdp2_trained["dir"]) / "logs" / "attempt-1" / "launch.json").read_text())
    assert launch["command"][1:3] == ["-m", "torch.distributed.run"]
    fsdp, ds = _metrics(fsdp2_trained), _metrics(trained)
    assert [r["step"] for r in fsdp] == list(range(1, 161))
    assert [r["lr"] for r in fsdp] == pytest.approx([r["lr"] for r in ds], rel=1e-6)
    gaps = [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(fsdp, ds)]
    # The same computation in another reduction order: identical at first, then bf16 rounding compounds. How
    # fast depends on the CPU's bf16 kernels: on AVX-512 hosts under 1e-3 for 20 steps, 2% at most, 0.5% on
    # average, final val loss within 1%; on an AVX2-only AMD EPYC host (emulated bf16) 0.3% within 20 steps,
    # 3.5% at most, 0.74% on average, final val loss 1.8% apart. A bug of the backend (another data order, a
    # loss scaled per rank, a missed gradient reduction) is apart from the first steps and by far more: the
    # first steps are the sharp check. Later, how fast the two drift apart (lr 1e-2 amplifies the last bit of a
    # sum) depends on the CPU, and CI draws hosts this suite has not met: the later bounds are about 3x the
    # largest figures measured, far under what a wrong reduction gives.
    assert max(gaps[:3]) < 1e-3, gaps[:3]  # 0, 0, 0 on the AVX2 host
    assert max(gaps[:20]) < 1e-2, gaps[:20]
    assert max(gaps) < 0.1 and sum(gaps) / len(gaps) < 0.025, (max(gaps), sum(gaps) / len(gaps))
    val = [r["val_loss"] for r in fsdp if "val_loss" in r]
    assert val[-1] < val[0] - 0.15
    assert abs(val[-1] - trained["metrics"]["final_val_loss"]) / trained["metrics"]["final_val_loss"] < 0.05
    assert fsdp[-1]["grad_norm"] > 0 and fsdp[-1]["mfu"] > 0
    assert fsdp2_trained["metrics"]["parity_max_abs_logit_diff"] <= 1e-3


def test_fsdp2_checkpoints_are_sharded_verified_and_pruned(fsdp2_trained: dict) -> None:
    from training import checkpoint

    root = Path(fsdp2_trained["dir"]) / "checkpoints"
    names = [p.name for p in checkpoint.list_checkpoints(root)]
    assert names == ["step-00000160", "step-00000140", "step-00000120"]
    latest = root / names[0]
    assert checkpoint.verify(latest) is None
    state = latest / "engine" / "state"
    assert (state / ".metadata").exists() and len(list(state.glob("*.distcp"))) == 2  # one shard file per rank
    assert sorted(p.name for p in latest.glob("rank-*.json")) == ["rank-00000.json", "rank-00001.json"]
    assert checkpoint.read_trainer_state(latest)["layout"]["backend"] == "fsdp2"


def test_a_killed_fsdp2_rank_is_retried_and_resumes_to_the_same_weights(
    curated: tuple[Path, dict], fsdp2_trained: dict, tmp_path: Path, prefect_server
) -> None:
    manifest = pretrain_with_a_killed_rank(curated[0], tmp_path / "ws", FSDP2)
    log = (Path(manifest["dir"]) / "logs" / "rank-0.log").read_text()
    assert "resumed from step-00000020" in log
    resumed, reference = _weights(manifest), _weights(fsdp2_trained)
    assert resumed.keys() == reference.keys()
    gap = max(float((resumed[k].float() - reference[k].float()).abs().max()) for k in reference)
    assert gap <= 1e-4, gap


def test_a_checkpoint_of_one_backend_is_not_resumed_by_the_other(fsdp2_trained: dict, tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    shutil.copytree(Path(fsdp2_trained["dir"]).parents[2], workspace)
    out = workspace / "pretrain" / "train" / fsdp2_trained["key"]
    (out / "manifest.json").unlink()  # progress left behind by an unfinished FSDP2 run
    shutil.rmtree(out / "hf")
    config = small_config(workspace, "pretrain.distributed.backend=deepspeed")
    with pytest.raises(ConfigError, match="written by fsdp2; this run uses deepspeed"):
        run_pipeline_locally(config, ["pretrain"])


def test_fsdp2_settings_are_checked_when_the_config_loads() -> None:
    from lmforge.config import load_config

    for setting, message in (
        (["pretrain.distributed.zero_stage=2"], "zero_stage is DeepSpeed's"),
        (["pretrain.distributed.offload=optimizer"], "offloads parameters, gradients and optimizer states together"),
        (["pretrain.distributed.sharding=hybrid"], "needs num_nodes > 1"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config("tiny-cpu", [FSDP2, *setting])
    with pytest.raises(ConfigError, match="sharding is FSDP2's"):
        load_config("tiny-cpu", ["pretrain.distributed.backend=deepspeed", "pretrain.distributed.sharding=full"])


def test_an_fsdp2_checkpoint_of_two_ranks_resumes_on_one(fsdp2_trained: dict, tmp_path: Path) -> None:
    """DCP reshards on load: the run picks up at step 140 on one rank (two micro-batches per step
    instead of two ranks) and continues the same trajectory."""
    workspace = tmp_path / "ws"
    shutil.copytree(Path(fsdp2_trained["dir"]).parents[2], workspace)
    out = workspace / "pretrain" / "train" / fsdp2_trained["key"]
    for name in ("manifest.json", "hf", "checkpoints/step-00000160"):
        target = out / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    config = small_config(workspace, FSDP2, "pretrain.distributed.num_ranks=1")
    manifest = run_pipeline_locally(config, ["pretrain"])["pretrain/train"]
    assert manifest["extra"]["plan"]["world_size"] == 1 and manifest["extra"]["plan"]["grad_accum"] == 2
    assert "resumed from step-00000140" in (out / "logs" / "rank-0.log").read_text()
    resumed, reference = _metrics(manifest), _metrics(fsdp2_trained)
    assert [r["step"] for r in resumed] == list(range(1, 161))
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(resumed[140:], reference[140:])) < 1e-3


def test_compiled_fsdp2_layers_train_export_and_report_the_compile_time(
    curated: tuple[Path, dict], tmp_path: Path
) -> None:
    """pretrain.compile compiles each decoder layer (inductor) under FSDP2's hooks; the export still
    reproduces the compiled engine's logits, and the first step's compile time is reported apart."""
    workspace = tmp_path / "ws"
    shutil.copytree(curated[0], workspace)
    steps = ["pretrain.max_steps=8", "pretrain.checkpoint.every_steps=8", "pretrain.eval_every=8"]
    manifest = run_pipeline_locally(small_config(workspace, FSDP2, "pretrain.compile=true", *steps), ["pretrain"])[
        "pretrain/train"
    ]
    metrics = manifest["metrics"]
    assert manifest["extra"]["plan"]["compile"] is True
    assert metrics["compile_s"] > 1 and metrics["first_step_s"] > metrics["compile_s"]
    assert metrics["parity_max_abs_logit_diff"] <= 1e-3


def test_fsdp2_never_applies_non_finite_gradients(curated: tuple[Path, dict], tmp_path: Path) -> None:
    """A finite loss with NaN gradients: FSDP2's engine skips the update (as DeepSpeed does) and the
    guardrails roll the step back; before, it applied them and every later loss was NaN (seen on an H200)."""
    workspace = tmp_path / "ws"
    shutil.copytree(curated[0], workspace)
    config = small_config(workspace, FSDP2, "debug.pretrain.nan_grad_at_batches=[52]", "pretrain.max_steps=60")
    manifest = run_pipeline_locally(config, ["pretrain"])["pretrain/train"]
    anomalies = json.loads((Path(manifest["dir"]) / "anomalies.json").read_text())
    assert [(a["kind"], a["step"], a["micro_batches"]) for a in anomalies] == [("non_finite_grad", 53, [52])]
    rows = _metrics(manifest)
    assert [r["step"] for r in rows] == list(range(1, 61)) and all(r["loss"] == r["loss"] for r in rows)
