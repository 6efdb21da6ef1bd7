"""GGUF for llama.cpp, for real: llama.cpp's converter and quantizer, the gate run in llama.cpp itself,
and llama.cpp's OpenAI-compatible server behind the key, answering the official `openai` client.

Needs the llama.cpp environment (`LMFORGE_LLAMACPP_ENV=1 bash scripts/setup.sh`; scripts/test.sh builds it).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmforge.errors import ConfigError
from serving.backends.llamacpp import DEFAULT_VENV

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (DEFAULT_VENV / "bin" / "python").exists() and not __import__("os").environ.get("CI"),
        reason="no llama.cpp environment (LMFORGE_LLAMACPP_ENV=1 bash scripts/setup.sh); CI always runs these",
    ),
]
GGUF = ["quantize.gguf.enabled=true", "quantize.schemes=[]"]


@pytest.fixture(scope="module")
def gguf_workspace(evaluated: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict]]:
    from lmforge.engine.executor import run_pipeline_locally
    from serving import release
    from tests.conftest import small_config

    workspace = tmp_path_factory.mktemp("gguf")
    shutil.copytree(Path(evaluated["evaluate/report"]["dir"]).parents[2], workspace, dirs_exist_ok=True)
    try:
        yield workspace, run_pipeline_locally(small_config(workspace, *GGUF), ["quantize"])
    finally:
        release.stop(workspace)


def test_q8_0_and_q4_k_m_load_in_llama_cpp_and_are_gated_against_bf16(gguf_workspace: tuple[Path, dict]) -> None:
    workspace, manifests = gguf_workspace
    step = manifests["quantize/gguf"]
    verdict = json.loads((Path(step["dir"]) / "verdict.json").read_text())
    types = verdict["types"]
    assert set(types) == {"bf16", "Q8_0", "Q4_K_M"} and verdict["architecture"] == "LlamaForCausalLM"
    assert types["Q4_K_M"]["bytes"] < types["Q8_0"]["bytes"] < types["bf16"]["bytes"]
    for kind in ("bf16", "Q8_0", "Q4_K_M"):
        outcome = types[kind]
        # llama.cpp loaded and ran each file: every held-out document scored, every item answered
        assert outcome["token_perplexity"] > 1 and 0 <= outcome["exact_match"] <= 1
        # the tokenizer, chat template and stop token survived conversion (checked, or it would be a failure)
        assert not [f for f in outcome["failures"] if "tokeniz" in f or "template" in f or "<|im_end|>" in f]
        assert outcome["chat"]["finish_reason"] == "stop"
    rows = {kind: {r["metric"]: r for r in types[kind]["comparisons"]} for kind in ("Q8_0", "Q4_K_M")}
    assert rows["Q8_0"]["token_perplexity"]["ratio"] < 1.02  # 8-bit is near lossless
    assert rows["Q8_0"]["exact_match"]["items"] == step["counts"]["items"] > 0
    assert types["Q8_0"]["eligible"], types["Q8_0"]["failures"]
    # the smallest type that passes ships; the Modelfile beside it names it and the stop token
    assert verdict["chosen"] == min(
        (k for k in ("Q8_0", "Q4_K_M") if types[k]["eligible"]), key=lambda k: types[k]["bytes"]
    )
    # the tokenizer serving needs is in the output itself, not only in the model folder it was made from
    assert Path(verdict["tokenizer_dir"]) == Path(step["dir"]) / "tokenizer"
    assert {"tokenizer.json", "config.json"} <= {p.name for p in Path(verdict["tokenizer_dir"]).iterdir()}
    modelfile = (Path(step["dir"]) / "Modelfile").read_text()
    assert f"FROM ./model-{verdict['chosen']}.gguf" in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile
    assert "<|im_start|>" in modelfile  # ChatML template
    print("GGUF gate:", json.dumps({k: {m: (r["quantized"], r["unquantized"], r["delta"]) for m, r in v.items()}
                                    for k, v in rows.items()}))  # fmt: skip


def test_the_shipped_gguf_is_served_by_llama_cpp_behind_the_key(gguf_workspace: tuple[Path, dict]) -> None:
    from openai import OpenAI

    from lmforge.engine.executor import run_pipeline_locally
    from lmforge.inference.vllm_server import request
    from serving import release
    from tests.conftest import small_config

    workspace, _ = gguf_workspace
    manifests = run_pipeline_locally(small_config(workspace, *GGUF, "serve.backend=llamacpp"), ["quantize", "serve"])
    extra = manifests["serve/release"]["extra"]
    assert "-gguf-" in extra["served_name"] and extra["model_dir"].endswith(".gguf")
    record = release.current(workspace)
    assert record is not None and record["settings"]["backend"] == "llamacpp"
    key, _ = release.api_key(workspace)
    client = OpenAI(base_url=f"{record['endpoint']}/v1", api_key=key, max_retries=0)
    reply = client.chat.completions.create(
        model=extra["served_name"],
        messages=[{"role": "user", "content": "What is 2 + 3?"}],
        max_tokens=24,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "stop" and "<|im_end|>" not in (reply.choices[0].message.content or "")
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("POST", "/v1/completions")):
        status, _ = request(f"{record['endpoint']}{path}", None, {} if method == "POST" else None)
        assert status == 401, path
    assert extra["slo"] and all(row["errors"] == 0 and row["output_tokens_per_s"] > 0 for row in extra["slo"])
    # without the llama.cpp environment: one line naming the field
    with pytest.raises(ConfigError, match=r"^serve.llamacpp.python: the llama.cpp environment is missing") as info:
        run_pipeline_locally(
            small_config(workspace, *GGUF, "serve.backend=llamacpp", "serve.llamacpp.python=/nonexistent/python"),
            ["quantize", "serve"],
        )
    assert "\n" not in str(info.value)


def test_an_architecture_llama_cpp_does_not_know_is_refused_in_one_line(tmp_path: Path, trained: dict) -> None:
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    from serving.backends.llamacpp import llamacpp_python
    from serving.quantize import gguf

    model_dir = tmp_path / "opt"
    config = OPTConfig(vocab_size=1024, hidden_size=64, ffn_dim=128, num_hidden_layers=1, num_attention_heads=2,
                       max_position_embeddings=64, word_embed_proj_dim=64)  # fmt: skip
    torch.manual_seed(0)
    OPTForCausalLM(config).save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(trained["dir"]) / "hf" / name, model_dir / name)
    with pytest.raises(ConfigError, match="does not know the architecture OPTForCausalLM") as info:
        gguf.convert(model_dir, tmp_path / "opt.gguf", llamacpp_python(None, "quantize.gguf.python"), tmp_path)
    assert "\n" not in str(info.value) and str(info.value).startswith("quantize.gguf:")
    # a Unigram vocabulary on GPT-NeoX (llama.cpp converts its tokenizer as BPE only): one line too
    from tests.base_models import build_neox_base, demo_texts

    unigram = build_neox_base(tmp_path / "neox", demo_texts(80), steps=5, tokenizer="unigram")
    with pytest.raises(ConfigError, match="cannot carry the tokenizer") as info:
        gguf.convert(unigram, tmp_path / "neox.gguf", llamacpp_python(None, "quantize.gguf.python"), tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("architecture", ["qwen2", "neox", "mixtral", "qwen2_moe"])
def test_the_base_model_architectures_convert_faithfully(tmp_path: Path, architecture: str) -> None:
    """Qwen2, GPT-NeoX and the two mixtures of experts (the base-model fixtures, byte-level BPE):
    llama.cpp tokenizes as transformers does, the file keeps the experts (count and top-k), the bf16
    file's perplexity is transformers' own, and Q8_0 stays within 2% of it."""
    from evaluation import stats
    from serving.backends.llamacpp import llamacpp_python
    from serving.quantize import gguf
    from tests.base_models import build_moe_base, build_neox_base, build_qwen2_base, demo_texts

    texts = demo_texts(120)
    if architecture in ("mixtral", "qwen2_moe"):
        model_dir = build_moe_base(tmp_path / architecture, texts, architecture, steps=30)
    else:
        build = build_qwen2_base if architecture == "qwen2" else build_neox_base
        model_dir = build(tmp_path / architecture, texts, steps=30, tokenizer="byte_bpe")
    python = llamacpp_python(None, "quantize.gguf.python")
    bf16, q8 = tmp_path / "bf16.gguf", tmp_path / "Q8_0.gguf"
    gguf.convert(model_dir, bf16, python, tmp_path / "work")
    gguf.quantize(bf16, q8, "Q8_0", python)
    if architecture in ("mixtral", "qwen2_moe"):  # llama.cpp's names: Mixtral is "llama" with experts
        prefix = {"mixtral": "llama", "qwen2_moe": "qwen2moe"}[architecture]
        fields = gguf_fields(
            q8, python, ("general.architecture", f"{prefix}.expert_count", f"{prefix}.expert_used_count")
        )
        assert fields == {"general.architecture": prefix, f"{prefix}.expert_count": 4, f"{prefix}.expert_used_count": 2}
    docs = [{"id": str(i), "text": t} for i, t in enumerate(texts[-6:])]
    spec = {**gguf.measure_spec(model_dir, docs, [], ""), "chat": None}
    measured = {name: gguf.measure(path, python, spec, tmp_path / "m") for name, path in (("bf16", bf16), ("q8", q8))}
    assert gguf.tokenization_mismatches(model_dir, spec["tokenize"], measured["q8"]["tokenized"]) == []
    ppl = {k: stats.aggregate("token_perplexity", list(gguf.scored(m, docs, [])["token_perplexity"].values()))
           for k, m in measured.items()}  # fmt: skip
    reference = stats.aggregate(
        "token_perplexity", list(gguf.hf_perplexity_values(model_dir, docs, spec["n_ctx"]).values())
    )
    assert abs(ppl["bf16"] / reference - 1) < 0.01, (ppl, reference)
    assert ppl["q8"] / ppl["bf16"] < 1.02, ppl


def gguf_fields(path: Path, python: Path, names: tuple[str, ...]) -> dict:
    """Metadata fields of a GGUF file, read with llama.cpp's own gguf-py reader."""
    import os
    import subprocess
    import sys

    from serving.quantize import gguf

    script = (
        "import json, sys; from gguf import GGUFReader; r = GGUFReader(sys.argv[1]); "
        "print(json.dumps({k: r.fields[k].contents() for k in sys.argv[2:] if k in r.fields}))"
    )
    env = {**os.environ, "PYTHONPATH": str(gguf.converter_dir(python) / "gguf-py")}
    done = subprocess.run([sys.executable, "-c", script, str(path), *names], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)
