"""Quantized checkpoints against bf16, served by vLLM on the same prompts: size, speed and the eval delta.

    .venv/bin/python benchmarks/quantize.py --workspace WS [--concurrency 1,8] [--max-tokens 32]

WS is a workspace where `lmforge stage quantize` ran. For the unquantized model the lineage
quantized and for each checkpoint the quantization gate measured: bytes of weights, output
tokens/s and TTFT/TPOT p50 from the serving stage's SLO client (streaming, `ignore_eos`, the
`distinct` workload) through a vLLM server started with the serving stage's settings, and the
gate's eval delta per task. Everything is printed as a ratio to bf16 as well. A checkpoint vLLM
cannot serve on this host (w8a8-fp8 on CPU, 4-bit ones on an AVX2 CPU) is not served: its row
says why, and its deltas are the gate's measurement in transformers.

Then, when the gate measured both 4-bit schemes, AWQ's held-out perplexity ratio beside GPTQ's
(the same model and calibration samples): `w4a16` is GPTQ, `w4a16-awq` AWQ.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serving import slo  # noqa: E402
from serving.quantize.report import bf16_bytes_and_params, weight_bytes  # noqa: E402
from serving.quantize.schemes import serving_problem  # noqa: E402
from serving.quantize.steps import serving_host  # noqa: E402


def serve_speed(model_dir: Path, concurrency: list[int], per_client: int, max_tokens: int) -> dict[int, dict]:
    from lmforge.inference.vllm_server import EngineConfig, TemporaryServer

    with (
        tempfile.TemporaryDirectory() as work,
        TemporaryServer(model_dir, EngineConfig(), Path(work), "bench") as server,
    ):
        words = slo.fit_prefix_words(model_dir, max_tokens, 120)
        rows = slo.run(
            server.base_url,
            server.api_key,
            "bench",
            concurrency,
            per_client,
            max_tokens,
            words,
            workloads=("distinct",),
        )
    return {r["clients"]: r for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workspace", required=True)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    gate = next(Path(args.workspace).glob("quantize/gate/*/verdict.json"), None)
    if gate is None:
        sys.exit(f"no quantization gate output under {args.workspace}: run `lmforge stage quantize` first")
    verdict = json.loads(gate.read_text())
    base_manifest = (
        json.loads(next(Path(args.workspace).glob(f"align/{verdict['model']}/*/manifest.json")).read_text())
        if verdict["model"] != "pretrained"
        else json.loads(next(Path(args.workspace).glob("pretrain/train/*/manifest.json")).read_text())
    )
    base_dir = Path(base_manifest["dir"]) / "hf"
    levels = [int(c) for c in args.concurrency.split(",")]
    models = {"bf16": (base_dir, bf16_bytes_and_params(base_dir)[0])}
    for scheme, outcome in verdict["schemes"].items():
        models[scheme] = (Path(outcome["model_dir"]), weight_bytes(Path(outcome["model_dir"])))
    host = serving_host()
    speed, unserved = {}, {}
    for name, (model_dir, _) in models.items():
        if name != "bf16" and (problem := serving_problem(name, host)):
            unserved[name] = problem
            continue
        print(f"serving {name} ...", file=sys.stderr, flush=True)
        speed[name] = serve_speed(model_dir, levels, args.requests_per_client, args.max_tokens)
    top = levels[-1]
    base = speed["bf16"]
    print(
        f"| model | weights | x bf16 | tok/s at {top} clients | x bf16 | TTFT p50 ms (1 client) | TPOT p50 ms (1 client) "
        "| gate | eval deltas (paired 95% CI) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (_, size) in models.items():
        s = speed.get(name)
        outcome = verdict["schemes"].get(name)
        deltas = (
            "; ".join(
                f"{r['task'].removeprefix('lmforge_')} {r['metric']} "
                + (
                    f"x{r['ratio']:.3f}"
                    if "ratio" in r
                    else f"{r['delta']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]"
                )
                for r in outcome["comparisons"]
            )
            if outcome
            else "reference"
        )
        if outcome and outcome.get("measured_on"):
            deltas = f"({outcome['measured_on']}) {deltas}"
        state = "eligible" if outcome and outcome["eligible"] else ("reference" if not outcome else "not eligible")
        served = (
            f"{s[top]['output_tokens_per_s']:.0f} | {s[top]['output_tokens_per_s'] / base[top]['output_tokens_per_s']:.2f} "
            f"| {s[levels[0]]['ttft_ms_p50']:.0f} | {s[levels[0]]['tpot_ms_p50']:.1f}"
            if s
            else f"not served here: {unserved[name]} | | |"
        )
        print(f"| {name} | {size / 2**20:.2f} MiB | {size / models['bf16'][1]:.2f} | {served} | {state} | {deltas} |")
    print(f"\n{verdict['decision']}")
    ratios = {
        scheme: next((r["ratio"] for r in verdict["schemes"][scheme]["comparisons"] if "ratio" in r), None)
        for scheme in ("w4a16", "w4a16-awq")
        if scheme in verdict["schemes"]
    }
    if len(ratios) == 2 and None not in ratios.values():
        gptq, awq = ratios["w4a16"], ratios["w4a16-awq"]
        print(
            f"4-bit held-out perplexity vs the unquantized model: GPTQ x{gptq:.4f}, AWQ x{awq:.4f} "
            f"(AWQ {'at least as good' if awq <= gptq else 'worse'}; AWQ/GPTQ {awq / gptq:.4f})"
        )


if __name__ == "__main__":
    main()
