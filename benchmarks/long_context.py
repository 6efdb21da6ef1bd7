"""Context extension on the demo: tiny-cpu trained at 64 tokens, then continued at 256 with YaRN and,
as the baseline in the same command, with the positions unscaled; both measured by length.

    .venv/bin/python benchmarks/long_context.py [--workdir DIR] [--short-steps 3000] [--long-steps 300]
        [--passkey-docs 4000] [--set KEY=VALUE ...]

The corpus is the demo plus synthetic retrieval documents in the passkey task's own words (its
opening line, the key's sentence and the question, around short real demo sentences), in their own
`passkey` domain at 30% of the training tokens: documents of 24-56 tokens for the 64-token model, of
64-240 tokens (and a quarter as many short ones) for the extension; and, at 20%, documents that repeat
random numbers (`copy`), without which the tiny model never learned to retrieve (docs/benchmarks.md).
Curation keeps both as it keeps the demo's prose (near-dedup off: they are near-duplicates by design;
the web rules and language ID skip their domains). Both extensions attend within each packed
document (`pretrain.document_mask`), so only the scaling differs. The evaluated items are new keys
in the evaluation's own filler.

Every run goes through `lmforge run --local` (curate -> pretrain -> evaluate); the three workspaces
stay in `--workdir` for inspection. Prints passkey accuracy and held-out perplexity at 64 and 256
tokens for the 64-token model and both extensions, with the acceptance ratios (YaRN: passkey at 256
>= 0.8 and above the unscaled run; perplexity at 256 <= 1.15x perplexity at 64).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


CHARS_PER_TOKEN = 3.6  # the demo tokenizer's English prose, measured: documents are sized in characters


def passkey_corpus(path: Path, docs: int, tokens: tuple[int, int], seed: int) -> Path:
    """Retrieval documents in the task's own words (its opening line, the key's sentence and the question)
    around short real demo sentences as filler, each of about `tokens` (low, high) tokens, the key at a
    uniform depth. The evaluation's items have new keys in other filler (`evaluation/build.py`)."""
    from evaluation.build import PASSKEY_HEAD, PASSKEY_QUESTION
    from tests.base_models import demo_texts

    pieces = (" ".join(s.split()).rstrip(".") for text in demo_texts(600) for s in text.split(". "))
    sentences = sorted({s + "." for s in pieces if 3 <= len(s.split()) <= 12})
    rng = random.Random(seed)
    with path.open("w") as out:
        for i in range(docs):
            key = rng.randint(10_000, 99_999)
            needle = f"The pass key is {key}. Remember it."
            budget = rng.randint(*tokens) * CHARS_PER_TOKEN - len(PASSKEY_HEAD + needle + PASSKEY_QUESTION) - 8
            filler: list[str] = []
            while sum(len(f) + 1 for f in filler) < budget:
                filler.append(rng.choice(sentences))
            filler.insert(rng.randint(0, len(filler)), needle)
            text = f"{PASSKEY_HEAD} {' '.join(filler)}{PASSKEY_QUESTION} {key}."
            out.write(
                json.dumps({"id": f"passkey-{tokens[1]}-{i}", "text": text, "meta": {"domain": "passkey"}}) + "\n"
            )
    return path


def copy_corpus(path: Path, docs: int, seed: int) -> Path:
    """Documents that repeat random five-digit numbers (`Numbers: X Y. Again: X Y.`): dense targets for
    copying what was just seen. Without them the tiny model never learned retrieval (0.000 after 2,000
    steps on pass-key documents alone); beside them a plain loop of the same model reached 0.87 on the
    evaluation's 64-token items after 1,500 steps (docs/benchmarks.md)."""
    rng = random.Random(seed)
    with path.open("w") as out:
        for i in range(docs):
            numbers = " ".join(str(rng.randint(10_000, 99_999)) for _ in range(rng.randint(2, 5)))
            text = f"Numbers: {numbers}. Again: {numbers}."
            out.write(json.dumps({"id": f"copy-{i}", "text": text, "meta": {"domain": "copy"}}) + "\n")
    return path


def lmforge(workspace: Path, overrides: list[str]) -> None:
    args = [a for o in overrides for a in ("--set", o)]
    command = [sys.executable, "-m", "lmforge.cli", "run", "--local", "--workspace", str(workspace), *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")


def by_length(workspace: Path) -> dict[str, dict[str, dict[int, float]]]:
    report = json.loads(next(workspace.glob("evaluate/report/*/report.json")).read_text())
    table: dict[str, dict[str, dict[int, float]]] = {}
    for row in report["results"]:
        table.setdefault(row["model"], {})[row["task"]] = {int(n): v for n, v in row["by_length"]}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lmforge-long-context"))
    parser.add_argument("--short-steps", type=int, default=3000)
    parser.add_argument("--long-steps", type=int, default=300)
    parser.add_argument("--passkey-docs", type=int, default=4000)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    # documents that fit a 64-token window for the first model; for the extension, documents up to
    # 240 tokens (most longer than 64, so the key is often further back than the model has seen) and
    # a quarter as many short ones
    short_docs = passkey_corpus(args.workdir / "passkey-short.jsonl", args.passkey_docs, (24, 56), seed=0)
    long_docs = passkey_corpus(args.workdir / "passkey-long.jsonl", args.passkey_docs, (64, 240), seed=1)
    short_mix = passkey_corpus(args.workdir / "passkey-short-2.jsonl", args.passkey_docs // 4, (24, 56), seed=2)
    copies = copy_corpus(args.workdir / "copy.jsonl", args.passkey_docs, seed=3)
    common = [
        # template-made documents are near-duplicates by design: MinHash would keep one in two; and
        # short ones: the web rules (as for the demo's prose) and language ID pass them as they are
        "curate.near_dedup.enabled=false",
        *(
            f"curate.{f}.skip_domains=[code, dialogue, prose, passkey, copy]"
            for f in ("gopher_quality", "gopher_repetition", "c4", "fineweb", "quality_classifier")
        ),
        "curate.langid.skip_domains=[code, passkey, copy]",
        "curate.length.skip_domains=[passkey, copy]",  # short by design (the 64-token model's documents)
        "curate.paragraph_dedup.skip_domains=[code, passkey, copy]",  # one templated paragraph each
        # half the tokens retrieval and copying, the rest the demo's own mix
        "curate.mix.weights={passkey: 0.3, copy: 0.2, code: 0.2, prose: 0.15, web: 0.075, dialogue: 0.075}",
        "pretrain.document_mask=on",  # both extensions alike: only the scaling differs
        *args.overrides,
    ]
    short = args.workdir / "short"
    lmforge(
        short,
        [
            *common,
            f"curate.inputs=[builtin:demo, {short_docs}, {copies}]",
            "stages=[curate, pretrain]",
            "pretrain.seq_len=64",
            f"pretrain.max_steps={args.short_steps}",
        ],
    )
    base = next(short.glob("pretrain/train/*/hf"))
    evaluate = [
        "evaluate.tasks=[lmforge_passkey, lmforge_ppl_by_length]",
        "evaluate.builtin.context_lengths=[64, 256]",
        "evaluate.models=[base, pretrained]",
        "evaluate.backends=[hf]",
        "evaluate.limit={}",
        "evaluate.judge.enabled=false",
        "evaluate.safety.enabled=false",
        "evaluate.contamination.action=annotate",
    ]
    results = {}
    for scaling in ("yarn", "none"):
        workspace = args.workdir / f"long-{scaling}"
        lmforge(
            workspace,
            [
                *common,
                *evaluate,
                f"curate.inputs=[builtin:demo, {long_docs}, {short_mix}, {copies}]",
                "stages=[curate, pretrain, evaluate]",
                f"base_model.path={base}",
                "pretrain.seq_len=256",
                f"pretrain.max_steps={args.long_steps}",
                "pretrain.optim.warmup_steps=10",
                f"pretrain.rope_scaling.type={scaling}",
            ],
        )
        results[scaling] = by_length(workspace)
    print(f"{'model':34} {'passkey@64':>10} {'passkey@256':>11} {'ppl@64':>8} {'ppl@256':>8} {'ppl 256/64':>10}")
    rows = [("trained at 64 (base)", results["yarn"]["base"])] + [
        (f"extended to 256, {s}", results[s]["pretrained"]) for s in ("yarn", "none")
    ]
    for name, row in rows:
        passkey, ppl = row["lmforge_passkey"], row["lmforge_ppl_by_length"]
        print(
            f"{name:34} {passkey[64]:10.3f} {passkey[256]:11.3f} {ppl[64]:8.2f} {ppl[256]:8.2f} "
            f"{ppl[256] / ppl[64]:10.3f}"
        )
    yarn, none = results["yarn"]["pretrained"], results["none"]["pretrained"]
    ok = (
        yarn["lmforge_passkey"][256] >= 0.8
        and yarn["lmforge_passkey"][256] > none["lmforge_passkey"][256]
        and yarn["lmforge_ppl_by_length"][256] <= 1.15 * yarn["lmforge_ppl_by_length"][64]
    )
    print(
        f"acceptance (YaRN passkey@256 >= 0.8 and above unscaled; ppl@256 <= 1.15 x ppl@64): {'met' if ok else 'NOT met'}"
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
