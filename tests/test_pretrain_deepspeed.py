"""Pretraining for real: 2 DeepSpeed CPU ranks on gloo, checkpoints, resume, guardrails, export.

These start real processes (about 15-30 s each) and are marked slow.
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from lmforge.engine.executor import run_pipeline_locally
from tests.conftest import small_config

pytestmark = pytest.mark.slow


def _metrics(manifest: dict) -> list[dict]:
    return [json.loads(line) for line in (Path(manifest["dir"]) / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_train_and_the_loss_falls(trained: dict) -> None:
    rows = _metrics(trained)
    assert [r["step"] for r in rows] == list(range(1, 161))
    assert trained["extra"]["plan"]["world_size"] == 2
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    # 0.24 nats from step 40 to 160 on an AVX2-only AMD EPYC host (6.12 -> 5.88), 0.3+ on the AVX-512 hosts.
    # The figures differ by host (bf16 on AMX hosts, fp32 on AVX2 ones; each CPU's kernels), and CI draws hosts this suite
    # has not met: the bounds leave room for that, and still fail a run that learns nothing (a flat loss)
    assert len(val) == 4 and val[-1] < val[0] - 0.15
    # below what a model that ignores context can reach: it has learnt something about order
    # (0.15 nats below on an AMD EPYC host, 0.2+ on the Intel hosts before it)
    assert val[-1] < trained["metrics"]["unigram_entropy_nats"] - 0.05
    last = rows[-1]
    assert last["grad_norm"] > 0 and last["tokens_per_s"] > 0 and 0 < last["mfu"] < 1 and last["lr"] > 0
    assert list((Path(trained["dir"]) / "tensorboard").glob("events.out.tfevents.*"))


def test_checkpoints_are_verified_and_pruned(trained: dict) -> None:
    from training import checkpoint

    root = Path(trained["dir"]) / "checkpoints"
    names = [p.name for p in checkpoint.list_checkpoints(root)]
    assert names == ["step-00000160", "step-00000140", "step-00000120"]  # keep_last = 3
    assert all(checkpoint.verify(root / n) is None for n in names)
    assert not list(root.glob(".tmp-*"))


def test_export_loads_generates_and_matches_the_engine(trained: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = Path(trained["dir"]) / "hf"
    assert (hf / "model.safetensors").exists() and (hf / "generation_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(str(hf))
    tokenizer = AutoTokenizer.from_pretrained(str(hf))
    inputs = tokenizer("def ", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 8
    assert trained["metrics"]["parity_max_abs_logit_diff"] <= 1e-3
    assert trained["digest"]  # downstream keys follow the exported weights


def _local_rank(proc: psutil.Process, cmd: str) -> int | None:
    """A rank's number: DeepSpeed's launcher passes --local_rank, torchrun sets LOCAL_RANK (the
    launchers themselves have neither)."""
    for part in cmd.split():
        if part.startswith("--local_rank="):
            return int(part.split("=", 1)[1])
    try:
        value = proc.environ().get("LOCAL_RANK")
    except psutil.Error:
        return None
    return int(value) if value is not None else None


def _kill_rank_when(workspace: Path, rank: int, step: int, done: threading.Event) -> None:
    """SIGKILL one training rank once the run has logged `step`."""
    while not done.is_set():
        for metrics in workspace.glob("pretrain/train/*/metrics.jsonl"):
            lines = metrics.read_text().splitlines()
            if lines and json.loads(lines[-1])["step"] >= step:
                for proc in psutil.process_iter(["cmdline"]):
                    cmd = " ".join(proc.info["cmdline"] or [])
                    if "training.train_entry" in cmd and str(workspace) in cmd and _local_rank(proc, cmd) == rank:
                        proc.send_signal(signal.SIGKILL)
                        return
        time.sleep(0.05)


def pretrain_with_a_killed_rank(curated: Path, workspace: Path, *overrides: str) -> dict:
    """The small pretraining under the Prefect pipeline with rank 1 SIGKILLed at step 25 (after the
    step-20 checkpoint); returns the manifest, checked to have cost exactly one retry."""
    from flows.pipeline import pipeline
    from tests.conftest import SMALL_CURATE, SMALL_PRETRAIN

    shutil.copytree(curated, workspace)
    done = threading.Event()
    killer = threading.Thread(target=_kill_rank_when, args=(workspace, 1, 25, done), daemon=True)
    killer.start()
    try:
        result = pipeline(
            preset="tiny-cpu",
            overrides=[*SMALL_CURATE, *SMALL_PRETRAIN, *overrides],
            workspace=str(workspace),
            stages=["pretrain"],
        )
    finally:
        done.set()
    step = result["steps"]["pretrain/train"]
    manifest = json.loads((Path(step["dir"]) / "manifest.json").read_text())
    assert manifest["counts"]["attempts"] == 2, "the kill should have cost exactly one retry"
    return manifest


def test_killed_rank_is_retried_by_prefect_and_resumes_to_the_same_loss(
    curated: tuple[Path, dict], trained: dict, tmp_path: Path, prefect_server
) -> None:
    manifest = pretrain_with_a_killed_rank(curated[0], tmp_path / "ws")
    log = (Path(manifest["dir"]) / "logs" / "rank-0.log").read_text()
    assert "resumed from step-000000" in log and "resumed from step-00000000 " not in log
    resumed, reference = _metrics(manifest), _metrics(trained)
    assert [r["step"] for r in resumed] == list(range(1, 161))
    # not just the end point: every step's loss, before and after the kill, is the uninterrupted run's
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(resumed, reference)) < 1e-4
    assert abs(manifest["metrics"]["final_val_loss"] - trained["metrics"]["final_val_loss"]) < 1e-4


@pytest.fixture(scope="module")
def guarded(curated: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One 60-step run meeting both kinds of bad step the guardrails roll back (one launch for both
    properties): gradients that overflow with a finite loss at batch 26, a NaN loss at batch 52."""
    workspace = tmp_path_factory.mktemp("guarded")
    shutil.copytree(curated[0], workspace, dirs_exist_ok=True)
    config = small_config(
        workspace,
        "debug.pretrain.nan_grad_at_batches=[26]",
        "debug.pretrain.nan_at_batches=[52]",
        "pretrain.max_steps=60",
    )
    manifest = run_pipeline_locally(config, ["pretrain"])["pretrain/train"]
    rows = _metrics(manifest)
    # every step of the run is there once, each with a finite loss and gradient norm
    assert [r["step"] for r in rows] == list(range(1, 61))
    assert all(r["loss"] == r["loss"] and r["grad_norm"] == r["grad_norm"] for r in rows)
    assert manifest["counts"]["anomalies"] == 2
    return {a["kind"]: a for a in json.loads((Path(manifest["dir"]) / "anomalies.json").read_text())}


def test_nan_batch_is_rolled_back_and_skipped(guarded: dict) -> None:
    # batch 26 was skipped before (the gradient anomaly), so from step 27 on step N reads batch N
    anomaly = guarded["non_finite"]
    assert anomaly["step"] == 52 and anomaly["micro_batches"] == [52]
    assert anomaly["action"].startswith("rolled back to step-00000040")
    assert anomaly["samples"] and all(s["doc_ids"] and s["shard"] for s in anomaly["samples"])
    # the replayed step 52 (batch 53 instead of 52) has a finite loss, close to the window's
    assert anomaly["loss_after"] == anomaly["loss_after"] and abs(anomaly["loss_after"] - anomaly["window_mean"]) < 1.0


def test_non_finite_gradients_with_a_finite_loss_are_an_anomaly(guarded: dict) -> None:
    """What overflowing bf16 gradients do (seen on an H200: a window starting with the pad id, whose
    embedding row is zero at initialisation, on a 22-layer model): DeepSpeed would skip or
    apply such a step without failing; the guardrails roll it back and skip its batch like a NaN loss."""
    anomaly = guarded["non_finite_grad"]
    assert (anomaly["step"], anomaly["micro_batches"]) == (27, [26])
    assert anomaly["loss"] == anomaly["loss"]  # the loss itself was finite
    assert anomaly["action"].startswith("rolled back to step-00000020")


def test_zero3_with_activation_checkpointing_trains_and_exports(curated: tuple[Path, dict], tmp_path: Path) -> None:
    """Parameters sharded over both ranks: the export has to gather them (a collective)."""
    workspace = tmp_path / "ws"
    shutil.copytree(curated[0], workspace)
    config = small_config(
        workspace,
        "pretrain.distributed.zero_stage=3",
        "pretrain.max_steps=20",
        "pretrain.distributed.activation_checkpointing=true",
    )
    manifest = run_pipeline_locally(config, ["pretrain"])["pretrain/train"]
    assert manifest["extra"]["plan"]["zero_stage"] == 3
    assert manifest["metrics"]["parity_max_abs_logit_diff"] <= 1e-3
    ds_config = json.loads((Path(manifest["dir"]) / "ds_config.json").read_text())
    assert ds_config["zero_optimization"]["stage"] == 3
    rows = _metrics(manifest)
    assert len(rows) == 20 and rows[-1]["grad_norm"] > 0


def _reopen(trained: dict, tmp_path: Path, drop: tuple[str, ...]) -> tuple[Path, Path]:
    """A copy of the trained workspace whose pretrain step is incomplete again."""
    copy = tmp_path / "ws"
    shutil.copytree(Path(trained["dir"]).parents[2], copy)
    out = copy / "pretrain" / "train" / trained["key"]
    (out / "manifest.json").unlink()
    for name in drop:
        shutil.rmtree(out / "checkpoints" / name)
    return copy, out


def test_resume_with_a_different_micro_batch_split(trained: dict, tmp_path: Path) -> None:
    """micro-batch 4 x 2 ranks -> 2 x 2 ranks x 2 accumulation steps: same windows per step."""
    copy, out = _reopen(trained, tmp_path, ("step-00000160", "step-00000140"))
    manifest = run_pipeline_locally(small_config(copy, "pretrain.distributed.micro_batch_size=2"), ["pretrain"])[
        "pretrain/train"
    ]
    assert "resumed from step-00000120 (step 120)" in (out / "logs" / "rank-0.log").read_text()
    assert manifest["extra"]["plan"]["grad_accum"] == 2
    resumed, reference = _metrics(manifest), _metrics(trained)
    assert [r["step"] for r in resumed] == list(range(1, 161))
    assert abs(resumed[-1]["loss"] - reference[-1]["loss"]) < 0.05


def test_resume_refuses_a_different_zero_layout(trained: dict, tmp_path: Path) -> None:
    from lmforge.errors import ConfigError

    copy, _ = _reopen(trained, tmp_path, ())
    with pytest.raises(ConfigError, match="written with ZeRO-0 on 2 rank\\(s\\); this run uses ZeRO-2"):
        run_pipeline_locally(small_config(copy, "pretrain.distributed.zero_stage=2"), ["pretrain"])


def test_damaged_progress_is_never_silently_restarted(trained: dict, tmp_path: Path) -> None:
    from lmforge.errors import DeterministicError, is_retryable

    copy, out = _reopen(trained, tmp_path, ())
    for engine_file in (out / "checkpoints").rglob("*.pt"):
        engine_file.write_bytes(b"damaged")
    with pytest.raises(DeterministicError, match="checkpoints exist but none verifies") as info:
        run_pipeline_locally(small_config(copy), ["pretrain"])
    assert not is_retryable(info.value)
    assert len(list((out / "checkpoints").glob(".corrupt-step-*"))) == 3
    shutil.rmtree(out / "checkpoints")  # progress without any checkpoint: still refused
    with pytest.raises(DeterministicError, match="records training progress but no checkpoint is left"):
        run_pipeline_locally(small_config(copy), ["pretrain"])


def test_a_corrupted_latest_checkpoint_and_lost_metrics_resume_from_the_previous_with_the_history_rebuilt(
    trained: dict, tmp_path: Path
) -> None:
    """A completed output missing its metrics is recomputed, and its newest checkpoint no longer verifies:
    one launch resumes at the one before (the damaged one set aside), the history up to it is restored
    from the checkpoint and the rest trained again to the same losses."""
    copy = tmp_path / "ws"
    shutil.copytree(Path(trained["dir"]).parents[2], copy)
    out = copy / "pretrain" / "train" / trained["key"]
    (out / "metrics.jsonl").unlink()
    shutil.rmtree(out / "tensorboard")
    engine_file = next((out / "checkpoints" / "step-00000160" / "engine").rglob("*.pt"))
    engine_file.write_bytes(b"not a checkpoint")
    manifest = run_pipeline_locally(small_config(copy), ["pretrain"])["pretrain/train"]
    assert manifest["timings"]["finished_at"] > trained["timings"]["finished_at"]  # recomputed, not reused
    assert "resumed from step-00000140 (step 140)" in (out / "logs" / "rank-0.log").read_text()
    assert list((out / "checkpoints").glob(".corrupt-step-00000160-*"))
    rebuilt, reference = _metrics(manifest), _metrics(trained)
    assert [r["step"] for r in rebuilt] == list(range(1, 161))
    assert [r["loss"] for r in rebuilt[:140]] == [r["loss"] for r in reference[:140]]  # restored, not retrained
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(rebuilt[140:], reference[140:])) < 1e-4
    events = [rel for rel in manifest["outputs"] if rel.startswith("tensorboard/")]
    assert events and all((out / rel).exists() for rel in events)


def test_repeated_anomalies_stop_the_run_as_non_retryable_and_publish_the_report(
    curated: tuple[Path, dict], tmp_path: Path, prefect_server
) -> None:
    """Under the Prefect pipeline (one launch for both properties): the run stops, is not retried,
    and its anomaly report is a Prefect artifact as well as a file."""
    import asyncio

    from prefect.client.orchestration import get_client

    from flows.pipeline import pipeline
    from lmforge.errors import TrainingDiverged, is_retryable
    from tests.conftest import SMALL_CURATE, SMALL_PRETRAIN

    workspace = tmp_path / "ws"
    shutil.copytree(curated[0], workspace)
    overrides = [
        *SMALL_CURATE,
        *SMALL_PRETRAIN,
        "debug.pretrain.nan_at_batches=[52,53,54]",
        "pretrain.max_steps=60",
        "pretrain.guardrails.max_consecutive_spikes=3",
    ]
    with pytest.raises(TrainingDiverged, match="3 anomalies in a row") as info:
        pipeline(preset="tiny-cpu", overrides=overrides, workspace=str(workspace), stages=["pretrain"])
    assert not is_retryable(info.value)
    out = next(workspace.glob("pretrain/train/*/"))
    assert not (out / "manifest.json").exists()
    assert len(list((out / "logs").glob("attempt-*"))) == 1  # not retried
    # the report is written before the run stops, and travels with the error for the Prefect artifact
    report = json.loads((out / "anomalies.json").read_text())
    assert [a["micro_batches"] for a in report] == [[52], [53], [54]]
    assert report[-1]["action"] == "stopped: 3 anomalies in a row" and report[0]["action"].startswith("rolled back")
    assert [r["step"] for r in info.value.anomalies] == [53, 53, 53]  # each replay of step 53 met the next bad batch
    assert all(r["shards"] and r["doc_ids"] for r in info.value.anomalies)
    records = [json.loads(p.read_text()) for p in (out / "logs" / "attempt-1").glob("exit-rank*.json")]
    assert {r["status"] for r in records} == {"diverged"}

    async def artifact():
        async with get_client() as client:
            return next(a for a in await client.read_latest_artifacts() if a.key == "pretrain-anomalies")

    published = asyncio.run(artifact())
    rows = json.loads(published.data) if isinstance(published.data, str) else published.data
    assert published.description.startswith("training stopped")
    assert [r["micro_batches"] for r in rows] == [[52], [53], [54]]
    assert rows[-1]["action"] == "stopped: 3 anomalies in a row"


def test_deepspeeds_runner_launches_the_same_training(
    curated: tuple[Path, dict], trained: dict, tmp_path: Path
) -> None:
    """On one node `launcher: auto` starts the ranks with torchrun; `launcher: deepspeed` (DeepSpeed's
    runner and its launch.py, what a hostfile needs) starts the same entry point: the same run."""
    assert _launch_command(trained)[1:3] == ["-m", "torch.distributed.run"]  # the shared lineage: auto
    workspace = tmp_path / "ws"
    shutil.copytree(curated[0], workspace)
    manifest = run_pipeline_locally(small_config(workspace, "pretrain.distributed.launcher=deepspeed"), ["pretrain"])[
        "pretrain/train"
    ]
    assert manifest["key"] == trained["key"]  # the launcher is how, not what: same cache identity
    assert _launch_command(manifest)[1:3] == ["-m", "deepspeed.launcher.runner"]
    records = [
        json.loads(p.read_text()) for p in (Path(manifest["dir"]) / "logs" / "attempt-1").glob("exit-rank*.json")
    ]
    assert sorted(r["rank"] for r in records) == [0, 1] and {r["status"] for r in records} == {"ok"}
    runner, torchrun = _metrics(manifest), _metrics(trained)
    assert [r["step"] for r in runner] == list(range(1, 161))
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(runner, torchrun)) < 1e-4


def _launch_command(manifest: dict) -> list[str]:
    return json.loads((Path(manifest["dir"]) / "logs" / "attempt-1" / "launch.json").read_text())["command"]


def test_planner_memory_matches_what_a_real_run_uses(curated: tuple[Path, dict], tmp_path: Path) -> None:
    """A 12M-parameter model on 2 CPU ranks: memory each rank gained from building the engine to
    the end of training (peak RSS) is what the planner said the rank needs, within 30%."""
    workspace = tmp_path / "ws"
    shutil.copytree(curated[0], workspace)
    config = small_config(
        workspace,
        "pretrain.model.hidden_size=512",
        "pretrain.model.intermediate_size=1376",
        "pretrain.model.num_layers=4",
        "pretrain.model.num_heads=8",
        "pretrain.model.num_kv_heads=4",
        "pretrain.max_steps=4",
        "pretrain.checkpoint.every_steps=4",
        "pretrain.eval_every=4",
    )
    manifest = run_pipeline_locally(config, ["pretrain"])["pretrain/train"]
    # The planner adds the fp32 copy a bf16 run builds its model in to the training parts (a bound
    # that assumes they coexist); it is cast and freed before DeepSpeed makes its fp32 master
    # weights and Adam states, so the peak measured here is the training parts alone (an AVX512-BF16
    # host, 2026-11-30: 287 MB measured, 412 planned with the copy, 366 without; fp32 plans none).
    parts = manifest["extra"]["plan"]["per_rank_gib"]
    planned_mb = sum(v for k, v in parts.items() if k != "fp32_build_copy") * 1024
    measured_mb = manifest["metrics"]["mem_peak_mb"] - manifest["metrics"]["mem_before_engine_mb"]
    assert manifest["extra"]["plan"]["zero_stage"] == 0 and manifest["counts"]["params"] > 10_000_000
    assert 0.7 < measured_mb / planned_mb < 1.3, (measured_mb, planned_mb)
