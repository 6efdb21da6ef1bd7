"""The toxicity filter (data_prep/filters/toxicity.py) on the demo corpus with 40 offensive documents
planted in it: recall, precision and the demo corpus' false-positive rate over max_score, and its
throughput beside the shared heuristics pass's on the same documents.

    .venv/bin/python benchmarks/toxicity.py [--thresholds 0.5,0.7,0.8,0.9,0.95] [--shard 1000]
    .venv/bin/python benchmarks/toxicity.py --scaling [--sizes 1,2,4,8] [--baseline-max-mb 8]

The demo corpus is generated with its default settings (every valid line; its documents are all
clean of offensive language); the planted set is tests/toxic_planted.py: 30 short offensive posts
and 10 long demo documents with one offensive paragraph planted inside. Printed per threshold:
recall on the planted set, precision (planted among removed) and the share of demo documents
removed (the default marked); then documents/s of the filter (its shard-at-once scoring, in
shards of --shard documents as curate/heuristics runs them, one process) beside documents/s of
the shared heuristics pass (`heuristics.compute_stats`, every other family's statistics), as a
ratio: the cost of the filter relative to the step it runs in. The classifier's one-time load
per process is printed apart.

--scaling times the windows alone (`windows`, the text cut for scoring, no classifier) on one
paragraph of 1, 2, 4 and 8 MB (words and spaces, no blank line) beside the previous algorithm's
(before issue 52: the rest of the paragraph re-sliced at every cut, quadratic), as a ratio, and
checks that both give the same windows; each figure is the least of --repeat runs (the previous
algorithm's once above 2 MB), and the growth column is the time relative to the size before
(linear: 2x a doubling, quadratic 4x). Sizes above --baseline-max-mb are timed without the
previous algorithm (100 MB took it minutes).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from data_prep.config import CurateConfig, DemoCorpusConfig  # noqa: E402
from data_prep.filters.toxicity import Toxicity, ToxicityConfig, _profanity_check, windows  # noqa: E402
from data_prep.heuristics import compute_stats  # noqa: E402
from data_prep.sources.demo import build_demo_corpus  # noqa: E402
from tests.test_toxicity_windows import one_paragraph, reference_windows  # noqa: E402
from tests.toxic_planted import planted_documents  # noqa: E402


def demo_documents() -> list[dict]:
    """The default demo corpus' valid records as {"id", "text", "domain", "kind"}."""
    with tempfile.TemporaryDirectory() as scratch:
        build_demo_corpus(DemoCorpusConfig(), Path(scratch))
        docs = []
        for line in (Path(scratch) / "demo.jsonl").read_bytes().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("text"), str) and record["text"]:
                meta = record.get("meta") or {}
                docs.append(
                    {"id": record["id"], "text": record["text"], **{k: meta.get(k) for k in ("domain", "kind")}}
                )
    return docs


def _best(function: Callable[[str], list[str]], text: str, repeat: int) -> tuple[float, list[str]]:
    best, out = float("inf"), []
    for _ in range(repeat):
        start = time.perf_counter()
        out = function(text)
        best = min(best, time.perf_counter() - start)
    return best, out


def scaling(sizes: list[float], baseline_max_mb: float, repeat: int) -> None:
    """Window-splitting time on one paragraph of each size, beside the previous algorithm's."""
    print("windows of one paragraph (min 200, max 1000 characters), seconds; previous: before issue 52")
    print("\n| size | windows | previous s | growth | now s | growth | previous/now |")
    print("|---|---|---|---|---|---|---|")
    last: tuple[float | None, float] | None = None
    for mb in sizes:
        text = one_paragraph(int(mb * 1_000_000))
        now_s, now = _best(windows, text, repeat)
        old_s: float | None = None
        if mb <= baseline_max_mb:
            old_s, old = _best(reference_windows, text, repeat if mb <= 2 else 1)
            assert old == now, f"{mb} MB: the windows differ from the previous algorithm's"
        old_growth = f"{old_s / last[0]:.1f}x" if last and last[0] and old_s is not None else ""
        now_growth = f"{now_s / last[1]:.1f}x" if last else ""
        old_cell, ratio = (f"{old_s:.4f}", f"{old_s / now_s:.1f}x") if old_s is not None else ("not run", "")
        print(f"| {mb:g} MB | {len(now)} | {old_cell} | {old_growth} | {now_s:.4f} | {now_growth} | {ratio} |")
        last = (old_s, now_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--thresholds", default="0.5,0.7,0.8,0.85,0.9,0.95")
    parser.add_argument("--shard", type=int, default=1000, help="documents per scoring call (curate.docs_per_shard)")
    parser.add_argument("--scaling", action="store_true", help="time the windows alone on one long paragraph")
    parser.add_argument("--sizes", default="1,2,4,8", help="--scaling: the paragraph's sizes, MB")
    parser.add_argument("--baseline-max-mb", type=float, default=8, help="--scaling: previous algorithm up to this")
    parser.add_argument("--repeat", type=int, default=5, help="--scaling: runs per figure, the least kept")
    args = parser.parse_args()
    if args.scaling:
        scaling([float(s) for s in args.sizes.split(",")], args.baseline_max_mb, args.repeat)
        return
    cfg: ToxicityConfig = CurateConfig().toxicity  # type: ignore[attr-defined]
    demo = demo_documents()
    planted = planted_documents([d for d in demo if d["kind"] == "clean"])
    docs = demo + planted
    texts = [d["text"] for d in docs]
    print(f"{len(demo)} demo documents + {len(planted)} planted, {sum(map(len, texts)) / 1e6:.1f} M characters")

    start = time.perf_counter()
    _profanity_check()
    print(f"classifier load (once per process): {time.perf_counter() - start:.2f} s")

    toxicity = Toxicity()
    start = time.perf_counter()
    scores = []
    for i in range(0, len(texts), args.shard):
        scores += [s["toxicity_score"] for s in toxicity.stats_batch(texts[i : i + args.shard], cfg)]
    filter_s = time.perf_counter() - start
    start = time.perf_counter()
    for text in texts:
        compute_stats(text)
    heuristics_s = time.perf_counter() - start

    demo_scores, planted_scores = scores[: len(demo)], scores[len(demo) :]
    print(f"\n| max_score | recall (of {len(planted)}) | precision | demo docs removed (FP rate) |")
    print("|---|---|---|---|")
    for threshold in sorted({*map(float, args.thresholds.split(",")), float(cfg.max_score or 1.0)}):
        found = sum(s > threshold for s in planted_scores)
        false = sum(s > threshold for s in demo_scores)
        precision = found / (found + false) if found + false else 1.0
        mark = " (default)" if threshold == cfg.max_score else ""
        print(
            f"| {threshold}{mark} | {found / len(planted):.3f} ({found}) | {precision:.3f} | "
            f"{false} ({false / len(demo):.2%}) |"
        )
    top = sorted(zip(demo_scores, demo), key=lambda p: -p[0])[:3]
    print("highest demo documents:", ", ".join(f"{d['id']} ({d['domain']}) {s:.3f}" for s, d in top))
    missed = [(d["id"], round(s, 3)) for s, d in zip(planted_scores, planted) if s <= (cfg.max_score or 1.0)]
    print("planted documents kept at the default:", missed)

    filter_rate, heuristics_rate = len(texts) / filter_s, len(texts) / heuristics_s
    print(
        f"\ntoxicity filter: {filter_rate:,.0f} docs/s; shared heuristics pass: {heuristics_rate:,.0f} docs/s; "
        f"the filter adds {filter_s / heuristics_s:.1%} to the heuristics step's time "
        f"(throughput ratio filter/baseline {filter_rate / heuristics_rate:.1f}x)"
    )


if __name__ == "__main__":
    main()
