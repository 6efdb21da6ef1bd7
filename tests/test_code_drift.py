"""Code is part of a step's identity: an edit to any module a step imports, directly or not,
changes its key; comments and docstrings do not; library upgrades are drift, reported and rerun
on request.

Before: code entered no key, only a hand-listed fingerprint beside it, and `curate/select` did
not list `data_prep/heuristics.py` although it applies its rules: an edited rule was reused even
with `on_code_drift=rerun`, and one key named two different outputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import lmforge.engine.codeprint as codeprint
from lmforge.engine.executor import graph, run_pipeline_locally
from lmforge.engine.explain import explain
from tests.conftest import small_config


def _edit(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    """As if `module` had been edited: its normalized source now digests differently."""
    real = codeprint._read

    def read(name: str, roots: tuple[str, ...] = ()) -> tuple[str, frozenset[str]]:
        digest, imports = real(name, roots)
        return ("0" * 16 if name == module else digest), imports

    monkeypatch.setattr(codeprint, "_read", read)


def test_every_manifest_records_its_code_closure_and_libraries(curated: tuple[Path, dict]) -> None:
    _, manifests = curated
    select = manifests["curate/select"]
    # found by reading imports, not listed: select applies heuristics' rules through data_prep.steps
    assert "data_prep/heuristics.py" in select["key_components"]["code"]
    assert select["code"]["modules"] == select["key_components"]["code"]
    # the core's helpers count (reached through data_prep modules); its orchestration does not
    ingest = manifests["curate/ingest"]["key_components"]["code"]
    assert "lmforge/inputs.py" in ingest and "data_prep/pii.py" in ingest  # pii: through ingest.py's imports
    assert not {"lmforge/engine/executor.py", "lmforge/console.py", "lmforge/engine/store.py"} & set(ingest)
    # data_prep/steps.py defines every curation step: each counts by the part its functions reach
    assert "data_prep/tokenizer.py" not in ingest
    assert ingest["data_prep/steps.py"] != manifests["curate/pack"]["key_components"]["code"]["data_prep/steps.py"]
    assert manifests["curate/minhash"]["code"]["libraries"]["datasketch"] == codeprint.library_version("datasketch")


def test_an_edit_to_a_module_imported_indirectly_reruns_exactly_the_steps_that_import_it(
    curated_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = small_config(curated_copy)
    assert all(e.reuse for e in explain(config, ["curate"]))  # unchanged code: all cache hits
    _edit(monkeypatch, "data_prep.pii")  # ingest reaches it through data_prep/ingest.py; select names it
    steps = {e.step: e for e in explain(config, ["curate"])}
    for name, item in steps.items():
        uses = "data_prep/pii.py" in codeprint.code_identity(graph().get(name))
        # a step that does not import it reruns only if an upstream output changes bytes
        assert any("code changed: data_prep/pii.py" in r for r in item.reasons) is uses, (name, item.reasons)
    assert not steps["curate/ingest"].reuse and not steps["curate/select"].reuse
    minhash_manifest = next((curated_copy / "curate" / "minhash").glob("*/manifest.json"))
    before = minhash_manifest.stat().st_mtime_ns
    manifests = run_pipeline_locally(config, ["curate"])
    assert manifests["curate/select"]["key_components"]["code"]["data_prep/pii.py"] == "0" * 16
    # ingest reran and made the same bytes: minhash, keyed on its digest, is not recomputed
    assert minhash_manifest.stat().st_mtime_ns == before
    assert all(e.reuse for e in explain(config, ["curate"]))  # the new keys are cache hits now
    monkeypatch.undo()
    # the real code again: the outputs of the real code's keys are still there and reused
    assert all(e.reuse for e in explain(small_config(curated_copy), ["curate"]))


def test_comments_and_docstrings_do_not_count_but_code_does(tmp_path: Path) -> None:
    base = 'def rule(text):\n    """Keep short lines."""\n    return len(text) < 80\n'
    variants = {
        "comment": '# a comment\ndef rule(text):\n    """Keep short lines."""\n    return len(text) < 80  # why\n',
        "docstring": 'def rule(text):\n    """Keep lines shorter than 80 characters."""\n    return len(text) < 80\n',
        "blank lines": '\n\ndef rule(text):\n\n    """Keep short lines."""\n\n    return len(text) < 80\n',
        "code": 'def rule(text):\n    """Keep short lines."""\n    return len(text) < 90\n',
    }
    (tmp_path / "base.py").write_text(base)
    reference = codeprint._parse("x", tmp_path / "base.py")[0]
    for name, source in variants.items():
        (tmp_path / f"{name}.py").write_text(source)
        same = codeprint._parse("x", tmp_path / f"{name}.py")[0] == reference
        assert same is (name != "code"), name


def test_a_fresh_workspace_with_the_same_code_and_config_reproduces_keys_and_bytes(
    curated: tuple[Path, dict], tmp_path: Path
) -> None:
    _, first = curated
    again = run_pipeline_locally(small_config(tmp_path / "fresh"), ["curate"])
    for name, manifest in first.items():
        assert again[name]["key"] == manifest["key"], name
        assert again[name]["digest"] == manifest["digest"], name


def test_a_library_upgrade_is_drift(curated_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codeprint, "library_version", lambda dist: "99.0" if dist == "datasketch" else "x")
    lines = {e.step: e for e in explain(small_config(curated_copy), ["curate"])}
    assert lines["curate/minhash"].reuse  # default: warn, reuse
    assert any("library datasketch changed" in r and "-> 99.0" in r for r in lines["curate/minhash"].reasons)
    rerun = {e.step: e for e in explain(small_config(curated_copy, "runtime.on_code_drift=rerun"), ["curate"])}
    assert not rerun["curate/minhash"].reuse
