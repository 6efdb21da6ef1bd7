"""Code drift: an output made by other code than what is here now is reported, and rerun on request."""

from __future__ import annotations

from pathlib import Path

import pytest

import lmforge.codeprint as codeprint
from lmforge.executor import run_pipeline_locally
from lmforge.explain import explain
from tests.conftest import small_config


def _edit(monkeypatch: pytest.MonkeyPatch, module_path: str) -> None:
    """As if `module_path` had been edited: its content now hashes differently."""
    real = codeprint.file_sha256
    monkeypatch.setattr(
        codeprint, "file_sha256", lambda path: ("0" * 64) if str(path).endswith(module_path) else real(path)
    )
    codeprint._fingerprint.cache_clear()


def test_every_manifest_records_its_code_and_libraries(curated: tuple[Path, dict]) -> None:
    _, manifests = curated
    heuristics = manifests["curate/heuristics"]["code"]
    assert "data_prep/heuristics.py" in heuristics["modules"] and "data_prep/steps.py" in heuristics["modules"]
    assert manifests["curate/minhash"]["code"]["libraries"]["datasketch"] == codeprint.library_version("datasketch")
    assert set(manifests["curate/tokenizer"]["code"]["libraries"]) == {"tokenizers", "transformers"}


def test_an_edited_module_shows_as_drift_and_rerun_recomputes(
    curated_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _edit(monkeypatch, "data_prep/heuristics.py")
    try:
        config = small_config(curated_copy)
        lines = {e.step: e for e in explain(config, ["curate"])}
        assert lines["curate/heuristics"].reuse  # default: warn, reuse
        assert any(
            "code of curate/heuristics changed since this output was made (data_prep/heuristics.py)" in r
            for r in lines["curate/heuristics"].reasons
        )
        assert not any("changed" in r for r in lines["curate/minhash"].reasons)

        rerun = small_config(curated_copy, "runtime.on_code_drift=rerun")
        lines = {e.step: e for e in explain(rerun, ["curate"])}
        assert not lines["curate/heuristics"].reuse and lines["curate/minhash"].reuse
        before = (curated_copy / "curate" / "heuristics").glob("*/manifest.json")
        first = next(before).stat().st_mtime_ns
        manifests = run_pipeline_locally(rerun, ["curate"])
        heuristics = manifests["curate/heuristics"]
        assert Path(heuristics["dir"], "manifest.json").stat().st_mtime_ns != first  # recomputed
        assert heuristics["code"]["modules"]["data_prep/heuristics.py"] == "0" * 16
        # the same statistics came out: downstream is reused, not recomputed
        assert manifests["curate/select"]["timings"]["finished_at"] < heuristics["timings"]["finished_at"]
        assert all(e.reuse and len(e.reasons) == 1 for e in explain(rerun, ["curate"]))
    finally:
        codeprint._fingerprint.cache_clear()


def test_a_library_upgrade_is_drift_too(curated_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codeprint, "library_version", lambda dist: "99.0" if dist == "datasketch" else "x")
    codeprint._fingerprint.cache_clear()
    try:
        lines = {e.step: e for e in explain(small_config(curated_copy), ["curate"])}
        assert any("library datasketch changed" in r and "-> 99.0" in r for r in lines["curate/minhash"].reasons)
    finally:
        codeprint._fingerprint.cache_clear()
