"""The adapter release's parity check, repeated: issue 57's stress check.

    .venv/bin/python benchmarks/adapter_parity.py WORKSPACE [--times 20]

WORKSPACE holds a lineage whose aligned models are LoRA adapters and whose `serve/release` ran with
`serve.adapters.enabled` (the README's adapter command). Each round runs the release's parity check
(`serving.adapters.parities`: a fresh process for all adapters) while a thread of this process loads
the lineage's models with plain `from_pretrained` in a loop: the condition of a Prefect stage, whose
steps load models in threads, that left 3e99bca's in-process check comparing garbage. It prints each
round's differences, the largest, how many rounds passed `serve.adapters.parity_tolerance`, and,
as the baseline in the same command, the in-process check of 3e99bca (`adapters.parity` without
the lock) once the loading thread has interleaved with it.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workspace", type=Path)
    parser.add_argument("--times", type=int, default=20)
    parser.add_argument("--tolerance", type=float, default=None, help="default: serve.adapters.parity_tolerance's")
    args = parser.parse_args()

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from serving import adapters

    release = json.loads(next(args.workspace.glob("serve/release/*/release.json")).read_text())
    chains = []
    for role in release["lineage"]["adapters"]:
        model_dir = next(p for p in args.workspace.glob(f"align/{role}/*/hf") if (p.parent / "adapter").exists())
        chain = adapters.chain_of(role, model_dir)
        assert chain is not None, role
        chains.append(chain)
    from serving.config import AdaptersConfig

    tolerance = AdaptersConfig().parity_tolerance if args.tolerance is None else args.tolerance
    work = Path(args.workspace) / "parity-stress"
    stacked = work / "stacked"
    for chain in chains:
        adapters.stack(chain.chain, stacked / chain.role)

    stop = threading.Event()

    def loads() -> None:  # what a Prefect stage's other steps do in threads of the flow process
        while not stop.is_set():
            for chain in chains:
                AutoModelForCausalLM.from_pretrained(str(chain.model_dir), dtype=torch.float32)

    loader = threading.Thread(target=loads, daemon=True)
    loader.start()
    worst, passed = 0.0, 0
    for round_ in range(1, args.times + 1):
        started = time.perf_counter()
        gaps = adapters.parities(chains, stacked, work / f"round-{round_}")
        ok = all(g <= tolerance for g in gaps.values())
        passed += ok
        worst = max([worst, *gaps.values()])
        shown = ", ".join(f"{r} {g:.3g}" for r, g in gaps.items())
        print(f"round {round_:2d}: {shown}  ({time.perf_counter() - started:.1f} s){'' if ok else '  FAILED'}")
    # the baseline: 3e99bca's check in this process, which the loading thread has interleaved with by now
    baseline = []
    for chain in chains:
        with torch.no_grad():
            reference = AutoModelForCausalLM.from_pretrained(str(chain.model_dir), dtype=torch.float32).eval()
            ids = torch.arange(3, 35).remainder(reference.config.vocab_size).unsqueeze(0)
            base = AutoModelForCausalLM.from_pretrained(str(chain.root), dtype=torch.float32)
            peft_model = PeftModel.from_pretrained(base, str(stacked / chain.role)).eval()
            baseline.append(float((peft_model(ids).logits - reference(ids).logits).abs().max()))
    stop.set()
    print(f"fresh-process parity: {passed}/{args.times} rounds within {tolerance:g}; largest difference {worst:.3g}")
    print(f"baseline, 3e99bca's in-process check in the same process: largest difference {max(baseline):.3g}")
    return 0 if passed == args.times else 1


if __name__ == "__main__":
    sys.exit(main())
