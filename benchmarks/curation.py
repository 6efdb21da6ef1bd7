"""Curation throughput per step, MinHash and heuristic filters against their peers, near-dup accuracy.

    bash scripts/setup_peers.sh                     # once: datasketch, rensa, datatrove in .venv-peers
    .venv/bin/python benchmarks/curation.py [--docs 3000] [--skip-pipeline] [--skip-peers]

The end-to-end part also runs the demo curation as a Prefect flow with the process pool and with
`runtime.task_runner=dask` (a local 2-worker cluster), and prints the cluster runner's overhead.

1. Documents/s per step on N documents of the demo corpus, one process (= per core).
2. MinHash signatures + LSH done the naive way (`datasketch.MinHash.update` per shingle,
   `datasketch.MinHashLSH`) side by side with lmforge's vectorized path, as a ratio.
3. MinHash signatures alone (112 permutations, seed 1, word 5-grams of the same normalized
   words) from lmforge and from the fastest way a user would call each peer: datasketch's
   per-shingle loop, `update_batch` and `MinHash.bulk`; rensa's `RMinHash.update` and its
   batch `digest_matrix_from_token_sets`; datatrove 0.10.1's `MinhashDedupSignature`
   (its own normalization and spaCy words, then its signature function) and its signature
   function on the same shingles. Peers run in a subprocess with `.venv-peers/bin/python`,
   one thread, best of 3; each measurement includes building the shingles from the text.
4. Heuristic statistics (`heuristics.compute_stats` + the four rule families) beside
   datatrove's GopherQuality, GopherRepetition, C4Quality and FineWebQuality filters on the
   demo corpus: documents/s and how often the keep/remove decisions agree per family.
5. Precision/recall of near-duplicate detection on a generated labelled set whose true
   Jaccard (same 5-gram shingles) is known, at true Jaccard >= 0.8.
6. The demo corpus curated end to end on this machine (2 workers), then re-selected after
   a threshold change.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Only numpy and the standard library above this line: the peer measurements import this file
# in .venv-peers, which has no pyarrow, pydantic or prefect.
from data_prep.textnorm import dedup_words, jaccard, shingle_set  # noqa: E402

PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
ONE_THREAD = {"RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def demo_corpus_texts(workdir: Path) -> list[str]:
    """Every ingested demo document once, without the two planted 700 KB giants (they would dominate timings)."""
    from data_prep.config import CurateConfig, DemoCorpusConfig
    from data_prep.ingest import ingest_file
    from data_prep.records import read_columns, shard_path
    from data_prep.sources.demo import build_demo_corpus

    build_demo_corpus(DemoCorpusConfig(), workdir)
    _, result = ingest_file(str(workdir / "demo.jsonl"), 0, CurateConfig(docs_per_shard=10**6), workdir / "ingest")
    texts = read_columns(shard_path(workdir / "ingest", result["shards"][0]["name"]), ["text"])["text"]
    return [t for t in texts if len(t) < 200_000]


def demo_texts(n: int, workdir: Path) -> list[str]:
    texts = demo_corpus_texts(workdir)
    return (texts * (n // len(texts) + 1))[:n]


REPEATS = 3  # per-step throughput: best of 3


def rate(fn: Callable[[], object], count: int, repeats: int = 1) -> tuple[float, float]:
    """Items/s of the fastest of `repeats` runs (timeit's convention: other load only slows a run down)."""
    seconds = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds = min(seconds, time.perf_counter() - start)
    return count / seconds, seconds


def naive_minhash_lsh(texts: list[str], bands: int = 14, rows: int = 8) -> int:
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(num_perm=bands * rows, params=(bands, rows))
    candidates = 0
    for i, text in enumerate(texts):
        words = dedup_words(text)
        signature = MinHash(num_perm=bands * rows, scheme="affine64")  # 64-bit, as lmforge (sha1_hash64 per shingle)
        for j in range(max(len(words) - 4, 1)):
            signature.update(" ".join(words[j : j + 5]).encode())
        candidates += len(lsh.query(signature))
        lsh.insert(str(i), signature)
    return candidates


def lmforge_minhash_lsh(texts: list[str]) -> int:
    from data_prep.minhash import MinHasher, band_keys, candidate_pairs

    hasher = MinHasher()
    signatures = np.concatenate([hasher.signatures(texts[i : i + 512]) for i in range(0, len(texts), 512)])
    return len(candidate_pairs(band_keys(signatures, 14, 8)))


# -- MinHash and heuristics beside their peers ------------------------------------------------
# Peer functions run in .venv-peers (`--peer-worker`); each returns what it measured as JSON.


def word_shingles(text: str, n: int = 5) -> list[bytes]:
    """The same shingles lmforge hashes: n-grams of its normalized words (all words if fewer than n)."""
    from data_prep.minhash import dedup_word_bytes

    words = dedup_word_bytes(text)
    return [b" ".join(words[j : j + n]) for j in range(max(len(words) - n + 1, 1))] if words else []


def peer_minhash_rates(texts: list[str]) -> list[tuple[str, float]]:
    from datasketch import MinHash
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
    from rensa import RMinHash

    def datasketch_loop() -> None:
        for text in texts:
            signature = MinHash(num_perm=112, seed=1, scheme="affine64")
            for shingle in word_shingles(text):
                signature.update(shingle)

    def datasketch_update_batch() -> None:
        for text in texts:
            MinHash(num_perm=112, seed=1, scheme="affine64").update_batch(word_shingles(text))

    def datasketch_bulk() -> None:
        MinHash.bulk((word_shingles(t) for t in texts), num_perm=112, seed=1, scheme="affine64")

    def rensa_update() -> None:
        for text in texts:
            signature = RMinHash(112, 1)
            signature.update(word_shingles(text))
            signature.digest()

    def rensa_matrix() -> None:
        RMinHash.digest_matrix_from_token_sets([word_shingles(t) for t in texts], 112, 1)

    datatrove = MinhashDedupSignature(output_folder=tempfile.mkdtemp(), config=MinhashConfig())

    def datatrove_own() -> None:  # what its MinhashDedupSignature.run does per document, minus the file writes
        for text in texts:
            shingles = datatrove.get_shingles(text)
            if shingles.size:
                datatrove.get_signature(shingles)

    def datatrove_same_shingles() -> None:
        hash_shingle = datatrove._hash_func
        for text in texts:
            keys = np.fromiter((hash_shingle(s.decode()) for s in word_shingles(text)), dtype=np.uint64).reshape(-1, 1)
            if keys.size:
                datatrove.get_signature(keys)

    runs = [
        ("datasketch MinHash.update per shingle (affine64)", datasketch_loop),
        ("datasketch MinHash.update_batch per doc (affine64)", datasketch_update_batch),
        ("datasketch MinHash.bulk (affine64)", datasketch_bulk),
        ("rensa RMinHash.update per doc", rensa_update),
        ("rensa RMinHash.digest_matrix_from_token_sets", rensa_matrix),
        ("datatrove MinhashDedupSignature (own words)", datatrove_own),
        ("datatrove signature, same shingles (xxhash64)", datatrove_same_shingles),
    ]
    return [(name, rate(fn, len(texts), REPEATS)[0]) for name, fn in runs]


def peer_filter_results(texts: list[str], timed: list[str]) -> dict[str, Any]:
    """datatrove's four quality filters, configured as lmforge's defaults (FineWeb's settings):
    the decision and datatrove's reason per document and family on `texts`, speed on `timed`."""
    from datatrove.data import Document
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )
    from datatrove.utils.text import split_into_parts
    from loguru import logger

    logger.remove()
    filters = {
        "gopher_quality": GopherQualityFilter(),
        "gopher_repetition": GopherRepetitionFilter(),
        "c4": C4QualityFilter(filter_no_terminal_punct=False),
        "fineweb": FineWebQualityFilter(),
    }
    fineweb_order = ["gopher_repetition", "gopher_quality", "c4", "fineweb"]  # FineWeb's pipeline order

    def removal_reason(family: str, text: str) -> str | None:
        outcome = filters[family].filter(Document(text=text, id="0"))  # a fresh document: C4 rewrites its text
        kept, reason = outcome if isinstance(outcome, tuple) else (outcome, "")
        return None if kept else reason or "removed"

    def every_filter(docs: list[str]) -> dict[str, list[str | None]]:
        return {family: [removal_reason(family, t) for t in docs] for family in filters}

    def pipeline() -> None:  # as a datatrove pipeline runs them: each document stops at its first removal
        for text in timed:
            doc = Document(text=text, id="0")
            for family in fineweb_order:
                outcome = filters[family].filter(doc)  # C4 rewrites doc.text, as in a pipeline
                if not (outcome[0] if isinstance(outcome, tuple) else outcome):
                    break

    def alone(family: str) -> None:  # without the words the previous filter left in split_into_parts' cache
        for text in timed:
            split_into_parts.cache_clear()
            removal_reason(family, text)

    return {
        "removed": every_filter(texts),
        "all_filters_docs_per_s": rate(lambda: every_filter(timed), len(timed), REPEATS)[0],
        "pipeline_docs_per_s": rate(pipeline, len(timed), REPEATS)[0],
        "per_filter_docs_per_s": {family: rate(lambda f=family: alone(f), len(timed))[0] for family in filters},
    }


def run_peer(kind: str, texts: Any, workdir: Path) -> Any:
    """A peer measurement in .venv-peers (None, with one line saying why, when it cannot run)."""
    if not PEERS_PYTHON.exists():
        print(f"  (skipped: {PEERS_PYTHON.relative_to(ROOT)} not found; create it with bash scripts/setup_peers.sh)")
        return None
    path = workdir / f"peer-{kind}.json"
    path.write_text(json.dumps(texts))
    done = subprocess.run(
        [str(PEERS_PYTHON), __file__, "--peer-worker", kind, "--texts", str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, **ONE_THREAD},
    )
    if done.returncode != 0:
        print(
            f"  (peer run failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode})"
        )
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def lmforge_signature_rate(texts: list[str]) -> float:
    from data_prep.minhash import MinHasher

    hasher = MinHasher()
    return rate(
        lambda: [hasher.signatures(texts[i : i + 512]) for i in range(0, len(texts), 512)], len(texts), REPEATS
    )[0]


def print_minhash_peers(texts: list[str], workdir: Path) -> None:
    print(
        f"\n== MinHash signatures only (112 perms, seed 1, word 5-grams of the same normalized words), "
        f"{len(texts)} documents, 1 process, 1 thread, best of {REPEATS}"
    )
    ours = lmforge_signature_rate(texts)
    print(f"  {'implementation':52} {'docs/s':>9}  {'lmforge / it':>12}")
    print(f"  {'lmforge MinHasher.signatures (numpy, batches of 512)':52} {ours:9.0f}  {1.0:11.2f}x")
    for name, docs_per_s in run_peer("minhash", texts, workdir) or []:
        print(f"  {name:52} {docs_per_s:9.0f}  {ours / docs_per_s:11.2f}x")


def lmforge_filter_results(texts: list[str], timed: list[str]) -> dict[str, Any]:
    from data_prep import heuristics
    from data_prep.config import CurateConfig

    cfg, params = CurateConfig(), heuristics.StatParams()
    from data_prep.filters import filters

    checks = {
        name: (getattr(cfg, name), family.failures)
        for name, family in filters().items()
        if name in ("gopher_quality", "gopher_repetition", "c4", "fineweb")
    }

    def failures(docs: list[str]) -> dict[str, list[list[str]]]:
        stats = [heuristics.compute_stats(t, params) for t in docs]
        return {family: [check(s, rule_cfg) for s in stats] for family, (rule_cfg, check) in checks.items()}

    return {
        "failed": failures(texts),
        "docs_per_s": rate(lambda: failures(timed), len(timed), REPEATS)[0],
        "stats_docs_per_s": rate(lambda: [heuristics.compute_stats(t, params) for t in timed], len(timed), REPEATS)[0],
    }


def print_filter_peers(texts: list[str], workdir: Path, timed_every: int = 4) -> None:
    """Decisions on every document; speed on every `timed_every`-th one (datatrove needs minutes for all)."""
    from collections import Counter

    timed = texts[::timed_every]
    print(
        f"\n== heuristic filters: Gopher quality + repetition, C4, FineWeb with lmforge's default thresholds (= datatrove's;"
        f" C4 filter_no_terminal_punct=False, as FineWeb)\n   decisions on all {len(texts)} demo documents, speed on "
        f"{len(timed)} of them, 1 process, best of {REPEATS}"
    )
    ours = lmforge_filter_results(texts, timed)
    print(
        f"  lmforge compute_stats + the 4 rule families            {ours['docs_per_s']:7.0f} docs/s "
        f"(compute_stats alone {ours['stats_docs_per_s']:.0f})"
    )
    peer = run_peer("filters", {"texts": texts, "timed": timed}, workdir)
    if peer is None:
        return
    print(
        f"  datatrove, the 4 filters on every document             {peer['all_filters_docs_per_s']:7.0f} docs/s  "
        f"(lmforge / datatrove: {ours['docs_per_s'] / peer['all_filters_docs_per_s']:.1f}x)"
    )
    print(
        f"  datatrove, as a pipeline (a document stops at its first removal) {peer['pipeline_docs_per_s']:7.0f} docs/s"
    )
    print(
        f"  {'family':18} {'datatrove alone':>16} {'agree':>7} {'both remove':>11} {'only lmforge':>12} "
        f"{'only datatrove':>14} {'both keep':>9}"
    )
    disagreements = []
    for family, failed in ours["failed"].items():
        theirs = peer["removed"][family]
        ours_only = Counter(f for a, b in zip(failed, theirs) if a and b is None for f in a)
        theirs_only = Counter(b for a, b in zip(failed, theirs) if not a and b is not None)
        both_remove = sum(bool(a) and b is not None for a, b in zip(failed, theirs))
        only_ours, only_theirs = sum(bool(a) and b is None for a, b in zip(failed, theirs)), sum(theirs_only.values())
        both_keep = len(texts) - both_remove - only_ours - only_theirs
        print(
            f"  {family:18} {peer['per_filter_docs_per_s'][family]:16.0f} "
            f"{(both_remove + both_keep) / len(texts):7.1%} {both_remove:11d} {only_ours:12d} {only_theirs:14d} {both_keep:9d}"
        )
        disagreements.append((family, ours_only, theirs_only))
    print("  why they disagree (rules lmforge failed where datatrove kept; datatrove's reason where lmforge kept):")
    for family, ours_only, theirs_only in disagreements:
        if ours_only or theirs_only:
            print(
                f"    {family}: lmforge only {dict(ours_only.most_common(4))}; datatrove only {dict(theirs_only.most_common(4))}"
            )


def peer_worker(kind: str, texts_path: str) -> None:
    texts = json.loads(Path(texts_path).read_text())
    result = peer_minhash_rates(texts) if kind == "minhash" else peer_filter_results(texts["texts"], texts["timed"])
    print(json.dumps(result))


def distinct(texts: list[str], max_jaccard: float = 0.3) -> list[str]:
    """Drop texts similar to an earlier one, so the only near-duplicates are the planted ones."""
    from data_prep.minhash import MinHasher, exact_jaccard

    hasher, kept, sets = MinHasher(), [], []
    for text in texts:
        shingles = hasher.shingles(text)
        if all(exact_jaccard(shingles, other) < max_jaccard for other in sets):
            kept.append(text)
            sets.append(shingles)
    return kept


def labelled_pairs(bases: list[str], seed: int = 0) -> tuple[list[str], dict[tuple[int, int], float]]:
    """Each base document and a copy with word edits at a random rate; true Jaccard of the pair.

    Bases are mutually dissimilar (Jaccard < 0.3), so every pair not labelled is a true negative.
    """
    rng = random.Random(seed)
    texts: list[str] = []
    truth: dict[tuple[int, int], float] = {}
    for base in bases:
        words = base.split()
        rate = rng.choice([0.005, 0.01, 0.02, 0.03, 0.05, 0.08, 0.12, 0.2])
        edited = []
        for word in words:
            roll = rng.random()
            if roll < rate / 3:
                continue  # deletion
            edited.append(rng.choice(words) if roll < 2 * rate / 3 else word)  # substitution
            if roll > 1 - rate / 3:
                edited.append(rng.choice(words))  # insertion
        copy = " ".join(edited)
        texts += [base, copy]
        truth[(len(texts) - 2, len(texts) - 1)] = jaccard(shingle_set(base, 5), shingle_set(copy, 5))
    return texts, truth


def near_dup_accuracy(texts: list[str], truth: dict[tuple[int, int], float], threshold: float = 0.8) -> dict:
    from data_prep.minhash import MinHasher, band_keys, candidate_pairs, estimated_jaccard, exact_jaccard

    hasher = MinHasher()
    signatures = hasher.signatures(texts)
    pairs = [tuple(map(int, p)) for p in candidate_pairs(band_keys(signatures, 14, 8))]
    shingles = [hasher.shingles(t) for t in texts]
    verified = {p for p in pairs if exact_jaccard(shingles[p[0]], shingles[p[1]]) >= threshold}
    estimated = {p for p in pairs if estimated_jaccard(signatures[p[0]], signatures[p[1]]) >= threshold}
    positives = {p for p, j in truth.items() if j >= threshold}

    def score(found: set) -> tuple[float, float]:
        hits = len(found & positives)
        return hits / max(len(found), 1), hits / max(len(positives), 1)

    return {
        "positives": len(positives),
        "pairs": len(truth),
        "lsh_candidates": len(pairs),
        "verified": score(verified),
        "signature_estimate": score(estimated),
        "lsh_only": score(set(pairs)),
    }


def per_step_rates(texts: list[str], workdir: Path) -> list[tuple[str, float]]:
    from data_prep import heuristics, paragraphs, split
    from data_prep.config import CurateConfig, PIIConfig, QualityClassifierConfig
    from data_prep.langid import LanguageIdentifier
    from data_prep.minhash import MinHasher
    from data_prep.pii import redact
    from data_prep.quality import QualityScorer, builtin_reference, train_classifier
    from data_prep.textnorm import normalize_document

    n = len(texts)
    hasher, params = MinHasher(), heuristics.StatParams()
    lid = LanguageIdentifier()
    train_classifier(builtin_reference()[:500], texts[:500], QualityClassifierConfig(epochs=3), workdir / "q.bin")
    scorer = QualityScorer(workdir / "q.bin")
    from data_prep.ingest import ingest_file
    from data_prep.tokenizer import load_tokenizer, train_bpe

    jsonl = workdir / "bench.jsonl"
    jsonl.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(texts)))
    runs = iter(range(REPEATS))
    train_bpe(texts[:500], 4096, 2, workdir / "tokenizer")
    tokenizer = load_tokenizer(workdir / "tokenizer")
    rows = [
        (
            "ingest (parse, validate, normalize, hash, Parquet)",
            rate(
                lambda: ingest_file(
                    str(jsonl), 0, CurateConfig(docs_per_shard=10**6), workdir / f"ingest-{next(runs)}"
                ),
                n,
                REPEATS,
            )[0],
        ),
        ("normalize (NFC, controls, whitespace)", rate(lambda: [normalize_document(t) for t in texts], n, REPEATS)[0]),
        (
            "minhash signatures (vectorized)",
            rate(lambda: [hasher.signatures(texts[i : i + 512]) for i in range(0, n, 512)], n, REPEATS)[0],
        ),
        ("paragraph hashes (paragraph dedup)", rate(lambda: paragraphs.shard_columns(texts), n, REPEATS)[0]),
        ("word 8-gram keys (held-out split)", rate(lambda: split.shard_keys(texts, 8), n, REPEATS)[0]),
        ("language ID (fastText lid.176)", rate(lambda: lid.predict(texts), n, REPEATS)[0]),
        (
            "heuristic stats (Gopher/C4/FineWeb)",
            rate(lambda: [heuristics.compute_stats(t, params) for t in texts], n, REPEATS)[0],
        ),
        ("quality classifier (fastText)", rate(lambda: scorer.score(texts), n, REPEATS)[0]),
        ("PII redaction", rate(lambda: [redact(t, PIIConfig()) for t in texts], n, REPEATS)[0]),
        (
            "tokenize (byte-level BPE, 4096 vocab; Rust threads)",
            rate(lambda: tokenizer.encode_batch(texts), n, REPEATS)[0],
        ),
    ]
    return rows


def pipeline_timings(workdir: Path) -> tuple[float, float, dict]:
    from lmforge.config import load_config
    from lmforge.engine.executor import run_pipeline_locally

    workspace = workdir / "ws"
    start = time.perf_counter()
    manifests = run_pipeline_locally(load_config("tiny-cpu", [], str(workspace)), ["curate"])
    full = time.perf_counter() - start
    start = time.perf_counter()
    changed = load_config(
        "tiny-cpu", ["curate.near_dedup.threshold=0.7", "curate.langid.min_score=0.5"], str(workspace)
    )
    from lmforge.engine.executor import execute_step, graph, make_pool, pool_unit_runner
    from lmforge.engine.store import StageStore

    store = StageStore(workspace)
    upstream = {n: m for n, m in manifests.items() if n != "curate/select"}
    with make_pool(1) as pool:  # units in this process: no worker start-up in the figure
        select, _ = execute_step(graph().get("curate/select"), changed, store, upstream, pool_unit_runner(pool, store))
    reselect = time.perf_counter() - start
    return full, reselect, select["counts"]


def runner_timings(workdir: Path) -> dict[str, float]:
    """The demo curation as a Prefect flow, once with the process pool and once on a local 2-worker Dask
    cluster (prefect-dask), each from an empty workspace, against a temporary Prefect API."""
    from prefect.testing.utilities import prefect_test_harness

    from flows.pipeline import pipeline

    seconds = {}
    with prefect_test_harness(server_startup_timeout=120):
        for runner in ("process", "dask"):
            start = time.perf_counter()
            pipeline(
                preset="tiny-cpu",
                overrides=[f"runtime.task_runner={runner}", "runtime.workers=2"],
                workspace=str(workdir / f"ws-{runner}"),
                stages=["curate"],
            )
            seconds[runner] = time.perf_counter() - start
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=3000, help="documents for the per-step and MinHash runs")
    parser.add_argument("--naive-docs", type=int, default=600, help="documents for the (slow) naive datasketch run")
    parser.add_argument("--skip-pipeline", action="store_true", help="skip the end-to-end demo curation timing")
    parser.add_argument("--skip-peers", action="store_true", help="skip the comparisons run in .venv-peers")
    parser.add_argument("--peer-worker", choices=["minhash", "filters"], help=argparse.SUPPRESS)
    parser.add_argument("--texts", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer_worker:
        peer_worker(args.peer_worker, args.texts)
        return
    workdir = Path(tempfile.mkdtemp(prefix="lmforge-bench-"))
    try:
        texts = demo_texts(args.docs, workdir / "demo")
        chars = sum(map(len, texts)) / len(texts)
        print(
            f"== per-step throughput, 1 process, best of {REPEATS}, {len(texts)} demo documents (mean {chars:.0f} chars)"
        )
        for name, docs_per_s in per_step_rates(texts, workdir):
            print(f"  {name:48} {docs_per_s:10.0f} docs/s")

        sample = texts[: args.naive_docs]
        # best of 3 for both, as for the per-step figures: the first call of either pays one-off warm-up
        naive, naive_s = rate(lambda: naive_minhash_lsh(sample), len(sample), REPEATS)
        ours, ours_s = rate(lambda: lmforge_minhash_lsh(sample), len(sample), REPEATS)
        print(
            f"\n== MinHash signatures + LSH (112 perms = 14 bands x 8 rows, word 5-grams), {len(sample)} documents, "
            f"1 process, best of {REPEATS}"
        )
        print(f"  datasketch naive (MinHash.update per shingle + MinHashLSH) {naive:10.0f} docs/s  ({naive_s:.2f}s)")
        print(f"  lmforge vectorized (numpy batch + sorted band keys)        {ours:10.0f} docs/s  ({ours_s:.2f}s)")
        print(f"  ratio: {ours / naive:.1f}x  (target >= 5x)")
        if not args.skip_peers:
            print_minhash_peers(sample, workdir)
            print_filter_peers(demo_corpus_texts(workdir / "demo-all"), workdir)

        from data_prep.quality import builtin_reference

        bases = distinct([t for t in builtin_reference(1500) if len(t.split()) >= 150])
        labelled, truth = labelled_pairs(bases)
        acc = near_dup_accuracy(labelled, truth)
        print(
            f"\n== near-duplicate detection, {acc['pairs']} labelled pairs ({acc['positives']} with true Jaccard >= 0.8), "
            f"{acc['lsh_candidates']} LSH candidate pairs"
        )
        for name in ("verified", "signature_estimate", "lsh_only"):
            precision, recall = acc[name]
            print(f"  {name:20} precision {precision:.3f}  recall {recall:.3f}")
        print("  targets: precision >= 0.95, recall >= 0.90 (lmforge uses 'verified')")
        print(
            "  verified = LSH candidates kept when the exact Jaccard of their shingle sets passes the threshold, so its\n"
            "  precision is 1 by construction and recall is what banding finds; signature_estimate is MinHash alone"
        )

        if not args.skip_pipeline:
            full, reselect, counts = pipeline_timings(workdir)
            print(
                f"\n== demo corpus end to end (runtime.workers=2): {full:.1f}s  (target < 120s); "
                f"kept {counts['kept']} of {counts['input']}"
            )
            print(
                f"   threshold change (near_dedup.threshold, langid.min_score) re-select: {reselect:.1f}s  (target < 10s)"
            )
            runners = runner_timings(workdir)
            print(
                f"\n== demo curation as a Prefect flow (2 workers): process pool {runners['process']:.1f}s, "
                f"local Dask cluster {runners['dask']:.1f}s  (Dask overhead {runners['dask'] / runners['process']:.2f}x)"
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
