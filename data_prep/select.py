"""Selection: turn stored attributes into keep/remove decisions, redact PII, mix domains.

This is the cheap step. It reads only small attribute columns to decide (no text, no
signatures, no models), then streams each shard once to write `kept/` and `removed/`.
Every removed document keeps its primary reason and every rule it failed; counts always
satisfy input = kept + sum(removed) + quarantined.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data_prep import heuristics
from data_prep.config import CurateConfig
from data_prep.mixing import plan_mix
from data_prep.pii import redact
from data_prep.records import shard_path, write_rows

KEPT_SCHEMA = pa.schema([
    ("id", pa.string()), ("text", pa.string()), ("source", pa.string()), ("domain", pa.string()),
    ("url", pa.string()), ("meta", pa.string()), ("lang", pa.string()), ("lang_score", pa.float32()),
    ("quality_score", pa.float32()), ("repeat", pa.int32()), ("origin", pa.string()),
])
REMOVED_SCHEMA = pa.schema([
    ("id", pa.string()), ("text", pa.string()), ("source", pa.string()), ("domain", pa.string()),
    ("url", pa.string()), ("meta", pa.string()), ("reason", pa.string()), ("reasons", pa.string()),
    ("duplicate_of", pa.string()), ("origin", pa.string()),
])


@dataclass
class AttributeDirs:
    """Where each upstream step put its per-shard attributes (None when the step is off)."""

    ingest: Path
    shards: list[str]
    minhash: Path | None = None
    langid: Path | None = None
    heuristics: Path | None = None
    quality: Path | None = None


@dataclass
class Decisions:
    ids: list[str] = field(default_factory=list)
    domains: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    reasons: list[list[str]] = field(default_factory=list)
    duplicate_of: dict[int, int] = field(default_factory=dict)
    langs: list[str | None] = field(default_factory=list)
    lang_scores: list[float | None] = field(default_factory=list)
    quality: list[float | None] = field(default_factory=list)


def near_duplicate_clusters(edges_path: Path, threshold: float) -> list[list[int]]:
    """Connected components (sorted member lists) of the edges at or above `threshold`.

    `scipy.sparse.csgraph.connected_components` on the edge list: linear in edges, and no
    Python object per edge. Members come sorted, so each cluster's first member is its
    earliest document.
    """
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    edges = pq.read_table(edges_path, columns=["a", "b", "jaccard"])
    keep = np.asarray(edges["jaccard"]) >= threshold
    a, b = np.asarray(edges["a"])[keep], np.asarray(edges["b"])[keep]
    if not len(a):
        return []
    nodes, index = np.unique(np.concatenate([a, b]), return_inverse=True)
    graph = coo_matrix((np.ones(len(a), dtype=np.int8), (index[: len(a)], index[len(a):])),
                       shape=(len(nodes), len(nodes)))
    _, labels = connected_components(graph, directed=False)
    order = np.argsort(labels, kind="stable")  # nodes are ascending, and stay so within a component
    bounds = np.flatnonzero(np.diff(labels[order])) + 1
    return [nodes[group].tolist() for group in np.split(order, bounds)]


def _attr(directory: Path | None, shard: str, columns: list[str] | None = None) -> list[dict[str, Any]] | None:
    if directory is None:
        return None
    return pq.read_table(directory / "attributes" / f"{shard}.parquet", columns=columns).to_pylist()


def _language_failures(cfg: CurateConfig, lang: str | None, score: float | None) -> list[str]:
    if lang is None:
        return []
    if cfg.langid.keep and lang not in cfg.langid.keep:
        return [f"langid:not_kept:{lang}"]
    if score is not None and score < cfg.langid.min_score:
        return ["langid:low_confidence"]
    return []


def _rule_failures(cfg: CurateConfig, domain: str, stats: dict[str, Any] | None,
                   lang: str | None, score: float | None) -> list[str]:
    """Failed rules in reporting order: length, language, then the quality rule families."""
    failures: list[str] = []
    for family, (section, check) in heuristics.ALL_RULE_FAMILIES.items():
        rule_cfg = getattr(cfg, section)
        if stats is not None and rule_cfg.enabled and domain not in rule_cfg.skip_domains:
            failures.extend(check(stats, rule_cfg))
        if family == "length" and cfg.langid.enabled and domain not in cfg.langid.skip_domains:
            failures.extend(_language_failures(cfg, lang, score))
    return failures


def decide(cfg: CurateConfig, dirs: AttributeDirs) -> Decisions:
    """Every rule except the quality keep-fraction and mixing, from attributes only.

    Filters run before dedup (FineWeb's order): the copy kept from a group of duplicates is
    the first one that passes the filters, so a good copy is never dropped because its
    first occurrence happened to be a truncated or mis-detected one.
    """
    out = Decisions()
    hashes: list[str] = []
    urls: list[str | None] = []
    for shard in dirs.shards:
        base = pq.read_table(shard_path(dirs.ingest, shard),
                             columns=["id", "domain", "text_hash", "url_norm", "n_chars"]).to_pylist()
        langs = _attr(dirs.langid, shard) or [None] * len(base)
        stats = _attr(dirs.heuristics, shard) or [None] * len(base)
        quality = _attr(dirs.quality, shard) or [None] * len(base)
        for doc, lang, stat, qual in zip(base, langs, stats, quality):
            lang_code = lang["lang"] if lang else None
            lang_score = lang["lang_score"] if lang else None
            out.reasons.append(_rule_failures(cfg, doc["domain"], stat, lang_code, lang_score))
            out.ids.append(doc["id"])
            out.domains.append(doc["domain"])
            out.sizes.append(doc["n_chars"])
            out.langs.append(lang_code)
            out.lang_scores.append(lang_score)
            out.quality.append(qual["quality_score"] if qual else None)
            hashes.append(doc["text_hash"])
            urls.append(doc["url_norm"])
    _deduplicate(cfg, dirs, out, hashes, urls)
    return out


def _deduplicate(cfg: CurateConfig, dirs: AttributeDirs, out: Decisions, hashes: list[str], urls: list[str | None]) -> None:
    """Exact, URL and near-duplicate removal among the documents that passed every filter."""
    if cfg.exact_dedup.enabled:
        seen_text: dict[str, int] = {}
        seen_url: dict[str, int] = {}
        for index, reasons in enumerate(out.reasons):
            if reasons:
                continue
            first = seen_text.setdefault(hashes[index], index)
            if first != index:
                reasons.append("exact_dedup")
                out.duplicate_of[index] = first
            elif cfg.exact_dedup.url and urls[index]:
                first_url = seen_url.setdefault(urls[index], index)  # type: ignore[arg-type]
                if first_url != index:
                    reasons.append("exact_dedup:url")
                    out.duplicate_of[index] = first_url
    if dirs.minhash is None:
        return
    for members in near_duplicate_clusters(dirs.minhash / "edges.parquet", cfg.near_dedup.threshold):
        survivors = [m for m in members if not out.reasons[m]]
        for member in survivors[1:]:
            out.reasons[member].append("near_dedup")
            out.duplicate_of[member] = survivors[0]


def apply_quality_rule(cfg: CurateConfig, d: Decisions) -> float | None:
    """Add `quality_classifier` failures; returns the effective score threshold."""
    qc = cfg.quality_classifier
    if not qc.enabled:
        return None
    eligible = [i for i, r in enumerate(d.reasons)
                if not r and d.quality[i] is not None and d.domains[i] not in qc.skip_domains]
    if not eligible:
        return None
    threshold = qc.threshold
    if threshold is None:
        scores = np.array([d.quality[i] for i in eligible])
        threshold = float(np.quantile(scores, 1.0 - qc.keep_fraction, method="lower"))  # type: ignore[operator]
    for i in eligible:
        if d.quality[i] < threshold:  # type: ignore[operator]
            d.reasons[i].append("quality_classifier")
    return threshold


def write_selection(cfg: CurateConfig, dirs: AttributeDirs, d: Decisions, repeats: dict[int, int],
                    out_dir: Path) -> tuple[Counter[str], Counter[str], int]:
    """Stream each shard once; returns (removed reasons, PII counts, number kept)."""
    removed_counts: Counter[str] = Counter()
    pii_counts: Counter[str] = Counter()
    kept_total, index = 0, 0
    for shard in dirs.shards:
        kept, removed = [], []
        for doc in pq.read_table(shard_path(dirs.ingest, shard)).to_pylist():
            reasons = d.reasons[index]
            if reasons:
                removed_counts[reasons[0]] += 1
                dup = d.duplicate_of.get(index)
                removed.append({**{k: doc[k] for k in ("id", "text", "source", "domain", "url", "meta", "origin")},
                                "reason": reasons[0], "reasons": json.dumps(reasons),
                                "duplicate_of": d.ids[dup] if dup is not None else None})
            else:
                text = doc["text"]
                if cfg.pii.enabled and doc["domain"] not in cfg.pii.skip_domains:
                    text, found = redact(text, cfg.pii)
                    pii_counts.update(found)
                kept.append({**{k: doc[k] for k in ("id", "source", "domain", "url", "meta", "origin")}, "text": text,
                             "lang": d.langs[index], "lang_score": d.lang_scores[index],
                             "quality_score": d.quality[index], "repeat": repeats.get(index, 1)})
            index += 1
        write_rows(out_dir / "kept" / f"{shard}.parquet", kept, KEPT_SCHEMA)
        write_rows(out_dir / "removed" / f"{shard}.parquet", removed, REMOVED_SCHEMA)
        kept_total += len(kept)
    return removed_counts, pii_counts, kept_total


def run_selection(cfg: CurateConfig, dirs: AttributeDirs, out_dir: Path) -> dict[str, Any]:
    decisions = decide(cfg, dirs)
    threshold = apply_quality_rule(cfg, decisions)
    survivors = [i for i, r in enumerate(decisions.reasons) if not r]
    repeats: dict[int, int] = {}
    mix_report: dict[str, Any] = {}
    if cfg.mix.enabled and cfg.mix.weights:
        planned, mix_report = plan_mix([(decisions.ids[i], decisions.domains[i], decisions.sizes[i]) for i in survivors],
                                       cfg.mix)
        for i, repeat in zip(survivors, planned):
            if repeat == 0:
                decisions.reasons[i].append("mix:downsampled")
            else:
                repeats[i] = repeat
    removed, pii, kept = write_selection(cfg, dirs, decisions, repeats, out_dir)
    kept_domains = Counter(decisions.domains[i] for i, r in enumerate(decisions.reasons) if not r)
    return {
        "counts": {"kept": kept, "removed": dict(sorted(removed.items())), "removed_total": sum(removed.values()),
                   "pii": dict(pii), "kept_by_domain": dict(kept_domains)},
        "metrics": {"quality_threshold": threshold, "mix": mix_report},
    }
