"""The toxicity filter (data_prep/filters/toxicity.py): offensive documents planted among clean demo
documents are removed by curation with their reason and counted; the fastText classifier trained
on a user's labelled file; that file's content in curate/heuristics' key."""

from __future__ import annotations

import json
import random
from pathlib import Path
from pydoc_data.topics import topics

import pyarrow.parquet as pq
import pytest

from data_prep.config import DemoCorpusConfig
from data_prep.filters.toxicity import CLEAN, TOXIC, Toxicity, ToxicityConfig, read_labelled, windows
from data_prep.sources.demo import build_demo_corpus
from lmforge.engine.executor import graph, run_pipeline_locally
from lmforge.engine.explain import diff_components
from lmforge.engine.graph import key_components, step_key
from lmforge.errors import ConfigError
from lmforge.hashing import file_sha256
from tests.conftest import small_config
from tests.toxic_planted import PARAGRAPHS, POSTS, planted_documents

CLEAN_SAMPLE = 300
# measured: 38 of the 40 planted documents score above 0.9, and no demo document does
# (benchmarks/toxicity.py); two offensive paragraphs inside long documents are missed
RECALL_FLOOR, PRECISION_FLOOR = 0.9, 0.95


@pytest.fixture(scope="module")
def demo_clean(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The default demo corpus' clean documents (every kind of planted noise left out)."""
    out = tmp_path_factory.mktemp("demo")
    build_demo_corpus(DemoCorpusConfig(), out)
    docs = []
    for line in (out / "demo.jsonl").read_bytes().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and (record.get("meta") or {}).get("kind") == "clean":
            docs.append({"id": record["id"], "text": record["text"], "domain": record["meta"]["domain"]})
    return docs


def _rows(directory: Path) -> list[dict]:
    return [r for p in sorted(directory.glob("*.parquet")) for r in pq.read_table(p).to_pylist()]


def test_planted_offensive_documents_are_removed_by_curation_with_their_reason(
    demo_clean: list[dict], tmp_path: Path
) -> None:
    """40 offensive documents (30 posts, 10 long clean documents with one offensive paragraph) mixed
    into 300 clean demo documents, curated by the real steps: curate/heuristics keeps each score
    as an attribute, curate/select removes what is above max_score with reason toxicity:score,
    keeps each removed document and counts it."""
    planted = planted_documents(demo_clean)
    docs = random.Random(0).sample(demo_clean, CLEAN_SAMPLE) + planted
    random.Random(1).shuffle(docs)
    corpus = tmp_path / "mixed.jsonl"
    corpus.write_text(
        "".join(json.dumps({"id": d["id"], "text": d["text"], "meta": {"domain": d["domain"]}}) + "\n" for d in docs)
    )
    config = small_config(
        tmp_path / "ws",
        f"curate.inputs=[{corpus}]",
        # toxicity alone (and the exact dedup that is always on: the documents are distinct)
        *(
            f"curate.{name}.enabled=false"
            for name in ("gopher_quality", "gopher_repetition", "c4", "fineweb", "encoding")
        ),
        *(
            f"curate.{name}.enabled=false"
            for name in ("langid", "quality_classifier", "near_dedup", "paragraph_dedup", "mix")
        ),
        "curate.length.min_chars=10",
        "curate.toxicity.enabled=true",
    )
    manifests = run_pipeline_locally(config, ["curate"])

    scores = _rows(Path(manifests["curate/heuristics"]["dir"]) / "attributes")
    assert len(scores) == len(docs) and all(0.0 <= r["toxicity_score"] <= 1.0 for r in scores)
    select = manifests["curate/select"]
    removed = _rows(Path(select["dir"]) / "removed")
    kept = _rows(Path(select["dir"]) / "kept")
    counts = select["counts"]
    assert counts["input"] == len(docs) == len(kept) + len(removed) == counts["kept"] + counts["removed_total"]
    flagged = {r["id"] for r in removed if r["reason"] == "toxicity:score"}
    assert counts["removed"] == {"toxicity:score": len(flagged)} and len(flagged) == len(removed)
    assert all(json.loads(r["reasons"]) == ["toxicity:score"] for r in removed)

    truth = {d["id"] for d in planted}
    recall, precision = len(flagged & truth) / len(truth), len(flagged & truth) / max(1, len(flagged))
    print(
        f"\ntoxicity filter, {len(truth)} planted among {CLEAN_SAMPLE} clean demo documents, max_score "
        f"{config.curate.toxicity.max_score}: recall {recall:.3f}, precision {precision:.3f}; "
        f"missed {sorted(truth - flagged)}, clean removed {sorted(flagged - truth)}"
    )
    assert recall >= RECALL_FLOOR and precision >= PRECISION_FLOOR
    # the posts alone are found every one, and a long clean document with one offensive paragraph is
    # found by its window (its whole text scores far lower)
    assert {d["id"] for d in planted if d["id"].startswith("toxic-post")} <= flagged
    inside = [d for d in planted if d["id"].startswith("toxic-inside") and d["id"] in flagged]
    assert inside and all(len(d["text"]) > 5000 for d in inside)


def test_windows_cover_the_text_in_pieces_of_bounded_size() -> None:
    text = "\n\n".join(["short line"] * 30 + ["word " * 500] + ["tail"])
    pieces = windows(text, 200, 1000)
    assert all(len(p) >= 200 for p in pieces[:-1]) and all(len(p) <= 1000 + 200 for p in pieces)
    assert "".join(pieces).replace("\n", "").replace(" ", "") == text.replace("\n", "").replace(" ", "")
    assert windows("", 200, 1000) == [""] and windows("one line", 200, 1000) == ["one line"]


def test_the_rule_follows_max_score_and_enabled() -> None:
    toxicity = Toxicity()
    stats = {"toxicity_score": 0.95}
    assert toxicity.failures(stats, ToxicityConfig()) == ["toxicity:score"]
    assert toxicity.failures({"toxicity_score": 0.9}, ToxicityConfig()) == []  # fails above, not at
    assert toxicity.failures(stats, ToxicityConfig(max_score=None)) == []
    assert toxicity.failures(stats, ToxicityConfig(enabled=False)) == []


# -- the fastText classifier on a user's labelled file ---------------------------------------------


def _paragraphs(n: int, skip: int = 0) -> list[str]:
    """Clean paragraphs of Python's reference documentation (one line each, 80-400 characters)."""
    found = [
        " ".join(p.split())
        for name in sorted(topics)
        for p in topics[name].split("\n\n")
        if 80 <= len(" ".join(p.split())) <= 400
    ]
    return found[skip : skip + n]


def _labelled_file(path: Path) -> Path:
    lines = [f"{TOXIC} {t}" for t in POSTS[:22] + PARAGRAPHS] + [f"{CLEAN} {t}" for t in _paragraphs(40)]
    random.Random(0).shuffle(lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_fasttext_classifier_learns_from_a_labelled_file(tmp_path: Path) -> None:
    cfg = ToxicityConfig(classifier="fasttext", labelled_file=str(_labelled_file(tmp_path / "labelled.txt")))
    held_out_toxic, held_out_clean = POSTS[22:], _paragraphs(40, skip=200)
    scores = [s["toxicity_score"] for s in Toxicity().stats_batch(held_out_toxic + held_out_clean, cfg)]
    toxic, clean = scores[: len(held_out_toxic)], scores[len(held_out_toxic) :]
    assert sum(s > 0.5 for s in toxic) >= 6 and sum(s > 0.5 for s in clean) <= 2, (toxic, clean)
    assert Toxicity().stats(POSTS[23], cfg)["toxicity_score"] == toxic[1]  # one at a time: the same model


def test_a_malformed_labelled_line_is_a_one_line_config_error(tmp_path: Path) -> None:
    path = tmp_path / "labelled.txt"
    path.write_text(f"{TOXIC} you idiot\n\n{CLEAN} a fine day\n__label__rude no such label\n")
    with pytest.raises(ConfigError, match=rf"^curate\.toxicity\.labelled_file: {path}, line 4: expected") as info:
        read_labelled(str(path))
    assert "\n" not in str(info.value)
    path.write_text(f"{TOXIC} you idiot\n{TOXIC}\n")  # a label with no text
    with pytest.raises(ConfigError, match=r", line 2: expected"):
        read_labelled(str(path))
    path.write_text(f"{TOXIC} you idiot\n")
    with pytest.raises(ConfigError, match="has no __label__clean example"):
        read_labelled(str(path))
    cfg = ToxicityConfig(classifier="fasttext", labelled_file=str(tmp_path / "absent.txt"))
    with pytest.raises(ConfigError, match="absent.txt does not exist"):
        Toxicity().stats_batch(["text"], cfg)
    with pytest.raises(ValueError, match="set it"):
        ToxicityConfig(classifier="fasttext")
    with pytest.raises(ValueError, match="read by classifier fasttext only"):
        ToxicityConfig(labelled_file=str(path))


def test_the_labelled_files_content_is_part_of_the_heuristics_key(tmp_path: Path) -> None:
    """Editing the labelled file re-keys curate/heuristics (which trains on it) and no other step;
    `explain` names the file. With the profanity-check classifier no file is read."""
    path = _labelled_file(tmp_path / "labelled.txt")
    config = small_config(
        tmp_path / "ws", "curate.toxicity.classifier=fasttext", f"curate.toxicity.labelled_file={path}"
    )

    def own_keys() -> dict[str, str]:
        return {s.name: step_key(key_components(s, config, (), {})) for s in graph().steps}

    heuristics = graph().get("curate/heuristics")
    before, components = own_keys(), key_components(heuristics, config, (), {})
    assert components["config"]["filter_files"] == {"toxicity": {str(path): file_sha256(path)}}
    with path.open("a") as handle:
        handle.write(f"{TOXIC} one more insult, you clown\n")
    after = own_keys()
    assert {name for name in before if before[name] != after[name]} == {"curate/heuristics"}
    reasons = diff_components(components, key_components(heuristics, config, (), {}))
    assert len(reasons) == 1 and str(path) in reasons[0], reasons

    default = small_config(tmp_path / "ws")
    assert "filter_files" not in key_components(heuristics, default, (), {})["config"]
    path.unlink()  # a run is refused when the config is loaded, naming the file
    with pytest.raises(ConfigError, match=r"curate\.toxicity: not a file: .*labelled\.txt$"):
        small_config(tmp_path / "ws", "curate.toxicity.classifier=fasttext", f"curate.toxicity.labelled_file={path}")
    assert key_components(heuristics, config, (), {})["config"]["filter_files"] == {"toxicity": {str(path): "missing"}}


@pytest.mark.parametrize(
    "override, steps",
    [
        ("curate.toxicity.max_score=0.8", {"curate/select"}),  # a threshold: re-selects, never rescores
        ("curate.toxicity.skip_domains=[code]", {"curate/select"}),
        ("curate.toxicity.max_window_chars=2000", {"curate/heuristics", "curate/select"}),
        ("curate.toxicity.enabled=false", {"curate/heuristics", "curate/select"}),
    ],
)
def test_a_threshold_reselects_and_a_scoring_setting_rescores(override: str, steps: set[str], tmp_path: Path) -> None:
    def own_keys(*extra: str) -> dict[str, str]:
        config = small_config(tmp_path / "ws", *extra)
        return {s.name: step_key(key_components(s, config, (), {})) for s in graph().steps}

    before, after = own_keys(), own_keys(override)
    assert {name for name in before if before[name] != after[name]} == steps
