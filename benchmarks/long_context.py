"""Context extension on the demo: tiny-cpu trained at 64 tokens, then continued at 256 with YaRN and,
as the baseline in the same command, with the positions unscaled; both measured by length.

    .venv/bin/python benchmarks/long_context.py [--workdir DIR] [--short-steps 300] [--long-steps 100]
        [--passkey-docs 2000] [--set KEY=VALUE ...]

The corpus is the demo plus `--passkey-docs` synthetic retrieval documents (a five-digit key at a
random depth of real demo sentences, asked for at the end), so the model can learn what the
passkey task asks; the evaluated items are new keys in the evaluation's own filler. Every run
goes through `lmforge run --local` (curate -> pretrain -> evaluate); the three workspaces stay in
`--workdir` for inspection. Prints passkey accuracy and held-out perplexity at 64 and 256 tokens for
the 64-token model and both extensions, with the acceptance ratios (YaRN: passkey at 256 >= 0.8 and
above the unscaled run; perplexity at 256 <= 1.15x perplexity at 64).
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


def passkey_corpus(path: Path, docs: int, seed: int = 0) -> Path:
    """Retrieval documents from real demo sentences: the key at a random depth, the question last."""
    from tests.base_models import demo_texts

    sentences = [s.strip() + "." for text in demo_texts(600) for s in text.split(". ") if 6 <= len(s.split()) <= 30]
    rng = random.Random(seed)
    with path.open("w") as out:
        for i in range(docs):
            key = rng.randint(10_000, 99_999)
            filler = rng.sample(sentences, rng.randint(4, 14))
            filler.insert(rng.randint(0, len(filler)), f"The pass key is {key}. Remember it.")
            text = " ".join(filler) + f" What is the pass key? The pass key is {key}."
            out.write(json.dumps({"id": f"passkey-{i}", "text": text, "meta": {"domain": "prose"}}) + "\n")
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
    parser.add_argument("--short-steps", type=int, default=300)
    parser.add_argument("--long-steps", type=int, default=100)
    parser.add_argument("--passkey-docs", type=int, default=2000)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    corpus = passkey_corpus(args.workdir / "passkey.jsonl", args.passkey_docs)
    common = [f"curate.inputs=[builtin:demo, {corpus}]", *args.overrides]
    short = args.workdir / "short"
    lmforge(
        short, [*common, "stages=[curate, pretrain]", "pretrain.seq_len=64", f"pretrain.max_steps={args.short_steps}"]
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
