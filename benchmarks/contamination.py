"""Contamination index: build and query throughput of lmforge's hashed n-gram index against a plain
Python set of n-gram strings, on the same generated documents, and how both scale.

    .venv/bin/python benchmarks/contamination.py [--sizes 10000,100000,1000000] [--words 120]
                                                 [--baseline-max 100000]

For each corpus size: documents of about `--words` words (a Zipf-like vocabulary of 50,000
words, so n-grams repeat the way text does) are indexed with 13-grams (and 8-grams for short
items, as the evaluation stage does), then 2,000 evaluation items (half copied from the corpus
with 5% of words changed, half new) are checked. Printed per size and method: build docs/s,
query items/s, peak RSS growth, bytes per indexed n-gram, and recall on the planted copies;
then lmforge's speed as a ratio of the baseline's. The baseline keeps every n-gram as a Python
string in a set (what a user would write first); above `--baseline-max` documents it is not
run (its memory is extrapolated from the sizes it ran at).
"""

from __future__ import annotations

import argparse
import gc
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evaluation.contamination import Index, Settings, build_index, check_item  # noqa: E402
from lmforge.textkeys import words  # noqa: E402


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def generate(count: int, mean_words: int, seed: int = 0) -> list[str]:
    """`count` documents over a Zipf-like vocabulary (vectorized: 10^6 documents in seconds)."""
    rng = np.random.default_rng(seed)
    vocabulary = np.array([f"w{i}" for i in range(50_000)])
    lengths = rng.integers(mean_words // 2, mean_words * 3 // 2, size=count)
    ranks = np.minimum(rng.zipf(1.2, size=int(lengths.sum())) - 1, len(vocabulary) - 1)
    tokens = vocabulary[ranks]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [" ".join(tokens[bounds[i] : bounds[i + 1]]) for i in range(count)]


def items_from(docs: list[str], count: int, seed: int = 1) -> tuple[list[str], set[int]]:
    """Evaluation items: even ones are 60-word spans of corpus documents with 5% of words changed."""
    rng = random.Random(seed)
    items, planted = [], set()
    fresh = generate(count, 60, seed=seed + 100)
    for i in range(count):
        if i % 2 == 0:
            words_ = docs[rng.randrange(len(docs))].split()
            start = rng.randrange(max(1, len(words_) - 60))
            span = words_[start : start + 60]
            for k in rng.sample(range(len(span)), max(1, len(span) // 20)):
                span[k] = "edited"
            items.append(" ".join(span))
            planted.add(i)
        else:
            items.append(fresh[i])
    return items, planted


class SetIndex:
    """The baseline: every n-gram of every document as a string in one Python set."""

    def __init__(self, docs: list[str], settings: Settings) -> None:
        self.settings = settings
        self.grams: set[str] = set()
        for doc in docs:
            tokens = words(doc)
            for n in (settings.ngram, settings.short_ngram):
                self.grams.update(" ".join(tokens[i : i + n]) for i in range(len(tokens) - n + 1))

    def contaminated(self, text: str) -> bool:
        tokens = words(text)
        n = self.settings.ngram if len(tokens) >= self.settings.ngram else self.settings.short_ngram
        grams = [" ".join(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
        return bool(grams) and sum(g in self.grams for g in grams) / len(grams) >= self.settings.min_coverage


def measure(name: str, build, query, docs: list[str], items: list[str], planted: set[int]) -> dict:  # type: ignore[no-untyped-def]
    gc.collect()
    before = rss_mb()
    started = time.perf_counter()
    index, grams = build(docs)
    built = time.perf_counter() - started
    grown = max(rss_mb() - before, 0.0)
    started = time.perf_counter()
    flags = [query(index, item) for item in items]
    queried = time.perf_counter() - started
    recall = sum(flags[i] for i in planted) / len(planted)
    false_rate = sum(f for i, f in enumerate(flags) if i not in planted) / (len(items) - len(planted))
    return {
        "method": name,
        "docs": len(docs),
        "build_docs_s": len(docs) / built,
        "query_items_s": len(items) / queried,
        "rss_growth_mb": grown,
        "ngrams": grams,
        "bytes_per_ngram": grown * 2**20 / max(grams, 1),
        "recall": recall,
        "false_positive_rate": false_rate,
        "build_s": built,
    }


def lmforge_build(workdir: Path, settings: Settings):  # type: ignore[no-untyped-def]
    def build(docs: list[str]) -> tuple[Index, int]:
        out = Path(tempfile.mkdtemp(dir=workdir))
        counts = build_index(((str(i), d) for i, d in enumerate(docs)), out, settings)
        index = Index(out, settings)
        for n in index.keys:  # the query reads the mapped arrays; touch them so their pages count as resident
            np.asarray(index.keys[n]).sum(), np.asarray(index.docs[n]).sum()
        return index, counts[f"ngrams_{settings.ngram}"] + counts[f"ngrams_{settings.short_ngram}"]

    return build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--words", type=int, default=120)
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--baseline-max", type=int, default=100_000)
    args = parser.parse_args()
    settings = Settings()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for size in [int(s) for s in args.sizes.split(",")]:
            docs = generate(size, args.words)
            items, planted = items_from(docs, args.items)
            rows.append(
                measure(
                    "lmforge (numpy, sorted hashes)",
                    lmforge_build(Path(work), settings),
                    lambda index, item: check_item(words(item), index)["contaminated"],
                    docs,
                    items,
                    planted,
                )
            )
            if size <= args.baseline_max:
                rows.append(
                    measure(
                        "python set of n-gram strings",
                        lambda d: (lambda index: (index, len(index.grams)))(SetIndex(d, settings)),
                        lambda index, item: index.contaminated(item),
                        docs,
                        items,
                        planted,
                    )
                )
            del docs
            gc.collect()
            print(
                f"{size:>9} docs done (peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)",
                file=sys.stderr,
                flush=True,
            )
    print(
        "| method | docs | build docs/s | query items/s | RSS growth MB | n-grams | bytes/n-gram | recall | false pos. |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['docs']:,} | {r['build_docs_s']:,.0f} | {r['query_items_s']:,.0f} | "
            f"{r['rss_growth_mb']:,.0f} | {r['ngrams']:,} | {r['bytes_per_ngram']:.1f} | {r['recall']:.3f} | "
            f"{r['false_positive_rate']:.3f} |"
        )
    print()
    for size in sorted({r["docs"] for r in rows}):
        mine = next(r for r in rows if r["docs"] == size and r["method"].startswith("lmforge"))
        base = next((r for r in rows if r["docs"] == size and r["method"].startswith("python")), None)
        if base:
            print(
                f"{size:,} docs: build {mine['build_docs_s'] / base['build_docs_s']:.1f}x, query "
                f"{mine['query_items_s'] / base['query_items_s']:.1f}x the baseline's speed; memory "
                f"{base['bytes_per_ngram'] / max(mine['bytes_per_ngram'], 1e-9):.1f}x less per n-gram"
            )
        else:
            print(
                f"{size:,} docs: lmforge only ({mine['rss_growth_mb']:,.0f} MB); the baseline at "
                f"{base_bytes(rows):.0f} bytes/n-gram would need ~{mine['ngrams'] * base_bytes(rows) / 2**30:.1f} GiB"
            )


def base_bytes(rows: list[dict]) -> float:
    measured = [r["bytes_per_ngram"] for r in rows if r["method"].startswith("python")]
    return max(measured) if measured else float("nan")


if __name__ == "__main__":
    main()
