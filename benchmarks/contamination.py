"""Contamination: the hashed n-gram index against a plain Python set of n-gram strings, the exact path
alone (the rule before the fuzzy path) against exact + fuzzy, and how both scale; with --sweep, precision
and recall over `min_similarity` on HumanEval items planted with edits.

    .venv/bin/python benchmarks/contamination.py [--sizes 10000,100000,1000000] [--words 120]
                                                 [--baseline-max 100000]
    .venv/bin/python benchmarks/contamination.py --sweep

For each corpus size: documents of about `--words` words (a Zipf-like vocabulary of 50,000
words, so n-grams repeat the way text does) are indexed with 13-grams and 5-grams (the exact and
the fuzzy path's sizes, as the evaluation stage does), then 2,000 evaluation items (half copied
from the corpus with 5% of words changed, half new) are checked, by the exact path alone and by
exact + fuzzy. Printed per size and method: build docs/s, query items/s, peak RSS growth, bytes per
indexed n-gram, recall on the planted copies and false positives; then lmforge's speed and memory as
a ratio of the baseline's. The baseline keeps every n-gram as a Python string in a set (what a user
would write first; exact rule only); above `--baseline-max` documents it is not run (its memory is
extrapolated from the sizes it ran at).

--sweep: the fixture of tests/test_evaluate.py (HumanEval items inside longer documents with 0, 1,
3 and 10% of words replaced, dropped or inserted, whitespace changed; other HumanEval items and
documentation paragraphs clean), checked by the gate and by decontamination at each
`min_similarity`: recall per edit rate, precision, clean items flagged. The default is marked.
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

from evaluation.contamination import Index, build_index, check_item, check_tasks  # noqa: E402
from lmforge.text.textkeys import words  # noqa: E402
from lmforge.text.textmatch import Rule  # noqa: E402


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

    def __init__(self, docs: list[str], rule: Rule) -> None:
        self.rule = rule
        self.grams: set[str] = set()
        for doc in docs:
            tokens = words(doc)
            for n in (rule.ngram, rule.fuzzy_ngram):
                self.grams.update(" ".join(tokens[i : i + n]) for i in range(len(tokens) - n + 1))

    def contaminated(self, text: str) -> bool:
        tokens = words(text)
        n = self.rule.ngram
        grams = [" ".join(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
        return bool(grams) and sum(g in self.grams for g in grams) / len(grams) >= self.rule.min_coverage


def measure(name: str, build, query, docs: list[str], items: list[str], planted: set[int], built_as=None) -> dict:  # type: ignore[no-untyped-def]
    """`built_as`: (index, n-grams, seconds, MB) of an index built already (a second query method on it)."""
    gc.collect()
    before = rss_mb()
    started = time.perf_counter()
    index, grams = build(docs) if built_as is None else built_as[:2]
    built = time.perf_counter() - started if built_as is None else built_as[2]
    grown = max(rss_mb() - before, 0.0) if built_as is None else built_as[3]
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
        "built": (index, grams, built, grown),
    }


def lmforge_build(workdir: Path, rule: Rule):  # type: ignore[no-untyped-def]
    def build(docs: list[str]) -> tuple[Index, int]:
        out = Path(tempfile.mkdtemp(dir=workdir))
        counts = build_index(((str(i), d) for i, d in enumerate(docs)), out, rule)
        index = Index(out, rule)
        for n in index.keys:  # the query reads the mapped arrays; touch them so their pages count as resident
            np.asarray(index.keys[n]).sum(), np.asarray(index.docs[n]).sum()
        return index, counts[f"ngrams_{rule.ngram}"] + counts[f"ngrams_{rule.fuzzy_ngram}"]

    return build


SWEEP = (0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)


def sweep() -> None:
    """Precision and recall over min_similarity on the planted HumanEval fixture, gate and decontamination."""
    from data_prep.decontaminate import ItemIndex, shard_attributes
    from tests.planted_items import RATES, planted_fixture

    fixture, default = planted_fixture(), Rule()
    every = [(task, i["id"], i["text"]) for task, items in fixture.items.items() for i in items]
    print(
        "| min_similarity | check | "
        + " | ".join(f"recall {r:.0%} edits" for r in RATES)
        + " | precision | clean flagged |"
    )
    print("|---|---|" + "---|" * (len(RATES) + 2))
    with tempfile.TemporaryDirectory() as work:
        build_index(fixture.training, Path(work) / "index", default)  # thresholds apply at query time
        for value in SWEEP:
            rule = Rule(min_similarity=value)
            records = list(check_tasks(fixture.items, {"documents": Index(Path(work) / "index", rule)}, rule))
            planted = [r for r in records if fixture.is_planted(r["task"], r["doc_id"])]
            clean = [r for r in records if not fixture.is_planted(r["task"], r["doc_id"])]
            gate = [
                _share([r["contaminated"] for r in planted if fixture.planted[(r["task"], r["doc_id"])][1] == rate])
                for rate in RATES
            ]
            flagged = sum(r["contaminated"] for r in records)
            precision = sum(r["contaminated"] for r in planted) / max(flagged, 1)
            mark = " **(default)**" if value == default.min_similarity else ""
            print(
                f"| {value:g}{mark} | gate | "
                + " | ".join(f"{g:.3f}" for g in gate)
                + f" | {precision:.3f} | {sum(r['contaminated'] for r in clean)} of {len(clean)} items "
                f"({sum(r['contaminated'] for r in clean if r['task'] == 'chat')} templated chats) |"
            )
            index = ItemIndex.build(every, rule)
            hits = shard_attributes(index, [text for _, text in fixture.training])["decontaminated"]
            removed = {doc for (doc, _), hit in zip(fixture.training, hits) if hit}
            kept = [
                _share([doc in removed for doc, rate_, _ in fixture.planted.values() if rate_ == rate])
                for rate in RATES
            ]
            wrong = len({d for d in removed if not d.startswith("planted")})
            print(
                f"| {value:g}{mark} | decontamination | "
                + " | ".join(f"{k:.3f}" for k in kept)
                + f" | {1 - wrong / max(len(removed), 1):.3f} | {wrong} of {len(fixture.training) - len(fixture.planted)} "
                "documents |"
            )


def _share(flags: list[bool]) -> float:
    return sum(flags) / max(len(flags), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--words", type=int, default=120)
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--baseline-max", type=int, default=100_000)
    parser.add_argument("--sweep", action="store_true", help="precision/recall over min_similarity instead")
    args = parser.parse_args()
    if args.sweep:
        sweep()
        return
    rule = Rule()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for size in [int(s) for s in args.sizes.split(",")]:
            docs = generate(size, args.words)
            items, planted = items_from(docs, args.items)
            exact = measure(
                "lmforge, exact path alone (13-gram coverage)",
                lmforge_build(Path(work), rule),
                lambda index, item: check_item(words(item), index, fuzzy=False)["contaminated"],
                docs,
                items,
                planted,
            )
            both = measure(
                "lmforge, exact + fuzzy (same index)",
                None,
                lambda index, item: check_item(words(item), index)["contaminated"],
                docs,
                items,
                planted,
                built_as=exact["built"],
            )
            rows += [exact, both]
            if size <= args.baseline_max:
                rows.append(
                    measure(
                        "python set of n-gram strings (exact rule)",
                        lambda d: (lambda index: (index, len(index.grams)))(SetIndex(d, rule)),
                        lambda index, item: index.contaminated(item),
                        docs,
                        items,
                        planted,
                    )
                )
            for row in rows:
                row.pop("built", None)
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
        exact, mine = (r for r in rows if r["docs"] == size and r["method"].startswith("lmforge"))
        base = next((r for r in rows if r["docs"] == size and r["method"].startswith("python")), None)
        print(
            f"{size:,} docs: fuzzy path recall {mine['recall']:.3f} (exact alone {exact['recall']:.3f}), "
            f"query {mine['query_items_s']:,.0f} items/s ({exact['query_items_s'] / max(mine['query_items_s'], 1e-9):.1f}x "
            "slower than the exact path alone)"
        )
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
