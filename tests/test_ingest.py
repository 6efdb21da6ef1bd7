"""Ingest: every input form, and bad records quarantined with file, line and reason, never lost."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from data_prep.config import CurateConfig
from data_prep.ingest import ingest_file, normalize_url
from data_prep.records import iter_rows, shard_path

GOOD = [{"id": f"doc-{i}", "text": f"Document number {i} has some words in it.", "source": "unit"} for i in range(7)]
BAD_LINES = [
    (b'{"id": "x", "text": "unterminated', "invalid_json"),
    (b'{"id": "y", "text": "caf\xe9 latin-1 byte"}', "invalid_utf8"),
    (b'{"id": "z", "body": "no text field"}', "missing_text"),
    (b'{"id": "n", "text": 42}', "text_not_string"),
    (b'{"id": "e", "text": "   \\n  "}', "empty_text"),
    (b'["an", "array"]', "not_an_object"),
]


def _mixed_jsonl_bytes() -> tuple[bytes, dict[int, str]]:
    lines, bad_at = [], {}
    good = iter(GOOD)
    for i in range(len(GOOD) + len(BAD_LINES)):
        if i % 2 == 1 and len(bad_at) < len(BAD_LINES):
            raw, reason = BAD_LINES[len(bad_at)]
            lines.append(raw)
            bad_at[i + 1] = reason
        else:
            lines.append(json.dumps(next(good)).encode())
    return b"\n".join(lines) + b"\n", bad_at


def _ingest(path: Path, tmp_path: Path, **cfg) -> tuple[list[dict], list[dict], dict]:
    out = tmp_path / "out"
    files, result = ingest_file(str(path), 0, CurateConfig(**cfg), out)
    docs = [row for s in result["shards"] for row in iter_rows(shard_path(out, s["name"]))]
    qfile = out / "quarantine" / "f0000.jsonl"
    quarantined = [json.loads(line) for line in qfile.read_text().splitlines()] if qfile.exists() else []
    return docs, quarantined, result


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_bad_lines_are_quarantined_and_no_good_line_is_lost(tmp_path: Path, suffix: str) -> None:
    data, bad_at = _mixed_jsonl_bytes()
    path = tmp_path / f"mixed{suffix}"
    if suffix.endswith(".gz"):
        data = gzip.compress(data)
    elif suffix.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    docs, quarantined, result = _ingest(path, tmp_path, docs_per_shard=3)
    assert [d["id"] for d in docs] == [g["id"] for g in GOOD]
    assert {q["line"]: q["reason"].split(" ")[0] for q in quarantined} == bad_at
    assert all(q["file"] == str(path) for q in quarantined)
    assert result["input"] == len(GOOD) + len(BAD_LINES) == result["docs"] + sum(result["quarantined"].values())
    assert len(result["shards"]) == 3  # 7 docs at 3 per shard
    assert "raw_base64" in next(q for q in quarantined if q["reason"].startswith("invalid_utf8"))


def test_parquet_text_folder_and_hf_dataset(tmp_path: Path) -> None:
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "Parquet text one."}, {"text": None}, {"text": "Two."}]), parquet)
    docs, quarantined, _ = _ingest(parquet, tmp_path / "p")
    assert [d["text"] for d in docs] == ["Parquet text one.", "Two."]
    assert quarantined[0]["line"] == 2 and quarantined[0]["reason"].startswith("text_not_string")
    assert docs[0]["id"] == f"{parquet}:1"  # generated when missing: file and row, unique

    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("First file.")
    (folder / "sub" / "b.txt").write_text("Second file.")
    docs, _, _ = _ingest(folder, tmp_path / "t")
    assert [(d["id"], d["source"]) for d in docs] == [("texts/a.txt", "texts"), ("texts/sub/b.txt", "texts")]

    import datasets

    saved = tmp_path / "hf"
    datasets.Dataset.from_dict({"text": ["from a dataset", ""], "id": ["h1", "h2"]}).save_to_disk(str(saved))
    docs, quarantined, _ = _ingest(saved, tmp_path / "h")
    assert [d["id"] for d in docs] == ["h1"] and quarantined[0]["reason"] == "empty_text"


def test_normalization_and_metadata(tmp_path: Path) -> None:
    path = tmp_path / "n.jsonl"
    record = {
        "id": "n1",
        "text": "Cafe\u0301\u00a0au lait\x07  \r\n\r\n\r\n\r\n    indented code  ",
        "url": "HTTPS://Example.COM:443/Page/#frag",
        "meta": {"domain": "web", "lang": "fr"},
    }
    path.write_text(json.dumps(record) + "\n" + json.dumps({"id": "n2", "text": "Already clean."}) + "\n")
    docs, _, result = _ingest(path, tmp_path)
    assert docs[0]["text"] == "Caf\u00e9 au lait\n\n    indented code" and docs[1]["text"] == "Already clean."
    assert result["normalized"] == 1  # the step's own statistic: documents whose text it changed
    assert docs[0]["domain"] == "web" and json.loads(docs[0]["meta"])["lang"] == "fr"
    assert docs[0]["url_norm"] == "https://example.com/Page"


def test_url_normalization_keeps_what_identifies_a_page() -> None:
    assert normalize_url("http://a.org/x/?q=1#top") == normalize_url("HTTP://A.ORG/x?q=1")
    assert normalize_url("http://a.org/x?q=1") != normalize_url("http://a.org/x?q=2")


def test_records_that_break_encoding_or_parsing_are_quarantined_too(tmp_path: Path) -> None:
    path = tmp_path / "odd.jsonl"
    path.write_text(
        '{"id": "s", "text": "lone surrogate \\ud800 here"}\n'
        '{"id": "u", "text": "fine text", "url": "http://[bad-ipv6/x"}\n'
        '{"id": "ok", "text": "fine text two", "meta": {"when": {"nested": [1, 2]}}}\n'
    )
    docs, quarantined, _ = _ingest(path, tmp_path)
    assert [q["reason"].split(" ")[0] for q in quarantined] == ["invalid_unicode"]
    assert [d["id"] for d in docs] == ["u", "ok"] and docs[0]["url_norm"] is None


def test_truncated_compressed_file_keeps_what_was_read_and_says_so(tmp_path: Path) -> None:
    data = gzip.compress(b"".join(json.dumps(g).encode() + b"\n" for g in GOOD))
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    docs, quarantined, result = _ingest(path, tmp_path)
    assert quarantined[-1]["reason"].startswith("unreadable_file (EOFError")
    assert result["input"] == len(docs) + len(quarantined)


def test_truncated_zstd_file_keeps_what_was_read_and_says_so(tmp_path: Path) -> None:
    """What the GPU presets read: a .zst cut short must not end quietly as if the file were complete."""
    lines = [json.dumps({"id": f"d{i}", "text": f"document {i} " + "word " * 40}).encode() for i in range(3000)]
    data = zstandard.ZstdCompressor().compress(b"\n".join(lines) + b"\n")
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(data[: len(data) * 2 // 3])
    docs, quarantined, result = _ingest(path, tmp_path)
    assert len(quarantined) == 1 and quarantined[0]["reason"].startswith("unreadable_file (EOFError")
    assert 0 < len(docs) < 3000 and [d["id"] for d in docs] == [f"d{i}" for i in range(len(docs))]
    assert result["input"] == len(docs) + len(quarantined)


def test_corrupt_zstd_file_is_quarantined_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl.zst"
    path.write_bytes(b"\x28\xb5\x2f\xfd" + b"not a frame" * 50)
    docs, quarantined, result = _ingest(path, tmp_path)
    assert docs == [] and result["input"] == 1
    assert quarantined[0]["reason"].startswith("unreadable_file (ZstdError")


def test_multi_frame_zstd_file_is_read_whole(tmp_path: Path) -> None:
    frames = [zstandard.ZstdCompressor().compress(json.dumps(g).encode() + b"\n") for g in GOOD]
    path = tmp_path / "frames.jsonl.zst"
    path.write_bytes(b"".join(frames))
    docs, quarantined, _ = _ingest(path, tmp_path)
    assert [d["id"] for d in docs] == [g["id"] for g in GOOD] and quarantined == []


def test_corrupt_parquet_is_quarantined_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 not really")
    docs, quarantined, result = _ingest(path, tmp_path)
    assert docs == [] and result["input"] == 1
    assert quarantined[0]["file"] == str(path) and quarantined[0]["reason"].startswith("unreadable_file")


def test_folders_stand_for_the_data_files_inside_and_datasetdicts_are_read(tmp_path: Path) -> None:
    import datasets

    from lmforge.errors import ConfigError
    from lmforge.inputs import expand_inputs, read_input

    corpus = tmp_path / "corpus"
    (corpus / "part2").mkdir(parents=True)
    (corpus / "a.jsonl").write_text(json.dumps(GOOD[0]) + "\n")
    pq.write_table(pa.Table.from_pylist(GOOD[1:3]), corpus / "part2" / "b.parquet")
    (corpus / "notes.txt").write_text("A plain text note.")
    (corpus / "README.md").write_text("not data")
    assert expand_inputs([str(corpus)]) == [str(corpus / "a.jsonl"), str(corpus / "part2" / "b.parquet"), str(corpus)]
    texts = [r.data["text"] for p in expand_inputs([str(corpus)]) for r in read_input(p)]
    assert texts == [GOOD[0]["text"], GOOD[1]["text"], GOOD[2]["text"], "A plain text note."]

    # a text folder is read recursively, so globbing into it adds no second reading of its files
    (corpus / "part2" / "more.txt").write_text("Nested note.")
    assert [p for p in expand_inputs([str(corpus / "**")]) if Path(p).is_dir()] == [str(corpus)]

    saved = tmp_path / "dd"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["split train"]}),
            "test": datasets.Dataset.from_dict({"text": ["split test"]}),
        }
    ).save_to_disk(str(saved))
    assert expand_inputs([str(saved)]) == [str(saved)]
    assert [r.data["text"] for r in read_input(str(saved))] == ["split train"]

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="holds no .jsonl"):
        expand_inputs([str(empty)])


def test_unsupported_input_is_a_clear_error(tmp_path: Path) -> None:
    from lmforge.errors import ConfigError

    path = tmp_path / "data.xlsx"
    path.write_text("x")
    with pytest.raises(ConfigError, match="data.xlsx: unsupported input format"):
        ingest_file(str(path), 0, CurateConfig(), tmp_path / "o")


def test_an_unreachable_hub_is_retryable_and_a_damaged_local_dataset_is_not(tmp_path: Path) -> None:
    from lmforge.errors import DataError, SourceUnavailable, is_retryable
    from lmforge.inputs import read_input

    with pytest.raises(SourceUnavailable, match="hf:nosuch/dataset: cannot load") as hub:
        list(read_input("hf:nosuch/dataset"))  # the tests run with HF_HUB_OFFLINE=1
    assert is_retryable(hub.value)
    broken = tmp_path / "saved"
    broken.mkdir()
    (broken / "dataset_info.json").write_text("{not json")
    with pytest.raises(DataError, match="cannot load Hugging Face dataset") as local:
        list(read_input(str(broken)))
    assert not is_retryable(local.value)


def test_hub_inputs_are_keyed_by_their_resolved_revision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    from lmforge.config import load_config
    from lmforge.engine.executor import graph
    from lmforge.errors import SourceUnavailable, is_retryable

    commit = {"sha": "aaaa"}

    class FakeApi:
        def dataset_info(self, name: str, timeout: float) -> object:
            return type("Info", (), {"sha": commit["sha"]})()

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    config = load_config(
        "tiny-cpu", ["curate.inputs=[hf:org/corpus, hf:org/pinned@v1.0]"], str(tmp_path), check_paths=False
    )
    first = graph().get("curate/ingest").identity(config)["input_files"]
    assert first == {"hf:org/corpus": "hf:org/corpus@aaaa", "hf:org/pinned@v1.0": "hf:org/pinned@v1.0"}
    commit["sha"] = "bbbb"  # the dataset was updated on the hub: a new key
    assert graph().get("curate/ingest").identity(config)["input_files"]["hf:org/corpus"] == "hf:org/corpus@bbbb"

    class Offline:
        def dataset_info(self, name: str, timeout: float) -> object:
            raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "HfApi", Offline)
    with pytest.raises(SourceUnavailable, match="pin one as hf:org/corpus@REVISION") as info:
        graph().get("curate/ingest").identity(config)
    assert is_retryable(info.value)


def test_a_glob_is_expanded_once_and_the_expansion_is_what_is_read(tmp_path: Path) -> None:
    from data_prep.steps import _input_paths
    from lmforge.config import load_config
    from lmforge.engine.executor import graph
    from lmforge.engine.graph import StepContext

    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(GOOD[0]) + "\n")
    config = load_config("tiny-cpu", [f"curate.inputs=[{tmp_path}/*.jsonl]"], str(tmp_path / "ws"))
    identity = graph().get("curate/ingest").identity(config)
    assert list(identity["input_files"]) == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    (tmp_path / "c.jsonl").write_text(json.dumps(GOOD[1]) + "\n")  # arrives while the step runs
    ctx = StepContext("curate/ingest", "k", tmp_path / "out", config, {}, tmp_path / "ws", identity=identity)
    assert _input_paths(ctx) == list(identity["input_files"])
    assert (
        str(tmp_path / "c.jsonl") in graph().get("curate/ingest").identity(config)["input_files"]
    )  # the next run's key has it


def test_fix_encoding_repairs_mojibake_with_ftfy(tmp_path: Path) -> None:
    from data_prep.heuristics import StatParams, compute_stats

    broken = (
        "Caf\u00c3\u00a9 au lait and na\u00c3\u00afve \u00e2\u20ac\u0153quotes\u00e2\u20ac\u009d in M\u00c3\u00bcnchen."
    )
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"id": "m", "text": broken}) + "\n")
    docs, _, _ = _ingest(path, tmp_path)
    assert docs[0]["text"] != broken and compute_stats(docs[0]["text"], StatParams())["bad_char_ratio"] > 0.05
    fixed, _, _ = _ingest(path, tmp_path / "fixed", normalize={"fix_encoding": True})
    assert fixed[0]["text"] == "Café au lait and naïve “quotes” in München."
    assert compute_stats(fixed[0]["text"], StatParams())["bad_char_ratio"] == 0
