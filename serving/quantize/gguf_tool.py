"""What lmforge asks of llama.cpp itself, run with the llama.cpp environment's Python (.venv-llamacpp).

    python -m serving.quantize.gguf_tool quantize SRC.gguf DST.gguf Q4_K_M
    python -m serving.quantize.gguf_tool measure MODEL.gguf --spec spec.json --out result.json

`quantize` is llama.cpp's own quantizer (`llama_model_quantize`, the function behind the
`llama-quantize` tool) through llama-cpp-python's bindings. `measure` loads a GGUF file in llama.cpp
and reports what the GGUF gate (serving/quantize/gguf.py) compares: each held-out document's summed negative
log-likelihood and token count, each verifiable item's greedy completion, llama.cpp's tokenization
of given texts (checked against the Hugging Face tokenizer's by the caller), the chat template and
end-of-generation tokens the file carries, and one chat completion through the template.

Why a script of its own: llama-cpp-python lives in its own environment (it is compiled there), so
this module imports only the standard library, numpy, llama_cpp and serving.backends.llamacpp_cpu; the caller scores
and gates.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path
from typing import Any

TYPES = ("Q8_0", "Q4_K_M", "Q5_K_M", "Q4_0", "F16", "BF16")


def quantize(src: str, dst: str, kind: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    started = time.time()
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0 or not Path(dst).exists():
        sys.exit(f"llama.cpp could not quantize {src} to {kind} (return code {rc})")
    print(json.dumps({"type": kind, "bytes": Path(dst).stat().st_size, "seconds": round(time.time() - started, 2)}))


def _log_softmax(logits: Any) -> Any:
    import numpy as np

    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def tensor_types(model: str) -> dict[str, dict[str, int]]:
    """{ggml type: {tensors, parameters}} of a GGUF file (llama.cpp keeps a tensor whose rows do not fit a
    type's block, e.g. K-quants' 256, in another type), read with llama.cpp's gguf-py when it is beside us."""
    source = Path(sys.executable).parents[1] / "llama.cpp" / "gguf-py"
    if not source.exists():
        return {}
    sys.path.insert(0, str(source))
    from gguf import GGUFReader  # type: ignore[attr-defined]  # llama.cpp's gguf-py, not serving.quantize.gguf

    out: dict[str, dict[str, int]] = {}
    for tensor in GGUFReader(model).tensors:
        row = out.setdefault(tensor.tensor_type.name, {"tensors": 0, "parameters": 0})
        row["tensors"] += 1
        row["parameters"] += int(tensor.n_elements)
    return out


def measure(model: str, spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    from llama_cpp import Llama

    from serving.backends.llamacpp_cpu import without_weight_repacking

    without_weight_repacking()
    ctx = int(spec["n_ctx"])
    llm = Llama(model_path=model, n_ctx=ctx, logits_all=True, seed=0, verbose=False, n_threads=spec.get("threads"))
    out: dict[str, Any] = {"model": model, "n_ctx": ctx}
    # perplexity: non-overlapping windows of the context, every token after a window's first scored
    docs = []
    for text in spec["documents"]:
        ids = llm.tokenize(text.encode(), add_bos=False, special=False)
        nll, count = 0.0, 0
        for start in range(0, len(ids), ctx):
            window = ids[start : start + ctx]
            if len(window) < 2:
                continue
            llm.reset()
            llm.eval(window)
            logp = _log_softmax(np.asarray(llm.scores[: len(window)], dtype=np.float64))
            nll -= float(sum(logp[i, window[i + 1]] for i in range(len(window) - 1)))
            count += len(window) - 1
        docs.append({"nll": nll, "tokens": count})
    out["documents"] = docs
    # exact match: greedy completions of the rendered prompts, stopped as the evaluation task stops them
    completions = []
    for prompt in spec["prompts"]:
        ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
        llm.reset()
        reply = llm.create_completion(ids, max_tokens=spec["max_tokens"], temperature=0.0, stop=spec["stop"])
        completions.append(reply["choices"][0]["text"])
    out["completions"] = completions
    out["tokenized"] = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in spec["tokenize"]]
    metadata = llm.metadata
    out["chat_template"] = metadata.get("tokenizer.chat_template", "")
    out["eos_token_id"] = llm.token_eos()
    import llama_cpp

    vocab = llm._model.vocab  # noqa: SLF001 - the bindings expose the vocabulary only there
    out["eog"] = {t: bool(llama_cpp.llama_vocab_is_eog(vocab, i)) for t, i in spec.get("special", {}).items()}
    out["file_type"] = metadata.get("general.file_type", "")
    out["llama_cpp_version"] = llama_cpp.__version__
    out["tensor_types"] = tensor_types(model)
    out["architecture"] = metadata.get("general.architecture", "")
    if spec.get("speed_tokens"):  # decode speed: greedy tokens one at a time, past any end-of-text
        ids = llm.tokenize(spec["documents"][0].encode(), add_bos=False, special=False)[: ctx // 4] or [0]
        llm.reset()
        count, started = 0, time.perf_counter()
        for _ in llm.generate(ids, temp=0.0):
            count += 1
            if count >= min(spec["speed_tokens"], ctx - len(ids)):
                break
        out["decode_tokens_per_s"] = count / (time.perf_counter() - started)
    if spec.get("chat"):
        llm.reset()
        reply = llm.create_chat_completion(
            messages=[{"role": "user", "content": spec["chat"]}], max_tokens=spec["chat_max_tokens"], temperature=0.0
        )
        choice = reply["choices"][0]
        out["chat"] = {"content": choice["message"]["content"], "finish_reason": choice["finish_reason"]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.quantize.gguf_tool")
    commands = parser.add_subparsers(dest="command", required=True)
    q = commands.add_parser("quantize")
    q.add_argument("src")
    q.add_argument("dst")
    q.add_argument("type", choices=TYPES)
    m = commands.add_parser("measure")
    m.add_argument("model")
    m.add_argument("--spec", required=True)
    m.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.command == "quantize":
        quantize(args.src, args.dst, args.type)
        return 0
    result = measure(args.model, json.loads(Path(args.spec).read_text()))
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
