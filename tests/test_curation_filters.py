"""Curation filters behind one interface (data_prep/filters/): the select step's reads and the rule
order come from the registry, and a filter another package registers needs no edit to lmforge."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SHOUTING_PACKAGE = """
from typing import Any

from pydantic import Field

from data_prep.filters.base import CurationFilter, FilterBase, Stats, failing


class ShoutingConfig(FilterBase):
    max_upper_ratio: float | None = Field(0.3, description="Max share of letters in upper case.")
    min_letters: int = Field(20, ge=0, description="Letters below which the ratio is 0 (a statistics setting).")


class Shouting(CurationFilter):
    name = "shouting"
    description = "Documents in capitals"
    config = ShoutingConfig
    stat_fields = ("min_letters",)
    code = ("shouting_filter",)

    def stats(self, text: str, cfg: Any) -> Stats:
        letters = [c for c in text if c.isalpha()]
        upper = sum(c.isupper() for c in letters)
        return {"shouting_upper_ratio": upper / len(letters) if len(letters) >= cfg.min_letters else 0.0}

    def failures(self, stats: Stats, cfg: Any) -> list[str]:
        return failing("shouting", cfg.enabled, [("upper_ratio", cfg.max_upper_ratio, stats["shouting_upper_ratio"], "max")])
"""

CHECK = """
import json, sys
from pathlib import Path

import pyarrow.parquet as pq

from data_prep.filters import filters
from data_prep.steps import HEURISTICS_READS, SELECT_READS
from lmforge.engine.executor import run_pipeline_locally
from tests.conftest import small_config

ws = Path(sys.argv[1])
shouted = ws / "shouted.jsonl"
ws.mkdir(parents=True, exist_ok=True)
prose = "The quick brown fox jumps over the lazy dog near the river bank today. " * 4
with shouted.open("w") as out:
    for i in range(6):
        text = prose.upper() if i % 2 else prose
        out.write(json.dumps({"id": f"s{i}", "text": text.replace("TODAY", f"DAY {i}").replace("today", f"day {i}")}) + "\\n")
config = small_config(ws, f"curate.inputs=[{shouted}]", "curate.gopher_quality.enabled=false", "curate.c4.enabled=false",
                      "curate.fineweb.enabled=false", "curate.gopher_repetition.enabled=false", "curate.langid.enabled=false",
                      "curate.quality_classifier.enabled=false", "curate.near_dedup.enabled=false", "curate.length.min_chars=10",
                      "curate.paragraph_dedup.enabled=false")  # the six differ only in a digit, which dedup folds
manifests = run_pipeline_locally(config, ["curate"])
select = manifests["curate/select"]
removed = [r for p in sorted((Path(select["dir"]) / "removed").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
print(json.dumps({
    "registered": list(filters()),
    "section": config.curate.shouting.max_upper_ratio,
    "heuristics_reads": [r for r in HEURISTICS_READS if "shouting" in r],
    "select_reads": [r for r in SELECT_READS if "shouting" in r],
    "removed": sorted((r["id"], r["reason"]) for r in removed),
    "counts": select["counts"]["removed"],
    "code": [m for m in manifests["curate/select"]["key_components"]["code"] if "shouting" in m],
}))
"""


def test_a_filter_a_package_registers_runs_in_curation_with_no_edit_to_the_project(tmp_path: Path) -> None:
    """A package with a `lmforge.curation_filters` entry point (a real dist-info, as pip installs it):
    `curate.shouting` is its section, its statistics are computed by curate/heuristics and its rule
    applied by curate/select, which keeps each removed document with its reason and counts it."""
    site = tmp_path / "site"
    info = site / "shouting_filter-0.1.dist-info"
    info.mkdir(parents=True)
    (site / "shouting_filter.py").write_text(SHOUTING_PACKAGE)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: shouting-filter\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[lmforge.curation_filters]\nshouting = shouting_filter:Shouting\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", CHECK, str(tmp_path / "ws")], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["registered"][-1] == "shouting" and seen["section"] == 0.3
    assert seen["heuristics_reads"] == ["curate.shouting.min_letters", "curate.shouting.enabled"]
    assert seen["select_reads"] == ["curate.shouting"]
    assert seen["removed"] == [
        ["s1", "shouting:upper_ratio"],
        ["s3", "shouting:upper_ratio"],
        ["s5", "shouting:upper_ratio"],
    ]
    assert seen["counts"] == {"shouting:upper_ratio": 3}
    assert seen["code"], "the filter's module is part of the select step's code identity"


def test_the_rule_order_and_the_reads_come_from_the_registry() -> None:
    from data_prep.config import CurateConfig
    from data_prep.filters import filters
    from data_prep.select import _rule_failures
    from data_prep.steps import SELECT_READS

    assert {f"curate.{name}" for name in filters()} <= set(SELECT_READS)
    cfg = CurateConfig()
    stats = {"n_chars": 5}
    # length (before the language check), then the language, as the removed records list them
    only_length = [f for name, f in filters().items() if name == "length"]
    assert only_length and only_length[0].before_language
    failures = _rule_failures(
        cfg.model_copy(update={n: getattr(cfg, n).model_copy(update={"enabled": n == "length"}) for n in filters()}),
        "web",
        stats,
        "fr",
        0.9,
    )
    assert failures == ["length:too_short", "langid:not_kept:fr"]
