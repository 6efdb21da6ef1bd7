"""Property-based fuzzing (hypothesis) of what users hand lmforge: config files, `--set` values and
JSONL inputs. Bounded in examples and time; each property is the promise the README makes.

- The config loader: any YAML tree, any text, any `--set`, either loads or raises `ConfigError`
  with one line (the CLI turns that into exit 2); never another exception (the CLI's "error: ..."
  path, exit 1, is for failures while running, not for a bad config).
- The JSONL reader behind curation's ingest: any bytes, line by line, are either documents or
  quarantined records with their reason and their raw bytes; the counts add up; nothing is lost.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from lmforge.config import load_config, pipeline_model
from lmforge.errors import ConfigError

EXAMPLES = int(os.environ.get("LMFORGE_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,  # no example database written into the checkout
)


def _field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    paths = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        paths.append(path)
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            paths += _field_paths(annotation, f"{path}.")
    return paths


PATHS = _field_paths(pipeline_model())
NAMES = sorted({p.rsplit(".", 1)[-1] for p in PATHS})
keys = st.sampled_from(NAMES) | st.text(min_size=1, max_size=10) | st.integers(-3, 3)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=24)
    | st.sampled_from(["tiny-cpu", "auto", "off", "1e-3", "[en, fr]", "s3://b/p", "../..", "\n", "~"])
)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4), max_leaves=16
)


def _nested(path: str, value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


trees = st.one_of(
    st.dictionaries(st.sampled_from(NAMES) | keys, values, max_size=6),  # sections and fields anywhere
    st.builds(_nested, st.sampled_from(PATHS), values),  # a real field, deep, with any value
    st.builds(lambda t: {"extends": "tiny-cpu", **t}, st.dictionaries(st.sampled_from(NAMES), values, max_size=4)),
)


def _outcome(preset: str, overrides: list[str] | None = None) -> str:
    """ "loaded", or the ConfigError's message (any other exception propagates and fails the property)."""
    try:
        load_config(preset, overrides)
    except ConfigError as exc:
        return str(exc)
    return "loaded"


def _loads_or_one_line(outcome: str) -> bool:
    return outcome == "loaded" or (bool(outcome) and outcome.isprintable() and "Traceback" not in outcome)


@FUZZ
@given(tree=trees)
def test_any_yaml_tree_loads_or_fails_with_one_line(tree: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.yaml"
        path.write_text(yaml.safe_dump(tree, allow_unicode=True))
        outcome = _outcome(str(path))
    assert _loads_or_one_line(outcome), outcome


@FUZZ
@given(text=st.text(max_size=200) | st.binary(max_size=200))
def test_any_file_text_loads_or_fails_with_one_line(text: str | bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.yaml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", errors="surrogatepass"))
        outcome = _outcome(str(path))
    assert _loads_or_one_line(outcome), outcome


assignments = st.one_of(
    st.builds(lambda p, v: f"{p}={v}", st.sampled_from(PATHS), st.text(max_size=40)),
    st.builds(lambda p, v: f"{p}={yaml.safe_dump(v, default_flow_style=True).strip()}", st.sampled_from(PATHS), values),
    st.text(max_size=40),  # anything at all, `=` or not
)


@FUZZ
@given(overrides=st.lists(assignments, min_size=1, max_size=3))
def test_any_set_value_loads_or_fails_with_one_line(overrides: list[str]) -> None:
    outcome = _outcome("tiny-cpu", overrides)
    assert _loads_or_one_line(outcome), outcome


@pytest.fixture(scope="module")
def curate_cfg():  # type: ignore[no-untyped-def]
    return load_config("tiny-cpu").curate


lines = st.one_of(
    st.binary(max_size=80).map(lambda b: b.replace(b"\n", b" ")),
    st.text(max_size=60).map(lambda t: t.replace("\n", " ").encode("utf-8", errors="surrogatepass")),
    st.builds(lambda v: json.dumps(v).encode(), values),
    st.builds(
        lambda text, extra: json.dumps({"text": text, **extra}).encode(),
        st.text(max_size=60),
        st.dictionaries(st.sampled_from(["id", "url", "source", "meta", "lang"]), values, max_size=3),
    ),
)


@FUZZ
@given(rows=st.lists(lines, max_size=12), compress=st.sampled_from(["none", "gzip", "torn-gzip"]))
def test_any_jsonl_bytes_are_kept_or_quarantined_and_counted(curate_cfg, rows: list[bytes], compress: str) -> None:  # type: ignore[no-untyped-def]
    from data_prep.ingest import ingest_file
    from lmforge.jsonl import read_jsonl

    body = b"".join(row + b"\n" for row in rows)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / ("input.jsonl" if compress == "none" else "input.jsonl.gz")
        data = body if compress == "none" else gzip.compress(body)
        path.write_bytes(data[: max(len(data) - 9, 1)] if compress == "torn-gzip" else data)
        out = Path(folder) / "out"
        files, stats = ingest_file(str(path), 0, curate_cfg, out)
        quarantined = list(read_jsonl(out / "quarantine" / "f0000.jsonl")) if stats["quarantined"] else []
        assert stats["docs"] + sum(stats["quarantined"].values()) == stats["input"] == stats["docs"] + len(quarantined)
        if compress == "torn-gzip":
            return  # what stood after the tear is gone with it: counted once as unreadable_file, with its reason
        assert stats["input"] == sum(1 for row in rows if row.strip())  # every non-blank line is accounted for
        for record in quarantined:  # kept whole: its line, its reason and its exact bytes
            assert record["reason"] and record["line"] >= 1
            assert base64.b64decode(record["raw_base64"]).rstrip(b"\n") == rows[record["line"] - 1]
