"""Ingest: read raw inputs, quarantine malformed records, normalize, write Parquet shards.

Inputs are JSONL (plain, .gz, .zst), Parquet, folders of .txt files, and Hugging Face
datasets (saved to disk, or `hf:NAME` when a hub is reachable), read by `lmforge.inputs`.
A malformed record (bad JSON, invalid UTF-8, missing/non-string/empty text) never crashes
the run and never vanishes: it goes to `quarantine.jsonl` with its file, line and reason, and is counted.
"""

from __future__ import annotations

import base64
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import xxhash

from data_prep.config import CurateConfig
from data_prep.pii import redact
from data_prep.records import DOC_SCHEMA, dumps_meta, shard_path, write_rows
from data_prep.textnorm import normalize_document
from lmforge.inputs import Raw, quarantine_record, read_input
from lmforge.jsonl import write_jsonl

log = logging.getLogger(__name__)


@dataclass
class ShardWriter:
    """Buffers normalized documents and flushes one Parquet shard per `docs_per_shard`."""

    out_dir: Path
    prefix: str
    docs_per_shard: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    shards: list[dict[str, Any]] = field(default_factory=list)

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if len(self.rows) >= self.docs_per_shard:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        name = f"{self.prefix}-s{len(self.shards):05d}"
        write_rows(shard_path(self.out_dir, name), self.rows, DOC_SCHEMA)
        self.shards.append({"name": name, "num_docs": len(self.rows)})
        self.rows = []


def normalize_url(url: str) -> str | None:
    """Lowercase scheme/host, drop fragment, default ports and trailing slash: one page, one URL.

    None for a URL that does not parse (the document is kept; it just takes no part in URL dedup).
    """
    try:
        parts = urlsplit(url.strip())
        host = (parts.hostname or "").lower()
        if parts.port and parts.port not in (80, 443):
            host = f"{host}:{parts.port}"
    except ValueError:
        return None
    path = parts.path.rstrip("/") or "/"
    return urlunsplit((parts.scheme.lower() or "http", host, path, parts.query, ""))


def validate(raw: Raw, cfg: CurateConfig, default_source: str) -> tuple[dict[str, Any] | None, str | None]:
    """(document, None) for a good record, (None, reason) for a bad one; never raises for bad data."""
    try:
        return _validate(raw, cfg, default_source)
    except (UnicodeEncodeError, UnicodeDecodeError, UnicodeTranslateError) as exc:
        # e.g. a lone surrogate "\ud800" escaped in valid JSON
        return None, f"invalid_unicode ({exc.reason} at {exc.start})"
    except (TypeError, ValueError) as exc:
        return None, f"invalid_record ({type(exc).__name__}: {exc})"


def _validate(raw: Raw, cfg: CurateConfig, default_source: str) -> tuple[dict[str, Any] | None, str | None]:
    if raw.problem:
        return None, raw.problem
    data = raw.data
    if not isinstance(data, dict):
        return None, f"not_an_object (got {type(data).__name__})"
    if cfg.text_field not in data:
        return None, f"missing_text (no field {cfg.text_field!r})"
    text = data[cfg.text_field]
    if not isinstance(text, str):
        return None, f"text_not_string (got {type(text).__name__})"
    original = text
    if cfg.normalize.enabled:
        text = normalize_document(text, cfg.normalize.unicode_form, cfg.normalize.fix_encoding)
    if not text.strip():
        return None, "empty_text"
    meta = data.get("meta")
    if not isinstance(meta, dict):
        meta = {}
    source = str(data.get("source") or default_source)
    url = data.get("url") if isinstance(data.get("url"), str) and data.get("url") else None
    doc_id = data.get(cfg.id_field)
    return {
        "id": str(doc_id) if doc_id not in (None, "") else f"{raw.origin}:{raw.line}",
        "text": text,
        "source": source,
        "domain": str(meta.get("domain") or source),
        "url": url,
        "meta": dumps_meta(meta),
        "text_hash": xxhash.xxh3_128_hexdigest(text.encode("utf-8")),
        "url_norm": normalize_url(url) if url else None,
        "n_chars": len(text),
        "origin": f"{raw.origin}:{raw.line}",
        "normalized": text != original,  # counted by ingest, not stored
    }, None


def _redacting(cfg: CurateConfig) -> bool:
    return cfg.pii.enabled and cfg.pii.redact_stored


def _redact_quarantined(record: dict[str, Any], cfg: CurateConfig, counts: Counter[str]) -> dict[str, Any]:
    """With `pii.redact_stored`, a quarantined record keeps its place and reason but not its PII."""
    text, found = redact(record["raw"], cfg.pii)
    counts.update(found)
    record = {**record, "raw": text}
    if "raw_base64" in record:
        record["raw_base64"] = base64.b64encode(text.encode()).decode()
    return record


def ingest_file(
    path: str, index: int, cfg: CurateConfig, out_dir: Path, label: str | None = None
) -> tuple[list[str], dict[str, Any]]:
    """Ingest one input into shards `f<index>-s<k>` and `quarantine/f<index>.jsonl`.

    `label` is how records name their origin (default: the path), so outputs do not depend
    on where the workspace happens to live.
    """
    prefix = f"f{index:04d}"
    writer = ShardWriter(out_dir, prefix, cfg.docs_per_shard)
    quarantined: list[dict[str, Any]] = []
    reasons: Counter[str] = Counter()
    domains: Counter[str] = Counter()
    default_source = Path(path.rstrip("/")).name.split(".")[0] or "input"
    total = normalized = 0
    pii: Counter[str] = Counter()
    for raw in read_input(path):
        total += 1
        if label and raw.origin.startswith(path):
            raw.origin = label + raw.origin[len(path) :]
        doc, problem = validate(raw, cfg, default_source)
        if doc is None:
            reasons[problem.split(" ")[0]] += 1  # type: ignore[union-attr]
            record = quarantine_record(raw, problem)  # type: ignore[arg-type]
            quarantined.append(_redact_quarantined(record, cfg, pii) if _redacting(cfg) else record)
            continue
        domains[doc["domain"]] += 1
        normalized += doc.pop("normalized")
        if _redacting(cfg) and doc["domain"] not in cfg.pii.skip_domains:
            doc["text"], found = redact(doc["text"], cfg.pii)
            pii.update(found)
        writer.add(doc)
    writer.flush()
    files = [str(shard_path(out_dir, s["name"]).relative_to(out_dir)) for s in writer.shards]
    if quarantined:
        qpath = out_dir / "quarantine" / f"{prefix}.jsonl"
        write_jsonl(qpath, quarantined)
        files.append(str(qpath.relative_to(out_dir)))
    if reasons:
        log.warning("%s: quarantined %d of %d records (%s)", path, len(quarantined), total, dict(reasons))
    return files, {
        "input": total,
        "docs": total - len(quarantined),
        "normalized": normalized,
        "pii_redacted": dict(pii),
        "quarantined": dict(reasons),
        "domains": dict(domains),
        "shards": writer.shards,
    }
