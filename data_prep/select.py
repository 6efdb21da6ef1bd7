"""Selection: turn stored attributes into keep/remove decisions, redact PII, mix domains.

This is the cheap step, and it stays cheap and bounded in memory on large corpora:

1. Per shard (a unit, in parallel, resumable): the rules every document fails are found
   from the small attribute columns (no text, no signatures, no models) and saved as a few
   numpy columns: a code for the document's list of failed rules, its domain, size, quality
   score and the 128-bit hashes of its text and URL.
2. Across the corpus (finalize), on those numpy columns only: exact and URL dedup (sorting
   hashes), near-dedup (connected components of the stored edges), the quality
   keep-fraction, paragraph dedup (data_prep/paragraphs.py, on curate/paragraphs'
   per-paragraph hashes) and mixing. Memory is a few tens of bytes per document; no Python object
   is made per document.
3. Each shard is streamed once to write `kept/` and `removed/`; a retried selection skips
   shards it already wrote.

Every removed document keeps its primary reason and every rule it failed; counts always
satisfy input = kept + sum(removed) + quarantined.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from data_prep import paragraphs, semantic
from data_prep.config import CurateConfig
from data_prep.filters import filters
from data_prep.mixing import plan_mix
from data_prep.pii import redact
from data_prep.records import shard_path, write_arrays, write_rows
from lmforge.hashing import atomic_write_json

KEPT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("text", pa.string()),
        ("source", pa.string()),
        ("domain", pa.string()),
        ("url", pa.string()),
        ("meta", pa.string()),
        ("lang", pa.string()),
        ("lang_score", pa.float32()),
        ("quality_score", pa.float32()),
        ("repeat", pa.int32()),
        ("origin", pa.string()),
    ]
)
REMOVED_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("text", pa.string()),
        ("source", pa.string()),
        ("domain", pa.string()),
        ("url", pa.string()),
        ("meta", pa.string()),
        ("reason", pa.string()),
        ("reasons", pa.string()),
        ("duplicate_of", pa.string()),
        ("origin", pa.string()),
    ]
)
REMOVED_PARAGRAPH_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("paragraph", pa.int32()),
        ("text", pa.string()),
        ("reason", pa.string()),
        ("duplicate_of", pa.string()),
    ]
)
# Rules decided across the corpus, after the per-document filters; a document fails at most one.
LATER_REASONS = (
    "",
    "exact_dedup",
    "exact_dedup:url",
    "near_dedup",
    "quality_classifier",
    "mix:downsampled",
    paragraphs.REASON,
    semantic.REASON,
)
EXACT, URL, NEAR, QUALITY, MIX, PARAGRAPH, SEMANTIC = range(1, len(LATER_REASONS))
SHARD_INPUTS = ".select-inputs"  # per-shard numpy columns (hidden: working state, not an output)
SHARD_WRITTEN = ".select-written"  # per-shard counts of a written shard, so a retry resumes


@dataclass
class AttributeDirs:
    """Where each upstream step put its per-shard attributes (None when the step is off)."""

    ingest: Path
    shards: list[str]
    minhash: Path | None = None
    paragraphs: Path | None = None
    semantic: Path | None = None
    semantic_kind: str | None = None  # the encoder's kind (its default threshold)
    langid: Path | None = None
    heuristics: Path | None = None
    quality: Path | None = None
    decontaminate: Path | None = None


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


def _rule_failures(
    cfg: CurateConfig,
    domain: str,
    stats: dict[str, Any] | None,
    lang: str | None,
    score: float | None,
    contaminated: bool = False,
) -> list[str]:
    """Failed rules in reporting order: decontamination, the families before the language check
    (length), language, then the other rule families (data_prep.filters, in registry order)."""
    failures: list[str] = ["decontaminated"] if contaminated else []
    language = cfg.langid.enabled and domain not in cfg.langid.skip_domains
    families = list(filters().values())
    for family in [f for f in families if f.before_language] + [None] + [f for f in families if not f.before_language]:
        if family is None:
            failures.extend(_language_failures(cfg, lang, score) if language else [])
            continue
        rule_cfg = getattr(cfg, family.name)
        if stats is not None and rule_cfg.enabled and domain not in rule_cfg.skip_domains:
            failures.extend(family.failures(stats, rule_cfg))
    return failures


def _hashes128(digests: list[bytes]) -> np.ndarray:
    """(n, 2) uint64 from n 16-byte digests."""
    return np.frombuffer(b"".join(digests), dtype=">u8").astype(np.uint64).reshape(len(digests), 2)


# -- 1. per shard ---------------------------------------------------------------------------


def shard_inputs(cfg: CurateConfig, dirs: AttributeDirs, shard: str, out_dir: Path) -> tuple[list[str], dict[str, Any]]:
    """Every per-document rule (filters, language) for one shard, plus what dedup, the quality
    rule and mixing need, as numpy columns. Failure lists and domains are coded per shard; the
    result lists the codes' meanings."""
    base = pq.read_table(shard_path(dirs.ingest, shard), columns=["domain", "text_hash", "url_norm", "n_chars"])
    domains = base["domain"].to_pylist()
    no_rows: list[None] = [None] * len(domains)  # for a step that is off: nothing for any document
    langs: Sequence[dict[str, Any] | None] = _attr(dirs.langid, shard) or no_rows
    stats: Sequence[dict[str, Any] | None] = _attr(dirs.heuristics, shard) or no_rows
    quality = _attr(dirs.quality, shard)
    flagged: Sequence[dict[str, Any] | None] = _attr(dirs.decontaminate, shard, ["decontaminated"]) or no_rows
    failure_codes: dict[tuple[str, ...], int] = {(): 0}
    domain_codes: dict[str, int] = {}
    failure = np.empty(len(domains), dtype=np.uint32)
    domain = np.empty(len(domains), dtype=np.uint32)
    for i, (dom, lang, stat, flag) in enumerate(zip(domains, langs, stats, flagged)):
        failed = tuple(
            _rule_failures(
                cfg,
                dom,
                stat,
                lang["lang"] if lang else None,
                lang["lang_score"] if lang else None,
                bool(flag and flag["decontaminated"]),
            )
        )
        failure[i] = failure_codes.setdefault(failed, len(failure_codes))
        domain[i] = domain_codes.setdefault(dom, len(domain_codes))
    urls = base["url_norm"].to_pylist()
    columns = {
        "failure": failure,
        "domain": domain,
        "n_chars": base["n_chars"].to_numpy().astype(np.int64),
        "text_hash": _hashes128([bytes.fromhex(h) for h in base["text_hash"].to_pylist()]),
        "url_hash": _hashes128([xxhash.xxh3_128_digest(u.encode()) if u else bytes(16) for u in urls]),
        "has_url": np.array([bool(u) for u in urls], dtype=bool),
        "quality": np.array([q["quality_score"] for q in quality], dtype=np.float64)
        if quality
        else np.full(len(domains), np.nan),
    }
    rel = f"{SHARD_INPUTS}/{shard}.npz"
    write_arrays(out_dir / rel, columns)
    return [rel], {"docs": len(domains), "failures": [list(f) for f in failure_codes], "domains": list(domain_codes)}


# -- 2. across the corpus -------------------------------------------------------------------


@dataclass
class Decisions:
    """One entry per document, in corpus order. A document's reasons are its failed rules
    (`failures[failure[i]]`), else the one corpus-level rule it failed (`LATER_REASONS[later[i]]`)."""

    failures: list[tuple[str, ...]]
    failure: np.ndarray  # uint32 code into failures; 0 = passed every per-document rule
    later: np.ndarray  # uint8 code into LATER_REASONS; 0 = none
    duplicate_of: np.ndarray  # int64 document index, -1 = none
    domains: list[str]
    domain: np.ndarray  # code into domains
    repeat: np.ndarray  # int32, for kept documents
    bounds: np.ndarray  # shard k holds documents bounds[k]:bounds[k+1]
    paragraphs: paragraphs.ParagraphDecisions | None = None  # paragraphs removed from kept documents

    def reasons(self, index: int) -> list[str]:
        later = LATER_REASONS[self.later[index]]
        return [*self.failures[self.failure[index]], *([later] if later else [])]

    @property
    def kept(self) -> np.ndarray:
        return (self.failure == 0) & (self.later == 0)


def _load(out_dir: Path, shards: list[str], column: str) -> np.ndarray:
    return np.concatenate([np.load(out_dir / SHARD_INPUTS / f"{s}.npz")[column] for s in shards])


def _recode(
    out_dir: Path, shards: list[str], results: dict[str, Any], column: str, key: str, table: dict[Any, int]
) -> np.ndarray:
    """A per-shard coded column with codes shared by the whole corpus (`table` grows as needed)."""
    parts = []
    for shard in shards:
        local = [table.setdefault(tuple(v) if isinstance(v, list) else v, len(table)) for v in results[shard][key]]
        parts.append(
            np.asarray(local, dtype=np.uint32)[np.load(out_dir / SHARD_INPUTS / f"{shard}.npz")[column]]
            if local
            else np.zeros(0, dtype=np.uint32)
        )
    return np.concatenate(parts)


def first_of_equal(rows: np.ndarray) -> np.ndarray:
    """For each row of an (n, 2) uint64 array, the index of the first row equal to it."""
    order = np.lexsort((rows[:, 1], rows[:, 0]))  # stable: equal rows stay in index order
    ordered = rows[order]
    starts = np.r_[True, (ordered[1:] != ordered[:-1]).any(axis=1)] if len(rows) else np.zeros(0, dtype=bool)
    first = np.empty(len(rows), dtype=np.int64)
    first[order] = order[np.flatnonzero(starts)][np.cumsum(starts) - 1]
    return first


def _mark_copies(d: Decisions, candidates: np.ndarray, hashes: np.ndarray, reason: int) -> np.ndarray:
    """Mark every candidate whose hash an earlier candidate has; returns the unmarked candidates."""
    first = first_of_equal(hashes)
    copy = first != np.arange(len(candidates))
    d.later[candidates[copy]] = reason
    d.duplicate_of[candidates[copy]] = candidates[first[copy]]
    return candidates[~copy]


def near_duplicate_components(edges_path: Path, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """(nodes, component label of each) for the edges at or above `threshold`; nodes ascending.

    `scipy.sparse.csgraph.connected_components` on the edge list: linear in edges, and no
    Python object per edge.
    """
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    edges = pq.read_table(edges_path, columns=["a", "b", "jaccard"])
    keep = np.asarray(edges["jaccard"]) >= threshold
    a, b = np.asarray(edges["a"])[keep], np.asarray(edges["b"])[keep]
    if not len(a):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    nodes, index = np.unique(np.concatenate([a, b]), return_inverse=True)
    graph = coo_matrix(
        (np.ones(len(a), dtype=np.int8), (index[: len(a)], index[len(a) :])), shape=(len(nodes), len(nodes))
    )
    return nodes, connected_components(graph, directed=False)[1]


def near_duplicate_clusters(edges_path: Path, threshold: float) -> list[list[int]]:
    """Connected components (sorted member lists) of the edges at or above `threshold`."""
    nodes, labels = near_duplicate_components(edges_path, threshold)
    order = np.argsort(labels, kind="stable")  # nodes are ascending, and stay so within a component
    bounds = np.flatnonzero(np.diff(labels[order])) + 1
    return [nodes[group].tolist() for group in np.split(order, bounds)] if len(nodes) else []


def _deduplicate(cfg: CurateConfig, dirs: AttributeDirs, out_dir: Path, d: Decisions) -> None:
    """Exact, URL and near-duplicate removal among the documents that passed every filter:
    of each group the first such document stays (FineWeb's order: filter, then deduplicate)."""
    if cfg.exact_dedup.enabled:
        passed = np.flatnonzero(d.failure == 0)
        firsts = _mark_copies(d, passed, _load(out_dir, dirs.shards, "text_hash")[passed], EXACT)
        if cfg.exact_dedup.url:
            firsts = firsts[_load(out_dir, dirs.shards, "has_url")[firsts]]
            _mark_copies(d, firsts, _load(out_dir, dirs.shards, "url_hash")[firsts], URL)
    if dirs.minhash is None:
        return
    nodes, labels = near_duplicate_components(dirs.minhash / "edges.parquet", cfg.near_dedup.threshold)
    alive = d.kept[nodes]
    nodes, labels = nodes[alive], labels[alive]
    order = np.lexsort((nodes, labels))  # by component, earliest document first
    nodes, labels = nodes[order], labels[order]
    starts = np.r_[True, labels[1:] != labels[:-1]] if len(nodes) else np.zeros(0, dtype=bool)
    survivor = nodes[np.flatnonzero(starts)][np.cumsum(starts) - 1]
    d.later[nodes[~starts]] = NEAR
    d.duplicate_of[nodes[~starts]] = survivor[~starts]


def _paragraph_dedup(cfg: CurateConfig, dirs: AttributeDirs, d: Decisions) -> None:
    """Repeated paragraphs among the documents every rule but mixing keeps (data_prep/paragraphs.py):
    documents mostly made of repeats are marked `paragraph_dedup`; the rest lose their repeats at
    writing. After the filters and the quality rule, so the copy kept is not in a document they
    drop; before mixing, so the domain shares are planned on the text that is left (mixing then
    downsamples a holder with all of its text, as it does any document)."""
    if dirs.paragraphs is None:
        return
    pc = cfg.paragraph_dedup
    parts = [np.load(dirs.paragraphs / "paragraphs" / f"{s}.npz") for s in dirs.shards]
    columns = {name: np.concatenate([p[name] for p in parts]) for name in ("number", "key", "chars", "norm")}
    columns["doc"] = np.concatenate([p["doc"] + d.bounds[k] for k, p in enumerate(parts)])
    skipped = np.array([name in pc.skip_domains for name in d.domains], dtype=bool)
    eligible = d.kept & ~skipped[d.domain] if len(d.domains) else d.kept
    decided = paragraphs.decide(columns, eligible, pc.min_chars, pc.max_repeated_fraction)
    d.later[decided.removed_docs] = PARAGRAPH
    d.duplicate_of[decided.removed_docs] = decided.removed_owner
    d.paragraphs = decided


def semantic_dedup(cfg: CurateConfig, dirs: AttributeDirs, out_dir: Path, d: Decisions) -> float | None:
    """Paraphrases among the documents every rule but paragraph dedup and mixing keeps
    (data_prep/semantic.py): of each similar pair the better document (quality score, then length)
    stays. The decisions, with both documents' scores, go to `semantic_pairs.parquet` (what a person
    checks before trusting a threshold). Returns the threshold applied."""
    if dirs.semantic is None:
        return None
    sd = cfg.semantic_dedup
    threshold = sd.threshold if sd.threshold is not None else semantic.default_threshold(dirs.semantic_kind or "")
    pairs = pq.read_table(dirs.semantic / "pairs.parquet")
    skipped = np.array([name in sd.skip_domains for name in d.domains], dtype=bool)
    eligible = d.kept & ~skipped[d.domain] if len(d.domains) else d.kept
    quality = _load(out_dir, dirs.shards, "quality")
    n_chars = _load(out_dir, dirs.shards, "n_chars")
    decided = semantic.decide(
        np.asarray(pairs["a"]),
        np.asarray(pairs["b"]),
        np.asarray(pairs["cosine"]),
        eligible,
        threshold,
        quality,
        n_chars,
    )
    d.later[decided.removed] = SEMANTIC
    d.duplicate_of[decided.removed] = decided.kept_copy
    unique, inverse = np.unique(np.concatenate([decided.removed, decided.kept_copy]), return_inverse=True)
    ids = _ids_at(dirs, d, unique).take(pa.array(inverse))
    n = len(decided.removed)
    columns = {
        "removed": ids[:n],
        "kept": ids[n:],
        "cosine": pa.array(decided.cosine, pa.float32()),
        "removed_quality": pa.array(quality[decided.removed], pa.float64(), from_pandas=True),
        "kept_quality": pa.array(quality[decided.kept_copy], pa.float64(), from_pandas=True),
        "removed_chars": pa.array(n_chars[decided.removed], pa.int64()),
        "kept_chars": pa.array(n_chars[decided.kept_copy], pa.int64()),
    }
    pq.write_table(pa.table(columns), out_dir / "semantic_pairs.parquet")
    return threshold


def decide(cfg: CurateConfig, dirs: AttributeDirs, out_dir: Path, results: dict[str, Any]) -> Decisions:
    """Every rule except the quality keep-fraction and mixing, from the per-shard inputs.

    Filters run before dedup (FineWeb's order): the copy kept from a group of duplicates is
    the first one that passes the filters, so a good copy is never dropped because its
    first occurrence happened to be a truncated or mis-detected one.
    """
    failures: dict[Any, int] = {(): 0}
    domains: dict[Any, int] = {}
    failure = _recode(out_dir, dirs.shards, results, "failure", "failures", failures)
    domain = _recode(out_dir, dirs.shards, results, "domain", "domains", domains)
    bounds = np.zeros(len(dirs.shards) + 1, dtype=np.int64)
    np.cumsum([results[s]["docs"] for s in dirs.shards], out=bounds[1:])
    d = Decisions(
        failures=list(failures),
        failure=failure,
        later=np.zeros(len(failure), dtype=np.uint8),
        duplicate_of=np.full(len(failure), -1, dtype=np.int64),
        domains=list(domains),
        domain=domain,
        repeat=np.ones(len(failure), dtype=np.int32),
        bounds=bounds,
    )
    _deduplicate(cfg, dirs, out_dir, d)
    return d


def apply_quality_rule(cfg: CurateConfig, dirs: AttributeDirs, out_dir: Path, d: Decisions) -> float | None:
    """Mark `quality_classifier` failures; returns the effective score threshold."""
    qc = cfg.quality_classifier
    if not qc.enabled:
        return None
    quality = _load(out_dir, dirs.shards, "quality")
    skipped = np.array([name in qc.skip_domains for name in d.domains], dtype=bool)
    eligible = np.flatnonzero(d.kept & ~np.isnan(quality) & ~skipped[d.domain])
    if not len(eligible):
        return None
    threshold = qc.threshold
    if threshold is None:
        assert qc.keep_fraction is not None  # the config's validator requires threshold or keep_fraction
        threshold = float(np.quantile(quality[eligible], 1.0 - qc.keep_fraction, method="lower"))
    d.later[eligible[quality[eligible] < threshold]] = QUALITY
    return threshold


def apply_mix(cfg: CurateConfig, dirs: AttributeDirs, out_dir: Path, d: Decisions) -> dict[str, Any]:
    """Downsample (`mix:downsampled`) or repeat survivors towards the domain weights."""
    if not (cfg.mix.enabled and cfg.mix.weights):
        return {}
    survivors = np.flatnonzero(d.kept)
    sizes = _load(out_dir, dirs.shards, "n_chars")
    if d.paragraphs is not None:  # what paragraph dedup takes out of kept documents (and a separator each)
        np.subtract.at(sizes, d.paragraphs.doc, d.paragraphs.chars + len(paragraphs.SEPARATOR))
        np.maximum(sizes, 0, out=sizes)
    docs = []
    for k, shard in enumerate(dirs.shards):
        mine = survivors[(survivors >= d.bounds[k]) & (survivors < d.bounds[k + 1])]
        ids = pq.read_table(shard_path(dirs.ingest, shard), columns=["id"])["id"].take(pa.array(mine - d.bounds[k]))
        docs += [(i, d.domains[d.domain[g]], int(sizes[g])) for i, g in zip(ids.to_pylist(), mine)]
    planned, report = plan_mix(docs, cfg.mix)
    planned_array = np.asarray(planned, dtype=np.int32)
    d.later[survivors[planned_array == 0]] = MIX
    d.repeat[survivors[planned_array > 0]] = planned_array[planned_array > 0]
    return report


# -- 3. writing -----------------------------------------------------------------------------


def _target_ids(dirs: AttributeDirs, d: Decisions) -> tuple[np.ndarray, pa.Array]:
    """(document indices that others duplicate, sorted; their ids), read one shard's ids at a time."""
    owners = d.paragraphs.owner if d.paragraphs is not None else np.zeros(0, dtype=np.int64)
    targets = np.unique(np.concatenate([d.duplicate_of[d.duplicate_of >= 0], owners]))
    return targets, _ids_at(dirs, d, targets)


def _ids_at(dirs: AttributeDirs, d: Decisions, indices: np.ndarray) -> pa.Array:
    """The ids of documents `indices` (sorted, unique), read one shard's ids at a time."""
    ids = []
    for k, shard in enumerate(dirs.shards):
        mine = indices[(indices >= d.bounds[k]) & (indices < d.bounds[k + 1])]
        if len(mine):
            column = pq.read_table(shard_path(dirs.ingest, shard), columns=["id"])["id"]
            ids.append(column.take(pa.array(mine - d.bounds[k])).combine_chunks())
    return pa.concat_arrays(ids) if ids else pa.array([], pa.string())


def write_shard(
    cfg: CurateConfig,
    dirs: AttributeDirs,
    d: Decisions,
    number: int,
    targets: tuple[np.ndarray, pa.Array],
    out_dir: Path,
) -> dict[str, Any]:
    """Write one shard's kept/ and removed/ files; returns its counts."""
    shard, offset = dirs.shards[number], int(d.bounds[number])
    removed_counts: Counter[str] = Counter()
    pii_counts: Counter[str] = Counter()
    kept_domains: Counter[str] = Counter()
    langs = _attr(dirs.langid, shard)
    quality = _attr(dirs.quality, shard)
    drops = _paragraph_drops(d, number)

    def doc_id(index: int) -> str:
        return targets[1][int(np.searchsorted(targets[0], index))].as_py()

    kept, removed, removed_paragraphs = [], [], []
    for row, doc in enumerate(pq.read_table(shard_path(dirs.ingest, shard)).to_pylist()):
        index = offset + row
        reasons = d.reasons(index)
        if reasons:
            removed_counts[reasons[0]] += 1
            dup = int(d.duplicate_of[index])
            removed.append(
                {
                    **{k: doc[k] for k in ("id", "text", "source", "domain", "url", "meta", "origin")},
                    "reason": reasons[0],
                    "reasons": json.dumps(reasons),
                    "duplicate_of": doc_id(dup) if dup >= 0 else None,
                }
            )
        else:
            text = doc["text"]
            if index in drops:
                parts = paragraphs.paragraphs(text)
                for number_in_doc, owner in drops[index]:
                    removed_paragraphs.append(
                        {
                            "id": doc["id"],
                            "paragraph": number_in_doc,
                            "text": parts[number_in_doc],
                            "reason": paragraphs.REASON,
                            "duplicate_of": doc_id(owner),
                        }
                    )
                gone = {n for n, _ in drops[index]}
                text = paragraphs.SEPARATOR.join(p for n, p in enumerate(parts) if n not in gone)
            if cfg.pii.enabled and doc["domain"] not in cfg.pii.skip_domains:
                text, found = redact(text, cfg.pii)
                pii_counts.update(found)
            kept_domains[doc["domain"]] += 1
            kept.append(
                {
                    **{k: doc[k] for k in ("id", "source", "domain", "url", "meta", "origin")},
                    "text": text,
                    "lang": langs[row]["lang"] if langs else None,
                    "lang_score": langs[row]["lang_score"] if langs else None,
                    "quality_score": quality[row]["quality_score"] if quality else None,
                    "repeat": int(d.repeat[index]),
                }
            )
    write_rows(out_dir / "kept" / f"{shard}.parquet", kept, KEPT_SCHEMA)
    write_rows(out_dir / "removed" / f"{shard}.parquet", removed, REMOVED_SCHEMA)
    write_rows(out_dir / "removed_paragraphs" / f"{shard}.parquet", removed_paragraphs, REMOVED_PARAGRAPH_SCHEMA)
    return {
        "paragraphs_removed": len(removed_paragraphs),
        "paragraph_chars_removed": sum(len(r["text"]) for r in removed_paragraphs),
        "removed": dict(removed_counts),
        "pii": dict(pii_counts),
        "kept": len(kept),
        "kept_by_domain": dict(kept_domains),
    }


def _paragraph_drops(d: Decisions, number: int) -> dict[int, list[tuple[int, int]]]:
    """{document index: [(paragraph number, owner document index)]} for shard `number`."""
    if d.paragraphs is None:
        return {}
    p = d.paragraphs
    lo, hi = np.searchsorted(p.doc, [d.bounds[number], d.bounds[number + 1]])
    drops: dict[int, list[tuple[int, int]]] = {}
    for doc, n, owner in zip(p.doc[lo:hi].tolist(), p.number[lo:hi].tolist(), p.owner[lo:hi].tolist()):
        drops.setdefault(doc, []).append((n, owner))
    return drops


class SelectionTotals(TypedDict):
    removed: Counter[str]
    pii: Counter[str]
    kept: int
    kept_by_domain: Counter[str]
    paragraphs_removed: int
    paragraph_chars_removed: int


def write_selection(cfg: CurateConfig, dirs: AttributeDirs, d: Decisions, out_dir: Path) -> SelectionTotals:
    """Stream each shard once (skipping shards a previous attempt finished); the summed counts."""
    targets = _target_ids(dirs, d)
    total = SelectionTotals(
        removed=Counter(),
        pii=Counter(),
        kept=0,
        kept_by_domain=Counter(),
        paragraphs_removed=0,
        paragraph_chars_removed=0,
    )
    for number, shard in enumerate(dirs.shards):
        marker = out_dir / SHARD_WRITTEN / f"{shard}.json"
        files = [out_dir / part / f"{shard}.parquet" for part in ("kept", "removed", "removed_paragraphs")]
        if marker.exists() and all(f.exists() for f in files):
            counts = json.loads(marker.read_text())
        else:
            counts = write_shard(cfg, dirs, d, number, targets, out_dir)
            atomic_write_json(marker, counts)
        total["removed"].update(counts["removed"])
        total["pii"].update(counts["pii"])
        total["kept_by_domain"].update(counts["kept_by_domain"])
        total["kept"] += counts["kept"]
        total["paragraphs_removed"] += counts["paragraphs_removed"]
        total["paragraph_chars_removed"] += counts["paragraph_chars_removed"]
    return total


def run_selection(cfg: CurateConfig, dirs: AttributeDirs, out_dir: Path, results: dict[str, Any]) -> dict[str, Any]:
    """Decide across the corpus from the per-shard inputs (`shard_inputs` results), then write."""
    decisions = decide(cfg, dirs, out_dir, results)
    threshold = apply_quality_rule(cfg, dirs, out_dir, decisions)
    semantic_threshold = semantic_dedup(cfg, dirs, out_dir, decisions)
    _paragraph_dedup(cfg, dirs, decisions)
    mix_report = apply_mix(cfg, dirs, out_dir, decisions)
    total = write_selection(cfg, dirs, decisions, out_dir)
    removed = total["removed"]
    return {
        "counts": {
            "kept": total["kept"],
            "removed": dict(sorted(removed.items())),
            "removed_total": sum(removed.values()),
            "paragraphs_removed": total["paragraphs_removed"],
            "paragraph_chars_removed": total["paragraph_chars_removed"],
            "pii": dict(total["pii"]),
            "kept_by_domain": dict(total["kept_by_domain"]),
        },
        "metrics": {
            "quality_threshold": threshold,
            "mix": mix_report,
            **({"semantic_threshold": semantic_threshold} if semantic_threshold is not None else {}),
        },
    }
