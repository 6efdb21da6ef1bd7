"""GGUF for llama.cpp: the lineage's model converted, quantized and gated in llama.cpp itself.

    hf-model + eval-tasks --> quantize/gguf: model-bf16.gguf, model-Q8_0.gguf, model-Q4_K_M.gguf,
                              Modelfile, verdict.json (the smallest type that passes ships)

- Conversion is llama.cpp's own `convert_hf_to_gguf.py` with its `gguf-py`, from the sources the
  llama-cpp-python sdist vendors (scripts/setup.sh unpacks them into .venv-llamacpp/llama.cpp), run
  by serving/quantize/gguf_convert.py; the model is converted to bf16 (the reference) with its chat
  template stripped of transformers' `{% generation %}` markers, which no other renderer knows.
- Quantization is llama.cpp's quantizer (`llama_model_quantize`), Q8_0 / Q4_K_M by config.
- The gate runs each file in llama.cpp (serving/quantize/gguf_tool.py, in the llama.cpp environment) on the
  evaluation stage's held-out documents (token perplexity) and held-out verifiable items (greedy
  exact match, scored by lmforge/text/verify.py as lm-eval's task scores them), and compares each type
  with the bf16 file item by item under the quantization gate's rules (`quantize.gate.max_drop`,
  `max_perplexity_ratio`; serving/quantize/gate.py's `failures`). It also checks what a served GGUF
  needs beyond weights: llama.cpp tokenizes held-out text exactly as the Hugging Face tokenizer
  does, the chat template is in the file, `<|im_end|>` ends generation, and a chat completion
  through the template stops there.

Why the gate does not go through lm-eval: lm-eval's `gguf` model has no rolling log-likelihood
(perplexity), and llama.cpp's OpenAI server takes text prompts only, so lm-eval's token-exact
`local-completions` path cannot drive it. The items and the verifier are the evaluation stage's.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from lmforge.errors import ConfigError, LmforgeError

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[2]
NOISE = ("Loading weights", "gguf: ", "Writing:", "INFO:gguf", "tcmalloc")
CHATML = "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"


class GgufFailed(LmforgeError):
    """llama.cpp failed on a file it should handle (the message has its last lines)."""


def converter_dir(python: Path) -> Path:
    source = python.parents[1] / "llama.cpp"
    if not (source / "convert_hf_to_gguf.py").exists():
        raise ConfigError(
            f"quantize.gguf: llama.cpp's converter is not in {source}; run `LMFORGE_LLAMACPP_ENV=1 bash "
            "scripts/setup.sh` again (it unpacks convert_hf_to_gguf.py there)"
        )
    return source


def _run(command: list[str], what: str, env: dict[str, str] | None = None) -> str:
    from lmforge.processes.launcher import run

    code, tail = run(command, log, env=env, noise=NOISE, tail_lines=8, what=what)
    if code != 0:
        raise GgufFailed(f"{what} failed (exit {code}): {tail}")
    return tail


def tool_env() -> dict[str, str]:
    """serving.quantize.gguf_tool runs in the llama.cpp environment with this repository on its path."""
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}


def staged(model_dir: Path, out: Path) -> Path:
    """The model as the converter should see it: its files (linked) and a chat template any jinja renders."""
    import shutil

    from lmforge.inference.vllm_server import plain_chat_template

    shutil.rmtree(out, ignore_errors=True)  # a retry's or another model's leftovers never mix in
    out.mkdir(parents=True)
    for item in model_dir.iterdir():
        if item.name != "chat_template.jinja":
            os.symlink(item.resolve(), out / item.name)
    plain_chat_template(model_dir, out / "chat_template.jinja")
    return out


# what a transformers tokenizer is saved as (any of them a model folder has), and the model's config.json (its
# context length, and what AutoTokenizer reads when tokenizer_config.json names no class): the GGUF output keeps a copy.
# training.export.TOKENIZER_FILES lists the same for an export; importing it would put the training package in
# this step's code key.
TOKENIZER_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)


def copy_tokenizer(model_dir: Path, out: Path) -> Path:
    """The model's tokenizer files copied into `out`: what serving the GGUF file needs besides it (the SLO
    benchmark sizes its prompts in tokens), so the output serves on a machine without the model's folder."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out / name)
    if not (out / "tokenizer.json").exists() and not (out / "tokenizer.model").exists():
        raise GgufFailed(f"{model_dir}: no tokenizer.json or tokenizer.model to keep beside the GGUF file")
    return out


def convert(model_dir: Path, out_file: Path, python: Path, work: Path) -> dict[str, Any]:
    """HF directory -> bf16 GGUF with llama.cpp's converter; one line when it does not know the architecture."""
    from lmforge.rope import gguf_refusal

    config = json.loads((model_dir / "config.json").read_text())
    architecture = (config.get("architectures") or ["?"])[0]
    if (refusal := gguf_refusal(config)) is not None:
        raise ConfigError(f"quantize.gguf: {model_dir}: {refusal}; or set quantize.gguf.enabled: false")
    command = [
        sys.executable,
        "-m",
        "serving.quantize.gguf_convert",
        str(converter_dir(python)),
        str(staged(model_dir, work / "staged")),
        "--outfile",
        str(out_file),
        "--outtype",
        "bf16",
    ]
    try:
        _run(command, f"llama.cpp's converter on {architecture}", env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    except GgufFailed as exc:
        if f"Model {architecture} is not supported" in str(exc) or f"{architecture!r} not supported" in str(exc):
            raise ConfigError(
                f"quantize.gguf: llama.cpp's converter (llama-cpp-python's vendored convert_hf_to_gguf.py) does not "
                f"know the architecture {architecture} of {model_dir}; set quantize.gguf.enabled: false for this model"
            ) from None
        if "pre-tokenizer was not recognized" in str(exc):
            raise ConfigError(
                f"quantize.gguf: llama.cpp's converter cannot carry the tokenizer of {model_dir} (its pre-tokenizer "
                "is none llama.cpp implements, e.g. a Unigram vocabulary on a BPE architecture); set "
                "quantize.gguf.enabled: false for this model"
            ) from None
        raise
    return {"architecture": architecture, "bytes": out_file.stat().st_size}


def quantize(src: Path, dst: Path, kind: str, python: Path) -> dict[str, Any]:
    tail = _run([str(python), "-m", "serving.quantize.gguf_tool", "quantize", str(src), str(dst), kind],
                f"llama.cpp's quantizer ({kind})", env=tool_env())  # fmt: skip
    return json.loads(tail.split(" | ")[-1])


def measure(gguf: Path, python: Path, spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """Run serving/quantize/gguf_tool.py's `measure` on one file (in the llama.cpp environment)."""
    work.mkdir(parents=True, exist_ok=True)
    spec_file, out_file = work / f"{gguf.stem}.spec.json", work / f"{gguf.stem}.measured.json"
    spec_file.write_text(json.dumps(spec))
    _run([str(python), "-m", "serving.quantize.gguf_tool", "measure", str(gguf), "--spec", str(spec_file), "--out",
          str(out_file)], f"llama.cpp on {gguf.name}", env=tool_env())  # fmt: skip
    return json.loads(out_file.read_text())


def read_items(tasks_dir: Path, max_docs: int, max_items: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The evaluation stage's held-out documents and verifiable chat items (prompts rendered with the chat template)."""
    from lmforge.jsonl import read_jsonl

    docs = list(read_jsonl(tasks_dir / "data" / "heldout_ppl.jsonl"))[:max_docs]
    items = list(read_jsonl(tasks_dir / "data" / "chat_exact.jsonl"))[:max_items]
    return docs, items


def measure_spec(model_dir: Path, docs: list[dict[str, Any]], items: list[dict[str, Any]], chat: str) -> dict[str, Any]:
    config = json.loads((model_dir / "config.json").read_text())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return {
        "n_ctx": int(config.get("max_position_embeddings", 2048)),
        "documents": [d["text"] for d in docs],
        "prompts": [i["prompt"] for i in items],
        "max_tokens": 16,
        "stop": ["<|im_end|>", "\n"],  # as lmforge_chat_exact stops
        "tokenize": [d["text"][:2000] for d in docs] + [i["prompt"] for i in items],
        "special": {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>",) if t in tokenizer.get_vocab()},
        "chat": chat,
        "chat_max_tokens": 48,
        "threads": max(1, (os.cpu_count() or 1)),
    }


def hf_perplexity_values(model_dir: Path, docs: list[dict[str, Any]], n_ctx: int) -> dict[str, Any]:
    """(log-likelihood, tokens) per document from transformers itself, windowed as gguf_tool.py windows
    them: what the bf16 GGUF must reproduce (a converter that misreads a setting shows here)."""
    import torch
    from transformers import AutoTokenizer

    from lmforge.inference.hf_load import load_causal_lm

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = load_causal_lm(model_dir, dtype=dtype)
    model = model.to(device).eval()  # type: ignore[arg-type]
    out = {}
    with torch.no_grad():
        for doc in docs:
            ids = tokenizer(doc["text"], add_special_tokens=False)["input_ids"]
            ll, count = 0.0, 0
            for start in range(0, len(ids), n_ctx):
                window = ids[start : start + n_ctx]
                if len(window) < 2:
                    continue
                batch = torch.tensor([window], device=device)
                logits = model(input_ids=batch).logits
                logp = torch.log_softmax(logits.float()[0, :-1], dim=-1)
                ll += float(logp.gather(1, batch[0, 1:, None]).sum())
                count += len(window) - 1
            if count:
                out[doc["id"]] = (ll, count)
    return out


def tokenization_mismatches(model_dir: Path, texts: list[str], llama_ids: list[list[int]]) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    bad = []
    for text, ids in zip(texts, llama_ids, strict=True):
        want = tokenizer(text, add_special_tokens=False)["input_ids"]
        if want != ids:
            bad.append(f"{text[:40]!r}: {len(ids)} tokens in llama.cpp, {len(want)} in transformers")
    return bad


def scored(measured: dict[str, Any], docs: list[dict[str, Any]], items: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-item values as the gate compares them: (log-likelihood, tokens) per document, 0/1 per item."""
    from lmforge.text.verify import is_correct

    ppl = {d["id"]: (-m["nll"], m["tokens"]) for d, m in zip(docs, measured["documents"], strict=True) if m["tokens"]}
    em = {i["id"]: float(is_correct(c, i["answer"])) for i, c in zip(items, measured["completions"], strict=True)}
    return {"token_perplexity": ppl, "exact_match": em}


def compare(reference: dict[str, Any], candidate: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows in the quantization gate's shape (serving/quantize/gate.py), one per metric."""
    from evaluation import stats
    from serving.quantize.gate import comparison_row

    return [
        comparison_row(task, metric, stats.aggregate(metric, list(reference[metric].values())),
                       stats.aggregate(metric, list(candidate[metric].values())), reference[metric], candidate[metric])
        for task, metric in (("heldout documents", "token_perplexity"), ("verifiable items", "exact_match"))
    ]  # fmt: skip


def template_problems(measured: dict[str, Any], expected_template: str) -> list[str]:
    """What a served GGUF would get wrong about chat: the template, the stop token, the first answer."""
    problems = []
    if measured["chat_template"].strip() != expected_template.strip():
        problems.append("the chat template in the file differs from the model's")
    if not all(measured["eog"].values()):
        problems.append(f"end-of-generation tokens missing: {measured['eog']}")
    chat = measured.get("chat") or {}
    if chat.get("finish_reason") != "stop" or "<|im_" in (chat.get("content") or ""):
        problems.append(f"a chat completion did not stop at <|im_end|> ({chat})")
    return problems


def modelfile(gguf_name: str, template: str, stop: list[str]) -> str:
    """An Ollama Modelfile for the file beside it (`ollama create NAME -f Modelfile`)."""
    lines = [f"FROM ./{gguf_name}"]
    if "<|im_start|>" in template:  # ChatML, as lmforge's chat models speak; else Ollama reads the GGUF's own
        lines.append(f'TEMPLATE """{CHATML}"""')
    lines += [f'PARAMETER stop "{s}"' for s in stop]
    lines.append("PARAMETER temperature 0")
    return "\n".join(lines) + "\n"
