"""`lmforge run` on the tiny-cpu preset, exactly as a newcomer runs it (CLI, Prefect, DeepSpeed)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def lmforge(*args: str, timeout: int = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmforge.cli", *args], capture_output=True, text=True, timeout=timeout)


def statuses(output: str) -> dict[str, str]:
    rows = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0].startswith(("curate/", "pretrain/")):
            rows[parts[0]] = parts[1]
    return rows


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def first_run(workspace: Path) -> subprocess.CompletedProcess:
    return lmforge("run", "--workspace", str(workspace))


def test_tiny_pipeline_runs_and_the_model_learns(first_run: subprocess.CompletedProcess, workspace: Path) -> None:
    assert first_run.returncode == 0, first_run.stderr[-3000:]
    assert set(statuses(first_run.stdout).values()) == {"computed"} and len(statuses(first_run.stdout)) == 11
    assert "model:" in first_run.stdout and "results:" in first_run.stdout
    manifest = json.loads(next(workspace.glob("pretrain/train/*/manifest.json")).read_text())
    assert manifest["counts"]["steps"] == 200 and manifest["extra"]["plan"]["world_size"] == 2
    # the unigram entropy is the best loss without context; the model must beat it clearly
    assert manifest["metrics"]["final_val_loss"] < manifest["metrics"]["unigram_entropy_nats"] - 1.0
    select = json.loads(next(workspace.glob("curate/select/*/manifest.json")).read_text())["counts"]
    assert select["input"] == select["kept"] + select["removed_total"] + select["quarantined"]


def test_second_run_recomputes_nothing_within_a_minute(first_run: subprocess.CompletedProcess, workspace: Path) -> None:
    started = time.perf_counter()
    second = lmforge("run", "--workspace", str(workspace))
    elapsed = time.perf_counter() - started
    assert second.returncode == 0, second.stderr[-3000:]
    assert set(statuses(second.stdout).values()) == {"cached"} and len(statuses(second.stdout)) == 11
    assert elapsed < 60


def test_explain_names_the_changed_field(first_run: subprocess.CompletedProcess, workspace: Path) -> None:
    result = lmforge("explain", "all", "--workspace", str(workspace), "--set", "pretrain.optim.lr=1e-3")
    assert result.returncode == 0, result.stderr
    lines = {l.split()[0]: l for l in result.stdout.splitlines() if l.startswith(("curate/", "pretrain/"))}
    assert all("reuse" in lines[name] for name in lines if name.startswith("curate/"))
    assert "recompute" in lines["pretrain/train"] and "pretrain.optim.lr changed 0.003 -> 0.001" in lines["pretrain/train"]


def test_deleted_model_file_is_rebuilt_by_resuming_from_the_final_checkpoint(
        first_run: subprocess.CompletedProcess, workspace: Path) -> None:
    out = next(workspace.glob("pretrain/train/*/"))
    (out / "hf" / "model.safetensors").unlink()
    started = time.perf_counter()
    rerun = lmforge("run", "--workspace", str(workspace))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    rows = statuses(rerun.stdout)
    assert rows["pretrain/train"] == "computed" and all(v == "cached" for k, v in rows.items() if k != "pretrain/train")
    assert (out / "hf" / "model.safetensors").exists()
    assert "resumed from step-00000200" in (out / "logs" / "rank-0.log").read_text()
    assert time.perf_counter() - started < 120  # no retraining


def test_bad_config_fails_fast_with_one_line(workspace: Path) -> None:
    result = lmforge("run", "--workspace", str(workspace), "--set", "curate.langid.min_scor=0.3")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "config error: --set curate.langid.min_scor=0.3: curate.langid.min_scor: unknown field (did you mean 'min_score'?)")
    assert "Traceback" not in result.stderr


def test_a_config_error_found_mid_run_is_one_line_without_traceback(tmp_path: Path) -> None:
    """Some settings can only be judged once the step reads them (here: a reference file with no documents)."""
    from tests.conftest import SMALL_CURATE

    empty = tmp_path / "reference.jsonl"
    empty.write_text("")
    overrides = [a for o in [*SMALL_CURATE, f"curate.quality_classifier.reference=[{empty}]"] for a in ("--set", o)]
    result = lmforge("stage", "curate", "--workspace", str(tmp_path / "ws"), *overrides)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [l for l in result.stderr.splitlines() if l.startswith("config error:")]
    assert errors == ["config error: curate.quality_classifier.reference: no reference documents to train on"]
