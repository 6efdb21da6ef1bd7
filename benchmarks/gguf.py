"""GGUF in llama.cpp: size, held-out perplexity and decode speed of Q8_0 / Q4_K_M against the bf16 file.

    .venv/bin/python benchmarks/gguf.py --model DIR            # any Hugging Face causal LM llama.cpp knows
    .venv/bin/python benchmarks/gguf.py --build-width 256      # a Qwen2 built and trained here, that wide

The same path as `quantize/gguf` (serving/quantize/gguf.py): llama.cpp's converter to bf16, llama.cpp's
quantizer, each file run in llama.cpp (the llama.cpp environment, .venv-llamacpp). Perplexity is
per token on held-out text in windows of the model's context; decode speed is greedy tokens per
second from a short prompt. The ratios are against the bf16 file, measured in the same command.
K-quants pack rows in blocks of 256: a narrower model keeps its tensors in other types, so
`--build-width` of 256 or more is what shows Q4_K_M as it is on real models.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    from serving.backends.llamacpp import llamacpp_python
    from serving.quantize import gguf

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face model directory")
    parser.add_argument("--build-width", type=int, default=256, help="without --model: a Qwen2 this wide")
    parser.add_argument("--types", default="Q8_0,Q4_K_M")
    parser.add_argument("--documents", type=int, default=24)
    parser.add_argument("--decode-tokens", type=int, default=48)
    args = parser.parse_args()
    from tests.base_models import build_qwen2_base, demo_texts

    texts = demo_texts(400)
    python = llamacpp_python(None, "benchmarks/gguf.py")
    with tempfile.TemporaryDirectory() as work_dir:
        work = Path(work_dir)
        if args.model:
            model_dir = Path(args.model)
        else:
            width = args.build_width
            model_dir = build_qwen2_base(work / "model", texts[: -args.documents], steps=200, hidden_size=width,
                                         intermediate_size=2 * width, num_attention_heads=max(width // 64, 1),
                                         num_key_value_heads=max(width // 128, 1))  # fmt: skip
        files = {"bf16": work / "bf16.gguf"}
        gguf.convert(model_dir, files["bf16"], python, work)
        for kind in args.types.split(","):
            files[kind] = work / f"{kind}.gguf"
            gguf.quantize(files["bf16"], files[kind], kind, python)
        docs = [{"id": str(i), "text": t} for i, t in enumerate(texts[-args.documents :])]
        spec = {**gguf.measure_spec(model_dir, docs, [], ""), "chat": None, "speed_tokens": args.decode_tokens}
        measured = {kind: gguf.measure(path, python, spec, work / "m") for kind, path in files.items()}
        sizes = {kind: path.stat().st_size for kind, path in files.items()}
    ppl = {kind: gguf.scored(m, docs, [])["token_perplexity"] for kind, m in measured.items()}
    from evaluation import stats

    base = measured["bf16"]
    params = sum(t["parameters"] for t in base["tensor_types"].values())
    print(f"model: {model_dir} ({params / 1e6:.2f}M parameters), {len(docs)} held-out documents, llama.cpp "
          f"{base['llama_cpp_version']}\n")  # fmt: skip
    print("| file | MiB | bits/param | tensor types | token ppl | ppl vs bf16 | decode tok/s | vs bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    base_ppl = stats.aggregate("token_perplexity", list(ppl["bf16"].values()))
    for kind, m in measured.items():
        size = sizes[kind]
        value = stats.aggregate("token_perplexity", list(ppl[kind].values()))
        types = ", ".join(f"{t} {v['parameters'] / params:.0%}" for t, v in sorted(m["tensor_types"].items()))
        print(f"| {kind} | {size / 2**20:.2f} | {8 * size / params:.2f} | {types} | {value:.3f} | "
              f"{value / base_ppl:.4f}x | {m['decode_tokens_per_s']:.0f} | "
              f"{m['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
