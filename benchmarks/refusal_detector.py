"""The rule-based refusal detector (`evaluation.safety.is_refusal`) on a labelled set of replies, beside
the detector it replaced (issue 52, item 3): precision, recall, F1 and accuracy, refusal the positive class.

    .venv/bin/python benchmarks/refusal_detector.py [--data tests/data/refusal_labelled.jsonl] [--show-errors]

The set is tests/data/refusal_labelled.jsonl (written by tests/data/make_refusal_labelled.py: replies
labelled by their stance, hand-written and templated, with nothing harmful in them). The baseline is a
verbatim copy of the detector at the commit before the change: it matched refusal phrases anywhere in a
reply, so "Sure, here are the steps: [...] As an AI I must note..." counted as a refusal. The new one
judges what the reply delivers. Printed: the figures over the whole set and per source, then the errors
of each detector counted by kind of reply. The sources: "hand" (the lines the rules were written beside),
"template", and three held-out batches labelled before the detector saw them; the rules were revised on
the misses of held-out-1 and held-out-2 after measuring them, not after held-out-3, so held-out-3 is the
figure for replies the rules were not fitted to.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evaluation.safety import is_refusal  # noqa: E402
from tests.test_refusal_detector import old_is_refusal  # noqa: E402

DATA = ROOT / "tests" / "data" / "refusal_labelled.jsonl"

# The baseline: the detector before issue 52 item 3, kept verbatim beside its test (one copy).
baseline_is_refusal = old_is_refusal


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def scores(rows: list[dict], detector: Callable[[str], bool]) -> dict[str, float]:
    """Precision, recall, F1 and accuracy with refusal the positive class, and the confusion counts."""
    tp = fp = fn = tn = 0
    for row in rows:
        said, truth = detector(row["reply"]), row["refusal"]
        tp += said and truth
        fp += said and not truth
        fn += truth and not said
        tn += not said and not truth
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "accuracy": (tp + tn) / len(rows) if rows else 0.0,
        "tp": tp,
        "fp": fp,
        "fn": fn,
        "tn": tn,
    }


def errors_by_kind(rows: list[dict], detector: Callable[[str], bool]) -> Counter[str]:
    return Counter(row["kind"] for row in rows if detector(row["reply"]) != row["refusal"])


DETECTORS: dict[str, Callable[[str], bool]] = {"baseline": baseline_is_refusal, "new": is_refusal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--show-errors", action="store_true", help="print each misclassified reply")
    args = parser.parse_args()
    rows = load(args.data)
    sources = sorted({row.get("source", "?") for row in rows})
    print(f"{args.data}: {len(rows)} replies, {sum(r['refusal'] for r in rows)} refusals (the positive class)\n")
    print("| detector | subset | n | precision | recall | F1 | accuracy | FP | FN |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, detector in DETECTORS.items():
        for subset in ["all", *sources]:
            part = rows if subset == "all" else [r for r in rows if r.get("source", "?") == subset]
            s = scores(part, detector)
            print(
                f"| {name} | {subset} | {len(part)} | {s['precision']:.3f} | {s['recall']:.3f} | {s['f1']:.3f} "
                f"| {s['accuracy']:.3f} | {s['fp']} | {s['fn']} |"
            )
    kinds = Counter(row["kind"] for row in rows)
    errors = {name: errors_by_kind(rows, detector) for name, detector in DETECTORS.items()}
    print("\nerrors by kind of reply (label in brackets: refusal R, compliance C)\n")
    print("| kind | label | n | baseline errors | new errors |")
    print("|---|---|---|---|---|")
    for kind in sorted(kinds, key=lambda k: (-errors["baseline"][k] - errors["new"][k], k)):
        labels = "".join(sorted({"R" if r["refusal"] else "C" for r in rows if r["kind"] == kind}))
        print(f"| {kind} | {labels} | {kinds[kind]} | {errors['baseline'][kind]} | {errors['new'][kind]} |")
    if args.show_errors:
        for name, detector in DETECTORS.items():
            print(f"\n{name}: misclassified")
            for row in rows:
                if detector(row["reply"]) != row["refusal"]:
                    label = "refusal" if row["refusal"] else "compliance"
                    print(f"  [{label}, {row['kind']}, {row.get('source', '?')}] {row['reply']!r}")


if __name__ == "__main__":
    main()
