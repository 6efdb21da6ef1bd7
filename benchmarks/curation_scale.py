"""Curation cost as the corpus grows: ingest -> minhash -> select on 10^4, 10^5 and 10^6 documents.

    .venv/bin/python benchmarks/curation_scale.py [--sizes 10000,100000,1000000] [--workers 2]

For each size, a corpus is generated (a few hundred words per document from a Zipf-like
vocabulary, with planted near-copies, exact copies and URL copies at known rates) and
written as 4 zstd JSONL files. Then a fresh subprocess runs the real lmforge steps
curate/ingest, curate/minhash and curate/select on it (`execute_step`, as `lmforge stage
curate --local` does, stopping after select), with language ID, the heuristic filters, the
quality classifier, PII redaction and mixing switched off, `runtime.workers` worker
processes and the default 1000 documents per shard. This process polls the resident memory
of that subprocess and its pool workers (psutil, every 0.2 s).

Printed per size and step: wall seconds (planning, units, finalize and output checksums),
documents/s, and the peak RSS summed over the main process and its workers while the step
ran; per size: the peak RSS of the main process and of the largest worker, and how many
planted near-copies selection removed per edit rate. The targets: documents/s at 10^6 within
2x of 10^4, and peak RSS growing much more slowly than the corpus.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STEPS = ("curate/ingest", "curate/minhash", "curate/select")
NUM_FILES = 4
NEAR_RATE, EXACT_RATE, URL_RATE = 0.10, 0.02, 0.01  # shares of all documents
EDIT_RATES = (0.005, 0.01, 0.02, 0.10)  # word substitutions in near-copies; 0.10 is below Jaccard 0.8
RECENT = 50_000  # copies are made of one of the last RECENT original documents (bounded memory)
OFF = [
    f"curate.{s}.enabled=false"
    for s in (
        "langid",
        "length",
        "encoding",
        "gopher_quality",
        "gopher_repetition",
        "c4",
        "fineweb",
        "quality_classifier",
        "pii",
        "mix",
    )
]


def generate(num_docs: int, out_dir: Path, seed: int = 0) -> list[Path]:
    """Write the corpus as NUM_FILES .jsonl.zst files and labels.jsonl (every planted copy)."""
    import zstandard

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = np.array(
        [
            "".join(rng.choice(letters, rng.integers(2, 11))) + ("." if rng.random() < 0.08 else "")
            for _ in range(30_000)
        ],
        dtype=object,
    )
    cdf = np.cumsum(1.0 / (np.arange(len(vocab)) + 10.0))
    cdf /= cdf[-1]

    def draw(count: int) -> np.ndarray:
        return np.minimum(np.searchsorted(cdf, rng.random(count)), len(vocab) - 1)

    recent: list[tuple[str, np.ndarray, str]] = []  # (id, word ids, url) of recent originals
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"part-{k}.jsonl.zst" for k in range(NUM_FILES)]
    files = [zstandard.ZstdCompressor(level=3).stream_writer(open(p, "wb")) for p in paths]
    per_file = -(-num_docs // NUM_FILES)
    with open(out_dir / "labels.jsonl", "w") as labels:
        for i in range(num_docs):
            doc_id, roll = f"d{i:08d}", rng.random()
            url = f"https://site{rng.integers(1000)}.example/page/{i}"
            if recent and roll < NEAR_RATE + EXACT_RATE + URL_RATE:
                base_id, words, base_url = recent[rng.integers(len(recent))]
                if roll < NEAR_RATE:
                    rate = EDIT_RATES[i % len(EDIT_RATES)]
                    words = words.copy()
                    edits = rng.random(len(words)) < rate
                    words[edits] = draw(int(edits.sum()))
                    label = {"id": doc_id, "kind": "near", "base_id": base_id, "edit_rate": rate}
                elif roll < NEAR_RATE + EXACT_RATE:
                    label = {"id": doc_id, "kind": "exact", "base_id": base_id}
                else:
                    words, url = draw(int(rng.integers(200, 401))), base_url
                    label = {"id": doc_id, "kind": "url", "base_id": base_id}
                labels.write(json.dumps(label) + "\n")
            else:
                words = draw(int(rng.integers(200, 401)))
                recent.append((doc_id, words, url))
                if len(recent) > RECENT:
                    recent.pop(rng.integers(len(recent)))
            record = {"id": doc_id, "text": " ".join(vocab[words].tolist()), "url": url, "source": "synthetic"}
            files[i // per_file].write((json.dumps(record) + "\n").encode())
    for handle in files:
        handle.close()
    return paths


def run_steps(inputs: list[str], workspace: Path, workers: int, progress: Path) -> None:
    """The measured subprocess: ingest, minhash and select, one after the other; per-step JSON lines to `progress`."""
    from lmforge.config import load_config
    from lmforge.engine.executor import execute_step, graph, make_pool, pool_unit_runner
    from lmforge.engine.store import StageStore

    overrides = [f"curate.inputs=[{','.join(inputs)}]", f"runtime.workers={workers}", *OFF]
    config = load_config("tiny-cpu", overrides, str(workspace))
    store = StageStore(config.workspace, config.runtime.verify)
    manifests: dict[str, dict] = {}
    with make_pool(config.runtime.workers) as pool, open(progress, "a") as log:
        for step in graph().active(config, ["curate"]):
            start = time.time()
            manifests[step.name], _ = execute_step(step, config, store, manifests, pool_unit_runner(pool, store))
            m = manifests[step.name]
            log.write(
                json.dumps(
                    {
                        "step": step.name,
                        "start": start,
                        "end": time.time(),
                        "dir": m["dir"],
                        "counts": m["counts"],
                        "finalize_and_units_s": m["timings"]["seconds"],
                    }
                )
                + "\n"
            )
            log.flush()
            if step.name == STEPS[-1]:
                break


def measure(num_docs: int, workdir: Path, workers: int) -> dict:
    import psutil

    corpus = workdir / "corpus"
    started = time.time()
    inputs = generate(num_docs, corpus)
    generated = time.time() - started
    progress = workdir / "progress.jsonl"
    child = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--run-steps",
            json.dumps([str(p) for p in inputs]),
            "--workspace",
            str(workdir / "ws"),
            "--workers",
            str(workers),
            "--progress",
            str(progress),
        ]
    )
    parent = psutil.Process(child.pid)
    samples: list[tuple[float, int, int, int]] = []  # (time, main rss, largest worker rss, sum)
    while child.poll() is None:
        try:
            main = parent.memory_info().rss
            workers_rss = [c.memory_info().rss for c in parent.children(recursive=True)]
        except psutil.Error:
            continue
        samples.append((time.time(), main, max(workers_rss, default=0), main + sum(workers_rss)))
        time.sleep(0.2)
    if child.returncode != 0:
        raise SystemExit(f"the measured run failed with exit code {child.returncode}")
    steps = [json.loads(line) for line in progress.read_text().splitlines()]
    for step in steps:
        during = [s[3] for s in samples if step["start"] <= s[0] <= step["end"]]
        step["peak_rss_sum"] = max(during, default=0)
    select_dir = Path(steps[-1]["dir"])
    return {
        "docs": num_docs,
        "generated_s": generated,
        "steps": steps,
        "near_found": near_copies_found(corpus, select_dir),
        "peak_main": max((s[1] for s in samples), default=0),
        "peak_worker": max((s[2] for s in samples), default=0),
        "peak_sum": max((s[3] for s in samples), default=0),
    }


def near_copies_found(corpus: Path, select_dir: Path) -> dict[float, tuple[int, int]]:
    """Per edit rate: (planted near-copies of which selection removed the copy or its original as a
    duplicate, planted). Exact dedup counts too: a copy whose edits happened to change nothing is exact."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    removed = ds.dataset(select_dir / "removed", format="parquet").to_table(columns=["id", "reason"])
    near = set(removed.filter(pc.is_in(removed["reason"], pa.array(["near_dedup", "exact_dedup"])))["id"].to_pylist())
    found: dict[float, list[int]] = {rate: [0, 0] for rate in EDIT_RATES}
    for line in (corpus / "labels.jsonl").read_text().splitlines():
        label = json.loads(line)
        if label["kind"] == "near":
            found[label["edit_rate"]][1] += 1
            found[label["edit_rate"]][0] += label["id"] in near or label["base_id"] in near
    return {rate: (hit, total) for rate, (hit, total) in found.items()}


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.0f} MiB"


def report(result: dict) -> None:
    n = result["docs"]
    print(f"\n== {n:,} documents (corpus generated in {result['generated_s']:.0f}s, not counted)")
    print(f"  {'step':16} {'wall s':>8} {'docs/s':>9} {'peak RSS, main + workers':>25}")
    total = 0.0
    for step in result["steps"]:
        seconds = step["end"] - step["start"]
        total += seconds
        print(f"  {step['step']:16} {seconds:8.1f} {n / seconds:9.0f} {mib(step['peak_rss_sum']):>25}")
    print(f"  {'total':16} {total:8.1f} {n / total:9.0f} {mib(result['peak_sum']):>25}")
    print(f"  peak RSS: main process {mib(result['peak_main'])}, largest worker {mib(result['peak_worker'])}")
    select = result["steps"][-1]["counts"]
    print(f"  select: kept {select['kept']:,}, removed {select['removed']}")
    found = ", ".join(f"edit rate {rate}: {hit}/{total}" for rate, (hit, total) in result["near_found"].items())
    print(f"  planted near-copies deduplicated (copy or original removed as near/exact duplicate): {found}")


def summary(results: list[dict]) -> None:
    if len(results) < 2:
        return
    small, large = results[0], results[-1]
    print(f"\n== {large['docs']:,} vs {small['docs']:,} documents ({large['docs'] // small['docs']}x the corpus)")
    for a, b in zip(small["steps"], large["steps"]):
        rate_small = small["docs"] / (a["end"] - a["start"])
        rate_large = large["docs"] / (b["end"] - b["start"])
        print(
            f"  {a['step']:16} docs/s {rate_large:8.0f} vs {rate_small:8.0f}: {rate_small / rate_large:.2f}x slower "
            f"per document (target <= 2x); peak RSS {large['peak_sum'] / small['peak_sum']:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000,1000000", help="comma-separated corpus sizes")
    parser.add_argument("--workers", type=int, default=2, help="runtime.workers (worker processes for shard units)")
    parser.add_argument("--workdir", help="where corpora and workspaces go (default: a temporary folder, removed)")
    parser.add_argument("--run-steps", help=argparse.SUPPRESS)
    parser.add_argument("--workspace", help=argparse.SUPPRESS)
    parser.add_argument("--progress", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_steps:
        run_steps(json.loads(args.run_steps), Path(args.workspace), args.workers, Path(args.progress))
        return
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="lmforge-scale-"))
    results = []
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            workdir = root / f"n{size}"
            shutil.rmtree(workdir, ignore_errors=True)
            results.append(measure(size, workdir, args.workers))
            report(results[-1])
            shutil.rmtree(workdir, ignore_errors=True)  # a 10^6 corpus and its outputs are several GB
        summary(results)
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
